"""On vLLM's CPU platform, an engine that selected TRTLLM_MLA gets CPU_MLA's engine settings.

vLLM's CPU platform (``vllm/platforms/cpu.py``, ``check_and_update_config``) gives an MLA
model one of two sets of settings, after the backend it will pick:

- CPU_MLA (no AMX, or ``--attention-backend CPU_MLA``): block size 16, chunked prefill and
  prefix caching off, ``max_num_batched_tokens = max(max_model_len, 2048)``;
- AMX_MLA (x86 with AMX tiles and CPU_MLA not named, which includes TRTLLM_MLA selected):
  block size 128 unless the user chose one, chunked prefill and prefix caching left on.
  AMX_MLA can: its own extend kernel attends over cached context in bf16.

With TRTLLM_MLA selected, ``cpu_routing`` hands the engine TRTLLM_MLA in place of either,
but what TRTLLM_MLA runs on CPU is CPU_MLA's design (vLLM's MLA prefill on CPU SDPA, CPU_MLA's
cache write, the pure-torch decode route), not AMX_MLA's. Under AMX_MLA's settings:

- prefill over cached context (a prefix-cache hit, or a prompt's later chunks) goes through
  vLLM's CPU context gather, which refuses quantised caches: with ``--kv-cache-dtype fp8``
  the first prefix-cache hit stops the engine ("CPU MLA context gather fallback only
  supports non-quantized KV cache", ``mla_attention.py`` ``_compute_prefill_context``);
- vLLM has no CPU backend that runs that path in float32 to check the plugin against;
- the same engine would run differently on CPUs with and without AMX.

So when TRTLLM_MLA is selected for an MLA model, the settings vLLM gives CPU_MLA are applied
right after vLLM's own platform hook, on every CPU. Where vLLM already applied them (no
AMX) nothing changes and nothing is logged. An engine that did not select TRTLLM_MLA is
never touched.
"""

from __future__ import annotations

import functools
from typing import Any

from ..log import get_logger
from .selection import is_selected

logger = get_logger(__name__)

#: The block size vLLM's CPU platform gives MLA models on CPU_MLA (its decode kernel's).
CPU_MLA_BLOCK_SIZE = 16
_MARK = "_trtllm_mla_cpu_settings"


def apply_cpu_mla_settings(vllm_config: Any) -> list[str]:
    """Give an engine that selected TRTLLM_MLA the settings vLLM gives CPU_MLA.

    Mirrors the CPU_MLA branch of vLLM's ``CpuPlatform.check_and_update_config`` (same
    condition on the model: MLA, not DeepSeek-V4, which vLLM configures apart).

    Returns:
        What was changed, one phrase per setting (empty: nothing).
    """
    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "use_mla", False):
        return []
    if getattr(model_config.hf_config, "model_type", None) == "deepseek_v4":
        return []
    if not is_selected(vllm_config):
        return []
    cache = vllm_config.cache_config
    scheduler = vllm_config.scheduler_config
    changed = []
    if cache.block_size != CPU_MLA_BLOCK_SIZE:
        if getattr(cache, "user_specified_block_size", False):
            logger.warning(
                "TRTLLM_MLA on CPU uses block size %d (as vLLM's CPU_MLA backend); "
                "overriding the requested block size %s.",
                CPU_MLA_BLOCK_SIZE, cache.block_size,
            )
        changed.append(f"block size {cache.block_size} -> {CPU_MLA_BLOCK_SIZE}")
        cache.block_size = CPU_MLA_BLOCK_SIZE
    if scheduler.enable_chunked_prefill:
        changed.append("chunked prefill off")
        scheduler.enable_chunked_prefill = False
    if cache.enable_prefix_caching:
        changed.append("prefix caching off")
        cache.enable_prefix_caching = False
    budget = max(model_config.max_model_len, scheduler.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if scheduler.max_num_batched_tokens != budget:
        changed.append(f"max_num_batched_tokens {scheduler.max_num_batched_tokens} -> {budget}")
        scheduler.max_num_batched_tokens = budget
    if changed:
        logger.info(
            "TRTLLM_MLA on CPU: %s: the settings vLLM gives its CPU_MLA backend, whose prefill "
            "and cache write TRTLLM_MLA uses on CPU (vLLM had set them up for AMX_MLA).",
            ", ".join(changed),
        )
    return changed


def install_cpu_mla_settings(platform_cls: type) -> None:
    """Run ``apply_cpu_mla_settings`` after ``platform_cls.check_and_update_config``.

    vLLM calls that hook while it builds the engine's config, in the process that builds
    it (plugins are loaded before, in ``EngineArgs.__post_init__``). Idempotent.
    """
    original = platform_cls.check_and_update_config
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        original(vllm_config)
        apply_cpu_mla_settings(vllm_config)

    setattr(check_and_update_config, _MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
