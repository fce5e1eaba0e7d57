"""vLLM's fused kernel for joining a decode query's two parts, where this build has it."""

from __future__ import annotations

import torch

from ..ops import DecodeSpec, QueryJoin

#: ``concat_mla_q``'s shape contract (vLLM's ``csrc``): a latent part of a multiple of 512
#: columns and a rope part of exactly 64 (DeepSeek-V2/V3, Kimi-K2).
CONCAT_LATENT_MULTIPLE, CONCAT_ROPE_DIM = 512, 64


def vllm_query_join(spec: DecodeSpec) -> QueryJoin | None:
    """vLLM's ``concat_mla_q`` (``[tokens, heads, Dc]`` + strided ``[tokens, heads, Dr]`` ->
    ``[tokens, heads, Dc + Dr]``, one kernel) for the decoder of ``spec``, or ``None`` where
    the build lacks it (vLLM's CPU build) or the dims fall outside its contract: the decoder
    then joins with two copies (``ops.join_query_parts``).

    Why: routes that read the query whole (FlashMLA) need the parts joined on every layer;
    ``torch.cat`` of vLLM's parts took 152 us a layer at 480 tokens x 128 heads on the H200,
    this kernel 40 us (run 220), where the decode itself took 700-900 us.
    """
    if spec.kv_lora_rank % CONCAT_LATENT_MULTIPLE or spec.rope_dim != CONCAT_ROPE_DIM:
        return None
    from vllm import _custom_ops

    try:
        torch.ops._C_cache_ops.concat_mla_q  # noqa: B018 - absent from some builds
    except (AttributeError, RuntimeError):
        return None
    return _custom_ops.concat_mla_q
