"""Hopper route through FlashMLA's dense decode as bundled in vLLM
(``vllm.third_party.flashmla.flash_mla_interface``; needs vLLM's ``_flashmla_C`` extension).

FlashMLA takes a uniform query ``[batch, q_len, heads, Dc + Dr]``, 64-token pages and a
bf16/fp16 cache of the query's dtype (FP8 caches go to ``flashmla-fp8``, another entry point).
Ragged query lengths are padded (``RightAlignedQuery``).

The split-KV schedule is FlashMLA's own plan written by the plugin's kernel
(``kernels.flashmla_schedule``, 3-34 us per step on the H200) into persistent buffers handed
to FlashMLA's ``dense_decode_fwd``; left to itself FlashMLA computes the same plan with a
one-warp kernel that takes 9-91 us per step (docs/benchmarks-history.md, runs 84-85). The
schedule is launched by the first ``run`` of a step and reused by the other layers. While a
CUDA graph is being captured, ``run`` launches it once per plan, so the graph recomputes the
schedule from the persistent ``seq_lens`` on every replay; reusing one computed by an eager
warm-up run would bake the warm-up step's split of the KV into the graph.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute, StagedTables, check_unit_scales, module_available

FLASHMLA_MODULE = "vllm.third_party.flashmla.flash_mla_interface"
#: Rows of ``tile_scheduler_metadata``: FlashMLA's ``num_sm_parts`` for 64-row query tiles.
FLASHMLA_ROWS_PER_PART = 64
#: FlashMLA's page size and the (kv_lora_rank, rope_dim) its kernels are compiled for.
FLASHMLA_BLOCK_SIZE = 64
FLASHMLA_DIMS = (512, 64)


def flashmla_shape_reason(spec: DecodeSpec) -> str | None:
    """Why FlashMLA's page size or head dims rule ``spec`` out (both FlashMLA routes)."""
    if spec.block_size != FLASHMLA_BLOCK_SIZE:
        return (
            f"block size {spec.block_size}: FlashMLA pages hold {FLASHMLA_BLOCK_SIZE} tokens; "
            f"start vLLM with --block-size {FLASHMLA_BLOCK_SIZE}"
        )
    if (spec.kv_lora_rank, spec.rope_dim) != FLASHMLA_DIMS:
        return (
            "FlashMLA needs kv_lora_rank 512 and rope_dim 64, got "
            f"{spec.kv_lora_rank}/{spec.rope_dim}"
        )
    return None


class RightAlignedQuery:
    """FlashMLA's uniform ``[batch, q_len, heads, D]`` query for batches whose requests
    have different query lengths.

    A request with ``n < q_len`` rows is placed in the *last* ``n`` rows of its slot, so
    with FlashMLA's bottom-right causal mask row ``t`` still sees ``L - n + t + 1`` keys;
    the padding rows are computed and dropped. Buffers are persistent (CUDA graphs).
    """

    def __init__(self, spec: DecodeSpec, max_batch_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        rows = max_batch_size * spec.max_q_len
        self.heads, self.dim = spec.num_heads, spec.head_dim
        #: Padded-slot index of every query row of the planned batch.
        self.slot = torch.zeros(rows, dtype=torch.int64, device=device)
        self.padded = torch.zeros(rows, spec.num_heads, spec.head_dim, dtype=dtype,
                                  device=device)
        self.ragged = False
        self._b = self._m = self._t = 0

    def plan(self, batch: DecodeBatch) -> None:
        """Lay out ``batch``'s rows (device work only for ragged batches)."""
        self._b, self._m, self._t = batch.batch_size, batch.max_q_len, batch.num_tokens
        self.ragged = not batch.uniform_q_len
        if not self.ragged:
            return
        m, t = self._m, self._t
        cu = batch.cu_seqlens_q.to(torch.int64)
        rows = torch.arange(t, device=cu.device)
        req = torch.searchsorted(cu[1:], rows, right=True)
        self.slot[:t].copy_(req * m + m - (cu[req + 1] - rows), non_blocking=True)
        # Padding rows stay finite so no NaN is produced from garbage.
        self.padded[: self._b * m].zero_()

    def gather(self, query: torch.Tensor) -> torch.Tensor:
        """``query [tokens, heads, D]`` -> ``[batch, q_len, heads, D]``."""
        b, m = self._b, self._m
        if not self.ragged:
            return query.view(b, m, self.heads, self.dim)
        padded = self.padded[: b * m]
        if padded.element_size() == 1:
            # index_copy_ has no FP8 kernel on CUDA; the bytes are what moves.
            padded.view(torch.uint8).index_copy_(0, self.slot[: self._t],
                                                 query.view(torch.uint8))
        else:
            padded.index_copy_(0, self.slot[: self._t], query)
        return padded.view(b, m, self.heads, self.dim)

    def scatter(self, result: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Kernel output ``[batch, q_len, heads, Dc]`` -> the caller's rows in ``out``."""
        rows = result.reshape(self._b * self._m, self.heads, result.shape[-1])
        if self.ragged:
            torch.index_select(rows, 0, self.slot[: self._t], out=out)
        else:
            out.copy_(rows)
        return out


class FlashMLASchedule:
    """A step's FlashMLA split-KV schedule, written by ``kernels.flashmla_schedule``:
    ``tile_metadata [parts, 8]`` (one row per SM part, at most one part per SM) and
    ``num_splits [batch + 1]`` int32, with the kernel's scratch. Persistent: captured decode
    launches read them, and a captured schedule launch rewrites them, in place on every
    replay. ``fp8_layout``: the plan of FlashMLA's dense FP8 scheduler; ``overhead_blocks``:
    a request's cost beside its KV blocks (FlashMLA's 5 unless given, see
    ``kernels.flashmla_schedule``; read by every ``write``)."""

    def __init__(self, max_batch_size: int, device: torch.device, fp8_layout: bool = False,
                 overhead_blocks: int | None = None):
        from ..kernels.flashmla_schedule import (
            FLASHMLA_OVERHEAD_BLOCKS,
            REQUEST_SCRATCH_ROWS,
            SCHED_META_INTS,
            flashmla_schedule,
        )

        self._kernel = flashmla_schedule
        self._fp8_layout = fp8_layout
        self.overhead_blocks = (FLASHMLA_OVERHEAD_BLOCKS if overhead_blocks is None
                                else overhead_blocks)
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        ints = {"dtype": torch.int32, "device": device}
        self._tile_metadata = torch.zeros(self.sms, SCHED_META_INTS, **ints)
        self._num_splits = torch.zeros(max_batch_size + 1, **ints)
        self._request_scratch = torch.zeros(REQUEST_SCRATCH_ROWS, max_batch_size, **ints)
        self._boundary_owners = torch.zeros(self.sms + 1, **ints)
        self.buffers: tuple[torch.Tensor, torch.Tensor] = (self._tile_metadata,
                                                           self._num_splits[:1])

    def num_parts(self, query_rows: int) -> int:
        """FlashMLA's SM parts for ``query_rows`` (query tokens x heads) per request (its
        decode checks the schedule's shape against the same formula)."""
        return max(self.sms // -(-query_rows // FLASHMLA_ROWS_PER_PART), 1)

    def plan(self, batch_size: int, query_rows: int) -> None:
        """Select the step's views (``buffers``: tile metadata, num_splits)."""
        self.buffers = (self._tile_metadata[: self.num_parts(query_rows)],
                        self._num_splits[: batch_size + 1])

    def write(self, seq_lens: torch.Tensor) -> None:
        """Launch the kernel for the planned step's ``seq_lens [batch]`` int32."""
        self._kernel(seq_lens, *self.buffers, self._request_scratch, self._boundary_owners,
                     fp8_layout=self._fp8_layout, overhead_blocks=self.overhead_blocks)


class FlashMLARoute(DecodeRoute):
    name = "flashmla"
    kernel = "FlashMLA (vLLM bundle) flash_mla_with_kvcache"
    own_output: ClassVar[bool] = True

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.capability is None or platform.capability[0] != 9:
            return f"FlashMLA dense decode runs on SM90 only; this is {platform.describe()}"
        if not module_available(FLASHMLA_MODULE):
            return "FlashMLA is not importable (it ships inside the CUDA build of vllm)"
        if spec.q_dtype not in (torch.bfloat16, torch.float16) or spec.kv_dtype != spec.q_dtype:
            return (
                "FlashMLA (this route) takes bfloat16/float16 query and cache of the same "
                f"dtype, got {spec.q_dtype} / {spec.kv_dtype}; FP8 caches go to flashmla-fp8"
            )
        return flashmla_shape_reason(spec)

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        import importlib

        # Importing the interface loads vLLM's ``_flashmla_C`` extension and its ops.
        importlib.import_module(FLASHMLA_MODULE)
        self._decode = torch.ops._flashmla_C.dense_decode_fwd
        self._tables = StagedTables(max_batch_size, device)
        self._query = RightAlignedQuery(spec, max_batch_size, spec.q_dtype, device)
        self._schedule = FlashMLASchedule(max_batch_size, device)
        self._batch: DecodeBatch | None = None
        self._scheduled = self._capture_scheduled = False

    def plan(self, batch: DecodeBatch) -> None:
        self._block_table, self._seq_lens = self._tables.stage(batch)
        self._query.plan(batch)
        b = batch.batch_size
        self._schedule.plan(b, batch.max_q_len * self.spec.num_heads)
        self._scheduled = self._capture_scheduled = False
        self._batch = batch

    def _ensure_schedule(self) -> None:
        """Launch the step's schedule once per plan, and once more inside a capture."""
        capturing = torch.cuda.is_current_stream_capturing()
        if self._capture_scheduled if capturing else self._scheduled:
            return
        self._schedule.write(self._seq_lens)
        if capturing:
            self._capture_scheduled = True
        else:
            self._scheduled = True

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor | None,
        scales: KVScales,
    ) -> torch.Tensor:
        check_unit_scales(self.spec, scales)
        batch, spec = self._batch, self.spec
        b, m = batch.batch_size, batch.max_q_len
        q = self._query.gather(query)
        # Write straight into ``out`` (one token per request: FlashMLA's ``out=`` failed for
        # q_len > 1 on the H200, docs/benchmarks-history.md).
        direct = (out is not None and m == 1 and not self._query.ragged
                  and out.is_contiguous() and out.dtype == q.dtype)
        self._ensure_schedule()
        result, *_ = self._decode(
            q, kv_cache.unsqueeze(-2), spec.kv_lora_rank, self._seq_lens, self._block_table,
            spec.softmax_scale,
            # The same math for one query token per request; vLLM passes True, and the mask
            # costs FlashMLA time at q_len 1 (docs/benchmarks-history.md, run 19).
            m > 1,
            *self._schedule.buffers,
            out.view(b, m, spec.num_heads, spec.kv_lora_rank) if direct else None,
        )
        if direct:
            return out
        if out is None and not self._query.ragged:
            return result.view(b * m, spec.num_heads, spec.kv_lora_rank)
        if out is None:
            out = result.new_empty(batch.num_tokens, spec.num_heads, spec.kv_lora_rank)
        return self._query.scatter(result, out)
