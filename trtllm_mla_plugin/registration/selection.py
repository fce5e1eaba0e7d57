"""Whether the user selected TRTLLM_MLA: by ``VLLM_ATTENTION_BACKEND`` or vLLM's config."""

from __future__ import annotations

import difflib
import os
from typing import Any

from .names import BACKEND_NAME, ENV_VAR


def env_selection() -> bool:
    """True when ``VLLM_ATTENTION_BACKEND`` names TRTLLM_MLA (any case).

    Raises:
        ValueError: the variable is a near miss of ``TRTLLM_MLA`` (e.g. ``TRTLLM_MAL``) and
            names no backend vLLM knows, so the user most likely mistyped ours.
    """
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return False
    if value.upper() == BACKEND_NAME:
        return True
    if _is_known_vllm_backend(value):
        return False
    if difflib.get_close_matches(value.upper(), [BACKEND_NAME], n=1, cutoff=0.75):
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a known attention backend; did you mean "
            f"{ENV_VAR}={BACKEND_NAME}?"
        )
    return False


def _is_known_vllm_backend(value: str) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return value.upper() in AttentionBackendEnum.__members__


def config_selection(vllm_config: Any) -> bool:
    """True when vLLM's attention config names TRTLLM_MLA for MLA layers."""
    if vllm_config is None:
        return False
    attention = vllm_config.attention_config
    chosen = [attention.backend, *attention.backend_per_kind.values()]
    return any(getattr(b, "name", None) == BACKEND_NAME for b in chosen)


def is_selected(vllm_config: Any) -> bool:
    """Selected by the environment variable or by ``vllm_config``."""
    return env_selection() or config_selection(vllm_config)
