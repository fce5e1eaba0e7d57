"""The swap-AB Triton decode kernel (``ops.kernels.swapab_mla_decode``) on one GPU: what it
compiled to, its error against float64, and its time against the plugin's routes and the
peers of ``bench_decode.py`` (imported: same cases, CUDA-graph timing and copy ceiling).

Usage (on the GPU machine)::

    python benchmarks/bench_swapab.py --out DIR [--budget-s 200] [--no-prewarm] [--kv bf16,fp8]

Writes ``DIR/swapab.csv`` (one row per shape x kernel: compile facts, error, time, % of the
copy ceiling, best peer over this kernel's time) and ``DIR/ceilings.csv``; prints tables.
Timing stops (remaining rows marked skipped) once ``--budget-s`` seconds have passed.
"""

from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd
from decode_kernels import (
    Case,
    Kernel,
    decoder_kernel,
    flashmla_fp8_peer,
    flashmla_peer,
    plugin_kernels,
)
from triton_ptx_probe import mma_loop_spills

from trtllm_mla_plugin.ops import mla_decode_reference
from trtllm_mla_plugin.ops.kernels import swapab_mla_decode as sk

K = 1024
BF, F8 = bd.BF, bd.F8
#: (heads, batch, ctx, lens, q_len, kv, block): error against float64. FP8 rows: an e4m3
#: cache read with the bf16 query (the reference reads the same stored values).
CHECK = [(16, 1, 8 * K, "u", 1, BF, 64), (16, 32, 4 * K, "r", 1, BF, 64),
         (32, 64, 4 * K, "r", 1, BF, 64), (128, 32, 4 * K, "u", 1, BF, 64),
         (16, 64, 4 * K, "r", 4, BF, 64), (128, 1, 8 * K, "u", 4, BF, 64),
         (16, 32, 4 * K, "r", 1, F8, 64), (32, 64, 4 * K, "r", 2, F8, 64)]
#: Timed, per KV dtype (``--kv``): ragged lengths uniform in [1, ctx].
TIMED = {kv: [(h, b, ctx, "r", 1, kv, 64) for h in (16, 32) for b in (32, 64, 128)
              for ctx in (4 * K, 8 * K)] for kv in (BF, F8)}
#: Swap-AB variants timed per head count: (label, launch_config overrides).
VARIANTS: dict[int, list[tuple[str, dict]]] = {
    16: [("swapab", {}), ("swapab-w8", {"num_warps": 8}), ("swapab-ptr", {"use_tma": False})],
    32: [("swapab", {}), ("swapab-bh16", {"block_h": 16, "num_warps": 4})],
}
FIELDS = ["phase", "shape", "kernel", "status", "us", "pct_copy", "best_peer", "peer_us",
          "peer_over_this", "rel_err", "max_err", "regs", "spills", "hot_loop_spills",
          "wgmma", "mma_sync", "config"]


def swapab_kernel(name: str, case: Case, **overrides) -> Kernel:
    """The swap-AB decode of ``case`` (planned once, outside any graph capture)."""
    spec, b, m = case.spec, case.batch.batch_size, case.q_len
    cfg = sk.launch_config(spec.num_heads, m, spec.block_size, **overrides)
    plan = sk.plan_swapab(case.batch.seq_lens, spec.num_heads, spec.block_size, q_len=m,
                          kv_lora_rank=spec.kv_lora_rank, config=cfg)
    q4 = case.query.view(b, m, spec.num_heads, spec.head_dim)
    out = torch.empty(b, m, spec.num_heads, spec.kv_lora_rank, dtype=case.query.dtype,
                      device=case.query.device)
    table, lens = case.batch.block_table, case.batch.seq_lens

    def call(cache: torch.Tensor) -> torch.Tensor:
        sk.swapab_mla_decode(q4, cache, table, lens, spec.softmax_scale, out,
                             kv_lora_rank=spec.kv_lora_rank, plan=plan)
        return out.view(b * m, spec.num_heads, spec.kv_lora_rank)

    return Kernel(name, call, out=out, obj=cfg)


def compile_facts() -> dict:
    """Registers, spills and MMA kind of the swap-AB kernel launched last."""
    c = sk.last_compiled
    ptx = c.asm.get("ptx", "")
    return {"regs": c.n_regs, "spills": c.n_spills, "wgmma": ptx.count("wgmma.mma_async"),
            "mma_sync": ptx.count("mma.sync"),
            "hot_loop_spills": mma_loop_spills(c.asm["cubin"]) if "cubin" in c.asm else -1}


def float64_reference(case: Case) -> torch.Tensor:
    return mla_decode_reference(case.query.double(), case.caches[0].double(),
                                case.batch.block_table, case.batch.seq_lens,
                                case.spec.softmax_scale, case.spec.kv_lora_rank,
                                max_seq_len=case.batch.max_seq_len)


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(norm-relative error, max |error| / max |ref|); NaN when ``out`` is not finite."""
    if not torch.isfinite(out).all():
        return float("nan"), float("nan")
    diff = out.double() - ref
    return ((diff.norm() / ref.norm()).item(),
            (diff.abs().max() / ref.abs().max()).item())


def check(device, writer, kvs: list[str]) -> None:
    for idx, shape in enumerate(s for s in CHECK if s[5] in kvs):
        case = bd.make_case(shape, seed=500 + idx, device=device)
        ref = float64_reference(case)
        k = swapab_kernel("swapab", case)
        row = dict(phase="check", shape=case.name, kernel=k.name, status="ok",
                   config=str(k.obj))
        try:
            k.out.fill_(float("nan"))
            rel, worst = errors(k.call(case.caches[0]), ref)
            torch.cuda.synchronize()
            row.update(compile_facts(), rel_err=f"{rel:.2e}", max_err=f"{worst:.2e}")
            if not rel < 2e-2:
                row["status"] = "FAIL"
        except Exception as exc:
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        writer.writerow(row)
        facts = " ".join(f"{key} {row.get(key, '-')}" for key in
                         ("rel_err", "max_err", "regs", "spills", "hot_loop_spills", "wgmma"))
        print(f"check {case.name:30} {facts} {row['status']}", flush=True)
        del case, ref
        torch.cuda.empty_cache()


def timed_kernels(case: Case) -> list[Kernel]:
    """Swap-AB variants, the plugin (policy pick), its routes forced, and the peers."""
    ks = [swapab_kernel(name, case, **kw) for name, kw in VARIANTS[case.spec.num_heads]]
    ks += plugin_kernels(case, "random")
    ks.append(decoder_kernel("triton-balanced", case, "triton-balanced"))
    ks.append(flashmla_fp8_peer(case) if case.spec.fp8_kv else flashmla_peer(case))
    return ks


def time_shape(shape: tuple, idx: int, device, writer, summary: list, deadline: float) -> None:
    case = bd.make_case(shape, seed=600 + idx, device=device)
    nbytes, _ = bd.bytes_flops(case)
    ref = bd.reference(case)
    rows, times = [], {}
    for k in timed_kernels(case):
        row = dict(phase="time", shape=case.name, kernel=k.name, status="ok")
        if k.name.startswith("swapab"):
            row["config"] = str(k.obj)
        if k.absent:
            row["status"] = "absent: " + k.absent
        elif time.time() > deadline:
            row["status"] = "skipped: time budget"
        else:
            try:
                k.out.fill_(float("nan"))
                rel, worst = errors(k.call(case.caches[0]), ref.double())
                row.update(rel_err=f"{rel:.2e}", max_err=f"{worst:.2e}")
                if k.name.startswith("swapab"):
                    row.update(compile_facts())
                us = bd.time_graph(k.call, case)
                times[k.name] = us
                pct = 100 * nbytes / (us * 1e-6) / bd.COPY_BPS
                row.update(us=f"{us:.2f}", pct_copy=f"{pct:.1f}")
            except Exception as exc:
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
    peers = {n: t for n, t in times.items() if n.startswith("peer:") and "sorted" not in n}
    best = min(peers.items(), key=lambda kv: kv[1]) if peers else (None, None)
    for row in rows:
        us = times.get(row["kernel"])
        if us and best[1]:
            row.update(best_peer=best[0], peer_us=f"{best[1]:.2f}",
                       peer_over_this=f"{best[1] / us:.3f}")
        writer.writerow(row)
    summary.append((case.name, times, best, nbytes))
    del case, ref
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="stop timing (rows marked skipped) after this many seconds")
    ap.add_argument("--no-prewarm", action="store_true")
    ap.add_argument("--kv", default=BF, help="cache dtypes to check and time: bf16, fp8 or "
                                             "both (bf16,fp8)")
    args = ap.parse_args()
    kvs = args.kv.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    device = torch.device("cuda")
    import triton

    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{triton.__version__}", flush=True)
    # FlashInfer's JIT (CPU, other processes) overlaps the float64 checks.
    prewarm = None if args.no_prewarm else threading.Thread(target=bd.prewarm_jit)
    if prewarm:
        prewarm.start()
    ceil = bd.ceilings(device)
    bd.COPY_BPS = ceil["copy_GBps"] * 1e9
    with open(args.out / "ceilings.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "torch", "triton", "copy_GBps", "bf16_matmul_TFLOPs"])
        w.writerow([torch.cuda.get_device_name(), torch.__version__, triton.__version__,
                    f"{ceil['copy_GBps']:.0f}", f"{ceil['bf16_matmul_TFLOPs']:.0f}"])
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s", flush=True)
    summary: list = []
    with open(args.out / "swapab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        check(device, writer, kvs)
        f.flush()
        if prewarm:
            prewarm.join()
        print(f"[{time.time() - t0:.0f}s] checks done", flush=True)
        for idx, shape in enumerate(s for kv in kvs for s in TIMED[kv]):
            time_shape(shape, idx, device, writer, summary, t0 + args.budget_s)
            f.flush()
            print(f"[{time.time() - t0:.0f}s] {summary[-1][0]} timed", flush=True)
    names = [n for n, _ in VARIANTS[16]] + [n for n, _ in VARIANTS[32] if n != "swapab"]
    print(f"\n{'shape':30} {'kernel':14} {'us':>8} {'%copy':>6} {'best peer':>22} "
          f"{'us':>8} {'peer/this':>9}")
    for name, times, (peer, peer_us), nbytes in summary:
        shown = [n for n in names if n in times] + ["triton-balanced"]
        shown += [n for n in times if n.startswith("plugin")]
        for n in shown:
            us = times.get(n)
            if us is None:
                continue
            pct = 100 * nbytes / (us * 1e-6) / bd.COPY_BPS
            ratio = peer_us / us if peer_us else float("nan")
            print(f"{name:30} {n:14} {us:8.1f} {pct:6.1f} {peer!s:>22} "
                  f"{peer_us or float('nan'):8.1f} {ratio:9.2f}")
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
