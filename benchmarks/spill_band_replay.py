"""FA3's splits past the band, and the band the route uses now, scored without a GPU.

``python benchmarks/spill_band_replay.py [--variant ROW] [--caller-order] SHAPES FILE.csv ...``
reads bench_decode.py output timed with ``--extra-routes vllm-fa3-mla:balanced`` (the
route's ``balanced_splits`` plan on every step FA3's formula spills past one wave; ``--variant
vllm-fa3-mla-balanced --caller-order`` for run 153's row of that plan, which launched every
batch in the caller's order) and prints:

* per shape past ``fa3_splits.SPILL`` (where the variant's plan differs from the route's of
  the same run), the variant's time over FA3's own plan, the baseline being the median of
  the timings of that plan (the route forced, ``vllm-fa3-mla-own`` and the CUDA-graph
  decoder where it ran ``vllm-fa3-mla``), with the waves of FA3's plan, rows per query tile
  and the requests' mean length; and whether this checkout's band (``fa3_splits.spill_band``,
  and the one-wave plans of ``fa3_splits.one_wave_past_band``) replans it as timed;
* the CUDA-graph decoder against the faster of vLLM's two calls per shape (``--measured``
  of ``evaluate_policy.py``), as timed and with this checkout's band replayed: the
  variant's time where the band now replans a shape the decoder ran on ``vllm-fa3-mla``.

Lengths come from ``SHAPES``, a ``shapes.jsonl`` (bench_decode.py writes every shape's since
run 158), or ``seeds`` for files named ``...random-SEED.csv``: drawn again as bench_decode.py
draws them (``random_set``, ``case_lengths``). Batches of at least
``policy.VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` requests are planned longest first, as the route
launches them (``--caller-order``: every batch as given).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics

import bench_decode
import numpy as np
import torch
from evaluate_policy import GRAPH_ROW, ratios, read_shapes_log, summary, timed_rows

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, fa3_splits, policy
from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import graph_splits

VARIANT = "route:vllm-fa3-mla:balanced"
DECODER_ON_FA3 = f"{GRAPH_ROW}[vllm-fa3-mla]"


#: Shapes drawn per seed when lengths are drawn again: more than any run used; the draw's
#: first shapes do not depend on the count.
SEED_DRAW = 64


def seed_lengths(paths: list[str]) -> dict[str, list[int]]:
    """Every bf16 shape's lengths for the random-set files among ``paths``, drawn again."""
    lens = {}
    for path in paths:
        found = re.search(r"random-(\d+)\.csv$", path)
        if found is None:
            continue
        for case_seed, shape in bench_decode.random_set(int(found.group(1)), SEED_DRAW,
                                                        keep=bench_decode.BF):
            _, b, ctx, kind, m, _, _ = shape
            g = torch.Generator(device="cpu").manual_seed(case_seed)
            lens[bench_decode.shape_name(shape)] = bench_decode.case_lengths(kind, ctx, b, m, g)
    return lens


def route_plan_inputs(heads: int, batch_size: int, q_len: int, block: int, lens: list[int],
                      caller_order: bool = False) -> tuple[np.ndarray, int, int, int, float]:
    """What the ``vllm-fa3-mla`` route plans a bf16 batch of ``lens`` from under CUDA graphs:
    each request's 64-token KV tiles in launch order (``[batch]`` int64, longest first for
    batches of ``policy.VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` or more unless ``caller_order``),
    query tiles per request, the splits the launch reserves, the cap it plans with and the
    query rows per tile."""
    spec = DecodeSpec(heads, 512, 64, block, torch.bfloat16, torch.bfloat16, 0.1, q_len)
    order = np.array(lens, dtype=np.int64)
    if policy.vllm_fa3_length_order(batch_size) and not caller_order:
        order = -np.sort(-order)
    host = torch.from_numpy(order.astype(np.int32))
    batch = DecodeBatch(torch.zeros(batch_size, 1, dtype=torch.int32), host,
                        int(order.max()), max_q_len=q_len, num_tokens=batch_size * q_len,
                        kv_tokens=int(order.sum()), seq_lens_host=host)
    reserved, planned = graph_splits(spec, batch, policy.HOPPER_SMS)
    return (np.maximum(-(-order // policy.FA3_KV_TILE), 1), policy.query_tiles(spec, q_len),
            reserved, planned, policy.query_tile_rows(spec, q_len))


def fa3_plans(row: dict, lens: list[int], caller_order: bool = False) -> dict:
    """FA3's own plan of a bf16 shape as the route makes it under CUDA graphs, and which
    bands replan it: ``waves`` (FA3's work tiles over SMs), ``rows`` (per query tile),
    ``mean`` (tokens), ``past`` (replanned with no upper bound, FA3's plan past ``SPILL``)
    and ``now`` (past ``SPILL`` and replanned by this checkout's ``balanced_splits`` as the
    timed variant was)."""
    kv_tiles, tiles, reserved, planned, rows = route_plan_inputs(
        int(row["heads"]), int(row["batch"]), int(row["q_len"]), int(row["block"]), lens,
        caller_order)

    def plan(spill: float | None) -> np.ndarray | None:
        return fa3_splits.balanced_splits(kv_tiles, tiles, reserved, policy.HOPPER_SMS, rows,
                                          planned, spill)

    own = fa3_splits.fa3_splits(kv_tiles, tiles, planned, policy.HOPPER_SMS)
    waves = tiles * int(own.sum()) / policy.HOPPER_SMS
    timed, now = plan(math.inf), plan(None)
    return dict(waves=waves, rows=rows, mean=float(np.mean(lens)),
                past=timed is not None and waves > fa3_splits.SPILL,
                now=(now is not None and waves > fa3_splits.SPILL
                     and np.array_equal(now, timed)))


def own_plan_us(ks: dict[str, dict]) -> float:
    """Median of the timings of FA3's own plan (shapes past ``SPILL``: the route forced,
    the route with its splits off, the decoder where it ran the route)."""
    names = ["vllm-fa3-mla", "vllm-fa3-mla-own", DECODER_ON_FA3]
    return statistics.median(float(ks[n]["us"]) for n in names if n in ks)


def main(*argv: str) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", help="shapes.jsonl, or 'seeds' to draw random sets' lengths")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--variant", default=VARIANT, help="the row of the route's own splits")
    ap.add_argument("--caller-order", action="store_true",
                    help="FA3 planned every batch in the caller's order (runs before 158)")
    args = ap.parse_args(argv)
    variant, paths = args.variant, args.files
    lens = seed_lengths(paths) if args.shapes == "seeds" else read_shapes_log(args.shapes)
    before: dict[str, list[float]] = {"random": [], "grid": []}
    after: dict[str, list[float]] = {"random": [], "grid": []}
    plans: dict[str, dict] = {}
    print("variant/own  waves  rows/tile  mean tokens  band now  shape")
    for path in paths:
        kind = "grid" if "grid" in path.rsplit("/", 1)[-1] else "random"
        rows = timed_rows(path)
        for shape, ks in rows.items():
            if " bf16 " not in shape or variant not in ks:
                continue
            plans[shape] = fa3_plans(ks[variant], lens[shape], args.caller_order)
            if plans[shape]["past"]:
                p = plans[shape]
                print(f"{own_plan_us(ks) / float(ks[variant]['us']):11.3f}  "
                      f"{p['waves']:5.2f}  {p['rows']:9.0f}  {p['mean']:11.0f}  "
                      f"{'replans' if p['now'] else '-':8s}  {shape}")
        # The decoder against the faster of vLLM's two calls (``evaluate_policy --measured``),
        # and with the variant's time where this checkout's band replans a shape on FA3.
        for ratio, shape, decoder in ratios(path, lens, "measured", "peer:vllm", rows=rows):
            if " bf16 " not in shape:
                continue
            before[kind].append(ratio)
            if decoder == DECODER_ON_FA3 and shape in plans and plans[shape]["now"]:
                ratio *= float(rows[shape][decoder]["us"]) / float(rows[shape][variant]["us"])
            after[kind].append(ratio)
    for kind in ("random", "grid"):
        if before[kind]:
            for label, rs in (("timed", before[kind]), ("band now", after[kind])):
                gm, worst, n = summary(rs)
                print(f"{kind} {label}: {n} shapes, geomean {gm:.4f}, worst {worst:.3f}, "
                      f"under 0.95: {sum(r < 0.95 for r in rs)}, "
                      f"under 0.98: {sum(r < 0.98 for r in rs)}")


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
