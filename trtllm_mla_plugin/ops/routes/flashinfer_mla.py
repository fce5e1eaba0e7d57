"""Hopper / Ampere routes through ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` with the
FA3 (SM90) and FA2 (SM80+) backends, keyword-only modern API (``metadata=``, ``query=``,
``kv_cache=``).

Read from FlashInfer 0.7.2.post1 (``mla/_batch_mla/_wrapper.py``, ``_backends/_fa_common.py``):

* query and cache share a dtype (bf16 or fp16), or the cache is FP8 e4m3 with a bfloat16
  query on SM90 (dims 512/64 or 512/0) and per-tensor ``ckv_scale``/``kpe_scale``; the
  output has the query's dtype.
* ``causal=True`` masks bottom-right aligned: row ``t`` of a request with ``L`` keys and
  ``n`` query rows sees ``L - n + t + 1`` keys (``ops.reference``'s convention).
* with ``causal=True`` and several query rows, heads that do not divide the 64-row query
  tile can hit a native tile-boundary bug that FlashInfer refuses at plan time; such specs
  are declared ineligible instead of failing mid-serving.
* ``use_cuda_graph=True`` wrappers copy metadata into caller-reserved int32 buffers at each
  ``plan`` and may be re-planned (same batch size), so a captured ``run`` stays valid.
* its planner (``scheduler.cuh`` ``MLAPlan``) splits each request's KV into chunks of about
  ``sum(kv_len) / num_SMs`` tokens and hands chunks to the least-loaded CTA *in request
  order*; on ragged batches a long request late in the batch lands on an already busy CTA.
  With ``sort_by_length`` (set per batch by ``ops.policy``; uniform query lengths only)
  the route hands the planner the requests longest first (longest-processing-time-first
  list scheduling) and puts the outputs back in the caller's order
  (docs/benchmarks-history.md, "Aims not met, and the next levers", lever (a)).
* ``plan`` runs on the host and needs every length there. Given device tensors (the
  page-table form) it copies them back, waiting for the GPU, and slices the table row by row
  in Python; in the engine that wait ends the overlap of host and GPU work each step (run 13:
  b128 at two thirds of FLASHMLA's throughput). With exact host lengths
  (``DecodeBatch.seq_lens_host``, which vLLM's builder has) the route passes the CSR form
  instead: offsets and lengths on the host, page ids gathered on the device
  (``paged_csr``), so planning never waits for the GPU.
* the FA2/FA3 kernels read the query as two tensors with strides of their own
  (``q_nope``, ``q_pe``; ``batch_mla_sm90_run.cu``), and a plan made with
  ``query_layout="split"`` takes them as two independent tensors (a ``"packed"`` plan takes
  only adjacent views of one tensor), so vLLM's two parts run without being joined; a
  packed query is cut into views of itself.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales, split_query
from .base import DecodeRoute, check_unit_scales, module_available, to_device
from .trtllm_gen import workspace_for

_FP8_DIMS = ((512, 64), (512, 0))


def fa_causal_tiles_safe(num_heads: int, max_q_len: int) -> bool:
    """Whether FlashInfer 0.7.2's FA MLA causal plan is safe for every batch of this shape.

    Its query tile is 64 rows, or 128 when the batch's mean ``q_len * heads`` exceeds 64
    (``_fa_common._validate_fa_causal_tile_bound``); a tile ending inside a request's rows
    can drop a visible key unless the head count divides the tile.
    """
    rows = num_heads * max_q_len
    tiles = (128,) if num_heads > 64 else (64, 128)
    return all(tile % num_heads == 0 or rows <= tile for tile in tiles)


def fa_unsupported_reason(
    spec: DecodeSpec, platform: Platform, backend: str
) -> str | None:
    """Eligibility shared by FA2 and FA3 (``backend`` is ``"fa2"`` or ``"fa3"``)."""
    if platform.kind != "cuda" or platform.capability is None:
        return f"FlashInfer {backend} needs a CUDA GPU; this is {platform.describe()}"
    if backend == "fa3" and platform.capability[0] != 9:
        return f"FlashInfer fa3 MLA runs on SM90 (H100/H200) only; this is {platform.describe()}"
    if backend == "fa2" and platform.capability < (8, 0):
        return f"FlashInfer fa2 MLA needs SM80 or newer; this is {platform.describe()}"
    if not module_available("flashinfer"):
        return "flashinfer is not installed; pip install flashinfer-python==0.7.2.post1"
    if spec.kv_lora_rank % 128 or spec.rope_dim % 64:
        return (
            f"kv_lora_rank={spec.kv_lora_rank} / rope_dim={spec.rope_dim}: FlashInfer {backend} "
            "needs kv_lora_rank a multiple of 128 and rope_dim a multiple of 64"
        )
    if backend == "fa3" and spec.kv_lora_rank not in (128, 256, 512):
        return f"FlashInfer fa3 MLA needs kv_lora_rank in (128, 256, 512), got {spec.kv_lora_rank}"
    if spec.fp8_kv:
        if platform.capability[0] != 9:
            return f"FlashInfer {backend} reads FP8 KV caches on SM90 only; use a bf16 KV cache"
        if spec.q_dtype != torch.bfloat16:
            return (
                f"FlashInfer {backend} with an FP8 KV cache takes bfloat16 queries only, got "
                f"{spec.q_dtype}; run the model in bfloat16 (--dtype bfloat16)"
            )
        if (spec.kv_lora_rank, spec.rope_dim) not in _FP8_DIMS:
            return f"FlashInfer {backend} FP8 KV needs kv_lora_rank 512 and rope_dim 64 or 0"
    elif spec.q_dtype not in (torch.bfloat16, torch.float16) or spec.kv_dtype != spec.q_dtype:
        return (
            f"FlashInfer {backend} takes bfloat16/float16 query and cache of the same dtype, "
            f"got {spec.q_dtype} / {spec.kv_dtype}"
        )
    if not fa_causal_tiles_safe(spec.num_heads, spec.max_q_len):
        return (
            f"{spec.num_heads} heads with up to {spec.max_q_len} query tokens per request: "
            f"FlashInfer {backend}'s causal query tiles (64 or 128 rows) can drop a visible "
            "key unless the head count divides the tile; use fewer speculative tokens"
        )
    return None


def paged_csr(
    block_table: torch.Tensor, seq_lens_host: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page list from a dense block table, without a device sync.

    Args:
        block_table: ``[batch, max_blocks]`` int32 on the device.
        seq_lens_host: ``[batch]`` int32 on the CPU, tokens per request.
        page_size: tokens per page.

    Returns:
        ``kv_indptr``: ``[batch + 1]`` int32 on the CPU, page offsets per request;
        ``kv_indices``: ``[kv_indptr[-1]]`` int32 on ``block_table``'s device, the first
        ``ceil(seq_lens[i] / page_size)`` entries of each row, rows one after another.
    """
    pages = (seq_lens_host.to(torch.int64) + page_size - 1) // page_size
    kv_indptr = torch.zeros(pages.numel() + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    total = int(kv_indptr[-1])
    device = block_table.device
    # Sizes come from the host, so no step here waits for the GPU.
    rows = torch.repeat_interleave(
        torch.arange(pages.numel(), device=device), to_device(pages, device),
        output_size=total,
    )
    starts = to_device(kv_indptr[:-1], device)
    cols = torch.arange(total, device=device) - starts[rows]
    kv_indices = block_table[rows, cols].to(torch.int32)
    return kv_indptr.to(torch.int32), kv_indices


class _FlashInferFARoute(DecodeRoute):
    backend: ClassVar[str]
    supports_length_sort = True
    takes_split_query = True

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        return fa_unsupported_reason(spec, platform, cls.backend)

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        self.workspace = workspace_for(device)
        self._uniform_cu = (
            torch.arange(max_batch_size + 1, dtype=torch.int32, device=device) * spec.max_q_len
        )
        # One wrapper for eager use; with cuda_graph one per batch size, each owning the
        # reserved metadata buffers its captured launches read.
        self._wrappers: dict[int, object] = {}
        self._wrapper = None
        # Length sort: row permutation (sorted row -> caller's row) and the permuted query
        # parts and output rows, all persistent so captured runs read this step's
        # permutation.
        self._sorted = False
        if self.supports_length_sort:
            rows = max_batch_size * spec.max_q_len
            out_dtype = torch.bfloat16 if spec.q_dtype == torch.float8_e4m3fn else spec.q_dtype
            self._row_ids = torch.arange(rows, dtype=torch.int64, device=device)
            self._perm_rows = torch.zeros(rows, dtype=torch.int64, device=device)
            self._q_sorted = tuple(
                torch.zeros(rows, spec.num_heads, dim, dtype=spec.q_dtype, device=device)
                for dim in (spec.kv_lora_rank, spec.rope_dim))
            self._out_sorted = torch.zeros(rows, spec.num_heads, spec.kv_lora_rank,
                                           dtype=out_dtype, device=device)

    def _wrapper_for(self, batch: DecodeBatch) -> object:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        key = batch.batch_size if self.cuda_graph else 0
        wrapper = self._wrappers.get(key)
        if wrapper is not None:
            capacity = getattr(wrapper, "_plugin_kv_indices_capacity", None)
            if capacity is not None and batch.batch_size * batch.block_table.shape[1] > capacity:
                raise ValueError(
                    f"block table of width {batch.block_table.shape[1]} is wider than the one "
                    f"first planned for batch size {batch.batch_size} with cuda_graph=True; "
                    "plan the widest block table first (vLLM's table width is fixed)"
                )
            return wrapper
        if not self.cuda_graph:
            wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend=self.backend)
        else:
            b = batch.batch_size
            capacity = b * batch.block_table.shape[1]

            def i32(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            wrapper = BatchMLAPagedAttentionWrapper(
                self.workspace,
                use_cuda_graph=True,
                qo_indptr=i32(b + 1),
                kv_indptr=i32(b + 1),
                kv_indices=i32(max(capacity, 1)),
                kv_len_arr=i32(b),
                backend=self.backend,
            )
            wrapper._plugin_kv_indices_capacity = capacity
        self._wrappers[key] = wrapper
        return wrapper

    def plan(self, batch: DecodeBatch) -> None:
        spec, b = self.spec, batch.batch_size
        # Under cuda_graph the gather/scatter path is fixed (captured); batches it cannot
        # reorder (ragged query lengths, one request) then take the identity permutation.
        self._sorted = self.sort_by_length and (self.cuda_graph or b > 1)
        reorder = self._sorted and batch.uniform_q_len and b > 1
        if batch.host_lengths:
            metadata = self._host_csr_metadata(batch, reorder)
        else:
            metadata = self._dense_metadata(batch, reorder)
        if self._sorted and not reorder:
            self._perm_rows[: batch.num_tokens].copy_(self._row_ids[: batch.num_tokens])
        wrapper = self._wrapper_for(batch)
        wrapper.plan(
            metadata=metadata,
            num_heads=spec.num_heads,
            head_dim_ckv=spec.kv_lora_rank,
            head_dim_kpe=spec.rope_dim,
            page_size=spec.block_size,
            # Fixed per spec: the mask mode is baked into captured launches.
            causal=spec.max_q_len > 1,
            sm_scale=spec.softmax_scale,
            q_data_type=spec.q_dtype,
            kv_data_type=spec.kv_dtype,
            scale_mode="kv-per-tensor" if spec.fp8_kv else "default",
            query_layout="split",
        )
        self._wrapper = wrapper

    def _query_indptr(self, batch: DecodeBatch, on_host: bool) -> torch.Tensor:
        """``[batch + 1]`` int32 query-row offsets, on the host or the device."""
        b, m = batch.batch_size, batch.max_q_len
        if not batch.uniform_q_len:
            return batch.cu_seqlens_q_host if on_host else batch.cu_seqlens_q
        if on_host:
            return torch.arange(b + 1, dtype=torch.int32) * m
        cu = self._uniform_cu[: b + 1]
        return cu if m == self.spec.max_q_len else cu // self.spec.max_q_len * m

    def _record_permutation(self, batch: DecodeBatch, perm: torch.Tensor) -> None:
        """Sorted row -> caller's row for the output scatter (``perm``: device, per request)."""
        m = batch.max_q_len
        self._perm_rows[: batch.num_tokens].copy_(
            (perm[:, None] * m + self._row_ids[:m][None, :]).flatten())

    def _dense_metadata(self, batch: DecodeBatch, reorder: bool) -> object:
        """Page-table form from device tensors; FlashInfer copies the lengths to the host
        (waiting for the GPU) and slices the table row by row in Python."""
        from flashinfer.mla import MLAPlanMetadata

        block_table, seq_lens = batch.block_table, batch.seq_lens
        if reorder:
            perm = torch.argsort(seq_lens, descending=True, stable=True)
            block_table, seq_lens = block_table[perm], seq_lens[perm]
            self._record_permutation(batch, perm)
        return MLAPlanMetadata.dense(
            cum_seq_lens_q=self._query_indptr(batch, on_host=False).to(torch.int32),
            block_tables=block_table.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            max_q_len=batch.max_q_len,
        )

    def _host_csr_metadata(self, batch: DecodeBatch, reorder: bool) -> object:
        """CSR form with the lengths and offsets on the host and the page ids gathered on
        the device: FlashInfer's planner (which runs on the host) then never waits for the
        GPU, so the engine's next step can be prepared while this one runs."""
        from flashinfer.mla import MLAPlanMetadata

        seq_lens = batch.seq_lens_host.to(torch.int32)
        block_table = batch.block_table
        if reorder:
            perm = torch.argsort(seq_lens, descending=True, stable=True)
            seq_lens = seq_lens[perm]
            perm = to_device(perm, self.device)
            block_table = block_table[perm]
            self._record_permutation(batch, perm)
        kv_indptr, kv_indices = paged_csr(block_table, seq_lens, self.spec.block_size)
        return MLAPlanMetadata.csr(
            qo_indptr=self._query_indptr(batch, on_host=True).to(torch.int32),
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_len_arr=seq_lens,
        )

    def run(
        self,
        query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scales: KVScales,
    ) -> torch.Tensor:
        if not self._sorted:
            return self._run(query, kv_cache, out, scales)
        query = split_query(query, self.spec.kv_lora_rank)
        rows = query[0].shape[0]
        perm = self._perm_rows[:rows]
        q_sorted = tuple(buf[:rows] for buf in self._q_sorted)
        for part, part_sorted in zip(query, q_sorted, strict=True):
            torch.index_select(part, 0, perm, out=part_sorted)
        out_sorted = self._out_sorted[:rows]
        self._run(q_sorted, kv_cache, out_sorted, scales)
        out.index_copy_(0, perm, out_sorted)
        return out

    def _run(
        self,
        query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scales: KVScales,
    ) -> torch.Tensor:
        if not self.spec.fp8_kv:
            check_unit_scales(self.spec, scales)
            self._wrapper.run(query=query, kv_cache=kv_cache, out=out)
            return out
        # FlashInfer dequantises the latent cache with one ckv_scale for both q.k and p.v;
        # fold q_scale into it and correct the values' scale afterwards when k != v.
        qk_scale = scales.q_scale * scales.k_scale
        self._wrapper.run(
            query=query, kv_cache=kv_cache, out=out, ckv_scale=qk_scale, kpe_scale=qk_scale
        )
        if scales.v_scale != qk_scale:
            out.mul_(scales.v_scale / qk_scale)
        return out


class FlashInferFA3Route(_FlashInferFARoute):
    name = "flashinfer-fa3"
    kernel = "FlashInfer BatchMLAPagedAttentionWrapper (fa3)"
    backend = "fa3"


class FlashInferFA2Route(_FlashInferFARoute):
    name = "flashinfer-fa2"
    kernel = "FlashInfer BatchMLAPagedAttentionWrapper (fa2)"
    backend = "fa2"
