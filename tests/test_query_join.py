"""The vLLM backend hands its decoders vLLM's fused query join where the build has it."""

from __future__ import annotations

import pytest
import torch

from trtllm_mla_plugin.ops import DecodeSpec

pytest.importorskip("vllm")
from trtllm_mla_plugin.vllm_backend.query_join import vllm_query_join


def spec(kv_lora_rank: int = 512, rope_dim: int = 64,
         dtype: torch.dtype = torch.bfloat16) -> DecodeSpec:
    return DecodeSpec(16, kv_lora_rank, rope_dim, 64, dtype, dtype, 0.07)


def build_has_concat_op() -> bool:
    try:
        torch.ops._C_cache_ops.concat_mla_q  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("dims", [(256, 64), (512, 32), (1024, 64), (1000, 64)])
def test_dims_outside_the_kernels_contract_keep_the_decoders_join(dims):
    """Not 512 + 64: vLLM's check admits a latent of 1024, its kernel reads 512 of it."""
    assert vllm_query_join(spec(*dims)) is None


def test_on_a_build_with_the_op_only_bf16_and_fp16_queries_get_it(monkeypatch):
    """vLLM's kernel is instantiated for half and bfloat16 and raises for other dtypes, so a
    float32 model keeps the decoder's own join (a CUDA build stood in for by its op)."""
    from types import SimpleNamespace

    from vllm import _custom_ops

    monkeypatch.setattr(torch.ops, "_C_cache_ops", SimpleNamespace(concat_mla_q=object()),
                        raising=False)
    assert vllm_query_join(spec()) is _custom_ops.concat_mla_q
    assert vllm_query_join(spec(dtype=torch.float16)) is _custom_ops.concat_mla_q
    assert vllm_query_join(spec(dtype=torch.float32)) is None


def test_a_build_without_the_op_keeps_the_decoders_join():
    if build_has_concat_op():
        pytest.skip("this vLLM build has concat_mla_q (a CUDA build)")
    assert vllm_query_join(spec()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_vllms_join_equals_torch_cat_on_the_engines_parts():
    """On a CUDA build: the latent part contiguous, the rope part a strided view of the
    projection's 128 + 64 columns a head, as vLLM's MLA layer hands them over."""
    join = vllm_query_join(spec())
    assert join is not None, "vLLM's CUDA build should have concat_mla_q"
    torch.manual_seed(0)
    for tokens, heads in ((1, 16), (480, 128), (37, 64)):
        latent = torch.randn(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
        projected = torch.randn(tokens, heads, 128 + 64, dtype=torch.bfloat16, device="cuda")
        rope = projected[..., 128:]
        out = torch.empty(tokens, heads, 576, dtype=torch.bfloat16, device="cuda")
        join(latent, rope, out)
        assert torch.equal(out, torch.cat((latent, rope), dim=-1))
