"""A rule for a per-step switch between vLLM's FA3 kernel and FlashMLA under CUDA graphs,
fitted on measured shapes and checked on others, without a GPU.

Why: a CUDA graph that held both routes behind a switch (``ops.graph_switch``) could run
the faster one each step if a rule picked it from the step's lengths; the eager rule
(``ops.policy.rank`` with lengths) was fitted against FlashInfer's FA3 and misses where
vLLM's FA3 kernel on the plugin's splits is the faster (docs/bench-2026-12-05/
run228-criteria.txt, addendum 6). This fits, on the fit files, a least-squares line through
``log(FlashMLA time / FA3 time)`` over features of the batch and of the plan the
``vllm-fa3-mla`` route makes for it under CUDA graphs (``route_plan_span``: FA3's formula
or ``fa3_splits.balanced_splits``, as the route plans), picks FlashMLA where the line says
it is faster, and scores that pick, FA3 alone, and the faster of the two per shape (the
oracle) against the faster of vLLM's two calls on the fit and the check files, each with
the engine's query join modelled (``evaluate_policy --query-join fused``).

Usage (any machine)::

    python benchmarks/fit_switch_rule.py \\
        --fit docs/bench-2026-12-03/run169-check-shapes.jsonl \\
              'docs/bench-2026-12-03/run169-check-random-*.csv' \\
        --fit docs/bench-2026-12-03/run177-check-shapes.jsonl \\
              'docs/bench-2026-12-03/run177-check-random-*.csv' \\
        --check docs/bench-2026-12-04/run180-check-shapes.jsonl \\
              'docs/bench-2026-12-04/run180-check-random-*.csv'

Shapes without both routes' forced rows, and FP8 shapes, are left out. ``cuda-splitk`` is
not modelled (the files time it only where the graph decoder ran it).
"""

from __future__ import annotations

import argparse
import glob
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policy import engine_peer_times, engine_us, read_shapes_log, timed_rows

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, fa3_splits, policy
from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import graph_replan, graph_splits

SMS = policy.HOPPER_SMS
JOIN = "fused"


@dataclass
class Shape:
    """One measured bf16 shape: its batch, the FA3 route's plan, and the engine times (us)
    of both routes and of the faster of vLLM's calls."""

    name: str
    heads: int
    q_len: int
    lens: list[int]
    span: float  # estimated busiest-CTA time of the route's plan, KV tiles
    fa3_us: float
    flashmla_us: float
    best_peer_us: float


def route_plan_span(heads: int, q_len: int, lens: list[int], sms: int = SMS,
                    replan: bool = True) -> float:
    """``fa3_splits.estimated_span`` of the splits the ``vllm-fa3-mla`` route plans under
    CUDA graphs for one step of ``lens`` (uniform ``q_len``): FA3's formula under the cap
    ``graph_splits`` gives, or (``replan``) ``balanced_splits``' replan where it makes one.
    Without ``replan``: FA3's formula alone, what a rule could afford to work out on the
    host every step (``balanced_splits`` searches)."""
    spec = DecodeSpec(heads, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1, q_len)
    host = torch.tensor(lens, dtype=torch.int32)
    batch = DecodeBatch(torch.zeros(len(lens), 1, dtype=torch.int32), host, max(lens),
                        max_q_len=q_len, num_tokens=len(lens) * q_len, kv_tokens=sum(lens),
                        seq_lens_host=host)
    reserved, planned = graph_splits(spec, batch, sms)
    tiles = policy.query_tiles(spec, q_len)
    rows_per_tile = policy.query_tile_rows(spec, q_len)
    n = np.maximum(-(-np.asarray(lens, dtype=np.int64) // policy.FA3_KV_TILE), 1)
    splits = fa3_splits.fa3_splits(n, tiles, planned, sms)
    if replan:
        balanced = graph_replan(spec, q_len, np.asarray(lens), reserved, planned, sms)
        if balanced is not None:
            splits = balanced
    plan = np.asarray(splits, dtype=np.float64)[:, None]
    return float(fa3_splits.estimated_span(n, plan, tiles, sms,
                                           fa3_splits.split_cost_tiles(rows_per_tile))[0])


def features(s: Shape, sms: int = SMS) -> list[float]:
    """The fit's inputs: 1, log of the plan's span over an even share, query rows per tile
    over 64, log batch, log mean KV tiles, query tiles over SMs, log of the even share."""
    spec = DecodeSpec(s.heads, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1, s.q_len)
    tiles = policy.query_tiles(spec, s.q_len)
    kv_tiles = sum(max(1, -(-n // policy.FA3_KV_TILE)) for n in s.lens)
    even = tiles * kv_tiles / sms
    b = len(s.lens)
    return [1.0, math.log(s.span / even), policy.query_tile_rows(spec, s.q_len) / 64,
            math.log(b), math.log(kv_tiles / b), tiles * b / sms, math.log(even)]


def load(shapes_path: str, pattern: str, replan: bool = True) -> list[Shape]:
    """The bf16 shapes of ``pattern``'s files (bench_decode CSVs) with both routes' rows
    (``replan``: as ``route_plan_span``)."""
    lens = read_shapes_log(shapes_path)
    out = []
    for path in sorted(glob.glob(pattern)):
        for name, ks in timed_rows(path).items():
            if "vllm-fa3-mla" not in ks or "flashmla" not in ks:
                continue
            row = ks["flashmla"]
            if row["kv"] != "bf16" or name not in lens:
                continue
            peers = engine_peer_times(ks, JOIN)
            if not peers:
                continue
            heads, q_len = int(row["heads"]), int(row["q_len"])
            out.append(Shape(name, heads, q_len, lens[name],
                             route_plan_span(heads, q_len, lens[name], replan=replan),
                             engine_us(ks, "vllm-fa3-mla", JOIN), engine_us(ks, "flashmla", JOIN),
                             min(peers.values())))
    return out


def fit(shapes: list[Shape]) -> np.ndarray:
    """Least-squares coefficients of ``log(flashmla_us / fa3_us)`` over ``features``."""
    x = np.array([features(s) for s in shapes])
    y = np.array([math.log(s.flashmla_us / s.fa3_us) for s in shapes])
    return np.linalg.lstsq(x, y, rcond=None)[0]


def picks_flashmla(s: Shape, coef: np.ndarray) -> bool:
    return float(np.dot(features(s), coef)) < 0.0


def scores(shapes: list[Shape], coef: np.ndarray) -> dict[str, list[float]]:
    """Best peer over each pick per shape: the fitted rule, FA3 alone, the oracle."""
    return {
        "rule": [s.best_peer_us / (s.flashmla_us if picks_flashmla(s, coef) else s.fa3_us)
                 for s in shapes],
        "fa3 only": [s.best_peer_us / s.fa3_us for s in shapes],
        "oracle": [s.best_peer_us / min(s.fa3_us, s.flashmla_us) for s in shapes],
    }


def summary_line(label: str, values: list[float]) -> str:
    return (f"{label}: geomean {statistics.geometric_mean(values):.3f} worst "
            f"{min(values):.3f} under 0.95: {sum(v < 0.95 for v in values)} n {len(values)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", nargs=2, action="append", required=True,
                    metavar=("SHAPES_JSONL", "CSV_GLOB"))
    ap.add_argument("--check", nargs=2, action="append", default=[],
                    metavar=("SHAPES_JSONL", "CSV_GLOB"))
    ap.add_argument("--span", choices=("route", "fa3"), default="route",
                    help="the plan whose span is a feature: the route's (with its replan) "
                    "or FA3's formula alone (route_plan_span's replan)")
    args = ap.parse_args()
    replan = args.span == "route"
    fit_set = [s for shapes, pattern in args.fit for s in load(shapes, pattern, replan)]
    check_set = [s for shapes, pattern in args.check for s in load(shapes, pattern, replan)]
    coef = fit(fit_set)
    print("coefficients:", " ".join(f"{c:+.4f}" for c in coef))
    for label, shapes in (("fit", fit_set), ("check", check_set)):
        if shapes:
            for name, values in scores(shapes, coef).items():
                print(summary_line(f"{label} {name}", values))


if __name__ == "__main__":
    main()
