"""Plugin routes under CUDA graphs timed in alternation with vLLM's own two SM90 bf16 calls
(FLASHMLA's and FLASH_ATTN_MLA's), for choosing which route the CUDA-graph rule gives a range
of batch sizes (docs/benchmarks-history.md "cuda-splitk from 33 requests under CUDA graphs").

Why alternation: ``bench_decode.py`` times a shape's kernels one after another, and the same
kernel timed twice there differed by up to 18% on 300-600 us shapes (run 131); here every
kernel's graph is captured once and replayed in ``--rounds`` rounds, the order rotated each
round, and each kernel scored by its median round.

Usage (GPU machine, the vLLM kit installed for vLLM's kernels)::

    python benchmarks/graph_routes_ab.py --out ab.csv --seeds 89,90 --count 1000 \\
        --request-rows 9-16 --batches 17-127 --routes flashmla,cuda-splitk [--grid 3,4]
    python benchmarks/graph_routes_ab.py --out grid.csv --grid 3,5,23,35,44 \\
        --routes plugin,vllm-fa3-mla,flashmla --rounds 5 --query-parts

``--routes``: plugin routes forced, and ``plugin`` for the CUDA-graph decoder itself (the
policy's pick per batch size, as the engine runs it). ``--query-parts``: the decoder and
routes get vLLM's two query parts and vLLM's FLASHMLA call concatenates them
(``decode_kernels.QUERY_PARTS``), as in the engine. ``--sustain S``: each timing after S
seconds of its graph (``bench_decode.SUSTAIN_S``).

``--out``: one row per shape and kernel (us per round and their median; ``--summarize``
reads it back on any machine); stdout: per batch range, each route's geometric mean and
worst of (the faster of vLLM's two calls) / route, over all shapes the same with the count
under 0.98 and the shapes under it, for each lower bound T, the rule "cuda-splitk from
T requests, the first route below" scored the same way (when both are timed), and for each
rows bound X, "vllm-fa3-mla up to X query rows, flashmla past it" (when both are timed;
``--rows`` keeps the draws of a range of query rows). ``--summarize --replay-gpu NAME``
also scores ``ops.policy``'s CUDA-graph rule as it ships today for the SM90 GPU of that name,
each shape on the forced row of the route the rule picks: a rule changed since the file
was timed, replayed on its timings.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode
import decode_kernels
from bench_decode import add_shape_options, chosen_shapes, make_case
from decode_kernels import Kernel, decoder_kernel, flashmla_peer, vllm_fa3_mla_peer
from evaluate_policy import spec_and_shape

from trtllm_mla_plugin.ops import Platform, policy

PEERS = ("peer:vllm-flashmla", "peer:vllm-fa3-mla")
BINS = ((17, 24), (25, 32), (33, 40), (41, 48), (49, 64), (65, 80), (81, 95), (96, 127),
        (128, 1024))
BOUNDS = (33, 40, 48, 56, 64, 80, 96)
#: Bounds on a batch's query rows scored for "vllm-fa3-mla up to X rows, flashmla past
#: it" (``policy.VLLM_FA3_GRAPH_MAX_ROWS``, 32 requests or fewer).
ROWS_BOUNDS = (3072, 4096, 6144, 8192, 12288, 16384)


#: ``--routes`` name of the CUDA-graph decoder itself (no route forced).
DECODER = "plugin"
#: Ratio to the faster of vLLM's two calls that the issue asks of every grid shape.
AIM = 0.98


def kernels(case, routes: list[str]) -> list[Kernel]:
    """The plugin's ``routes`` forced with their CUDA-graph set-up (as the graph rule would
    run them; ``engine_query`` as vLLM hands the query over; ``DECODER``: the decoder with
    the policy's pick), then vLLM's two calls."""
    ks = [decoder_kernel(route, case, None if route == DECODER else route,
                         engine_query=True, cuda_graph=True)
          for route in routes]
    return [*ks, flashmla_peer(case), vllm_fa3_mla_peer(case)]


def time_alternating(ks: list[Kernel], case, rounds: int) -> dict[str, list[float]]:
    """``bench_decode.time_alternating`` of the runnable kernels of ``ks``, by name."""
    runnable = [k for k in ks if k.call is not None]
    per_kernel = bench_decode.time_alternating([k.call for k in runnable], case, rounds)
    return {k.name: t for k, t in zip(runnable, per_kernel, strict=True)}


def score(times: dict[str, float], route: str) -> float | None:
    """(the faster of vLLM's calls that ran) / ``route``'s time; None where ``route`` or
    both calls are missing. vLLM's FLASHMLA cannot run pages of 32 tokens, so there the
    faster call vLLM has is its FA3 one (run 223 left those grid shapes unscored)."""
    peers = [times[p] for p in PEERS if p in times]
    if route not in times or not peers:
        return None
    return min(peers) / times[route]


def shipped_rule_route(name: str, times: dict[str, float], gpu_name: str) -> str | None:
    """The route ``ops.policy``'s CUDA-graph rule gives the bf16 shape ``name`` on the SM90
    GPU named ``gpu_name`` (its ranking's first: a machine that builds ``cuda-splitk``)
    where ``times`` holds that route's forced row, else ``None`` (another cache dtype, or
    the route not timed: left out rather than scored on a route the rule would not run)."""
    heads, batch, _ctx, _kind, q_len, kv, block = bench_decode.parse_shape_name(name)
    if kv != "bf16":
        return None
    spec, shape = spec_and_shape({"heads": heads, "batch": batch, "q_len": q_len,
                                  "block": block}, [], graph=True)
    route = policy.rank(spec, Platform("cuda", (9, 0), gpu_name), shape)[0]
    return route if route in times else None


def summarize(results: list[tuple[int, dict[str, float]]], routes: list[str],
              names: list[str] | None = None, replay_gpu: str | None = None) -> None:
    """Per batch range and route, over all shapes (``names``: the shapes', to list those
    under ``AIM`` and read their query rows), then per lower bound of the ``cuda-splitk``
    range and per bound of ``ROWS_BOUNDS`` between ``vllm-fa3-mla`` and ``flashmla``; with
    ``replay_gpu`` (and ``names``) first today's CUDA-graph rule for that GPU, replayed."""
    def line(values: list[float]) -> str:
        return (f"geomean {statistics.geometric_mean(values):.3f} worst {min(values):.3f} "
                f"n {len(values)}") if values else "n 0"

    names = names or [""] * len(results)
    if replay_gpu and any(names):
        picked = [(name, route, s) for name, (_, t) in zip(names, results, strict=True)
                  if (route := shipped_rule_route(name, t, replay_gpu))
                  if (s := score(t, route))]
        under = [f"{name} {s:.3f} ({route})" for name, route, s in picked if s < AIM]
        print(f"today's rule on {replay_gpu}, replayed: {line([s for *_, s in picked])} "
              f"({len(results) - len(picked)} left out: its route not timed), under {AIM}: "
              f"{len(under)}" + "".join(f"\n  {u}" for u in under))
    for route in routes:
        scored = [(name, s) for name, (_, t) in zip(names, results, strict=True)
                  if (s := score(t, route))]
        under = [f"{name} {s:.3f}" for name, s in scored if s < AIM]
        print(f"all shapes: {route} {line([s for _, s in scored])}, under {AIM}: "
              f"{len(under)}" + "".join(f"\n  {u}" for u in under))

    for lo, hi in BINS:
        inside = [t for b, t in results if lo <= b <= hi]
        if not inside:
            continue
        cells = [f"{route} {line([s for t in inside if (s := score(t, route))])}"
                 for route in routes]
        print(f"b{lo}-{hi}: " + " | ".join(cells))
    if "cuda-splitk" in routes and len(routes) > 1:
        other = next(r for r in routes if r != "cuda-splitk")
        for bound in BOUNDS:
            values = [s for b, t in results if b >= BOUNDS[0]
                      if (s := score(t, "cuda-splitk" if b >= bound else other))]
            print(f"cuda-splitk from {bound} requests, {other} below "
                  f"(batches >= {BOUNDS[0]}): {line(values)}")
    if {"vllm-fa3-mla", "flashmla"} <= set(routes) and any(names):
        rows = [query_rows(name) for name in names]
        for bound in ROWS_BOUNDS:
            values = [s for n, (_, t) in zip(rows, results, strict=True)
                      if (s := score(t, "vllm-fa3-mla" if n <= bound else "flashmla"))]
            under = sum(v < 0.95 for v in values)
            print(f"vllm-fa3-mla up to {bound} query rows, flashmla past it: {line(values)}, "
                  f"under 0.95: {under}")


def query_rows(name: str) -> int:
    """A batch's query rows (requests x heads x query tokens) from its shape name, e.g.
    ``h128 b32 9951 r0.04 q1 bf16 p64`` -> 4096."""
    return bench_decode.batch_query_rows(bench_decode.parse_shape_name(name))


def read_results(path: Path) -> list[tuple[int, dict[str, float]]]:
    """``(batch size, median us per kernel)`` per shape of an ``--out`` file."""
    return list(read_results_by_shape(path).values())


def read_results_by_shape(path: Path) -> dict[str, tuple[int, dict[str, float]]]:
    """Shape name -> ``(batch size, median us per kernel)`` of an ``--out`` file."""
    by_shape: dict[str, tuple[int, dict[str, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["median_us"]:
                entry = by_shape.setdefault(row["shape"], (int(row["batch"]), {}))
                entry[1][row["kernel"]] = float(row["median_us"])
    return by_shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    add_shape_options(ap, count=1000, request_rows=(9, 16), batches=(17, 127))
    ap.add_argument("--routes", default="flashmla,cuda-splitk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--query-parts", action="store_true",
                    help="vLLM's two query parts, as in the engine (decode_kernels.QUERY_PARTS)")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="S",
                    help="replay each graph for S seconds before each timing")
    ap.add_argument("--summarize", action="store_true",
                    help="only summarize an existing --out file (any machine)")
    ap.add_argument("--replay-gpu", metavar="NAME",
                    help="with --summarize: also score today's CUDA-graph rule for the SM90 "
                         "GPU of this name ('NVIDIA H200'), on the routes' forced rows")
    args = ap.parse_args()
    routes = [r for r in args.routes.split(",") if r]
    if args.summarize:
        by_shape = read_results_by_shape(args.out)
        summarize(list(by_shape.values()), routes, list(by_shape), args.replay_gpu)
        return
    decode_kernels.QUERY_PARTS = args.query_parts
    bench_decode.SUSTAIN_S = args.sustain
    device = torch.device("cuda")
    shapes = chosen_shapes(args)
    print(f"{len(shapes)} shapes, routes {routes}, {args.rounds} rounds", flush=True)
    results, names = [], []
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["shape", "batch", "kernel", "rounds_us", "median_us", "rel_diff"])
        for case_seed, shape in shapes:
            case = make_case(shape, case_seed, device)
            ks = kernels(case, routes)
            outs = {k.name: k.call(case.caches[0]).float() for k in ks if k.call is not None}
            # vLLM's FA3 call (else the last runnable kernel): what the others are compared to
            first = next(outs[k.name] for k in reversed(ks) if k.name in outs)
            times = time_alternating(ks, case, args.rounds)
            medians = {name: statistics.median(v) for name, v in times.items()}
            for name, values in times.items():
                diff = ((outs[name] - first).norm() / first.norm()).item()
                writer.writerow([case.name, shape[1], name,
                                 " ".join(f"{v:.2f}" for v in values),
                                 f"{medians[name]:.2f}", f"{diff:.2e}"])
            for k in ks:
                if k.call is None:
                    writer.writerow([case.name, shape[1], k.name, "", "", k.absent])
            f.flush()
            results.append((shape[1], medians))
            names.append(case.name)
            cells = ", ".join(f"{r} {s:.3f}" for r in routes if (s := score(medians, r)))
            print(f"{case.name}: {cells}", flush=True)
            del case, ks, outs
            torch.cuda.empty_cache()
    summarize(results, routes, names)


if __name__ == "__main__":
    main()
