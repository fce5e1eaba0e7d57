"""Two routes in one CUDA graph, one of them run per replay: what CUDA graph conditional
nodes would cost and gain the CUDA-graph decoder.

Why: under CUDA graphs the decoder's route is fixed per captured batch size, ranked
without the lengths, and every bf16 shape that misses the aims of issue 9 is a batch whose
lengths favour the route the graph did not take (docs/benchmarks.md, "Where things
stand"). The host has each step's exact lengths when it plans; if both routes sat in the
graph, each inside an if-node (``ops.graph_switch.if_node``: a CUDA graph conditional
node whose body runs only while a device flag is true), the plan could pick
per step. This probe answers, before any decoder change, whether that works with the
plugin's routes and what it costs: per shape it captures route A alone, route B alone and
both behind flags (``KINDS``: an if-node each, and one switch node whose index is read when
the replay starts, where the driver has switch nodes), checks that a replay runs only
the chosen route (the other's output stays untouched; the chosen one's equals its own
graph's), and times, in alternation with
vLLM's two calls and the decoder as the engine runs it, each route in its own graph and
behind the flags.

Usage (GPU machine, the vLLM kit installed for vLLM's kernels)::

    python benchmarks/graph_switch_probe.py --out switch.csv --grid 5,18 \\
        --routes cuda-splitk,vllm-fa3-mla --rounds 5 --query-parts
    python benchmarks/graph_switch_probe.py --out switch.csv --seeds 500,501,502,503 \\
        --count 40 --request-rows 1-512 --batches 1-1024 \\
        --only "h16 b56 467 r0.22 q1 bf16 p64;h8 b51 316 r0.16 q1 bf16 p64" \\
        --routes cuda-splitk,vllm-fa3-mla --rounds 5 --query-parts
    python benchmarks/graph_switch_probe.py --out switch.csv --summarize   # any machine

``--out``: one row per shape and kernel (``decode_kernels`` names, ``A``/``B`` for the
routes alone, ``switch:A``/``switch:B`` for the graph of both behind if-nodes with that one
flagged, ``node:A``/``node:B`` the same in one switch node; us per round and their median),
and per shape a row ``check`` with the replay checks (``replay_checks``).
Stdout and ``--summarize``: per shape, what the flags cost over each route's own graph,
and the decoder's score (the faster of vLLM's calls over it) beside the score of the
faster route behind the flags (what a per-step pick from the lengths would reach if its
rule always picked the faster: an upper bound).
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode
import decode_kernels
from bench_decode import add_shape_options, chosen_shapes, make_case, shape_name
from decode_kernels import Kernel, decoder_kernel, flashmla_peer, vllm_fa3_mla_peer
from graph_routes_ab import read_results_by_shape, score

from trtllm_mla_plugin.ops.graph_switch import (
    if_node,
    if_node_support,
    prepare_if_nodes,
    switch_node,
    switch_node_support,
)

#: How the routes sit behind device memory: ``switch``, one if-node each (``if_node``:
#: torch's capture where torch has it; the kernel reading each flag on the path of the
#: work); ``node``, one switch node (``switch_node``, the driver API; its index read by a
#: kernel that runs when the replay starts).
KINDS = ("switch", "node")
#: Each kind with the label of its per-step pick.
PICK_LABELS = (("switch", "per-step pick"), ("node", "per-step pick (node)"))


def switched(calls: list[Callable], flags: torch.Tensor) -> Callable:
    """One call of ``calls`` (each ``call(cache) -> out``) that runs ``calls[i]`` where
    ``flags[i]`` (``[len(calls)]`` bool, CUDA) is true: under stream capture each inside an
    if-node, so a replay runs only the flagged ones; outside capture (warm-up) all of
    them. Returns their outputs."""
    def call(cache: torch.Tensor) -> list[torch.Tensor]:
        if not torch.cuda.is_current_stream_capturing():
            prepare_if_nodes(cache.device)
            return [c(cache) for c in calls]
        outs = []
        for flag, c in zip(flags, calls, strict=True):
            with if_node(flag):
                outs.append(c(cache))
        return outs

    return call


def switch_noded(calls: list[Callable], index: torch.Tensor) -> Callable:
    """As ``switched``, the calls in one switch node run by ``index`` (0-dim int32, CUDA)."""
    def call(cache: torch.Tensor) -> list[torch.Tensor]:
        if not torch.cuda.is_current_stream_capturing():
            prepare_if_nodes(cache.device, driver=True)
            return [c(cache) for c in calls]
        return switch_node(index, [functools.partial(c, cache) for c in calls])

    return call


def selector(kind: str, count: int, device: torch.device) -> torch.Tensor:
    """The device memory a replay of ``kind`` reads: ``count`` flags, or one index."""
    if kind == "switch":
        return torch.zeros(count, dtype=torch.bool, device=device)
    return torch.zeros((), dtype=torch.int32, device=device)


def select(kind: str, chosen: torch.Tensor, i: int) -> None:
    """Make the replays of ``kind`` run call ``i``."""
    if kind == "switch":
        chosen.zero_()
        chosen[i] = True
    else:
        chosen.fill_(i)


def behind(kind: str, calls: list[Callable], chosen: torch.Tensor) -> Callable:
    return switched(calls, chosen) if kind == "switch" else switch_noded(calls, chosen)


def replay_checks(calls: list[Callable], cache: torch.Tensor,
                  kind: str = "switch") -> dict[str, float | bool]:
    """Captures ``calls`` behind ``kind`` once on ``cache`` and replays it with each call
    chosen alone: the chosen call's output against its own eager output (relative
    difference; 0.0 for the same kernel on the same plan) and whether every other output
    kept the NaN it was filled with (its body did not run). Keys ``ran_*`` for ``switch``,
    ``node_ran_*`` for ``node``."""
    expected = [c(cache).float() for c in calls]
    chosen = selector(kind, len(calls), cache.device)
    call = behind(kind, calls, chosen)
    call(cache)
    outs: list[torch.Tensor] = []
    graph = bench_decode.capture_calls(lambda _: outs.extend(call(cache)), reps=1)
    result: dict[str, float | bool] = {}
    prefix = "" if kind == "switch" else f"{kind}_"
    for i in range(len(calls)):
        select(kind, chosen, i)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        diff = (outs[i].float() - expected[i]).norm() / expected[i].norm()
        result[f"{prefix}ran_{i}_rel_diff"] = float(diff)
        result[f"{prefix}ran_{i}_others_untouched"] = all(
            bool(torch.isnan(out).all()) for j, out in enumerate(outs) if j != i)
    return result


def timed_graphs(case, pair: list[Kernel], kinds: tuple[str, ...] = KINDS
                 ) -> dict[str, torch.cuda.CUDAGraph]:
    """Graphs of ``bench_decode.REPS_PER_GRAPH`` calls each: the decoder (``plugin``),
    each route of ``pair`` alone (``A``, ``B``), both behind each of ``kinds`` with one
    chosen (``switch:A``, ``node:B``, ...), and vLLM's two calls where they run."""
    kernels = {"plugin": decoder_kernel("plugin", case, None, engine_query=True,
                                        cuda_graph=True), "A": pair[0], "B": pair[1]}
    for peer in (flashmla_peer(case), vllm_fa3_mla_peer(case)):
        kernels[peer.name] = peer
    graphs = {name: bench_decode.capture_graph(k.call, case)
              for name, k in kernels.items() if k.call is not None}
    for kind in kinds:
        for i, label in enumerate("AB"):
            chosen = selector(kind, 2, case.query.device)
            select(kind, chosen, i)
            graphs[f"{kind}:{label}"] = bench_decode.capture_graph(
                behind(kind, [pair[0].call, pair[1].call], chosen), case)
    return graphs


def _best_score(times: dict[str, float], kind: str) -> float | None:
    return max((s for k in (f"{kind}:A", f"{kind}:B") if (s := score(times, k))),
               default=None)


def shape_line(name: str, times: dict[str, float]) -> str:
    """One shape's reading: what each kind costs over each route's own graph (us; ``flags``
    for ``switch``, ``node`` for ``node``), and the decoder's score beside the faster
    chosen route's per kind (``per-step pick``; ``per-step pick (node)``)."""
    cells = [name]
    for kind, word in (("switch", "flags"), ("node", "node")):
        for label in "AB":
            if label in times and f"{kind}:{label}" in times:
                cells.append(f"{word} over {label} "
                             f"{times[f'{kind}:{label}'] - times[label]:+.2f} us")
    plugin = score(times, "plugin")
    cells.append(f"decoder {plugin:.3f}" if plugin else "decoder -")
    for kind, label in PICK_LABELS:
        best = _best_score(times, kind)
        if kind == "switch" or best:
            cells.append(f"{label} {best:.3f}" if best else f"{label} -")
    return ", ".join(cells)


def _stat_line(label: str, values: list[float]) -> str:
    return (f"{label}: geomean {statistics.geometric_mean(values):.3f} "
            f"worst {min(values):.3f} n {len(values)}")


def summary(results: dict[str, dict[str, float]]) -> list[str]:
    """``shape_line`` per shape, then the geometric mean and worst of the decoder's score
    and of each kind's per-step pick over the shapes that have both (the decoder's over
    those of the first kind timed)."""
    lines = [shape_line(name, t) for name, t in results.items()]
    decoder_done = False
    for kind, label in PICK_LABELS:
        pairs = [(p, b) for t in results.values()
                 if (p := score(t, "plugin")) and (b := _best_score(t, kind))]
        if not pairs:
            continue
        if not decoder_done:
            lines.append(_stat_line("decoder", [p for p, _ in pairs]))
            decoder_done = True
        lines.append(_stat_line(label, [b for _, b in pairs]))
    return lines


def read_results(path: Path) -> dict[str, dict[str, float]]:
    """Shape name -> median us per kernel of an ``--out`` file (its ``check`` rows hold no
    time)."""
    return {name: times for name, (_, times) in read_results_by_shape(path).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    add_shape_options(ap, count=40, request_rows=(1, 512), batches=(1, 1024))
    ap.add_argument("--only", default="", help="';'-separated names of the random draws' "
                    "shapes to keep (grid shapes are always kept)")
    ap.add_argument("--routes", default="cuda-splitk,vllm-fa3-mla",
                    help="the two routes A,B behind the flags")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--query-parts", action="store_true",
                    help="vLLM's two query parts, as in the engine (decode_kernels.QUERY_PARTS)")
    ap.add_argument("--summarize", action="store_true",
                    help="only summarize an existing --out file (any machine)")
    args = ap.parse_args()
    if args.summarize:
        print("\n".join(summary(read_results(args.out))))
        return
    missing = if_node_support()
    if missing:
        raise SystemExit(f"no if-node capture: {missing}")
    kinds = KINDS
    if (why := switch_node_support()) is not None:
        kinds = ("switch",)
        print(f"switch node left out: {why}", flush=True)
    routes = args.routes.split(",")
    if len(routes) != 2:
        raise SystemExit(f"--routes takes two routes, got {args.routes!r}")
    decode_kernels.QUERY_PARTS = args.query_parts
    device = torch.device("cuda")
    only = {n.strip() for n in args.only.split(";") if n.strip()}
    shapes = chosen_shapes(args, lambda shape: not only or shape_name(shape) in only)
    results: dict[str, dict[str, float]] = {}
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["shape", "batch", "kernel", "rounds_us", "median_us", "checks"])
        for case_seed, shape in shapes:
            case = make_case(shape, case_seed, device)
            pair = [decoder_kernel(label, case, route, engine_query=True, cuda_graph=True)
                    for label, route in zip("AB", routes, strict=True)]
            if any(k.call is None for k in pair):
                reasons = "; ".join(k.absent for k in pair if k.absent)
                writer.writerow([case.name, shape[1], "check", "", "", reasons])
                print(f"{case.name}: skipped ({reasons})", flush=True)
                continue
            checks: dict[str, object] = {}
            for kind in kinds:
                try:
                    checks.update(replay_checks([k.call for k in pair], case.caches[0], kind))
                except Exception as error:  # the probe's question: record why, go on
                    # without this kind (the other's readings stay)
                    checks[f"{kind}_error"] = f"{type(error).__name__}: {error}"
                    print(f"{case.name}: {kind} left out: {checks[f'{kind}_error']}",
                          flush=True)
            kinds = tuple(k for k in kinds if f"{k}_error" not in checks)
            try:
                graphs = timed_graphs(case, pair, kinds)
            except Exception as error:
                writer.writerow([case.name, shape[1], "check", "", "",
                                 f"error={type(error).__name__}: {error}"])
                print(f"{case.name}: {type(error).__name__}: {error}", flush=True)
                continue
            writer.writerow([case.name, shape[1], "check", "", "",
                             " ".join(f"{k}={v}" for k, v in checks.items())])
            per_round = bench_decode.alternate_graphs(list(graphs.values()), args.rounds)
            times = {}
            for name, values in zip(graphs, per_round, strict=True):
                times[name] = statistics.median(values)
                writer.writerow([case.name, shape[1], name, " ".join(f"{v:.2f}" for v in values),
                                 f"{times[name]:.2f}", ""])
            f.flush()
            results[case.name] = times
            print(shape_line(case.name, times) + f"; checks {checks}", flush=True)
            del case, pair, graphs
            torch.cuda.empty_cache()
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
