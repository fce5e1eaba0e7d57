"""The ``vllm-fa3-mla`` route's plan for each decode step of a bench_engine.py batch, on a CPU.

``python benchmarks/engine_steps_replay.py --heads H --batch B --min-prompt LO
--max-prompt HI [--output-len N] [--seed S] [--block P]`` draws the prompts as
``bench_engine.py`` does (``prompt_lens``, the same seed) and replays the decode steps of its
timed generation (step ``k`` of ``1..N``: every request's KV length its prompt plus ``k``),
one query token a request, as the route plans them under CUDA graphs
(``spill_band_replay.route_plan_inputs``, ``fa3_splits.balanced_splits``). It prints the
route the graph rule ranks first, the spread (longest over mean KV tiles), the longest
request's KV tiles and the waves of FA3's own plan over the steps, and how many steps keep
FA3's plan, are replanned inside the band (``fa3_splits.spill_band``) or into one wave past
it (``fa3_splits.one_wave_past_band``, the only plans ``one_wave_max_spread`` bounds).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from bench_engine import prompt_lens
from evaluate_policy import H200
from spill_band_replay import route_plan_inputs

from trtllm_mla_plugin.ops import DecodeSpec, fa3_splits, policy

#: What the route does with a step: FA3's own plan, a plan of its own inside the band, or
#: one wave past the band.
KEEP, BAND, ONE_WAVE = "fa3's own", "band", "one wave past the band"


def step_plan(heads: int, block: int, lens: Sequence[int]) -> dict:
    """The route's plan for one decode step of one query token per request over KV lengths
    ``lens``: ``kind`` (``KEEP``, ``BAND`` or ``ONE_WAVE``), ``spread``, ``longest`` (KV
    tiles) and ``waves`` (FA3's own plan's work tiles over the SMs)."""
    kv_tiles, tiles, reserved, planned, rows = route_plan_inputs(heads, len(lens), 1, block,
                                                                 list(lens))
    own = fa3_splits.fa3_splits(kv_tiles, tiles, planned, policy.HOPPER_SMS)
    waves = tiles * int(own.sum()) / policy.HOPPER_SMS
    plan = fa3_splits.balanced_splits(kv_tiles, tiles, reserved, policy.HOPPER_SMS, rows,
                                      planned)
    if plan is None:
        kind = KEEP
    elif waves > fa3_splits.spill_band(heads, kv_tiles):  # one query token: heads rows
        kind = ONE_WAVE
    else:
        kind = BAND
    return dict(kind=kind, spread=float(kv_tiles.max() * kv_tiles.size / kv_tiles.sum()),
                longest=int(kv_tiles.max()), waves=waves)


def replay_steps(heads: int, block: int, prompts: Sequence[int], output_len: int) -> list[dict]:
    """``step_plan`` for decode steps ``1..output_len`` over ``prompts`` (tokens a request)."""
    base = np.asarray(prompts, dtype=np.int64)
    return [step_plan(heads, block, (base + k).tolist()) for k in range(1, output_len + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--min-prompt", type=int, required=True)
    ap.add_argument("--max-prompt", type=int, required=True)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block", type=int, default=64, help="tokens per KV page")
    args = ap.parse_args()
    spec = DecodeSpec(args.heads, 512, 64, args.block, torch.bfloat16, torch.bfloat16, 0.1, 1)
    route = policy.rank(spec, H200, policy.BatchShape(args.batch, 1))[0]
    prompts = prompt_lens(args.batch, args.min_prompt, args.max_prompt, args.seed)
    steps = replay_steps(args.heads, args.block, prompts, args.output_len)
    print(f"h{args.heads} b{args.batch} prompts {args.min_prompt}-{args.max_prompt} "
          f"(seed {args.seed}), {len(steps)} decode steps; the graph rule ranks {route} first")
    for key, fmt in (("spread", ".3f"), ("longest", "d"), ("waves", ".2f")):
        values = [s[key] for s in steps]
        print(f"  {key}: {min(values):{fmt}}-{max(values):{fmt}}")
    for kind, count in Counter(s["kind"] for s in steps).most_common():
        print(f"  {kind}: {count} steps")


if __name__ == "__main__":
    main()
