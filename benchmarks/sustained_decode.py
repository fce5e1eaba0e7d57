"""Decode routes timed for seconds on end, as an engine runs them, with the GPU's clock and
power beside each timing.

Usage (on the GPU machine)::

    python benchmarks/sustained_decode.py --out DIR --heads 128 --batch 160 --q-len 3 \\
        --min-prompt 1300 --max-prompt 4500 --output-len 336 \\
        --routes vllm-fa3-mla,flashmla [--layers 24] [--seconds 3] [--blocks 4]
    python benchmarks/sustained_decode.py --summarize DIR/sustained.csv   # on any machine

Why: in the engine (run 217: 128 heads, 160 requests, MTP 2, 24 layers) the plugin on
FlashMLA lost ~0.1 ms a layer to FLASH_ATTN_MLA that kernel timings of the same lengths did
not show (FlashMLA 752-761 us a layer, FA3 782); the query concatenation FlashMLA needs
explains about a third. Kernel timings last ~60 ms after a pause; an engine keeps these
math-bound kernels running for seconds, where the board's power limit may lower the SM
clock, by more for one kernel than for another.

Per route, the plugin's decoder forced to it (``bench_engine.layer_decoder``) on
``bench_engine``'s prompt lengths for the batch plus half the output (as its attention
share), the query handed over as vLLM's MLA layer does (``--whole-query``: one 576-wide
tensor, as the kernel benchmarks), one CUDA graph of ``--layers`` decodes (a step's
attention). Then, routes alternated block by block (A B, B A, ...):

- ``burst``: after ``--idle`` seconds with the GPU idle, the graph timed as the kernel
  benchmarks time it (``bench_decode.time_replays``: ``do_bench``, 60 ms, median);
- ``sustained``: the graph replayed back to back for ``--seconds``, each replay timed with
  CUDA events; the median of the second half.

``nvidia-smi`` is sampled every 50 ms during each (``gpu_clocks``; a burst of ~0.2 s may
end before the first sample, which leaves its clock columns empty). Writes
``DIR/sustained.csv`` (one row per route, block and mode: us per layer, SM clock, power,
share of samples power-capped) and prints per route the median of its blocks, and each
route's time over the first route's, burst and sustained.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path

import bench_engine  # this folder is on sys.path when a file of it runs as a script
from gpu_clocks import ClockSampler

FIELDS = ["route", "served_by", "block", "mode", "us_per_layer", "replays", "sm_mhz",
          "power_w", "power_capped"]
MODES = ("burst", "sustained")


def time_sustained(replay, seconds: float) -> tuple[float, int]:
    """``replay`` launched back to back for ``seconds``, each launch between two CUDA
    events; the median ms of the second half of the launches, and their count."""
    import torch

    events = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        events.append((start, end))
        if len(events) % 16 == 0:
            events[-16][1].synchronize()  # keep the host at most 16 replays ahead
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return statistics.median(times[len(times) // 2:]), len(times)


def measure(args: argparse.Namespace) -> list[dict]:
    import torch
    from bench_decode import time_replays

    lens = bench_engine.attention_lens(args, args.batch)
    routes = args.routes.split(",")
    graphs, served = {}, {}
    for route in routes:
        dec, query, cache = bench_engine.layer_decoder(
            args.heads, args.kv, lens, route, q_len=args.q_len,
            query_parts=not args.whole_query)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(args.layers):
                dec.run(query, cache)
        graph.replay()
        torch.cuda.synchronize()
        graphs[route] = (graph, dec, query, cache)  # the graph reads these: keep them alive
        served[route] = dec.route.name
    rows = []
    for block, order in enumerate(bench_engine.alternating(routes, args.blocks)):
        for route in order:
            replay = graphs[route][0].replay
            time.sleep(args.idle)
            with ClockSampler(interval_ms=50) as clocks:
                us = time_replays(graphs[route][0], args.layers)
            rows.append(row(route, served[route], block, "burst", us, 0, clocks))
            with ClockSampler(interval_ms=50) as clocks:
                ms, n = time_sustained(replay, args.seconds)
            rows.append(row(route, served[route], block, "sustained", ms * 1e3 / args.layers,
                            n, clocks))
            print(f"block {block} {route}: burst {rows[-2]['us_per_layer']} us/layer, "
                  f"sustained {rows[-1]['us_per_layer']} ({n} replays); "
                  f"{describe(rows[-2])} | {describe(rows[-1])}", flush=True)
    return rows


def row(route: str, served_by: str, block: int, mode: str, us_per_layer: float,
        replays: int, clocks: ClockSampler) -> dict:
    summary = clocks.summary
    return dict(route=route, served_by=served_by, block=block, mode=mode,
                us_per_layer=f"{us_per_layer:.1f}", replays=replays,
                **(summary.columns() if summary else {}))


def describe(r: dict) -> str:
    if not r.get("sm_mhz"):
        return "no clock samples"
    text = f"SM {r['sm_mhz']} MHz, {r.get('power_w') or '?'} W"
    return text + (f", capped {r['power_capped']}" if r.get("power_capped") else "")


def medians(rows: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (route, mode): the median over blocks of us per layer and of the SM clock."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["route"], r["mode"]), []).append(r)
    out = {}
    for key, group in groups.items():
        clocks = [float(r["sm_mhz"]) for r in group if r.get("sm_mhz")]
        out[key] = dict(us=statistics.median(float(r["us_per_layer"]) for r in group),
                        sm_mhz=statistics.median(clocks) if clocks else float("nan"),
                        blocks=len(group))
    return out


def print_summary(rows: list[dict]) -> None:
    """Per route and mode the median us per layer and SM clock over blocks, and each route's
    time over the first route's (above 1: slower than the first)."""
    table = medians(rows)
    routes = list(dict.fromkeys(r["route"] for r in rows))
    print(f"\n{'route':>16} {'burst us':>9} {'MHz':>6} {'sustained us':>12} {'MHz':>6} "
          f"{'sust/burst':>10} {'vs first, burst':>15} {'sustained':>9}")
    for route in routes:
        burst, sust = table.get((route, "burst")), table.get((route, "sustained"))
        if burst is None or sust is None:
            continue
        first_b, first_s = table[(routes[0], "burst")], table[(routes[0], "sustained")]
        print(f"{route:>16} {burst['us']:>9.1f} {burst['sm_mhz']:>6.0f} {sust['us']:>12.1f} "
              f"{sust['sm_mhz']:>6.0f} {sust['us'] / burst['us']:>10.3f} "
              f"{burst['us'] / first_b['us']:>15.3f} {sust['us'] / first_s['us']:>9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("sustained-out"))
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--q-len", type=int, default=3, help="query tokens a request (1 + MTP K)")
    ap.add_argument("--kv", default="auto", choices=("auto", "fp8"))
    ap.add_argument("--routes", default="vllm-fa3-mla,flashmla",
                    help="the first is the reference of the printed ratios")
    ap.add_argument("--layers", type=int, default=24, help="decodes per graph (a step)")
    ap.add_argument("--output-len", type=int, default=336,
                    help="as bench_engine: half of it is added to every prompt length")
    ap.add_argument("--min-prompt", type=int, default=1300)
    ap.add_argument("--max-prompt", type=int, default=4500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=3.0, help="sustained replay per block")
    ap.add_argument("--idle", type=float, default=2.0, help="idle seconds before a burst")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--whole-query", action="store_true",
                    help="one 576-wide query (as the kernel benchmarks) instead of vLLM's "
                         "two parts")
    ap.add_argument("--summarize", type=Path, metavar="CSV",
                    help="only print the summary of an earlier run's sustained.csv")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print_summary(list(csv.DictReader(f)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args)
    with open(args.out / "sustained.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    print_summary(rows)


if __name__ == "__main__":
    main()
