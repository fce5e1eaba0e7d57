"""Which cost per request FlashMLA's plan should use (``overhead_blocks`` of
``ops/kernels/flashmla_schedule.py``), from ``bench_flashmla_schedule.py --sections
overhead`` output, on any machine.

``python benchmarks/fit_flashmla_overhead.py FIT.csv [CHECK.csv ...]`` reads each CSV and
the ``.shapes.jsonl`` beside it (every shape's lengths, SM parts and query rows), scores
rules that pick a cost from what the schedule kernel sees (the step's lengths and the
parts), ranks them on ``FIT.csv`` and reports the best few on every file, so that a rule
fitted on one set of shapes is judged on shapes it was not fitted on. Scores per rule:
geometric mean and worst of the default plan's time over the rule's (> 1: the rule beats
FlashMLA's own plan) and of vLLM's FA3 call's time over the rule's (> 1: FlashMLA on the
rule beats vLLM's default kernel). A rule is kept only if no shape of the fit set is more
than ``--slack`` (2%) slower than on FlashMLA's own plan.

Rules (each may pick only costs the bench measured):
* ``fixed O``: one cost for every batch;
* ``requests >= K parts -> O``: cost O when the batch has at least K requests per SM part,
  else FlashMLA's;
* ``mean <= T blocks -> O``: cost O when the requests average at most T KV blocks, else
  FlashMLA's;
* ``best per shape``: the fastest measured cost on each shape (a bound, not a rule).

A rule by requests per part needs only the batch size and the query rows, which a captured
CUDA graph fixes, so the route could pass its cost at plan time; a rule by lengths needs the
schedule kernel to compute the cost from the step's lengths itself (not built).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtllm_mla_plugin.ops.kernels.flashmla_schedule import (
    FLASHMLA_OVERHEAD_BLOCKS as DEFAULT_COST,
)
from trtllm_mla_plugin.ops.kernels.flashmla_schedule import FLASHMLA_PAGE as PAGE

FA3 = "peer:vllm-fa3-mla"


@dataclass(frozen=True)
class Shape:
    """One measured shape: the route's time per cost, the peers' times, what the schedule
    kernel sees."""

    name: str
    route_us: dict[int, float]
    peer_us: dict[str, float]
    lens: list[int]
    parts: int

    @property
    def mean_blocks(self) -> float:
        return sum(-(-n // PAGE) for n in self.lens) / max(len(self.lens), 1)


Rule = Callable[[Shape], int]


def load(path: Path) -> list[Shape]:
    """Shapes of one ``--sections overhead`` CSV with a default-cost row."""
    route: dict[str, dict[int, float]] = {}
    peers: dict[str, dict[str, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            kernel, us = row["kernel"], float(row["us"])
            if kernel.startswith("flashmla@"):
                route.setdefault(row["shape"], {})[int(kernel.split("@")[1])] = us
            else:
                peers.setdefault(row["shape"], {})[kernel] = us
    shapes = []
    with open(path.with_suffix(".shapes.jsonl")) as f:
        for line in f:
            d = json.loads(line)
            times = route.get(d["shape"], {})
            if DEFAULT_COST in times:
                shapes.append(Shape(d["shape"], times, peers.get(d["shape"], {}), d["lens"],
                                    d["parts"]))
    return shapes


def candidate_rules(costs: list[int]) -> dict[str, Rule]:
    """Every rule of the families in the module docstring, over the measured ``costs``."""
    rules: dict[str, Rule] = {f"fixed {o}": (lambda s, o=o: o) for o in costs}
    for o in costs:
        if o == DEFAULT_COST:
            continue
        for k in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0):
            rules[f"requests >= {k} parts -> {o}"] = (
                lambda s, k=k, o=o: o if len(s.lens) >= k * s.parts else DEFAULT_COST)
        for t in (4, 8, 16, 32, 64, 128):
            rules[f"mean <= {t} blocks -> {o}"] = (
                lambda s, t=t, o=o: o if s.mean_blocks <= t else DEFAULT_COST)
    return rules


@dataclass(frozen=True)
class Score:
    gain_geomean: float  # FlashMLA's own plan / the rule's, geometric mean
    gain_worst: float
    fa3_geomean: float | None  # vLLM's FA3 call / the rule's
    fa3_worst: float | None
    shapes: int


def score(shapes: list[Shape], pick: Callable[[Shape], float]) -> Score:
    """``pick``: a shape's time under the rule."""
    gains = [s.route_us[DEFAULT_COST] / pick(s) for s in shapes]
    fa3 = [s.peer_us[FA3] / pick(s) for s in shapes if FA3 in s.peer_us]
    return Score(statistics.geometric_mean(gains), min(gains),
                 statistics.geometric_mean(fa3) if fa3 else None,
                 min(fa3) if fa3 else None, len(shapes))


def rule_time(rule: Rule) -> Callable[[Shape], float]:
    """A shape's time under ``rule`` (its pick must have been measured there)."""
    return lambda s: s.route_us[rule(s)]


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def report(name: str, sc: Score) -> str:
    return (f"  {name:34} vs own plan {sc.gain_geomean:.3f} (worst {sc.gain_worst:.3f}), "
            f"vs vLLM FA3 {fmt(sc.fa3_geomean)} (worst {fmt(sc.fa3_worst)}), "
            f"{sc.shapes} shapes")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help="FIT.csv, then CHECK.csv ...")
    ap.add_argument("--slack", type=float, default=0.02)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args(argv)
    sets = [load(p) for p in args.files]
    fit = sets[0]
    costs = sorted(set.intersection(*(set(s.route_us) for s in fit)))
    rules = candidate_rules(costs)
    usable = {n: r for n, r in rules.items()
              if all(r(s) in s.route_us for shapes in sets for s in shapes)}
    ranked = sorted(((score(fit, rule_time(r)), n) for n, r in usable.items()),
                    key=lambda x: -x[0].gain_geomean)
    kept = [n for sc, n in ranked if sc.gain_worst >= 1 - args.slack][: args.top]
    for path, shapes in zip(args.files, sets, strict=True):
        print(f"{path} ({'fit' if shapes is fit else 'check'}):")
        print(report("best per shape (bound)",
                     score(shapes, lambda s: min(s.route_us.values()))))
        print(report(f"fixed {DEFAULT_COST} (FlashMLA's plan)",
                     score(shapes, lambda s: s.route_us[DEFAULT_COST])))
        for n in kept:
            print(report(n, score(shapes, rule_time(usable[n]))))


if __name__ == "__main__":
    main()
