"""Class-path target for vLLM's CPU MLA backend names (see ``plugin``).

``AttentionBackendEnum.CPU_MLA`` / ``AMX_MLA`` point here on the CPU platform. vLLM resolves
a backend by importing this module and reading an attribute named like vLLM's class; the
module ``__getattr__`` answers with the TRTLLM_MLA backend when the engine being built
selected it, else with vLLM's own class — the one the name pointed to before.
"""

from __future__ import annotations

from typing import Any

#: vLLM class name -> the backend name whose default class path (its enum value) it is.
_VLLM_BACKENDS = {"CPUMLABackend": "CPU_MLA", "AMXMLABackend": "AMX_MLA"}


def __getattr__(name: str) -> Any:
    if name not in _VLLM_BACKENDS:
        raise AttributeError(name)
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .names import BACKEND_PATH
    from .selection import is_selected

    if is_selected(get_current_vllm_config_or_none()):
        return resolve_obj_by_qualname(BACKEND_PATH)
    return resolve_obj_by_qualname(AttentionBackendEnum[_VLLM_BACKENDS[name]].value)
