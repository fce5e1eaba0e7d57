"""The CUDA-graph band of ``cuda-splitk`` with its smaller batches on vLLM's FA3 kernel,
scored on measured rows without a GPU.

``python benchmarks/band16_bound_replay.py [--bounds 0,48,64,96] [--with-8-rows]
[--rows LO-HI] [--batches LO-HI] [GROUP=]FILE.csv[,FILE.csv ...] ...`` (each argument one
group of files, named ``GROUP``; ``--rows`` scores only shapes of that many query rows a
request, ``--batches`` only shapes of that many requests: ``--batches 33-64`` with bound 65
scores the shapes that bound moves and none that it leaves where they were)

Under CUDA graphs ``ops.policy`` gives ``cuda-splitk`` every batch of
``SPLITK_MIN_REQUEST_ROWS``-``SPLITK_MAX_REQUEST_ROWS`` query rows a request (8-16) from
``SPLITK_GRAPH_MIN_BATCH`` to ``SPLITK_MAX_BATCH`` requests. The candidate replayed here
gives the batches of more than 8 rows below a bound to the ``vllm-fa3-mla`` route instead
(longest first, as it launches batches of that size); ``--with-8-rows`` moves the 8-row
batches too. Per bound it prints, for each group and for all groups together (a shape
in two groups counts twice there: its two measurements), the geometric mean and the worst
of the faster of vLLM's two calls (``peer:`` rows) over the time of the route the bound
picks, and how many shapes are under 0.95 (bound 0: today's rule).

Files, each shape's times the median over the files that timed it:

* bench_decode.py output (``us`` column): the CUDA-graph decoder's row
  ``plugin-graph[cuda-splitk]`` for ``cuda-splitk`` and the forced ``vllm-fa3-mla`` row
  (``evaluate_policy.timed_rows``: first-pass rows that timed ``ok``; where a shape has no
  ``vllm-fa3-mla`` row it stands in vLLM's own call, ``peer:vllm-fa3-mla``, which launches
  in the caller's order);
* graph_routes_ab.py output (``median_us``): the ``plugin`` row (the decoder, on
  ``cuda-splitk`` for every shape of the band), else the forced ``cuda-splitk`` row, and
  ``vllm-fa3-mla``.

Shapes without both rows, or outside the band, are left out.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict

from bench_decode import int_range, parse_shape_name
from evaluate_policy import GRAPH_ROW, summary, timed_rows

from trtllm_mla_plugin.ops import policy

#: Rows that time cuda-splitk in the band: the decoder (preferred), else the route forced.
SPLITK_ROWS = (f"{GRAPH_ROW}[cuda-splitk]", "plugin", "cuda-splitk")
FA3_ROW = "vllm-fa3-mla"


def band_rows_and_batch(shape: str) -> tuple[int, int] | None:
    """``(query rows a request, requests)`` of a shape name such as
    ``h16 b56 467 r0.22 q1 bf16 p64`` if the CUDA-graph rule gives that bf16 shape to
    ``cuda-splitk``, else ``None``."""
    heads, batch, _ctx, _kind, q_len, kv, _block = parse_shape_name(shape)
    rows = heads * q_len
    if (kv == "bf16" and policy.SPLITK_MIN_REQUEST_ROWS <= rows <= policy.SPLITK_MAX_REQUEST_ROWS
            and policy.SPLITK_GRAPH_MIN_BATCH <= batch <= policy.SPLITK_MAX_BATCH):
        return rows, batch
    return None


def file_times(path: str) -> dict[str, dict[str, float]]:
    """``{shape: {row: us}}`` of one file of either kind (module docstring)."""
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    if "median_us" not in header:
        return {s: {n: float(r["us"]) for n, r in ks.items()}
                for s, ks in timed_rows(path).items()}
    times: dict[str, dict[str, float]] = defaultdict(dict)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["median_us"]:
                times[r["shape"]][r["kernel"]] = float(r["median_us"])
    return times


def band_ratios(paths: list[str]) -> dict[str, tuple[int, int, float, float]]:
    """``{shape: (rows a request, requests, best peer / cuda-splitk, best peer / FA3)}``
    over ``paths``, each time the median over the files that timed it."""
    merged: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for shape, ks in file_times(path).items():
            for name, us in ks.items():
                merged[shape][name].append(us)
    out = {}
    for shape, ks in merged.items():
        place = band_rows_and_batch(shape)
        splitk = next((n for n in SPLITK_ROWS if n in ks), None)
        peers = [statistics.median(v) for n, v in ks.items() if n.startswith("peer:")]
        if place is None or splitk is None or FA3_ROW not in ks or not peers:
            continue
        best = min(peers)
        out[shape] = (*place, best / statistics.median(ks[splitk]),
                      best / statistics.median(ks[FA3_ROW]))
    return out


def with_bound(ratios: dict[str, tuple[int, int, float, float]], bound: int,
               eight_rows: bool = False) -> list[float]:
    """Each shape's ratio with batches of fewer than ``bound`` requests (of more than 8
    rows a request, or any with ``eight_rows``) on FA3, the rest on ``cuda-splitk``."""
    return [fa3 if batch < bound and (eight_rows or rows > policy.SPLITK_MIN_REQUEST_ROWS)
            else splitk for rows, batch, splitk, fa3 in ratios.values()]


def main(*argv: str) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="FILE.csv, or GROUP=FILE.csv,FILE.csv")
    ap.add_argument("--bounds", default="0,48,64,96,128")
    ap.add_argument("--with-8-rows", action="store_true")
    ap.add_argument("--rows", type=int_range, default=None, metavar="LO-HI")
    ap.add_argument("--batches", type=int_range, default=None, metavar="LO-HI")
    args = ap.parse_args(argv)
    groups = {}
    for arg in args.files:
        name, _, files = arg.rpartition("=")
        groups[name or arg] = files.split(",")
    ratios = {name: band_ratios(paths) for name, paths in groups.items()}
    for field, span in ((0, args.rows), (1, args.batches)):
        if span is not None:
            lo, hi = span
            ratios = {name: {s: r for s, r in rs.items() if lo <= r[field] <= hi}
                      for name, rs in ratios.items()}
    ratios["all"] = {f"{g} {s}": r for g, rs in ratios.items() for s, r in rs.items()}
    for bound in (int(b) for b in args.bounds.split(",")):
        cells = []
        for name, rs in ratios.items():
            scored = with_bound(rs, bound, args.with_8_rows)
            if scored:
                gm, worst, n = summary(scored)
                under = sum(r < 0.95 for r in scored)
                cells.append(f"{name}: {n} shapes {gm:.3f} worst {worst:.3f} under {under}")
        print(f"FA3 below {bound:4d}: " + "; ".join(cells))


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:])
