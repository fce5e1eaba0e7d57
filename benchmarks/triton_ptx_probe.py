"""Compile a Triton kernel for Hopper without a GPU and report what the tensor-core code
became: ``wgmma.mma_async`` (SM90 warpgroup MMA) or ``mma.sync`` (the SM80 path), plus the
registers, spills and shared memory ptxas gives it.

Usage::

    python benchmarks/triton_ptx_probe.py            # trivial tl.dot, then the swap-AB kernel
    python benchmarks/triton_ptx_probe.py --trivial  # trivial tl.dot only
    python benchmarks/triton_ptx_probe.py --arch 90 --dump DIR  # also write PTX/TTGIR files

How: ``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(...))``
runs the whole pipeline (TTIR, TTGIR, LLIR, PTX, cubin via the ptxas bundled in the
triton wheel) with no CUDA driver. ``CompiledKernel.n_regs`` / ``n_spills`` are only filled
when the cubin is loaded onto a device, so registers and spills come from running the same
ptxas again with ``-v`` on the PTX. Pointer and integer arguments listed in ``aligned`` get
``tt.divisibility = 16``, as the JIT gives 16-byte-aligned tensors and multiples of 16 at
run time (vectorised loads and the MMA pipelining depend on it).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: CUDA warps are 32 threads: GPUTarget's third field is the warp size, not an SM count.
WARP_SIZE = 32


@dataclass
class ProbeResult:
    """What one compiled variant issues and costs (per thread / per CTA)."""

    name: str
    wgmma: int  # wgmma.mma_async instructions in the PTX
    mma_sync: int  # mma.sync instructions in the PTX
    regs: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared: int  # bytes of shared memory (static, from ptxas; Triton's dynamic is below)
    triton_shared: int  # bytes, Triton's own count (metadata.shared)
    num_warps: int
    num_stages: int
    loop_spills: int  # local-memory loads/stores (SASS) inside the innermost MMA loop; -1: unknown
    ptxas_log: str
    ptx: str
    ttgir: str

    def line(self) -> str:
        mma = "wgmma" if self.wgmma else ("mma.sync" if self.mma_sync else "no-mma")
        return (f"{self.name}: {mma} (wgmma={self.wgmma} mma.sync={self.mma_sync}) "
                f"regs={self.regs} spill_st={self.spill_stores}B spill_ld={self.spill_loads}B "
                f"hot-loop spill instrs={self.loop_spills} smem={self.triton_shared}B "
                f"warps={self.num_warps} stages={self.num_stages}")


def _ptxas(arch: int) -> str:
    """Path of the ptxas Triton runs for ``sm_<arch>`` (the wheel's unless overridden)."""
    from triton.backends.nvidia import compiler as nvidia

    try:
        return nvidia.get_ptxas(arch).path
    except TypeError:  # older Triton: get_ptxas() takes no architecture
        return nvidia.get_ptxas().path


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int, int, str]:
    """``(registers, spill store bytes, spill load bytes, shared bytes, log)`` from
    ``ptxas -v`` on ``ptx`` (the ptxas Triton itself runs)."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={gpu}",
                               str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, check=True)
    log = proc.stderr + proc.stdout

    def grab(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return (grab(r"Used (\d+) registers"), grab(r"(\d+) bytes spill stores"),
            grab(r"(\d+) bytes spill loads"), grab(r"(\d+) bytes smem"), log)


def mma_loop_spills(cubin: bytes) -> int:
    """STL/LDL instructions inside the innermost loop that issues tensor-core MMAs
    (``HGMMA``/``HMMA``), from ``nvdisasm`` SASS; -1 when SASS is unavailable. Spills of
    loop-invariant values outside that loop are reloaded once per request segment and
    cost little; spills inside it are paid per KV tile."""
    import shutil

    tool = Path(_ptxas(90)).with_name("nvdisasm")
    found = str(tool) if tool.exists() else shutil.which("nvdisasm")
    if found is None:
        return -1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([found, "-c", str(path)], capture_output=True, text=True).stdout
    if not sass:
        return -1
    labels: dict[str, int] = {}
    instrs: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if ins:
            off = int(ins.group(1), 16)
            labels.update({name: off for name in pending})
            pending = []
            instrs.append((off, ins.group(2)))
    loops = []
    for off, text in instrs:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), off + 1) <= off:
            body = [t for o, t in instrs if labels[target.group(1)] <= o <= off]
            if any("HGMMA" in t or "HMMA" in t for t in body):
                loops.append((off - labels[target.group(1)], body))
    if not loops:
        return 0
    _, body = min(loops, key=lambda x: x[0])
    return sum(1 for t in body if re.search(r"\b(STL|LDL)\b", t))


def probe(
    fn: triton.runtime.JITFunction,
    signature: dict[str, str],
    constexprs: dict[str, object],
    *,
    name: str | None = None,
    aligned: tuple[str, ...] = (),
    num_warps: int = 4,
    num_stages: int = 3,
    arch: int = 90,
) -> ProbeResult:
    """Compile ``fn`` for ``sm_<arch>`` (no GPU needed) and count its MMA instructions.

    Args:
        signature: every argument's Triton type (``"*bf16"``, ``"i32"``, ``"fp32"``);
            constexpr arguments may be left out (they are added as ``"constexpr"``).
        constexprs: values of the constexpr arguments.
        aligned: arguments to compile as divisible by 16 (pointers: 16-byte aligned).
    """
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    order = [a for a in fn.arg_names if a in sig]
    sig = {a: sig[a] for a in order}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                              target=GPUTarget("cuda", arch, WARP_SIZE),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    regs, st, ld, smem, log = _ptxas_usage(ptx, arch)
    return ProbeResult(
        name=name or fn.__name__,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        regs=regs, spill_stores=st, spill_loads=ld, shared=smem,
        triton_shared=int(getattr(compiled.metadata, "shared", 0) or 0),
        num_warps=num_warps, num_stages=num_stages,
        loop_spills=mma_loop_spills(compiled.asm["cubin"]), ptxas_log=log, ptx=ptx,
        ttgir=compiled.asm.get("ttgir", ""),
    )


@triton.jit
def _trivial_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    """``c[M, N] = a[M, K] @ b[K, N]`` (row-major, one tile)."""
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


def probe_trivial(arch: int = 90) -> list[ProbeResult]:
    """The smallest wgmma-eligible product (M=64 rows, 4 warps = one warpgroup), and an
    M=16 one that can only be mma.sync (wgmma's M is 64)."""
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32"}
    ptrs = ("a_ptr", "b_ptr", "c_ptr")
    return [probe(_trivial_dot, sig, {"M": m, "N": n, "K": 64}, name=f"dot M{m} N{n} K64",
                  aligned=ptrs, num_warps=4, arch=arch)
            for m, n in ((64, 16), (16, 64))]


def probe_swapab(arch: int = 90) -> list[ProbeResult]:
    """The swap-AB decode kernel at the configurations of ``SWAPAB_PROBES``."""
    from trtllm_mla_plugin.ops.kernels import swapab_mla_decode as sk

    results = []
    for heads, q_len, kw in SWAPAB_PROBES:
        overrides = {k: v for k, v in kw.items() if k != "kv_dtype"}
        kv_dtype = kw.get("kv_dtype", "bf16")
        cfg = sk.launch_config(heads, q_len, **overrides)
        sig, consts, aligned = sk.compile_signature(heads, q_len, cfg, kv_dtype=kv_dtype)
        label = (f"swapab h{heads} q{q_len} bn{cfg.block_n} bh{cfg.block_h} "
                 f"{'tma' if cfg.use_tma else 'ptr'} w{cfg.num_warps} kv-{kv_dtype}")
        results.append(probe(sk._swapab_decode_kernel, sig, consts, name=label,
                             aligned=aligned, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages, arch=arch))
    return results


#: (heads, q_len, launch_config overrides, plus ``kv_dtype``) probed by ``--swapab``: the
#: defaults (TMA tiles), the pointer-load (cp.async) path, a few alternatives, and FP8
#: (e4m3) caches widened to bf16 in registers.
SWAPAB_PROBES: list[tuple[int, int, dict]] = [
    (16, 1, {}), (16, 2, {}), (16, 4, {}), (32, 1, {}), (64, 1, {}), (128, 1, {}),
    (128, 4, {}),
    (16, 1, {"use_tma": False}), (16, 4, {"use_tma": False}), (64, 1, {"use_tma": False}),
    (16, 1, {"num_warps": 8}), (32, 1, {"num_warps": 4}), (16, 4, {"block_h": 16}),
    (64, 1, {"block_h": 64}), (16, 1, {"block_n": 128, "num_stages": 1}),
    (16, 1, {"kv_dtype": "fp8e4nv"}), (16, 1, {"kv_dtype": "fp8e4nv", "num_warps": 8}),
    (32, 1, {"kv_dtype": "fp8e4nv"}), (16, 4, {"kv_dtype": "fp8e4nv"}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--trivial", action="store_true", help="only the trivial tl.dot")
    ap.add_argument("--swapab", action="store_true", help="only the swap-AB kernel")
    ap.add_argument("--dump", type=Path, default=None, help="write PTX, TTGIR, ptxas logs")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    results = []
    if not args.swapab:
        results += probe_trivial(args.arch)
    if not args.trivial:
        results += probe_swapab(args.arch)
    for r in results:
        print(r.line(), flush=True)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9]+", "_", r.name)
            (args.dump / f"{stem}.ptx").write_text(r.ptx)
            (args.dump / f"{stem}.ttgir").write_text(r.ttgir)
            (args.dump / f"{stem}.ptxas.log").write_text(r.ptxas_log)


if __name__ == "__main__":
    main()
