"""vLLM plugin entry point: registers the ``TRTLLM_MLA`` backend name.

Cheap by contract: no torch CUDA initialisation, no FlashInfer import.
"""

from .names import BACKEND_NAME, BACKEND_PATH, ENV_VAR
from .plugin import register

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "ENV_VAR", "register"]
