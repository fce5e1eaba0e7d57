"""Host time of one decode step's ``plan`` per route, with the GPU idle and with it busy.

In the engine ``plan`` runs on the host while the GPU still executes the previous step; a
plan that waits for the GPU (a device-to-host copy) ends that overlap. Here the GPU is
kept busy with ``torch.cuda._sleep`` (``--busy-us`` per plan, standing in for the previous
step) before each ``plan``; a route that synchronises then takes about that long per plan.

Usage (GPU machine, FlashInfer and vLLM's FlashMLA importable)::

    python benchmarks/bench_plan_host.py --out DIR [--batches 1,8,32,64,128,256]

Writes ``DIR/plan_host.csv`` (route, lengths given, batch, GPU state, host us per plan).
"""

from __future__ import annotations

import argparse
import csv
import random
import time
from dataclasses import replace
from pathlib import Path

import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, MLADecoder, engine_query_dtype
from trtllm_mla_plugin.ops.platform import platform_of

#: (route, KV dtype, host lengths given)
CASES = [("flashinfer-fa3", "bf16", True), ("flashinfer-fa3", "bf16", False),
         ("flashmla", "bf16", True), ("flashmla-fp8", "fp8", True),
         ("vllm-fa3-mla", "bf16", True)]


def batch_for(b: int, heads: int, rng: random.Random, width: int, device) -> DecodeBatch:
    lens = [rng.randint(1024, 8192) for _ in range(b)]
    table = torch.randint(0, 4096, (b, width), dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return DecodeBatch(table, lens_t.to(device), max(lens), kv_tokens=sum(lens),
                       seq_lens_host=lens_t)


def host_us_per_plan(dec: MLADecoder, batch: DecodeBatch, busy_us: int, reps: int) -> float:
    cycles = int(busy_us * 1.98e3)  # H200 SM clock ~1.98 GHz
    dec.plan(batch)
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(reps):
        if busy_us:
            torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        dec.plan(batch)
        total += time.perf_counter() - t0
        torch.cuda.synchronize()
    return total / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("plan-out"))
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--busy-us", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    rows = []
    for route, kv, host in CASES:
        kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        spec = DecodeSpec(args.heads, 512, 64, 64, torch.bfloat16, kv_dtype, 1 / 192**0.5)
        spec = replace(spec, q_dtype=engine_query_dtype(spec, platform_of(device), route))
        for b in (int(x) for x in args.batches.split(",")):
            batch = batch_for(b, args.heads, random.Random(b), 8192 // 64, device)
            if not host:
                batch = replace(batch, seq_lens_host=None)
            dec = MLADecoder(spec, device, b, route=route, cuda_graph=True)
            for busy in (0, args.busy_us):
                us = host_us_per_plan(dec, batch, busy, args.reps)
                rows.append(dict(route=route, kv=kv, host_lengths=host, batch=b,
                                 gpu_busy_us=busy, host_us_per_plan=f"{us:.1f}"))
                print(f"{route:>15} {kv:>4} host_lengths={host!s:>5} b={b:>4} "
                      f"gpu_busy={busy:>5}us: plan {us:8.1f} us", flush=True)
    with open(args.out / "plan_host.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
