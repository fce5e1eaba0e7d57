"""Markdown tables from bench_decode.py output (for docs/benchmarks.md).

``python benchmarks/summarize_decode.py shapes.jsonl decode.csv`` prints, per shape of
pass 1: the route the *current* ``ops.policy`` runs (bf16: picked from the forced-route rows,
the dispatcher adds no kernel of its own; FP8: the dispatched ``plugin[...]`` row), its
time, % of the copy ceiling and TFLOP/s, each peer, the best peer and the ratio
best-peer-time / plugin-time (> 1: the plugin is faster).
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_policy import policy_row

PEERS = ("peer:flashinfer-fa3", "peer:vllm-flashmla", "peer:vllm-flashmla-fp8",
         "peer:vllm-triton")
LABEL = {"peer:flashinfer-fa3": "fa3", "fa3-sorted": "fa3+sort", "flashmla": "flashmla"}


def main(shapes_path: str, path: str) -> None:
    lens = {}
    with open(shapes_path) as f:
        for line in f:
            d = json.loads(line)
            lens[d["shape"]] = d["lens"]
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("pass_no", "1") == "1":
                by[r["shape"]][r["kernel"]] = r
    print("| shape | plugin route | plugin us | %copy | TFLOP/s | FA3 (peer) | "
          "FlashMLA (peer) | Triton MLA (peer) | best peer | peer/plugin |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, ks in by.items():
        any_row = next(iter(ks.values()))
        if any_row["kv"] == "fp8":
            name = next((n for n in ks if n.startswith("plugin")), None)
            label = name.removeprefix("plugin[").removesuffix("]") if name else "-"
        else:
            name = policy_row(any_row, lens[shape])
            label = LABEL[name]
        p = ks.get(name)
        if p is None or not p["us"]:
            continue
        us = float(p["us"])
        peers = {n: float(ks[n]["us"]) for n in PEERS if n in ks and ks[n]["us"]}
        best = min(peers, key=peers.get)

        def cell(*names: str, ks=ks) -> str:
            r = next((ks[n] for n in names if n in ks and ks[n]["us"]), None)
            return "-" if r is None else f"{float(r['us']):.1f} ({r['pct_copy']}%)"

        print(f"| {shape} | {label} | {us:.1f} | {p['pct_copy']} | {p['tflops']} | "
              f"{cell('peer:flashinfer-fa3')} | "
              f"{cell('peer:vllm-flashmla', 'peer:vllm-flashmla-fp8')} | "
              f"{cell('peer:vllm-triton')} | {best.removeprefix('peer:')} | "
              f"{peers[best] / us:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
