"""What one CUDA graph conditional node costs a replay, apart from any decode route.

Why: a per-step route switch in the decoder's graph pays its node on every layer of every
step, and replays of run 180's shapes say it gains only at about 0.25 us a call or less
(docs/bench-2026-12-05/run228-criteria.txt, addendum 6). ``graph_switch_probe.py`` reads
the cost beside two real routes, where a route's own noise is some microseconds; this
reads it bare: a graph of ``--calls`` small dependent kernels (one ``add_`` on a small
tensor each), and the same with each kernel inside a conditional node of each kind, timed
in rotated rounds (``bench_decode.alternate_graphs``).

Kinds (``ops.graph_switch``): ``plain`` (no node), ``if`` (``if_node``: torch's capture
where torch has it, else the driver API; the flag read by a kernel on the path), ``if-root``
(the driver API's if-node, its flag read by a root kernel), ``switch`` (a switch node of two
branches, the second not chosen, its index read by a root kernel). The cost of a kind is its
time per call less ``plain``'s.

Usage (GPU machine)::

    python benchmarks/conditional_node_cost.py --out cost.csv [--calls 64] [--rounds 7]
    python benchmarks/conditional_node_cost.py --out cost.csv --summarize   # any machine
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

from trtllm_mla_plugin.ops.graph_switch import (
    if_node,
    if_node_support,
    prepare_if_nodes,
    switch_node,
    switch_node_support,
)

KINDS = ("plain", "if", "if-root", "switch")


def step(x: torch.Tensor) -> None:
    x.add_(1.0)


def wrapped(kind: str, x: torch.Tensor, flag: torch.Tensor, index: torch.Tensor,
            other: torch.Tensor) -> Callable:
    """One call of ``kind``: ``step(x)`` bare or inside that kind's node (chosen to run;
    the switch node's second branch steps ``other``)."""
    if kind == "plain":
        return lambda: step(x)
    if kind == "if":
        def call() -> None:
            with if_node(flag):
                step(x)
        return call
    if kind == "if-root":
        from trtllm_mla_plugin.ops.kernels.graph_if_node import driver_if_node

        def call_root() -> None:
            with driver_if_node(flag, setter_at_root=True):
                step(x)
        return call_root
    return lambda: switch_node(index, [functools.partial(step, x),
                                       functools.partial(step, other)])


def kinds_here() -> tuple[str, ...]:
    """The kinds this machine can capture."""
    kinds = ["plain"]
    driver_way = switch_node_support() is None
    if if_node_support() is None:
        kinds.append("if")
        if driver_way:
            kinds.append("if-root")
    if driver_way:
        kinds.append("switch")
    return tuple(kinds)


def capture(call: Callable, calls: int) -> torch.cuda.CUDAGraph:
    return bench_decode.capture_calls(lambda _: call(), reps=calls)


def costs(times: dict[str, list[float]]) -> dict[str, float]:
    """Each kind's median us per call less ``plain``'s (``times``: us per call per round)."""
    plain = statistics.median(times["plain"])
    return {k: statistics.median(v) - plain for k, v in times.items() if k != "plain"}


def read(path: Path) -> dict[str, list[float]]:
    with open(path, newline="") as f:
        return {r["kind"]: [float(v) for v in r["rounds_us"].split()] for r in csv.DictReader(f)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=64, help="calls (nodes) per graph")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--summarize", action="store_true")
    args = ap.parse_args()
    if not args.summarize:
        device = torch.device("cuda")
        prepare_if_nodes(device, driver=switch_node_support() is None)
        x, other = torch.zeros(256, device=device), torch.zeros(256, device=device)
        flag = torch.ones((), dtype=torch.bool, device=device)
        index = torch.zeros((), dtype=torch.int32, device=device)
        kinds = kinds_here()
        graphs = [capture(wrapped(k, x, flag, index, other), args.calls) for k in kinds]
        per_round = bench_decode.alternate_graphs(graphs, args.rounds)
        # bench_decode's times are per REPS_PER_GRAPH calls; these graphs hold args.calls.
        scale = bench_decode.REPS_PER_GRAPH / args.calls
        with open(args.out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["kind", "calls", "rounds_us"])
            for kind, values in zip(kinds, per_round, strict=True):
                w.writerow([kind, args.calls, " ".join(f"{v * scale:.4f}" for v in values)])
    times = read(args.out)
    print(f"plain: {statistics.median(times['plain']):.3f} us a call")
    for kind, cost in costs(times).items():
        print(f"{kind}: {cost:+.3f} us a call over plain")


if __name__ == "__main__":
    main()
