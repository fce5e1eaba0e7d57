"""Engine settings for the tiny model on the machines this project runs on."""

from __future__ import annotations

from typing import Any

#: KV cache for the tiny model on CPU. vLLM CPU otherwise reserves a fraction of the NUMA
#: node's memory, which fails on small CI machines.
CPU_KV_CACHE_BYTES = 256 << 20


def tiny_engine_kwargs(on_gpu: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for the tiny local model on this kind of machine."""
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "seed": 0,
    }
    if not on_gpu:
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
    return kwargs
