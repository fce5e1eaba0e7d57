"""vLLM's fused kernel for joining a decode query's two parts, where this build has it."""

from __future__ import annotations

import torch

from ..ops import DecodeSpec, QueryJoin

#: The dims ``concat_mla_q`` serves (DeepSeek-V2/V3, Kimi-K2): its check admits latent parts
#: of any multiple of 512 columns, but its kernel is instantiated for 512
#: (``ConcatMLAQKernel<scalar_t, 512>`` in vLLM's ``csrc/cache_kernels.cu``), and a rope
#: part of exactly 64 ...
CONCAT_LATENT_DIM, CONCAT_ROPE_DIM = 512, 64
#: ... in these dtypes (it raises ``Invalid dtype`` for any other).
CONCAT_DTYPES = (torch.bfloat16, torch.float16)


def vllm_query_join(spec: DecodeSpec) -> QueryJoin | None:
    """vLLM's ``concat_mla_q`` (``[tokens, heads, Dc]`` + strided ``[tokens, heads, Dr]`` ->
    ``[tokens, heads, Dc + Dr]``, one kernel) for the decoder of ``spec``, or ``None`` where
    the build lacks it (vLLM's CPU build), the dims are not 512 + 64 or the query is not
    bf16/fp16: the decoder then joins with two copies (``ops.join_query_parts``).

    Why: routes that read the query whole (FlashMLA) need the parts joined on every layer;
    ``torch.cat`` of vLLM's parts took 152 us a layer at 480 tokens x 128 heads on the H200,
    this kernel 40 us (run 220), where the decode itself took 700-900 us.
    """
    if ((spec.kv_lora_rank, spec.rope_dim) != (CONCAT_LATENT_DIM, CONCAT_ROPE_DIM)
            or spec.q_dtype not in CONCAT_DTYPES):
        return None
    from vllm import _custom_ops

    try:
        torch.ops._C_cache_ops.concat_mla_q  # noqa: B018 - absent from some builds
    except (AttributeError, RuntimeError):
        return None
    return _custom_ops.concat_mla_q
