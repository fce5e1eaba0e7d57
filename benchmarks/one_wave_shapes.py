"""Seeded shapes for checking the one-wave plans past the band (``fa3_splits.one_wave_past_band``).

``python benchmarks/one_wave_shapes.py SEED COUNT [--min-spread S] [--controls N
[--control-spread LO HI]] [--lo-min LO] [--block P] > FILE`` prints ``COUNT`` bf16 shapes that the
CUDA-graph decoder runs on ``vllm-fa3-mla`` and whose FA3 plan the route now replans into
one wave past the band (of spread >= ``S``: longest over mean KV tiles), then ``N``
controls: shapes of the same kind the rule declines for their spread or their longest
request (``fa3_splits.one_wave_max_spread``; spreads from ``ONE_WAVE_MAX_SPREAD`` to 2 by
default), to be timed with ``--extra-routes vllm-fa3-mla:balanced``
(the plan the rule would have made). Each line is
``CASE_SEED SHAPE`` for ``bench_decode.py --shape-list FILE`` (the case seed draws the
lengths, as for the random sets). Draw: heads 8-128, q_len 1-4, up to 132 query tiles
(each request fits the grid unsplit), longest request log-uniform in 256-16k tokens,
lengths uniform or uniform in ``[lo x ctx, ctx]`` (``lo`` drawn in 0.6-0.95 or in
``--lo-min``-0.6), pages of ``--block`` tokens (64). Lists ``shapes/one-wave-301.txt`` and
``-302.txt`` (run 180) were drawn with the spread bound at 1.25 and controls of 1.25-1.6
(the script at 68654bf); lists up to ``-304.txt`` with case seeds ``1000 x SEED + i``, which
overlap another seed's past 1000 draws (``-304.txt`` holds 305xxx), since then
``1_000_000 x SEED + i``.
"""

from __future__ import annotations

import argparse
import math
import random

import torch
from bench_decode import BF, RANDOM_HEADS, case_lengths, shape_name
from evaluate_policy import H200
from spill_band_replay import route_plan_inputs

from trtllm_mla_plugin.ops import DecodeSpec, fa3_splits, policy


def one_wave_plan(shape: tuple, lens: list[int]) -> tuple[bool, bool, float]:
    """For a batch the graph decoder runs on ``vllm-fa3-mla`` with FA3's plan past the band:
    (whether the route replans it, whether ``balanced_splits`` unbounded plans one wave,
    spread of the lengths); all false elsewhere."""
    heads, b, _ctx, _kind, q, _kvd, block = shape
    spec = DecodeSpec(heads, 512, 64, block, torch.bfloat16, torch.bfloat16, 0.1, q)
    if policy.rank(spec, H200, policy.BatchShape(b, q))[0] != policy.VLLM_FA3:
        return False, False, 0.0
    kv_tiles, tiles, reserved, planned, rows = route_plan_inputs(heads, b, q, block, lens)
    own = fa3_splits.fa3_splits(kv_tiles, tiles, planned, policy.HOPPER_SMS)
    if tiles * int(own.sum()) <= fa3_splits.spill_band(heads * q, kv_tiles) * policy.HOPPER_SMS:
        return False, False, 0.0
    args = (kv_tiles, tiles, reserved, policy.HOPPER_SMS, rows, planned)
    unbounded = fa3_splits.balanced_splits(*args, math.inf)
    spread = float(kv_tiles.max() * kv_tiles.size / kv_tiles.sum())
    return (fa3_splits.balanced_splits(*args) is not None,
            unbounded is not None and tiles * int(unbounded.sum()) <= policy.HOPPER_SMS,
            spread)


#: Case seeds ``CASE_SEED_STRIDE x seed + i``: no two seeds' draws share one.
CASE_SEED_STRIDE = 1_000_000


def draw(seed: int, count: int, controls: int, control_spread: tuple[float, float],
         lo_min: float, min_spread: float = 0.0, block: int = 64) -> list[tuple[int, tuple]]:
    """``count`` shapes the rule replans (of at least ``min_spread``) and ``controls`` it
    declines for their spread (within ``control_spread``)."""
    rng = random.Random(seed)
    found, declined = [], []
    i = 0
    while len(found) < count or len(declined) < controls:
        i += 1
        heads, q = rng.choice(RANDOM_HEADS), rng.choice((1, 1, 2, 3, 4))
        tiles = -(-heads * q // 64)
        b = rng.randint(max(2, 132 // (12 * tiles)), 132 // tiles)
        ctx = round(2 ** rng.uniform(8, 14))
        lo = rng.choice((None, rng.uniform(0.6, 0.95), rng.uniform(lo_min, 0.6)))
        shape = (heads, b, ctx, "u" if lo is None else f"r{lo:.2f}", q, BF, block)
        case_seed = CASE_SEED_STRIDE * seed + i
        g = torch.Generator(device="cpu").manual_seed(case_seed)
        replans, one_wave, spread = one_wave_plan(shape, case_lengths(shape[3], ctx, b, q, g))
        if replans and spread >= min_spread and len(found) < count:
            found.append((case_seed, shape))
        elif (one_wave and not replans and control_spread[0] <= spread < control_spread[1]
              and len(declined) < controls):
            declined.append((case_seed, shape))
    return found + declined


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seed", type=int)
    ap.add_argument("count", type=int)
    ap.add_argument("--controls", type=int, default=0)
    ap.add_argument("--control-spread", type=float, nargs=2, metavar=("LO", "HI"),
                    default=(fa3_splits.ONE_WAVE_MAX_SPREAD, 2.0))
    ap.add_argument("--lo-min", type=float, default=0.2)
    ap.add_argument("--min-spread", type=float, default=0.0,
                    help="only replanned shapes of at least this spread")
    ap.add_argument("--block", type=int, default=64, help="tokens per KV page")
    args = ap.parse_args()
    for case_seed, shape in draw(args.seed, args.count, args.controls, args.control_spread,
                                 args.lo_min, args.min_spread, args.block):
        print(case_seed, shape_name(shape))


if __name__ == "__main__":
    main()
