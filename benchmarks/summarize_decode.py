"""Markdown tables from ``decode.csv`` of bench_decode.py (for docs/benchmarks.md).

``python benchmarks/summarize_decode.py decode.csv`` prints, per shape of pass 1: each
kernel's median time and % of copy ceiling (or TFLOP/s for 64+ heads), the route the
*current* ``ops.policy`` picks for that batch on SM90 and its measured time (from the forced
route rows: the dispatcher adds no kernel of its own), the best peer and the ratio
best-peer-time / plugin-time (> 1: the plugin is faster).
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict

import torch

from trtllm_mla_plugin.ops import DecodeSpec, policy

PEERS = ("peer:flashinfer-fa3", "peer:vllm-flashmla", "peer:vllm-triton")


def policy_kernel(r: dict) -> str:
    """Row name of the kernel the current policy runs for this shape."""
    heads, b, kv_tokens = int(r["heads"]), int(r["batch"]), int(r["kv_tokens"])
    max_len = round(float(r["spread"]) * kv_tokens / b)
    kv = torch.float8_e4m3fn if r["kv"] == "fp8" else torch.bfloat16
    spec = DecodeSpec(heads, 512, 64, int(r["block"]), torch.bfloat16, kv, 0.1,
                      int(r["q_len"]))
    shape = policy.BatchShape(b, int(r["q_len"]), max_len, kv_tokens)
    if policy.hopper_prefers_flashmla(spec, shape) and r["kv"] == "bf16" and r["block"] == "64":
        return "flashmla"
    sort = policy.fa_sort_by_length(spec, shape) and b > 1
    return "fa3-sorted" if sort else "peer:flashinfer-fa3"


def main(path: str, pass_no: str = "1") -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["pass_no"] == pass_no]
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        name = "fa3-sorted" if r["kernel"] == "fa3" else r["kernel"]
        by[r["shape"]][name] = r
    print("| shape | policy route | plugin us | %copy | TFLOP/s | FA3 unsorted | FA3 sorted | "
          "FlashMLA (peer) | Triton (peer) | best peer | peer/plugin |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, ks in by.items():
        any_row = next(iter(ks.values()))
        pk = policy_kernel(any_row)
        p = ks.get(pk)
        if p is None or not p["us"]:
            continue
        us = float(p["us"])
        peers = {n: float(ks[n]["us"]) for n in PEERS if n in ks and ks[n]["us"]}
        best = min(peers, key=peers.get)

        def cell(n: str, ks=ks) -> str:
            r = ks.get(n)
            if r is None or not r["us"]:
                return "-"
            return f"{float(r['us']):.1f} ({r['pct_copy']}%)"

        label = {"peer:flashinfer-fa3": "fa3", "fa3-sorted": "fa3+sort"}.get(pk, pk)
        print(f"| {shape} | {label} | {us:.1f} | {p['pct_copy']} | {p['tflops']} | "
              f"{cell('peer:flashinfer-fa3')} | {cell('fa3-sorted')} | "
              f"{cell('peer:vllm-flashmla')} | {cell('peer:vllm-triton')} | "
              f"{best.removeprefix('peer:')} | {peers[best] / us:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
