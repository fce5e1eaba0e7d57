"""vLLM's FA3 MLA kernel under CUDA graphs at other caps on its KV splits (needs CUDA and
the kit's vLLM).

``python3 benchmarks/bench_fa3_graph_splits.py [--grid random|short|short-random|mid-random|window]
[--seed S[,S...]] [--count N] [--caps 32,64,128,rule,/2] --out F.csv`` times the
``vllm-fa3-mla`` route set up for CUDA graphs (the graph rule's route for batches of up to 32
requests) with its cap on FA3's KV splits (``num_splits``, vLLM's
``flash_attn_max_num_splits_for_cuda_graph``, 32) set to each of ``--caps`` (``rule``: the
route's own choice, ``graph_split_reserve``, ``ops.policy.vllm_fa3_wide_splits`` and
``ops.policy.vllm_fa3_halved_splits``; ``/K``: the plan cut to the longest request's KV
tiles / K, the launch keeping the rule's reserve), beside the route as an eager decoder runs
it (FA3's own bound, up to 128) and, except on ``short``, vLLM's FLASH_ATTN_MLA call
(``peer:vllm-fa3-mla``, cap 32) and FLASHMLA's call, all graph-timed. The route plans on the
host's exact lengths, as vLLM's builder hands them over under CUDA graphs. Shapes
(``--grid``): ``random``, fixed long and short contexts at b1-b4 and the bf16 shapes of the
random sets whose batch holds at most ``MAX_TILES`` FA3 query tiles (only there can a
request want more than 32 splits); ``short``, ``short_grid()`` (batches of short requests
that FA3 cuts into one-KV-tile splits); ``short-random``, seeded draws in that region;
``mid-random``, seeded draws between the two split rules (``mid_random``);
``window``, the random sets' shapes of at most 32 requests and 16-160 work tiles. Writes
``--out`` (CSV: shape, tiles, kernel, us, difference to the first cap's output) and prints,
per cap, the geometric mean and range of the first cap's time over that cap's.

Why: in runs 80 and 85 the eager route (uncapped) beat the capped one by 1.06-1.42x on
b1-b3 batches of 12k-43k tokens (h16 b1 43k: 43.5 -> 30.6 us) and lost up to 21% on some
short ones, so the cap is a lever at small batches; and in runs 97 and 99 the eager route's
splits of two KV tiles beat vLLM's one-tile splits by 1.10-1.24x on some batches of short
requests (h64 b3 1.2k q2). FA3 sizes its partial outputs by the launch's cap (``cap x query
rows x 512`` floats per call, in the captured graph's memory).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
from pathlib import Path

import bench_decode as bd
import decode_kernels as dk
import torch

#: FA3's query tile (rows of heads x query tokens) for MLA on SM90, and the most tiles a
#: batch may hold here: at 32 splits each, under two waves of the H200's 132 SMs.
FA3_TILE_ROWS = 64
MAX_TILES = 8
FIXED = [(16, 1, 43444, "u", 1, bd.BF, 64), (16, 1, 16384, "u", 1, bd.BF, 64),
         (16, 1, 2048, "u", 1, bd.BF, 64), (16, 1, 512, "u", 1, bd.BF, 64),
         (16, 2, 25696, "r0.27", 1, bd.BF, 64), (16, 4, 32768, "u", 1, bd.BF, 64),
         (32, 1, 1070, "r0.15", 1, bd.BF, 64), (32, 3, 53409, "u", 1, bd.BF, 64),
         (64, 3, 1209, "u", 2, bd.BF, 64), (128, 1, 32768, "u", 1, bd.BF, 64),
         (8, 2, 13125, "r0.66", 2, bd.BF, 64), (16, 8, 8192, "u", 1, bd.BF, 64)]
FIELDS = ["shape", "tiles", "kernel", "us", "rel_diff"]


def request_tiles(heads: int, q_len: int) -> int:
    """FA3's query tiles for one request of ``heads x q_len`` query rows."""
    return math.ceil(heads * q_len / FA3_TILE_ROWS)


def query_tiles(shape: tuple) -> int:
    """FA3's query tiles for a batch of ``shape`` (``bench_decode`` shape tuple)."""
    heads, batch, _, _, q_len, _, _ = shape
    return batch * request_tiles(heads, q_len)


def random_request(rng: random.Random, context: tuple[int, int]) -> tuple[int, int, int, str]:
    """One seeded draw of (heads of 8-128, 1-4 query tokens, a longest request of
    ``context`` tokens, uniform or ragged lengths) for the random grids below."""
    heads, q_len = rng.choice((8, 16, 32, 64, 128)), rng.randint(1, 4)
    return heads, q_len, rng.randint(*context), rng.choice(("u", "r0.2", "r0.5", "r0.8"))


def short_grid() -> list[tuple]:
    """Uniform and ragged batches of requests of at most 2k tokens whose FA3 work (query
    tiles x 64-token KV tiles) is 24-150 tiles: at vLLM's cap FA3 splits them into one-KV-tile
    pieces up to 120 tiles (its ``prepare_varlen_num_blocks``: ``ceil(1.1 x tiles / SMs)``
    KV tiles per split), and these are the shapes where its eager heuristic's two-tile
    pieces ran faster or slower (runs 97, 99)."""
    shapes = []
    for heads in (8, 16, 32, 64, 128):
        for q_len in (1, 2, 4):
            tiles = request_tiles(heads, q_len)
            for ctx in (320, 704, 1216, 1920):
                kv_tiles = math.ceil(ctx / 64)
                sizes = sorted({max(1, round(work / (tiles * kv_tiles)))
                                for work in (24, 48, 72, 96, 120, 150)})
                for b in sizes:
                    if b <= 32 and 16 <= b * tiles * kv_tiles <= 160:
                        kind = "u" if (heads + q_len + b) % 3 else "r0.5"
                        shapes.append((heads, b, ctx, kind, q_len, bd.BF, 64))
    return shapes


def short_random(seed: int, count: int) -> list[tuple[int, tuple]]:
    """``(case seed, shape)`` of ``count`` seeded random batches in ``short_grid``'s region
    (any heads of 8-128, 1-4 query tokens, 256-2048 tokens, uniform or ragged, 40-130 work
    tiles as if every request were the longest): shapes off that grid, for checking a rule
    fitted on it."""
    rng = random.Random(seed)
    shapes: list[tuple[int, tuple]] = []
    while len(shapes) < count:
        heads, q_len, ctx, kind = random_request(rng, (256, 2048))
        per_request = request_tiles(heads, q_len) * math.ceil(ctx / 64)
        b = max(1, round(rng.uniform(40, 130) / per_request))
        if b <= 32:
            shape = (heads, b, ctx, kind, q_len, bd.BF, 64)
            shapes.append((1000 * seed + len(shapes), shape))
    return shapes


#: ``mid_random``'s region: the longest request's tokens, and the most FA3 query tiles a
#: batch holds (at 32 splits each, at most 128 CTAs: under one wave of the H200's SMs).
MID_CONTEXT = (2048, 8191)
MID_MAX_TILES = 4


def mid_random(seed: int, count: int) -> list[tuple[int, tuple]]:
    """``(case seed, shape)`` of ``count`` seeded random batches between the two split rules
    (``ops.policy.vllm_fa3_wide_splits`` from 8k tokens, ``vllm_fa3_halved_splits`` for busy
    batches of short requests): any heads of 8-128, 1-4 query tokens, a longest request of
    2k-8k tokens, uniform or ragged, at most ``MID_MAX_TILES`` query tiles in all, where
    FA3 at vLLM's cap of 32 splits runs under one wave of CTAs and the cap may bind."""
    rng = random.Random(seed)
    shapes: list[tuple[int, tuple]] = []
    while len(shapes) < count:
        heads, q_len, ctx, kind = random_request(rng, MID_CONTEXT)
        tiles = request_tiles(heads, q_len)
        if tiles > MID_MAX_TILES:
            continue
        b = rng.randint(1, MID_MAX_TILES // tiles)
        shapes.append((1000 * seed + len(shapes), (heads, b, ctx, kind, q_len, bd.BF, 64)))
    return shapes


def set_cap(route, cap: int | str, case: bd.Case) -> None:
    """The ``vllm-fa3-mla`` route's cap on FA3's KV splits for its plan and run (``"rule"``:
    its own; ``"/K"``: the plan's cap ``ceil(KV tiles of the longest request / K)``, the
    launch the rule's reserve)."""
    route.max_splits_override = None if cap == "rule" or str(cap)[0] == "/" else cap
    # At least 2: a plan of one split leaves out the per-request split counts that a launch
    # reserving more expects (FA3: "scheduler_metadata must have shape").
    route.planned_splits_override = (
        max(2, math.ceil(math.ceil(case.batch.max_seq_len / 64) / int(cap[1:])))
        if str(cap)[0] == "/" else None)


def fa3_work_tiles(shape: tuple) -> int:
    """Query tiles x 64-token KV tiles of ``shape`` as if every request were the longest."""
    return query_tiles(shape) * math.ceil(shape[2] / 64)


def sweep(device: torch.device, seeds: list[int], count: int, caps: list[int | str],
          out: Path, grid: str = "random", skip: int = 0) -> None:
    if grid == "short":
        shapes = [(900 + i, s) for i, s in enumerate(short_grid())][skip:]
    elif grid == "short-random":
        shapes = [x for seed in seeds for x in short_random(seed, count)]
    elif grid == "mid-random":
        shapes = [x for seed in seeds for x in mid_random(seed, count)]
    elif grid == "window":
        shapes = [(case_seed, s) for seed in seeds
                  for case_seed, s in bd.random_set(seed, count, keep=bd.BF)
                  if s[1] <= 32 and 16 <= fa3_work_tiles(s) <= 160]
    else:
        shapes = [(11, s) for s in FIXED] + [
            (case_seed, s) for seed in seeds
            for case_seed, s in bd.random_set(seed, count, keep=bd.BF)
            if query_tiles(s) <= MAX_TILES]
    gains: dict[int | str, list[float]] = {cap: [] for cap in caps}
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for case_seed, shape in shapes:
            case = bd.make_case(shape, case_seed, device)
            route = dk.decoder_kernel("vllm-fa3-mla", case, "vllm-fa3-mla", cuda_graph=True)
            if route.call is None:
                continue
            kernels = {"vllm-fa3-mla-eager": dk.decoder_kernel(
                           "vllm-fa3-mla-eager", case, "vllm-fa3-mla")}
            if grid != "short":
                kernels |= {"peer:vllm-fa3-mla": dk.vllm_fa3_mla_peer(case),
                            "peer:vllm-flashmla": dk.flashmla_peer(case)}
            times = bd.time_kernels(kernels, case)
            try:
                for cap, us, diff in bd.route_variants(
                        route, case, caps, lambda r, c, case=case: set_cap(r, c, case)):
                    times[f"vllm-fa3-mla@{cap}"] = us
                    writer.writerow(dict(shape=case.name, tiles=query_tiles(shape),
                                         kernel=f"vllm-fa3-mla@{cap}", us=f"{us:.2f}",
                                         rel_diff=f"{diff:.1e}"))
            except RuntimeError as error:  # the caps timed before it have their rows
                print(f"{case.name}: failed: {error}", flush=True)
                continue
            bd.write_peer_rows(writer, case.name, list(kernels), times,
                               tiles=query_tiles(shape))
            f.flush()
            base = times[f"vllm-fa3-mla@{caps[0]}"]
            for cap in caps:
                gains[cap].append(base / times[f"vllm-fa3-mla@{cap}"])
            del case
            torch.cuda.empty_cache()
    for cap, g in gains.items():
        if g:
            print(f"cap {cap}: cap-{caps[0]} time / this cap's {bd.ratio_summary(g)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", default="41", help="random set seeds, comma-separated")
    parser.add_argument("--count", type=int, default=120)
    parser.add_argument("--caps", default="32,64,128,rule",
                        help="caps on FA3's KV splits (rule: the route's own; /K: the plan "
                        "cut to the longest request's KV tiles / K); the first is the one "
                        "the others' outputs and times are compared with")
    parser.add_argument("--grid",
                        choices=("random", "short", "short-random", "mid-random", "window"),
                        default="random",
                        help="random: FIXED and the shapes of at most MAX_TILES query tiles "
                        "of the random sets; short: short_grid(); short-random: --count "
                        "shapes of short_random() per seed; mid-random: --count shapes of "
                        "mid_random() per seed; window: the random sets' shapes of <= 32 "
                        "requests and 16-160 FA3 work tiles")
    parser.add_argument("--skip", type=int, default=0, help="short: start at this shape")
    parser.add_argument("--out", type=Path, default=Path("fa3-graph-splits.csv"))
    args = parser.parse_args()
    sweep(torch.device("cuda"), [int(x) for x in args.seed.split(",")], args.count,
          [c if c == "rule" or c[0] == "/" else int(c) for c in args.caps.split(",")],
          args.out, args.grid, args.skip)


if __name__ == "__main__":
    main()
