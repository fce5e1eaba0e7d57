"""How the *current* SM90 policy does on measured shapes, without a GPU.

``python benchmarks/evaluate_policy.py [--graph | --measured | --twin | --oracle [--node-us US]]
[--vs PEER] [--query-join fused|copies|cat] shapes.jsonl FILE.csv ...`` reads
bench_decode.py output (every route of the policy timed forced on every shape, and every
peer), picks for each bf16 shape the route
``ops.policy`` ranks first (per batch, lengths known, as an eager decoder does; ``--graph``:
batch size and query length only, as a CUDA-graph decoder does; ``--measured``: no replay,
the ``plugin-graph[...]`` rows the bench timed, the CUDA-graph decoder itself; ``--twin``:
the forced row of the route the decoder ran, timed later in the shape, with a count of the
small shapes where the two differ by more than 1 us each way; ``--oracle``:
the fastest of the CUDA-graph decoder's routes per shape, the ``vllm-fa3-mla`` and
``flashmla`` rows and the decoder's own ``plugin-graph[...]`` row where it ran another route
(``cuda-splitk``), plus ``--node-us US`` per call, which is the best a graph that picked between
them per step from the step's lengths could score, with its extra graph nodes' cost)
and prints its time over the best peer's (``--vs PEER``: over that peer's, e.g.
``peer:vllm-fa3-mla``, vLLM's default SM90 kernel for bf16 caches): per file the worst and
the geometric-mean ratio (> 1: the plugin is faster) and the shapes under 0.95. FP8 shapes
report the plugin's own dispatched time (``plugin[...]`` rows).

``--search-graph-bounds [--check CHECK.csv,...]`` instead replays the CUDA-graph rule under
every combination of ``GRAPH_BOUND_GRID``'s bounds (``ops.policy``'s
``VLLM_FA3_GRAPH_MAX_BATCH``, ``..._MAX_ROWS``, ``..._MAX_REQUEST_ROWS``,
``..._ORDERED_MAX_BATCH`` and ``..._ORDERED_UNEVEN_TILES``) on the files
(the fit set) and on ``--check``'s (shapes the choice is checked on) and prints the best
bounds by the fit set's geometric mean beside today's (``shapes.jsonl`` may be ``-``: the
graph rule needs no lengths).

``--query-join fused|copies|cat`` models the engine's query form on files timed with one
576-wide query (runs 1-220): vLLM hands a 16-bit query over in two parts, which FA3 kernels
read apart (vLLM's, and FlashInfer's as the plugin plans it: ``SPLIT_QUERY_ROWS``), while
the other kernels need them joined first: vLLM's FLASHMLA with ``torch.cat`` (added to
``peer:vllm-flashmla``), the plugin's decoder with the given join (added to its rows of
FlashMLA and the CUDA split-KV kernel; ``fused``: vLLM's ``concat_mla_q``, what the vLLM
backend passes; ``copies``: the decoder's own two copies). Each join costs ``JOIN_COSTS``,
fitted on run 220. A model, not a measurement.

Rows whose status is not ``ok`` are left out; a missing ``vllm-fa3-mla`` row is stood in
for by ``peer:vllm-fa3-mla`` (the same kernel and schedule; run 23: equal within 1%).
In files of runs before 80 (``runNN-`` in the file name), vLLM's FLASHMLA is scored by the
``flashmla`` row: the route then ran FlashMLA's kernels as that backend does, its schedule
kernel once per step (per graph of calls), while those ``peer:vllm-flashmla`` rows left the
schedule kernel out (found in run 78: 2-3 us per call less than vLLM's FLASHMLA spends).
From run 80 the peer row has FlashMLA's schedule kernel in it; from run 85 the route writes
its own schedule (``ops/kernels/flashmla_schedule.py``) and is no stand-in for vLLM's
FLASHMLA.
Eager picks of vLLM's FA3 kernel are scored by the ``vllm-fa3-mla-eager`` row where the
file has one (no cap on its KV splits, as an eager decoder runs it; run 80 on), else by
the capped ``vllm-fa3-mla`` row (0.999 of the uncapped time over run 80's 82 shapes).
Batches of >= 33 requests on vLLM's FA3 kernel are scored by the ``vllm-fa3-mla`` row as
the file timed it: longest first from run 158 on (``policy.vllm_fa3_length_order``), in the
caller's order before (run 157's ``route:vllm-fa3-mla:sorted`` rows have the order).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager

import torch

from trtllm_mla_plugin.ops import DecodeSpec, Platform, policy

H200 = Platform("cuda", (9, 0), "NVIDIA H200")
#: Row of each bf16 route the policy picks between (FA3: FlashInfer's wrapper as the peer
#: calls it; ``fa3-sorted`` where the route would sort the requests; the CUDA split-KV
#: kernel where the bench timed it, ``--extra-routes cuda-splitk``).
ROUTE_ROWS = {"flashinfer-fa3": "peer:flashinfer-fa3", "flashmla": "flashmla",
              "vllm-fa3-mla": "vllm-fa3-mla", "cuda-splitk": "route:cuda-splitk"}


#: A join's cost as ``(fixed us, GB/s)`` over the bytes it moves (reads both parts, writes
#: the whole: 2 x 1152 bytes a query row), fitted on run 220's eight shapes
#: (``bench_query_concat.py``, H200; every fit within 4 us of its timing).
JOIN_COSTS = {"cat": (1.7, 938.0), "copies": (2.5, 1707.0), "fused": (1.7, 3716.0)}
#: Rows of kernels that read the query in vLLM's two parts (no join): vLLM's FA3 kernel,
#: and FlashInfer's FA3 wrapper as the plugin's ``flashinfer-fa3`` route plans it (split
#: query layout, forty-third session).
SPLIT_QUERY_ROWS = ("vllm-fa3-mla", "peer:vllm-fa3-mla", "plugin-graph[vllm-fa3-mla]",
                    "fa3-sorted", "peer:flashinfer-fa3", "plugin-graph[flashinfer-fa3]")


def join_us(kernel: str, r: dict, join: str | None, plugin: bool) -> float:
    """What the ``kernel`` row's call would add in the engine to join the query's parts
    (``--query-join``): ``join`` where it is the plugin's row (``plugin``) of a route that
    reads the query whole, ``torch.cat`` for vLLM's FLASHMLA, nothing for vLLM's FA3
    kernel, other peers, FP8 queries or without ``join``."""
    if join is None or r["kv"] == "fp8" or kernel.startswith(SPLIT_QUERY_ROWS):
        return 0.0
    if not plugin and kernel != "peer:vllm-flashmla":
        return 0.0
    fixed, gbps = JOIN_COSTS[join if plugin else "cat"]
    rows = int(r["batch"]) * int(r["q_len"]) * int(r["heads"])
    return fixed + 2 * rows * 1152 / (gbps * 1e3)


def spec_and_shape(r: dict, lens: list[int],
                   graph: bool = False) -> tuple[DecodeSpec, policy.BatchShape]:
    """A bf16 row's decode spec and the batch the policy sees: its lengths, or (``graph``)
    batch size and query length only."""
    b, q = int(r["batch"]), int(r["q_len"])
    spec = DecodeSpec(int(r["heads"]), 512, 64, int(r["block"]), torch.bfloat16,
                      torch.bfloat16, 0.1, q)
    shape = (policy.BatchShape(b, q) if graph
             else policy.BatchShape(b, q, max(lens), sum(lens), lengths=tuple(lens)))
    return spec, shape


def policy_row(r: dict, lens: list[int], graph: bool = False,
               timed: Container[str] = tuple(ROUTE_ROWS.values())) -> str:
    """Row name of the kernel the current policy runs for this bf16 shape: the first route
    of ``policy.rank`` that this bench timed (``timed``: the shape's row names) and that
    can serve the page size; a file without ``route:cuda-splitk`` rows is scored as a
    machine without nvcc runs (the ranking after it)."""
    spec, shape = spec_and_shape(r, lens, graph)
    b = shape.batch_size
    name = next(n for n in policy.rank(spec, H200, shape)
                if n in ROUTE_ROWS and (n != "flashmla" or r["block"] == "64")
                and (n != "cuda-splitk" or ROUTE_ROWS[n] in timed))
    if name == "flashinfer-fa3" and b > 1 and policy.fa_sort_by_length(spec, shape):
        return "fa3-sorted"
    if name == "vllm-fa3-mla" and not graph and "vllm-fa3-mla-eager" in timed:
        return "vllm-fa3-mla-eager"  # no cap on its KV splits, as an eager decoder runs it
    return ROUTE_ROWS[name]


#: What picks the plugin's row: the policy replayed with lengths (``eager``) or without
#: (``graph``), the CUDA-graph decoder's own timed row (``measured``), the forced row of the
#: route the decoder ran, its twin (``twin``: the same kernel and plan timed later in the
#: shape; the decoder's row where the file has none), the fastest of ``ORACLE_ROWS`` and
#: that row per shape (``oracle``), or the route a per-step switch between the graph
#: decoder's routes would run from the step's lengths (``switch``: ``switch_row``).
RULES = ("eager", "graph", "measured", "twin", "oracle", "switch")
#: The routes a CUDA-graph decoder picks between for most bf16 batches (``ops.policy``'s
#: graph rule: vLLM's FA3 kernel for small batches, FlashMLA for the rest).
ORACLE_ROWS = ("vllm-fa3-mla", "flashmla")
#: The CUDA-graph decoder's timed row, ``plugin-graph[<route>]`` (``decode_kernels.py``).
GRAPH_ROW = "plugin-graph"


def switch_row(r: dict, lens: list[int], ks: dict[str, dict],
               graph_row: str | None) -> str | None:
    """The row a CUDA graph holding the decoder's routes behind a per-step switch would run
    for this bf16 shape: the eager rule's ranking (lengths known) with FlashInfer's FA3
    read as vLLM's (the graph routes' FA3 kernel), its first route the shape has a row of
    (``ORACLE_ROWS``, and ``cuda-splitk`` by the decoder's own row where the graph ran it);
    ``None`` where none is timed."""
    spec, shape = spec_and_shape(r, lens)
    rows = {n: n for n in ORACLE_ROWS}
    if graph_row is not None and decoder_route(graph_row) == "cuda-splitk":
        rows["cuda-splitk"] = graph_row
    for name in policy.rank(spec, H200, shape):
        name = "vllm-fa3-mla" if name == "flashinfer-fa3" else name
        if name in rows and rows[name] in ks:
            return rows[name]
    return None


def decoder_row(ks: dict[str, dict]) -> str | None:
    """The name of a shape's ``GRAPH_ROW`` row, if the bench timed the decoder."""
    return next((n for n in ks if n.startswith(GRAPH_ROW)), None)


def decoder_route(row: str) -> str:
    """The route a ``plugin-graph[<route>]`` row ran."""
    return row[len(GRAPH_ROW) + 1:-1]


#: First run whose ``peer:vllm-flashmla`` rows have FlashMLA's per-step schedule kernel in
#: them (docs/benchmarks-history.md: found missing in run 78, put back for run 80).
PEER_FLASHMLA_SCHEDULED_FROM_RUN = 80


def peer_flashmla_unscheduled(path: str) -> bool:
    """Whether the file's ``peer:vllm-flashmla`` rows left FlashMLA's schedule kernel out."""
    run = re.match(r"run(\d+)-", path.rsplit("/", 1)[-1])
    return run is not None and int(run.group(1)) < PEER_FLASHMLA_SCHEDULED_FROM_RUN


def timed_rows(path: str) -> dict[str, dict[str, dict]]:
    """``{shape: {kernel: row}}`` of a bench_decode CSV: first-pass rows that timed ``ok``,
    ``vllm-fa3-mla`` stood in for by ``peer:vllm-fa3-mla`` where missing, and, in files of
    runs before 80, ``peer:vllm-flashmla`` by the ``flashmla`` row (module docstring)."""
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("pass_no", "1") == "1" and r["us"] and r.get("status", "ok") == "ok":
                by[r["shape"]][r["kernel"]] = r
    for ks in by.values():
        if "vllm-fa3-mla" not in ks and "peer:vllm-fa3-mla" in ks:
            ks["vllm-fa3-mla"] = ks["peer:vllm-fa3-mla"]
        if ("flashmla" in ks and "peer:vllm-flashmla" in ks
                and peer_flashmla_unscheduled(path)):
            ks["peer:vllm-flashmla"] = ks["flashmla"]
    return by


def read_shapes_log(path: str) -> dict[str, list[int]]:
    """Every shape's KV lengths from a run's ``shapes.jsonl`` (bench_decode.py writes it)."""
    with open(path) as f:
        return {(row := json.loads(line))["shape"]: row["lens"] for line in f if line.strip()}


def vllm_peer_times(ks: dict[str, dict]) -> dict[str, float]:
    """``{row: us}`` of a shape's ``timed_rows`` that time vLLM's own calls (``peer:``
    rows, but the ``sorted`` variants of early runs, which no vLLM backend makes)."""
    return {n: float(r["us"]) for n, r in ks.items()
            if n.startswith("peer:") and "sorted" not in n}


def engine_peer_times(ks: dict[str, dict], join: str | None) -> dict[str, float]:
    """``vllm_peer_times`` with each call's query join modelled (``join_us``)."""
    return {n: t + join_us(n, ks[n], join, plugin=False) for n, t in vllm_peer_times(ks).items()}


def engine_us(ks: dict[str, dict], name: str, join: str | None) -> float:
    """The plugin's row ``name`` of a shape's ``timed_rows`` with its query join modelled
    (``join_us``)."""
    return float(ks[name]["us"]) + join_us(name, ks[name], join, plugin=True)


def ratios(path: str, lens: dict[str, list[int]], rule: str = "eager",
           vs: str | None = None, node_us: float = 0.0,
           rows: dict[str, dict[str, dict]] | None = None,
           join: str | None = None) -> list[tuple[float, str, str]]:
    """Per scored shape (best peer's time / the plugin's, shape, the plugin's row); with
    rules ``oracle`` and ``switch``, ``node_us`` is added to the plugin's time. ``rows``: the file's
    ``timed_rows`` where already read. ``join``: the engine's query form modelled
    (``join_us``)."""
    out = []
    for shape, ks in (rows if rows is not None else timed_rows(path)).items():
        peers = engine_peer_times(ks, join)
        if vs is not None:
            peers = {n: t for n, t in peers.items() if n.startswith(vs)}
        if not peers:
            continue
        any_row = next(iter(ks.values()))
        extra_us = 0.0
        graph_row = decoder_row(ks)
        if any_row["kv"] == "fp8":
            name = next((n for n in ks if n.startswith("plugin")), None)
        elif rule == "measured":
            name = graph_row
        elif rule == "twin":
            name = twin_row(ks, graph_row)
        elif rule == "oracle":
            timed = [n for n in ORACLE_ROWS if n in ks]
            # The decoder's own row where it ran a third route (``cuda-splitk``); never a
            # second timing of one of ORACLE_ROWS, whose minimum would favour noise.
            if graph_row is not None and decoder_route(graph_row) not in ORACLE_ROWS:
                timed.append(graph_row)
            name = (min(timed, key=lambda n: engine_us(ks, n, join))
                    if all(n in ks for n in ORACLE_ROWS) else None)
            extra_us = node_us
        elif rule == "switch":
            both = all(n in ks for n in ORACLE_ROWS)
            name = switch_row(any_row, lens[shape], ks, graph_row) if both else None
            extra_us = node_us
        else:
            name = policy_row(any_row, lens[shape], graph=rule == "graph", timed=ks)
        if name is None or name not in ks:
            continue
        out.append((min(peers.values()) / (engine_us(ks, name, join) + extra_us), shape, name))
    return out


def twin_row(ks: dict[str, dict], graph_row: str | None) -> str | None:
    """The forced row of the route the decoder's row ``graph_row`` ran (``plugin-graph[R]``
    -> ``R``) where the shape has one, else ``graph_row``."""
    if graph_row is None:
        return None
    route = decoder_route(graph_row)
    return route if route in ks else graph_row


#: ``--twin``'s report of the timing order: shapes whose twin took under this many us ...
TWIN_SMALL_US = 40.0
#: ... and a gap between the decoder's row and its twin's of more than this many us.
TWIN_GAP_US = 1.0


def twin_gaps(rows: dict[str, dict[str, dict]]) -> tuple[int, int, int]:
    """``(pairs, decoder slower, decoder faster)`` over the shapes of one file whose
    decoder row has a twin taking under ``TWIN_SMALL_US``: slower / faster by more than
    ``TWIN_GAP_US``. The decoder's row is timed first for each shape (``bench_decode.py``
    without ``--rounds``), its twin later."""
    pairs = slower = faster = 0
    for ks in rows.values():
        graph_row = decoder_row(ks)
        twin = twin_row(ks, graph_row)
        if twin is None or twin == graph_row or float(ks[twin]["us"]) >= TWIN_SMALL_US:
            continue
        gap = float(ks[graph_row]["us"]) - float(ks[twin]["us"])
        pairs += 1
        slower += gap > TWIN_GAP_US
        faster += gap < -TWIN_GAP_US
    return pairs, slower, faster


#: Bounds of the CUDA-graph rule searched by ``--search-graph-bounds``: requests, query rows
#: (requests x heads x query tokens; a large number: none) and query rows per request.
GRAPH_BOUND_GRID = {
    "VLLM_FA3_GRAPH_MAX_BATCH": (16, 24, 32, 40, 48, 64, 96, 128, 192, 256, 512, 1024),
    "VLLM_FA3_GRAPH_MAX_ROWS": (1024, 2048, 3072, 4096, 6144, 8192, 16384, 1 << 30),
    "VLLM_FA3_GRAPH_MAX_REQUEST_ROWS": (0, 8, 16),
    # 0: no batch of >= VLLM_FA3_LENGTH_ORDER_MIN_BATCH requests goes to FA3 by this bound
    # (one bound for every width since the forty-third session; before, requests of <= 32
    # rows had a bound of their own, 1024).
    "VLLM_FA3_GRAPH_ORDERED_MAX_BATCH": (0, 256, 512, 1024),
    # True: those batches go to FA3 at 96 rows per request too (unevenly filled tiles).
    "VLLM_FA3_GRAPH_ORDERED_UNEVEN_TILES": (False, True),
}


@contextmanager
def graph_bounds(bounds: dict[str, int]) -> Iterator[None]:
    """``ops.policy``'s CUDA-graph bounds set to ``bounds`` inside the block, restored after."""
    saved = {name: getattr(policy, name) for name in bounds}
    try:
        for name, value in bounds.items():
            setattr(policy, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(policy, name, value)


def summary(rs: Sequence[float]) -> tuple[float, float, int]:
    """Geometric mean, worst and number of ratios."""
    return math.exp(sum(map(math.log, rs)) / len(rs)), min(rs), len(rs)


def score(files: dict[str, dict[str, dict[str, dict]]], lens: dict[str, list[int]],
          rule: str = "graph", vs: str | None = None,
          join: str | None = None) -> tuple[float, float, int]:
    """``summary`` of the bf16 ratios of ``ratios`` over all ``files`` (path: its
    ``timed_rows``) together."""
    rs = [x[0] for path, rows in files.items()
          for x in ratios(path, lens, rule, vs, rows=rows, join=join) if " bf16 " in x[1]]
    if not rs:
        raise ValueError(f"no bf16 shape with peers to score in {', '.join(files)}")
    return summary(rs)


def search_graph_bounds(fit: Sequence[str], check: Sequence[str], lens: dict[str, list[int]],
                        vs: str | None = None, join: str | None = None,
                        ) -> list[tuple[dict[str, int], tuple, tuple | None]]:
    """Every combination of ``GRAPH_BOUND_GRID`` scored with the CUDA-graph rule on the fit
    and check files: ``(bounds, fit score, check score or None)``, best fit geomean first.
    The graph rule reads no lengths: ``lens`` may leave shapes out."""
    lens = defaultdict(list, lens)
    fit_rows = {path: timed_rows(path) for path in fit}
    check_rows = {path: timed_rows(path) for path in check}
    results = []
    for values in itertools.product(*GRAPH_BOUND_GRID.values()):
        bounds = dict(zip(GRAPH_BOUND_GRID, values, strict=True))
        with graph_bounds(bounds):
            results.append((bounds, score(fit_rows, lens, "graph", vs, join),
                            score(check_rows, lens, "graph", vs, join) if check else None))
    return sorted(results, key=lambda r: -r[1][0])


def print_graph_bounds_search(fit: Sequence[str], check: Sequence[str],
                              lens: dict[str, list[int]], vs: str | None, top: int = 12,
                              join: str | None = None) -> None:
    """The ``top`` bounds by fit geomean and today's, each with its fit and check scores."""
    today = {name: getattr(policy, name) for name in GRAPH_BOUND_GRID}
    results = search_graph_bounds(fit, check, lens, vs, join)
    print("max batch, max rows, max rows per request, max ordered batch, uneven tiles to FA3: "
          "fit geomean / worst (shapes)"
          + ("; check geomean / worst (shapes)" if check else ""))
    shown = results[:top]
    if all(r[0] != today for r in shown):
        shown += [r for r in results if r[0] == today]
    for bounds, fit_score, check_score in shown:
        label = "today" if bounds == today else "     "
        line = f"{label} {', '.join(str(v) for v in bounds.values()):>20}: "
        line += "{:.3f} / {:.3f} ({})".format(*fit_score)
        if check_score is not None:
            line += "; {:.3f} / {:.3f} ({})".format(*check_score)
        print(line)
    if check:
        best = max(results, key=lambda r: r[2][0])
        print("best on the check set alone: "
              f"{', '.join(str(v) for v in best[0].values())}: {best[2][0]:.3f}")


def main(*argv: str) -> None:
    args = list(argv)
    search = "--search-graph-bounds" in args
    args = [a for a in args if a != "--search-graph-bounds"]
    check: list[str] = []
    if "--check" in args:
        i = args.index("--check")
        check = args[i + 1].split(",")
        del args[i:i + 2]
    rule = next((r for r in RULES if f"--{r}" in args), "eager")
    args = [a for a in args if a.lstrip("-") not in RULES]
    vs = None
    if "--vs" in args:
        i = args.index("--vs")
        vs = args[i + 1]
        del args[i:i + 2]
    join = None
    if "--query-join" in args:
        i = args.index("--query-join")
        join = args[i + 1]
        if join not in JOIN_COSTS:
            raise SystemExit(f"--query-join: one of {', '.join(JOIN_COSTS)}")
        del args[i:i + 2]
    node_us = 0.0
    if "--node-us" in args:
        i = args.index("--node-us")
        node_us = float(args[i + 1])
        del args[i:i + 2]
    shapes_path, *paths = args
    lens: dict[str, list[int]] = defaultdict(list)  # "-": no lengths (the graph rule)
    if shapes_path != "-":
        lens.update(read_shapes_log(shapes_path))
    if search:
        print_graph_bounds_search(paths, check, lens, vs, join=join)
        return
    every: dict[str, list[float]] = defaultdict(list)
    gaps = [0, 0, 0]
    for path in paths:
        rows = timed_rows(path)
        rs = ratios(path, lens, rule, vs, node_us, rows=rows, join=join)
        if rule == "twin":
            gaps = [a + b for a, b in zip(gaps, twin_gaps(rows), strict=True)]
        for kv in ("bf16", "fp8"):
            sel = [x for x in rs if f" {kv} " in x[1]]
            if not sel:
                continue
            every[kv] += [x[0] for x in sel]
            geo, worst, n = summary([x[0] for x in sel])
            low = sorted(x for x in sel if x[0] < 0.95)
            print(f"{path} {kv}: {n} shapes, worst {worst:.3f}, "
                  f"geomean {geo:.3f}, under 0.95: {len(low)}")
            for ratio, shape, name in low:
                print(f"    {ratio:.3f} {shape} ({name})")
    if len(paths) > 1:
        for kv, rs in every.items():
            geo, worst, n = summary(rs)
            print(f"all {len(paths)} files {kv}: {n} shapes, worst {worst:.3f}, "
                  f"geomean {geo:.3f}, under 0.95: {sum(r < 0.95 for r in rs)}")
    if rule == "twin":
        print(f"decoder row against its twin, twins under {TWIN_SMALL_US:g} us: {gaps[0]} "
              f"pairs, decoder slower by > {TWIN_GAP_US:g} us in {gaps[1]}, faster in "
              f"{gaps[2]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
