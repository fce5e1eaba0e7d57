"""The TRTLLM_MLA impl: vLLM's MLA prefill path, decode handed to the ops layer."""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionLayer, max_decode_query_len

from ..log import logger_name
from ..ops import KVScales
from .builder import TrtllmMLAMetadata
from .capabilities import feature_reasons, raise_if_any
from .decode_spec import model_decode_spec
from .prefill import prefer_flashinfer_prefill

logger = init_logger(logger_name(__name__))


class TrtllmMLAImpl(MLACommonImpl[TrtllmMLAMetadata]):
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        **mla_args,
    ) -> None:
        vllm_config = get_current_vllm_config()
        raise_if_any(
            feature_reasons(
                alibi_slopes=alibi_slopes,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                attn_type=getattr(attn_type, "value", attn_type),
                use_sparse=mla_args.get("indexer") is not None,
                kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
                kv_cache_dtype=kv_cache_dtype,
            )
        )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            **mla_args,
        )
        # vLLM quantises the decode query to FP8 (fused with the concat, with the layer's
        # q_scale) only when the decode routes read an FP8 query anyway; otherwise it stays
        # in the model dtype, in real values.
        self.decode_q_dtype = model_decode_spec(
            vllm_config,
            torch.device("cuda") if current_platform.is_cuda() else torch.device("cpu"),
            block_size=vllm_config.cache_config.block_size,
            num_heads=num_heads,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.qk_rope_head_dim,
            softmax_scale=scale,
            max_q_len=max_decode_query_len(vllm_config),
        ).q_dtype
        self.supports_quant_query_input = self.decode_q_dtype == torch.float8_e4m3fn
        if not current_platform.is_cuda():
            self._use_flashinfer_concat_mla_k = False
        else:
            prefer_flashinfer_prefill(vllm_config)

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        *args,
        **kwargs,
    ) -> None:
        if not current_platform.is_cpu():
            return super().do_kv_cache_update(
                kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                *args, **kwargs,
            )
        # vLLM's CUDA cache-write op does not exist in the CPU build; vLLM's CPU MLA impl
        # writes the latent cache with torch indexing, but only unquantised. For FP8 the
        # entries are quantised here (stored = value / k_scale, saturated to e4m3's range)
        # into the byte cache viewed as float8_e4m3fn, as the CUDA op does.
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        if kv_cache_dtype.startswith("fp8"):
            fp8 = torch.float8_e4m3fn
            limit = torch.finfo(fp8).max
            inv = 1.0 / float(k_scale)
            kv_c_normed = (kv_c_normed.float() * inv).clamp(-limit, limit)
            k_pe = (k_pe.float() * inv).clamp(-limit, limit)
            kv_cache = kv_cache.view(fp8)
        return CPUMLAImpl.do_kv_cache_update(
            self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale
        )

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: TrtllmMLAMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # A 16-bit query arrives as its (latent, rope) parts: the decoder joins them (with
        # vLLM's fused kernel, query_join.vllm_query_join) only for routes that read it whole.
        # An FP8 query was quantised by vLLM with q_scale; a wider one is in real values.
        # MLA's single latent cache is quantised with k_scale for both its K and V roles (as
        # in vLLM's FlashMLA, FlashInfer and Triton MLA backends).
        q_scale = layer._q_scale_float if self.supports_quant_query_input else 1.0
        k_scale = layer._k_scale_float
        scales = KVScales(q_scale=q_scale, k_scale=k_scale, v_scale=k_scale)
        return attn_metadata.decode.decoder.run(q, kv_c_and_k_pe_cache, scales=scales), None
