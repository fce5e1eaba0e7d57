"""The ops layer's ``DecodeSpec`` for a vLLM model: one function, so the impl (which
decides the query dtype vLLM hands over) and the metadata builder (which builds the
decoder) cannot disagree."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from vllm.config import VllmConfig

from ..ops import DecodeSpec, engine_query_dtype, platform_of

#: Force one decode route by name (tests, benchmarks, debugging); unset = the policy's pick.
ROUTE_ENV_VAR = "TRTLLM_MLA_DECODE_ROUTE"


#: Force the route of decode batches that carry short prefills (tests: the CPU engine runs
#: that path on the reference route); unset = ``ops.small_prefill_choice``.
SHORT_PREFILL_ROUTE_ENV_VAR = "TRTLLM_MLA_SHORT_PREFILL_ROUTE"


#: ``1`` / ``0``: the ``vllm-fa3-mla`` route computes its per-step plan (length order,
#: balanced splits) on the GPU / on the host, instead of as ``ops.policy.vllm_fa3_device_plan``
#: says (benchmarks: an engine pair with the GPU plan on); unset = the policy's default.
FA3_DEVICE_PLAN_ENV_VAR = "TRTLLM_MLA_FA3_DEVICE_PLAN"


def forced_route() -> str | None:
    return os.environ.get(ROUTE_ENV_VAR) or None


def fa3_device_plan() -> bool | None:
    """``FA3_DEVICE_PLAN_ENV_VAR`` as a flag; ``None`` when unset."""
    value = os.environ.get(FA3_DEVICE_PLAN_ENV_VAR, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{FA3_DEVICE_PLAN_ENV_VAR}={value!r}: use 1 (plan on the GPU) or 0 "
                         "(on the host), or unset it for the plugin's default")
    return value == "1"


def forced_short_prefill_route() -> str | None:
    return os.environ.get(SHORT_PREFILL_ROUTE_ENV_VAR) or None


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """dtype of the latent cache as the decode routes see it (FP8 caches are stored as
    bytes by vLLM and viewed as ``float8_e4m3fn``)."""
    if cache_dtype.startswith("fp8"):
        return torch.float8_e4m3fn
    if cache_dtype == "auto":
        return model_dtype
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}[
        cache_dtype
    ]


def model_decode_spec(
    vllm_config: VllmConfig,
    device: torch.device,
    *,
    block_size: int,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    softmax_scale: float,
    max_q_len: int,
) -> DecodeSpec:
    """The decode spec of the model's MLA layers on this rank.

    ``q_dtype`` is what vLLM hands to ``forward_mqa``: FP8 when the decode routes read an
    FP8 query anyway (``ops.engine_query_dtype``; vLLM then quantises it fused with the
    concat, with the layer's ``q_scale``), else the model dtype.
    """
    model_dtype = vllm_config.model_config.dtype
    spec = DecodeSpec(
        num_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        block_size=block_size,
        q_dtype=model_dtype,
        kv_dtype=kv_cache_torch_dtype(vllm_config.cache_config.cache_dtype, model_dtype),
        softmax_scale=softmax_scale,
        max_q_len=max_q_len,
    )
    q_dtype = engine_query_dtype(spec, platform_of(device), forced_route())
    return replace(spec, q_dtype=q_dtype)
