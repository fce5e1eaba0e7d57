"""Hopper route through FlashMLA as bundled in vLLM
(``vllm.third_party.flashmla.flash_mla_interface``; needs vLLM's ``_flashmla_C`` extension).

FlashMLA takes a uniform query ``[batch, q_len, heads, Dc + Dr]``, 64-token pages and a
bf16/fp16 cache of the query's dtype (its FP8 path uses another entry point and cache
format). Ragged query lengths are padded here: a request with ``n < q_len`` rows is placed
in the *last* ``n`` rows of its slot, so with FlashMLA's bottom-right causal mask row ``t``
still sees ``L - n + t + 1`` keys; the padding rows are computed and dropped.

Scheduling metadata is created per step in ``plan`` and filled by the first ``run`` of the
step (FlashMLA computes it on the device from the sequence lengths), then reused by the
other layers. While a CUDA graph is being captured, ``run`` starts from fresh metadata (once
per plan) so that the metadata kernel itself is captured and every replay recomputes the
schedule from the persistent ``seq_lens`` buffer; reusing metadata filled by an eager
warm-up run would bake the warm-up step's split of the KV into the graph.
"""

from __future__ import annotations

import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute, StagedTables, module_available

FLASHMLA_MODULE = "vllm.third_party.flashmla.flash_mla_interface"


class FlashMLARoute(DecodeRoute):
    name = "flashmla"
    kernel = "FlashMLA (vLLM bundle) flash_mla_with_kvcache"

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.capability is None or platform.capability[0] != 9:
            return f"FlashMLA dense decode runs on SM90 only; this is {platform.describe()}"
        if not module_available(FLASHMLA_MODULE):
            return "FlashMLA is not importable (it ships inside the CUDA build of vllm)"
        if spec.block_size != 64:
            return (
                f"block size {spec.block_size}: FlashMLA pages hold 64 tokens; start vLLM "
                "with --block-size 64"
            )
        if spec.q_dtype not in (torch.bfloat16, torch.float16) or spec.kv_dtype != spec.q_dtype:
            return (
                "FlashMLA (this route) takes bfloat16/float16 query and cache of the same "
                f"dtype, got {spec.q_dtype} / {spec.kv_dtype}; FP8 caches go to flashinfer-fa3"
            )
        if (spec.kv_lora_rank, spec.rope_dim) != (512, 64):
            return (
                "FlashMLA needs kv_lora_rank 512 and rope_dim 64, got "
                f"{spec.kv_lora_rank}/{spec.rope_dim}"
            )
        return None

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        import importlib

        self._fm = importlib.import_module(FLASHMLA_MODULE)
        n, q = max_batch_size, spec.max_q_len
        self._tables = StagedTables(n, device)
        # Padded-slot index of every query row (ragged batches only).
        self._slot = torch.zeros(n * q, dtype=torch.int64, device=device)
        self._padded_q = torch.zeros(n * q, spec.num_heads, spec.head_dim,
                                     dtype=spec.q_dtype, device=device)
        self._batch: DecodeBatch | None = None
        self._meta = None
        self._capture_meta = None

    def plan(self, batch: DecodeBatch) -> None:
        b = batch.batch_size
        self._block_table, self._seq_lens = self._tables.stage(batch)
        if not batch.uniform_q_len:
            m, t = batch.max_q_len, batch.num_tokens
            cu = batch.cu_seqlens_q.to(torch.int64)
            rows = torch.arange(t, device=cu.device)
            req = torch.searchsorted(cu[1:], rows, right=True)
            # Right-align each request's rows in its slot of max_q_len rows.
            self._slot[:t].copy_(req * m + m - (cu[req + 1] - rows), non_blocking=True)
            # Padding rows stay finite so no NaN is produced from garbage.
            self._padded_q[: b * m].zero_()
        self._meta, _ = self._fm.get_mla_metadata()
        self._capture_meta = None
        self._batch = batch

    def _schedule(self) -> object:
        if not torch.cuda.is_current_stream_capturing():
            return self._meta
        if self._capture_meta is None:
            self._capture_meta, _ = self._fm.get_mla_metadata()
        return self._capture_meta

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scales: KVScales
    ) -> torch.Tensor:
        if not scales.is_unit:
            raise ValueError(
                "KV scales apply to FP8 caches only; pass UNIT_SCALES with a "
                f"{self.spec.kv_dtype} cache"
            )
        batch, spec = self._batch, self.spec
        b, m, t = batch.batch_size, batch.max_q_len, batch.num_tokens
        ragged = not batch.uniform_q_len
        if ragged:
            slot = self._slot[:t]
            padded = self._padded_q[: b * m]
            padded.index_copy_(0, slot, query)
            q = padded.view(b, m, spec.num_heads, spec.head_dim)
        else:
            q = query.view(b, m, spec.num_heads, spec.head_dim)
        # Write straight into ``out`` (one token per request: FlashMLA's ``out=`` failed for
        # q_len > 1 on the H200, docs/benchmarks.md).
        direct = m == 1 and not ragged and out.is_contiguous() and out.dtype == q.dtype
        result, _ = self._fm.flash_mla_with_kvcache(
            q=q,
            k_cache=kv_cache.unsqueeze(-2),
            block_table=self._block_table,
            cache_seqlens=self._seq_lens,
            head_dim_v=spec.kv_lora_rank,
            tile_scheduler_metadata=self._schedule(),
            softmax_scale=spec.softmax_scale,
            causal=True,
            is_fp8_kvcache=False,
            out=out.view(b, m, spec.num_heads, spec.kv_lora_rank) if direct else None,
        )
        if direct:
            return out
        result = result.view(b * m, spec.num_heads, spec.kv_lora_rank)
        if ragged:
            torch.index_select(result, 0, self._slot[:t], out=out)
        else:
            out.copy_(result)
        return out
