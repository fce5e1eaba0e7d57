"""Per-step metadata: vLLM's MLA prefill/decode split, plus one decode plan for all layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.kv_cache_interface import AttentionSpec

from ..log import logger_name
from ..ops import (
    DecodeBatch,
    DecodeSpec,
    MLADecoder,
    QueryJoin,
    platform_of,
    small_prefill_choice,
    small_prefill_spec,
)
from .decode_spec import (
    fa3_device_plan,
    forced_route,
    forced_short_prefill_route,
    model_decode_spec,
)
from .query_join import vllm_query_join

logger = init_logger(logger_name(__name__))


@dataclass
class TrtllmMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the decoder planned for this step's decode batch."""

    decoder: MLADecoder | None = None


@dataclass
class TrtllmMLAMetadata(MLACommonMetadata[TrtllmMLADecodeMetadata]):
    pass


class TrtllmMLAMetadataBuilder(MLACommonMetadataBuilder[TrtllmMLAMetadata]):
    # Decode runs inside full CUDA graphs for uniform batches (1 or 1 + k query tokens);
    # the plan is host-side and happens in build(), outside the graph.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Speculative decoding: several query tokens per request, causal inside each request.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, TrtllmMLAMetadata)
        layer = self.compilation_config.static_forward_context[layer_names[0]]
        spec = model_decode_spec(
            vllm_config,
            device,
            block_size=kv_cache_spec.block_size,
            num_heads=self.num_heads,
            kv_lora_rank=self.mla_dims.kv_lora_rank,
            rope_dim=self.mla_dims.qk_rope_head_dim,
            softmax_scale=float(layer.scale),
            max_q_len=self.reorder_batch_threshold,
        )
        if spec.q_dtype != layer.impl.decode_q_dtype:
            # The impl chose the query dtype from the configured block size; a kernel block
            # size vLLM picked differently must not silently change it.
            raise ValueError(
                f"TRTLLM_MLA: decode query dtype {spec.q_dtype} for kernel block size "
                f"{kv_cache_spec.block_size} differs from {layer.impl.decode_q_dtype} chosen "
                f"for block size {vllm_config.cache_config.block_size}; pass --block-size "
                f"{kv_cache_spec.block_size}"
            )
        self._seq_lens_host: torch.Tensor | None = None
        # vLLM's host lengths are exact except under asynchronous speculative decoding,
        # where they assume every draft token was accepted.
        sched = vllm_config.scheduler_config
        self._host_lens_exact = (
            vllm_config.speculative_config is None or sched.async_scheduling is False
        )
        self._slot_mapping: torch.Tensor | None = None
        # What real steps (not CUDA-graph capture runs) have shown the log so far: decode
        # with several query tokens per request, the widest short prefill; see
        # _log_multi_token_step.
        self._multi_token_decode_seen = False
        self._widest_small_prefill = 0
        max_batch = vllm_config.scheduler_config.max_num_seqs
        cudagraph_mode = self.compilation_config.cudagraph_mode
        full_graphs = device.type == "cuda" and cudagraph_mode.has_full_cudagraphs()
        # The persistent decoder: one per KV-cache group, planned once per step and shared
        # by every layer of the group, so its buffers keep stable addresses for CUDA graphs.
        query_join = vllm_query_join(spec)
        self.decoder = MLADecoder(
            spec, device, max_batch, route=forced_route(), cuda_graph=full_graphs,
            query_join=query_join,
        )
        self.small_prefill_decoder = self._small_prefill_decoder(spec, device, max_batch,
                                                                 query_join)
        if (device_plan := fa3_device_plan()) is not None:
            self.decoder.set_device_plan(device_plan)
            logger.info_once("TRTLLM_MLA: the vllm-fa3-mla route plans its steps on the %s "
                             "(TRTLLM_MLA_FA3_DEVICE_PLAN)", "GPU" if device_plan else "host")
        if self.small_prefill_decoder is not None:
            # vLLM now classes requests with this many new tokens or fewer as decodes.
            self.reorder_batch_threshold = max(self.reorder_batch_threshold,
                                               self.small_prefill_decoder.spec.max_q_len)
        if self.decoder.route_name == "torch-reference" and device.type == "cuda":
            logger.warning_once(
                "TRTLLM_MLA: no GPU decode kernel serves this model on this GPU; decode runs "
                "on the slow pure-torch reference route. Why:\n%s",
                self.decoder.choice.explain(),
            )
        small = self.small_prefill_decoder
        logger.info_once(
            "TRTLLM_MLA backend in use: decode route %s (%s); prefill %s%s.",
            self.decoder.route_name,
            self.decoder.choice.kernel,
            self._prefill_backend.get_name(),
            "" if small is None else (
                f", short prefills (up to {self.reorder_batch_threshold} new tokens) on "
                f"decode route {small.route_name}"),
        )

    def _small_prefill_decoder(
        self, spec: DecodeSpec, device: torch.device, max_batch: int,
        query_join: QueryJoin | None,
    ) -> MLADecoder | None:
        """A decoder for steps whose decode part carries short prefills, where a route
        serves them (``ops.small_prefill_choice``: vLLM's FA3 MLA kernel on SM90 with a
        16-bit cache). With ``reorder_batch_threshold`` raised to its query length, vLLM
        sends requests with that many new tokens or fewer here instead of through the
        prefill path, as vLLM's FLASH_ATTN_MLA does (its threshold: 512). Such steps are
        never replayed from a full CUDA graph (not uniform), so this decoder plans eagerly
        with the step's lengths. Not built when a decode route is forced
        (``TRTLLM_MLA_DECODE_ROUTE``): everything then decodes on that route, unless
        ``TRTLLM_MLA_SHORT_PREFILL_ROUTE`` names this decoder's route (on any device)."""
        name = forced_short_prefill_route()
        if name is None:
            if device.type != "cuda" or forced_route() is not None:
                return None
            choice = small_prefill_choice(spec, platform_of(device))
            if choice is None:
                return None
            name = choice.name
        return MLADecoder(small_prefill_spec(spec), device, max_batch, route=name,
                          query_join=query_join)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        # vLLM's host copy of the lengths (exact outside async speculative decoding) lets the
        # Hopper route policy see the batch's total KV tokens without a device sync.
        self._seq_lens_host = getattr(common_attn_metadata, "seq_lens_cpu_upper_bound", None)
        self._slot_mapping = common_attn_metadata.slot_mapping
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> TrtllmMLADecodeMetadata:
        num_decodes = seq_lens_device.shape[0]
        single_token = num_decode_tokens == num_decodes
        decoder = self.decoder
        if not single_token:
            small = self.small_prefill_decoder
            if small is not None:
                # vLLM passes min(the step's longest query, reorder_batch_threshold): with
                # short prefills in the step, that bound exceeds the decode part's own.
                max_query_len = int(query_start_loc_cpu.diff().max())
                if max_query_len > decoder.spec.max_q_len:
                    decoder = small
            self._log_multi_token_step(decoder, num_decodes, num_decode_tokens, max_query_len)
        host_lens = self._seq_lens_host
        if host_lens is not None:
            host_lens = host_lens[:num_decodes] if host_lens.shape[0] >= num_decodes else None
        exact = host_lens is not None and self._host_lens_exact
        # The policy sums exact host lengths itself when they matter; only an upper bound
        # (asynchronous speculative decoding) is summed here, and only for a decoder that
        # ranks with lengths.
        count_kv = host_lens is not None and not exact and not decoder.cuda_graph
        decoder.plan(
            DecodeBatch(
                block_table=block_table_tensor,
                seq_lens=seq_lens_device,
                max_seq_len=max_seq_len,
                cu_seqlens_q=None if single_token else query_start_loc_device,
                max_q_len=1 if single_token else max_query_len,
                num_tokens=num_decode_tokens,
                kv_tokens=int(host_lens.sum()) if count_kv else None,
                seq_lens_host=host_lens if exact else None,
                cu_seqlens_q_host=(
                    query_start_loc_cpu[: num_decodes + 1] if exact and not single_token
                    else None
                ),
                # vLLM's model runner keeps its block table and lengths at fixed addresses
                # for CUDA graphs (its own MLA backends hand them to captured kernels).
                persistent=True,
            )
        )
        return TrtllmMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            decoder=decoder,
        )

    def _log_multi_token_step(
        self, decoder: MLADecoder, num_decodes: int, num_decode_tokens: int,
        max_query_len: int,
    ) -> None:
        """Log the first real decode step with several query tokens per request on the step
        decoder (speculative decoding: verification, or an MTP draft pass), once per
        builder; on ``small_prefill_decoder``, each real step whose longest request is
        longer than on any earlier one (a few lines: records of the step's widest query).

        Steps whose slots are all -1 (no KV write: vLLM's CUDA-graph capture runs) are not
        counted. vLLM's start-up may still run one batch that writes slots (run 57: 64
        requests of 2 tokens, logged as short prefills before any request arrived). Reading
        the slots may synchronise the device, so it happens only on steps that would log.
        """
        small = decoder is self.small_prefill_decoder
        if small:
            if max_query_len <= self._widest_small_prefill:
                return
        elif self._multi_token_decode_seen:
            return
        slots = self._slot_mapping
        if slots is None or (slots.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        if not bool((slots[:num_decode_tokens] >= 0).any()):
            return
        if small:
            self._widest_small_prefill = max_query_len
            logger.info(
                "TRTLLM_MLA short prefills on decode route %s: %d requests, %d query "
                "tokens, up to %d per request.",
                decoder.route_name, num_decodes, num_decode_tokens, max_query_len,
            )
            return
        self._multi_token_decode_seen = True
        logger.info(
            "TRTLLM_MLA decode step with several query tokens per request: %d requests, "
            "%d query tokens, up to %d per request.",
            num_decodes,
            num_decode_tokens,
            max_query_len,
        )
