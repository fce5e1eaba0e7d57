"""The CUDA-graph decoder and the two routes it picks between, by query rows and batch size.

``python benchmarks/graph_rows_table.py [--block P] [--rows R[,R...]] [--q-lens LO-HI]
[--query-join fused|copies|cat] [--total LO-HI] FILE.csv ...`` reads bench_decode.py output
timed with ``--graph-only`` (the decoder's ``plugin-graph[...]`` row, the routes forced,
vLLM's calls as ``peer:`` rows) and, for the bf16 shapes on pages of ``--block`` tokens
(64), groups them by query rows per request (heads x query tokens; only ``--rows`` if given,
and only shapes of ``--q-lens`` query tokens) and batch band (``BATCH_BANDS``). Per group:
shapes, the routes the decoder ran, and for the decoder and for each of
``evaluate_policy.ORACLE_ROWS`` forced (``vllm-fa3-mla``, ``flashmla``) the geometric mean
of the faster of vLLM's calls over its time (> 1: faster than vLLM), how many shapes are
under 1.0 and the worst; then FlashMLA forced against FA3 forced (``PAIR``: geomean, shapes
FlashMLA ran faster); ``--total``: then the same per query rows over all batches of LO-HI
requests. A group where a forced route beats the decoder is a candidate for the graph rule
(``ops.policy``), to be checked on fresh draws (``bench_decode.py --random ...
--random-request-rows R --random-batches LO-HI``) before any change. Each file's timings
count apart: a shape timed in two runs counts twice. ``--query-join``: each time with what
joining vLLM's two query parts would add in the engine (``evaluate_policy.join_us``: the
given join for the plugin's rows of routes that read the query whole, ``torch.cat`` for
vLLM's FLASHMLA), for files timed with one 576-wide query (runs 1-220).
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from collections.abc import Sequence

from bench_decode import int_range, parse_shape_name
from evaluate_policy import (
    GRAPH_ROW,
    JOIN_COSTS,
    ORACLE_ROWS,
    decoder_route,
    decoder_row,
    engine_peer_times,
    engine_us,
    summary,
    timed_rows,
)

#: The table's column of FlashMLA forced against FA3 forced.
PAIR = "flashmla/vllm-fa3-mla"

#: Batch bands of the table, inclusive: the graph rule's bounds fall on their edges
#: (32 requests, 132 SMs' worth of 64-row query tiles at one or two tiles a request, 256).
BATCH_BANDS = ((1, 32), (33, 40), (41, 48), (49, 64), (65, 96), (97, 132), (133, 256),
               (257, 1024))


def batch_band(batch: int, bands: Sequence[tuple[int, int]] = BATCH_BANDS
               ) -> tuple[int, int] | None:
    """The band of ``bands`` (``BATCH_BANDS``) holding ``batch``, if any."""
    return next((band for band in bands if band[0] <= batch <= band[1]), None)


def graph_timings(paths: Sequence[str], block: int = 64,
                  join: str | None = None) -> list[dict]:
    """Per bf16 shape timed with the decoder and vLLM's calls, on pages of ``block``
    tokens: ``rows`` (per request), ``batch``, ``decoder`` (its route), and the faster of
    vLLM's calls over the decoder's time (``plugin-graph``) and over each forced route's
    where timed (``vllm-fa3-mla``, ``flashmla``); ``join``: each call with its query join
    modelled (``evaluate_policy.join_us``)."""
    found = []
    for path in paths:
        for shape, ks in timed_rows(path).items():
            heads, batch, _ctx, _kind, q_len, kv, page = parse_shape_name(shape)
            graph = decoder_row(ks)
            peers = engine_peer_times(ks, join)
            if kv != "bf16" or page != block or graph is None or not peers:
                continue
            vllm = min(peers.values())
            timing = dict(rows=heads * q_len, q_len=q_len, batch=batch,
                          decoder=decoder_route(graph),
                          **{GRAPH_ROW: vllm / engine_us(ks, graph, join)})
            timing.update({n: vllm / engine_us(ks, n, join) for n in ORACLE_ROWS if n in ks})
            found.append(timing)
    return found


def group_table(timings: Sequence[dict],
                bands: Sequence[tuple[int, int]] = BATCH_BANDS) -> list[dict]:
    """Per (rows, batch band of ``bands``; shapes in none are left out), in that order:
    ``rows``, ``band``, ``shapes``, ``decoders`` (route: shapes), for the decoder and
    each forced route ``(geomean, under 1.0, shapes timed, worst)``, and ``PAIR``
    (FlashMLA forced over FA3 forced, the time of one over the other's, on the shapes
    both were timed: ``(geomean, FlashMLA faster, shapes)``), the numbers a candidate's
    criterion reads."""
    groups: dict[tuple[int, tuple[int, int]], list[dict]] = defaultdict(list)
    for t in timings:
        band = batch_band(t["batch"], bands)
        if band is not None:
            groups[(t["rows"], band)].append(t)
    table = []
    for (rows, band), group in sorted(groups.items()):
        line = dict(rows=rows, band=band, shapes=len(group),
                    decoders=dict(Counter(t["decoder"] for t in group)))
        for name in (GRAPH_ROW, *ORACLE_ROWS):
            values = [t[name] for t in group if name in t]
            if values:
                geomean, worst, count = summary(values)
                line[name] = (geomean, sum(v < 1.0 for v in values), count, worst)
            else:
                line[name] = None
        fa3, flashmla = ORACLE_ROWS
        gains = [t[flashmla] / t[fa3] for t in group if fa3 in t and flashmla in t]
        line[PAIR] = ((summary(gains)[0], sum(g > 1.0 for g in gains), len(gains))
                      if gains else None)
        table.append(line)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--block", type=int, default=64, help="tokens per KV page")
    ap.add_argument("--rows", default="", help="comma-separated query rows per request")
    ap.add_argument("--q-lens", type=int_range, default=(1, 4), metavar="LO-HI",
                    help="query tokens per request of the shapes kept")
    ap.add_argument("--query-join", choices=sorted(JOIN_COSTS), default=None,
                    help="add the engine's query join to each call (files of runs 1-220)")
    ap.add_argument("--total", type=int_range, default=None, metavar="LO-HI",
                    help="then one line per rows over all batches of LO-HI requests")
    args = ap.parse_args()
    keep = {int(r) for r in args.rows.split(",") if r}
    lo, hi = args.q_lens
    timings = [t for t in graph_timings(args.files, args.block, args.query_join)
               if (not keep or t["rows"] in keep) and lo <= t["q_len"] <= hi]
    print("rows  batch     shapes  " + "  ".join(f"{n:>34}" for n in (GRAPH_ROW, *ORACLE_ROWS))
          + f"  {PAIR:>26}  decoder's routes")
    print_lines(group_table(timings))
    if args.total:
        print(f"over {args.total[0]}-{args.total[1]} requests:")
        print_lines(group_table(timings, (args.total,)))


def print_lines(lines: Sequence[dict]) -> None:
    """``group_table``'s lines, one a row, in the header's columns."""
    for line in lines:
        cells = ["{:.3f} ({:2d} < 1 of {:3d}, worst {:.3f})".format(*line[n]) if line[n]
                 else f"{'-':>34}" for n in (GRAPH_ROW, *ORACLE_ROWS)]
        cells.append("{:.3f} (faster {:2d} of {:3d})".format(*line[PAIR]) if line[PAIR]
                     else f"{'-':>26}")
        routes = ", ".join(f"{r} {c}" for r, c in line["decoders"].items())
        print(f"{line['rows']:4d}  {line['band'][0]:>4}-{line['band'][1]:<4} {line['shapes']:6d}  "
              + "  ".join(cells) + f"  {routes}")


if __name__ == "__main__":
    main()
