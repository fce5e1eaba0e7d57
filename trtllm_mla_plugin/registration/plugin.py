"""``register()``: the ``vllm.general_plugins`` entry point.

vLLM calls it in every process (API server, engine core, each worker), sometimes twice,
so every step is idempotent. It never initialises CUDA or imports FlashInfer, and it
changes nothing in vLLM beyond adding the ``TRTLLM_MLA`` name unless the user selected it
(see ``cpu_routing`` for the one exception, which still resolves to vLLM's own classes).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from ..log import get_logger
from .cpu_settings import install_cpu_mla_settings
from .names import BACKEND_NAME, BACKEND_PATH, TESTED_ENGINES
from .selection import env_selection

logger = get_logger(__name__)

#: vLLM CPU backends that the CPU platform picks for MLA models whatever the selection.
CPU_MLA_BACKENDS = ("CPU_MLA", "AMX_MLA")
CPU_ROUTING_MODULE = "trtllm_mla_plugin.registration.cpu_routing"


def register() -> None:
    """Register ``TRTLLM_MLA`` with vLLM and honour ``VLLM_ATTENTION_BACKEND=TRTLLM_MLA``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        backend_member()
        _warn_outside_tested_versions()
    selected_by_env = env_selection()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _route_cpu_mla_through_selection(AttentionBackendEnum, register_backend)
        install_cpu_mla_settings(type(current_platform))
    elif selected_by_env:
        install_env_selection(type(current_platform))


def backend_member() -> Any:
    """``AttentionBackendEnum.TRTLLM_MLA``, registered first if this process lacks it.

    Also what a pickled member unpickles through: vLLM's worker processes (tensor
    parallelism) unpickle their config, which names the selected backend, before they load
    plugins, and a plain member would then be an unknown enum value ("... is not a valid
    AttentionBackendEnum") for ``--attention-backend TRTLLM_MLA``.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)
        # pickle looks __reduce_ex__ up on the instance first.
        AttentionBackendEnum[BACKEND_NAME].__reduce_ex__ = _reduce_backend_member
    return AttentionBackendEnum[BACKEND_NAME]


def _reduce_backend_member(protocol: int) -> tuple:
    return backend_member, ()


def engine_distribution() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM engine, or ``None``."""
    for dist in TESTED_ENGINES:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _warn_outside_tested_versions() -> None:
    found = engine_distribution()
    if found is None:
        return
    dist, version = found
    if TESTED_ENGINES[dist] != version:
        logger.warning(
            "trtllm_mla_plugin is tested with %s; found %s==%s. The TRTLLM_MLA backend "
            "may fail or misbehave; install a tested version.",
            ", ".join(f"{d}=={v}" for d, v in TESTED_ENGINES.items()),
            dist,
            version,
        )


def _route_cpu_mla_through_selection(enum, register_backend) -> None:
    """Point vLLM's CPU MLA backend names at ``cpu_routing``.

    vLLM's CPU platform returns CPU_MLA (or AMX_MLA) for every MLA model and ignores the
    selected backend. ``cpu_routing`` resolves those names to TRTLLM_MLA when the running
    engine's config (or the environment variable) selected it, and to vLLM's own class
    otherwise, so an engine that did not select TRTLLM_MLA runs exactly what it ran before.
    """
    for name in CPU_MLA_BACKENDS:
        member = enum[name]
        current = member.get_path()
        if current.startswith(CPU_ROUTING_MODULE):
            continue
        cls_name = current.rsplit(".", 1)[1]
        register_backend(member, f"{CPU_ROUTING_MODULE}.{cls_name}")


def install_env_selection(platform_cls: type) -> None:
    """Make ``platform_cls`` treat "no backend selected" as TRTLLM_MLA for MLA layers.

    vLLM >= 0.32 no longer reads ``VLLM_ATTENTION_BACKEND``; this restores it for our name
    only. Installed only when the variable says TRTLLM_MLA; an explicit
    ``--attention-backend`` still wins, and non-MLA layers are untouched. Idempotent.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = platform_cls.get_attn_backend_cls
    if getattr(original, "_trtllm_mla_env_selection", False):
        return
    trtllm_mla = AttentionBackendEnum[BACKEND_NAME]

    @functools.wraps(original)
    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is None and attn_selector_config.use_mla:
            selected_backend = trtllm_mla
        return original(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._trtllm_mla_env_selection = True  # type: ignore[attr-defined]
    platform_cls.get_attn_backend_cls = staticmethod(get_attn_backend_cls)
