"""The TRTLLM_MLA attention backend: vLLM's MLA scaffolding with the plugin's decode routes."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import MultipleOf

from ..log import logger_name
from ..registration.names import BACKEND_NAME
from .capabilities import SUPPORTED_KV_CACHE_DTYPES

if TYPE_CHECKING:
    from .builder import TrtllmMLAMetadataBuilder
    from .impl import TrtllmMLAImpl

logger = init_logger(logger_name(__name__))

#: Block sizes TRTLLM-gen's MLA decode kernel takes (FlashInfer's contract).
TRTLLM_GEN_BLOCK_SIZES = (32, 64)
#: What a user-chosen unsupported block size on Blackwell is replaced with.
FALLBACK_BLOCK_SIZE = 64
#: Preferred on every GPU: TRTLLM-gen and FlashMLA need it, FA3 was fastest with it.
PREFERRED_GPU_BLOCK_SIZE = 64
#: vLLM's reason for a backend without ``supports_device_cpu_query_lens_mismatch`` when
#: adaptive verification is on (``v1/attention/backend.py``, vLLM 0.32 and 0.33).
ADAPTIVE_VERIFICATION_REASON = (
    "device-cpu query lens mismatch not supported, this is needed for adaptive verification"
)


def _is_blackwell() -> bool:
    if not current_platform.is_cuda():
        return False
    capability = current_platform.get_device_capability()
    return capability is not None and (capability.major, capability.minor) in ((10, 0), (10, 3))


class TrtllmMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[TrtllmMLAImpl]:
        from .impl import TrtllmMLAImpl

        return TrtllmMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TrtllmMLAMetadataBuilder]:
        from .builder import TrtllmMLAMetadataBuilder

        return TrtllmMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # TRTLLM-gen pages only 32 or 64 tokens; the Hopper, Ampere and reference routes
        # page any multiple of 16 (vLLM's default block size).
        return list(TRTLLM_GEN_BLOCK_SIZES) if _is_blackwell() else [MultipleOf(16)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return PREFERRED_GPU_BLOCK_SIZE if current_platform.is_cuda() else default_block_size

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # Every GPU has a route (at worst the pure-torch reference); the doctor and the
        # engine log say which.
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The decode plans read each step's query lengths on the host (the uniform-query
        # reshape, FlashInfer's host-side plan, the short-prefill split), and adaptive
        # verification changes them on the device: opting out makes vLLM refuse it at start
        # instead of decoding batches the plan does not describe.
        return False

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        reasons = super().validate_configuration(*args, **kwargs)
        if ADAPTIVE_VERIFICATION_REASON in reasons:
            # vLLM's reason names what is missing; say what the user set and how to go on.
            reasons[reasons.index(ADAPTIVE_VERIFICATION_REASON)] = (
                "speculative decoding with enable_adaptive_verification is not supported by "
                "TRTLLM_MLA (its decode plans read each step's query lengths on the host, "
                "which adaptive verification changes on the device); set "
                "enable_adaptive_verification to false in --speculative-config"
            )
        block_size = kwargs.get("block_size")
        if "block_size not supported" in reasons:
            reasons.remove("block_size not supported")
            if not _adopt_fallback_block_size(block_size):
                reasons.append(
                    f"block_size {block_size} not supported by TRTLLM_MLA on this GPU "
                    f"(supported: {_describe_block_sizes()}); use --block-size "
                    f"{FALLBACK_BLOCK_SIZE}"
                )
        return reasons


def _describe_block_sizes() -> str:
    sizes = TrtllmMLABackend.get_supported_kernel_block_sizes()
    return ", ".join(f"multiples of {s.base}" if isinstance(s, MultipleOf) else str(s)
                     for s in sizes)


def _adopt_fallback_block_size(block_size: int | None) -> bool:
    """Replace a user-chosen block size the GPU's decode kernel cannot page with 64.

    Runs in the worker while the model's layers pick their backend, before any KV-cache
    spec exists; the KV-cache specs built afterwards carry the new size to the scheduler.
    Returns False when there is no config to adjust (the caller reports the reason).
    """
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or block_size is None:
        return False
    cache_config = vllm_config.cache_config
    if TrtllmMLABackend.supports_block_size(cache_config.block_size):
        return True  # already adopted by an earlier layer
    logger.warning(
        "TRTLLM_MLA: block size %d is not supported by the decode kernel on this GPU "
        "(supported: %s); using block size %d instead. Pass --block-size %d to silence "
        "this warning.",
        block_size,
        _describe_block_sizes(),
        FALLBACK_BLOCK_SIZE,
        FALLBACK_BLOCK_SIZE,
    )
    cache_config.block_size = FALLBACK_BLOCK_SIZE
    return True
