"""One call of an MLA decode kernel inside a profiler range, for Nsight Compute: where the
swap-AB Triton kernel's time goes, against FlashMLA and the plugin's Triton route on the
same shape and cache.

Usage (on the GPU machine, Firecracker runtime, where ncu reads the hardware counters)::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats ... \\
        python3 benchmarks/ncu_decode_kernels.py --kernel swapab --kv fp8

Planning, JIT compilation and two warm-up calls run before ``cudaProfilerStart``; exactly
one call (all of its kernels: FlashMLA's metadata, split and combine kernels included)
runs inside the range. Lengths are uniform in [1, ctx] (the ragged shapes of
``bench_swapab.py``); an FP8 cache is read with a bf16 query except by ``flashmla``, which
is vLLM's FLASHMLA call (FP8 query).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from bench_swapab import swapab_kernel
from decode_kernels import Case, Kernel, decoder_kernel, flashmla_fp8_peer, flashmla_peer

KERNELS = ("swapab", "swapab-w8", "triton-balanced", "flashmla")


def build(name: str, case: Case) -> Kernel:
    """The kernel ``name`` of ``KERNELS`` on ``case``, planned."""
    if name == "swapab":
        return swapab_kernel(name, case)
    if name == "swapab-w8":
        return swapab_kernel(name, case, num_warps=8)
    if name == "triton-balanced":
        return decoder_kernel(name, case, "triton-balanced")
    if name == "flashmla":
        return flashmla_fp8_peer(case) if case.spec.fp8_kv else flashmla_peer(case)
    raise ValueError(f"unknown kernel {name!r}; one of {KERNELS}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=KERNELS, required=True)
    ap.add_argument("--kv", choices=(bd.BF, bd.F8), default=bd.F8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    case = bd.make_case((args.heads, args.batch, args.ctx, "r", 1, args.kv, 64), seed=600,
                        device=torch.device("cuda"))
    kernel = build(args.kernel, case)
    if kernel.absent:
        raise SystemExit(f"{args.kernel}: {kernel.absent}")
    for cache in case.caches[:2]:
        kernel.call(cache)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kernel.call(case.caches[0])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    nbytes, _ = bd.bytes_flops(case)
    print(f"{args.kernel} on {case.name}: {nbytes / 1e6:.1f} MB of KV, query and output "
          f"(copy-ceiling time at 4.27 TB/s: {nbytes / 4.27e12 * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
