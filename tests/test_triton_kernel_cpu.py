"""The plugin's Triton decode kernel without a GPU: its arithmetic under Triton's CPU
interpreter against the float64 reference, its compilation for Hopper, and the route's
eligibility reasons. The H200 runs are in tests/gpu and docs/gpu-validation.md."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from triton_cpu import compile_for_hopper, interpreted

from trtllm_mla_plugin.ops import DecodeSpec, Platform
from trtllm_mla_plugin.ops.routes import ROUTES

HERE = Path(__file__).resolve().parent
H200 = Platform("cuda", (9, 0), "NVIDIA H200")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _run_interpreter_cases(*args: str) -> subprocess.CompletedProcess:
    proc = interpreted(str(HERE / "triton_interpreter_cases.py"), *args)
    print(proc.stdout)
    return proc


def test_kernel_matches_reference_under_interpreter():
    proc = _run_interpreter_cases()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "0 of 10 cases above 1e-5" in proc.stdout


def test_route_plans_and_runs_under_interpreter():
    """The route's own plan (query offsets, page prefix sums, tables staged for CUDA graphs,
    scratch) and run, re-planned over three steps, eager and with ``cuda_graph=True``."""
    proc = _run_interpreter_cases("--route")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "route: 0 of 6 steps above 1e-5" in proc.stdout


def _signature(kv: str, q: str) -> dict:
    ptr = {"q_ptr": q, "kv_ptr": kv, "out_ptr": q, "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32"}
    ints = ("batch_size", "num_heads", "num_ctas", "min_pages", "stride_q_row", "stride_q_head",
            "stride_kv_block", "stride_kv_token", "stride_bt", "stride_out_row",
            "stride_out_head")
    sig = dict(ptr, **{name: "*i32" for name in ("block_table_ptr", "seq_lens_ptr",
                                                  "cu_q_ptr", "page_start_ptr")})
    sig.update({name: "i32" for name in ints})
    sig.update(qk_scale_log2="fp32", v_scale="fp32")
    return sig


@pytest.mark.parametrize(("q", "kv", "block_h", "max_q", "warps"), [
    ("*bf16", "*bf16", 16, 1, 4), ("*fp16", "*fp16", 32, 2, 8), ("*bf16", "*fp8e4nv", 16, 1, 4),
    ("*bf16", "*fp8e4nv", 64, 1, 8),
])
def test_kernel_compiles_for_hopper(q, kv, block_h, max_q, warps):
    """Front end, TTGIR and PTX for SM90 (no GPU needed): catches kernel-language errors
    before a GPU run does."""
    pytest.importorskip("triton")
    from trtllm_mla_plugin.ops.kernels import balanced_mla_decode as kernels

    consts = {"DC": 512, "DR": 64, "PAGE": 64, "BLOCK_N": 32, "BLOCK_H": block_h,
              "MAX_Q": max_q, "SEARCH_STEPS": 10}
    compiled = compile_for_hopper(kernels._balanced_decode_kernel, _signature(kv, q), consts,
                                  num_warps=warps, num_stages=3)
    assert "mma" in compiled.asm["ptx"]  # mma.sync or wgmma: the dots reached tensor cores


def spec(**kw) -> DecodeSpec:
    base = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64, q_dtype=BF16,
                kv_dtype=BF16, softmax_scale=0.1, max_q_len=1)
    base.update(kw)
    return DecodeSpec(**base)


@pytest.mark.parametrize(("kw", "platform", "fragment"), [
    ({}, Platform("cpu", None, "cpu"), "needs a CUDA GPU"),
    ({}, Platform("cuda", (7, 5), "T4"), "SM80 or newer"),
    ({"kv_lora_rank": 448}, H200, "kv_lora_rank=448"),
    ({"rope_dim": 0}, H200, "rope_dim=0"),
    ({"block_size": 48}, H200, "block size 48"),
    ({"q_dtype": FP8, "kv_dtype": FP8}, H200, "bfloat16/float16 queries"),
    ({"kv_dtype": FP16}, H200, "FP8 e4m3 cache"),
    ({"max_q_len": 17}, H200, "max_q_len=17"),
])
def test_route_refuses_with_reason(monkeypatch, kw, platform, fragment):
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.triton_balanced.module_available",
                        lambda name: True)
    reason = ROUTES["triton-balanced"].unsupported_reason(spec(**kw), platform)
    assert reason is not None and fragment in reason


def test_route_serves_deepseek_shapes(monkeypatch):
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.triton_balanced.module_available",
                        lambda name: True)
    route = ROUTES["triton-balanced"]
    for kw in ({}, {"kv_dtype": FP8}, {"q_dtype": FP16, "kv_dtype": FP16}, {"block_size": 16},
               {"num_heads": 128, "max_q_len": 4}):
        assert route.unsupported_reason(spec(**kw), H200) is None, kw
