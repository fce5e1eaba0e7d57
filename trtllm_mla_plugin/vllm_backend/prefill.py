"""Prefill kernel choice: FlashInfer's MLA prefill on CUDA unless the user named one."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform

from ..log import logger_name

logger = init_logger(logger_name(__name__))


def prefer_flashinfer_prefill(vllm_config: VllmConfig) -> None:
    """Ask vLLM for FlashInfer MLA prefill when the user chose no prefill backend.

    vLLM picks each layer's prefill backend right after it builds the layer's impl, from
    ``attention_config.mla_prefill_backend``; naming FlashInfer there is how a decode
    backend asks for it. When FlashInfer's prefill cannot serve this GPU or model, vLLM's
    own automatic choice stands and the reason is logged.
    """
    from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.mla.prefill.selector import (
        MLAPrefillSelectorConfig,
    )

    attention = vllm_config.attention_config
    if attention.mla_prefill_backend is not None:
        return
    text_config = vllm_config.model_config.hf_text_config
    selector = MLAPrefillSelectorConfig(
        dtype=vllm_config.model_config.dtype,
        mla_dimensions=MLADimensions(
            qk_nope_head_dim=getattr(text_config, "qk_nope_head_dim", 0),
            qk_rope_head_dim=getattr(text_config, "qk_rope_head_dim", 0),
            v_head_dim=getattr(text_config, "v_head_dim", 0),
        ),
    )
    try:
        flashinfer = MLAPrefillBackendEnum.FLASHINFER.get_class()
        reasons = flashinfer.validate_configuration(
            current_platform.get_device_capability(), selector
        )
    except ImportError as error:
        reasons = [f"FlashInfer is not importable ({error}); pip install flashinfer-python"]
    if reasons:
        logger.info_once(
            "TRTLLM_MLA: FlashInfer MLA prefill cannot serve this model here (%s); "
            "vLLM's automatic prefill choice is used instead.",
            "; ".join(map(str, reasons)),
        )
        return
    attention.mla_prefill_backend = MLAPrefillBackendEnum.FLASHINFER
