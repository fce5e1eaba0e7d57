"""Hopper route through vLLM's own FlashAttention-3 MLA decode (``vllm.vllm_flash_attn``,
the ``_vllm_fa3_C`` extension in the CUDA build of vllm): the kernel of vLLM's
``FLASH_ATTN_MLA`` backend, which vLLM 0.33 selects first for MLA on SM90 with a bf16 cache.

Read from vLLM 0.33.0 (``v1/attention/backends/mla/flashattn_mla.py``,
``vllm_flash_attn/flash_attn_interface.py``):

* ``flash_attn_varlen_func(q=q_pe, k=k_pe_cache, v=kv_c_cache, q_v=q_nope, ...)``: the rope
  part of query ``[tokens, heads, Dr]`` and of the cache ``[blocks, page, 1, Dr]`` form the
  scores' "K" product, the latent part (query ``[tokens, heads, Dc]``, cache
  ``[blocks, page, 1, Dc]``) both the ``q_v`` term of the scores and the values; output
  ``[tokens, heads, Dc]`` in the query's dtype. The cache halves are strided views of the one
  ``[blocks, page, Dc + Dr]`` latent cache.
* pages: any multiple of 16 tokens; bf16/fp16 only (vLLM: "FP8 FlashAttention MLA not yet
  supported").
* ``causal=True`` masks bottom-right aligned per request (``cu_seqlens_q`` gives each
  request's query rows), as ``ops.reference`` does.
* scheduling: ``get_scheduler_metadata`` (a device op on the step's lengths) in ``plan``,
  copied into a persistent buffer whose tail holds zeros (vLLM: stale entries would let spare
  thread blocks overwrite output). Eager steps let the kernel choose the number of KV
  splits. Under CUDA graphs the launch's ``num_splits`` is a cap that also sizes FA3's
  partial outputs (``[num_splits, heads, tokens, Dc]`` float32, allocated inside the
  captured graph), so it must not change between capture and replay, while the scheduler
  metadata, planned per step, may use any cap up to it (the kernel reads each request's
  splits from the metadata). vLLM uses ``GRAPH_MAX_SPLITS`` for both. This route reserves
  ``graph_split_reserve`` splits per launch (a function of the captured batch's query rows,
  so capture and replay agree: vLLM builds a replayed step's metadata for the padded batch
  it captured) and plans per step ``GRAPH_MAX_SPLITS``; for long requests with query tiles
  of at most 32 rows (``ops.policy.vllm_fa3_wide_splits``) all it reserved; for busy
  batches of short requests that FA3 would cut into one-KV-tile splits, half the longest
  request's KV tiles (``ops.policy.vllm_fa3_halved_splits``: two tiles a split, the work
  counted on the host's lengths, which vLLM's builder passes outside asynchronous
  speculation). A planned cap stays >= 2: with one split FA3's metadata leaves out the
  per-request split counts that a launch of more splits reads ("scheduler_metadata must
  have shape", run 102). Where FA3's own plan of a step would spill a second wave of work
  tiles onto a few SMs, the route writes its own per-request splits over FA3's
  (``ops.fa3_splits``, runs 153-156), from the host's exact lengths (or, with
  ``policy.VLLM_FA3_DEVICE_PLAN``, searched on the GPU from the same lengths there).
* batch order: batches of ``policy.VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` or more requests are
  launched longest first (``LengthOrder``, runs 157-158): FA3's persistent grid takes work
  tiles in batch order, and with ``seqused_q`` (which ``flash_attn_varlen_func`` does not
  pass, so the route calls the op itself) a permuted ``cu_seqlens_q`` reorders the batch
  without moving query or output rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import fa3_splits, policy
from ..platform import Platform, platform_of
from ..spec import DecodeBatch, DecodeSpec, KVScales, split_query
from .base import (
    DecodeRoute,
    StagedQueryOffsets,
    StagedTables,
    check_unit_scales,
    copy_from_host,
    module_available,
    round_up,
)

FA3_MODULE = "vllm.vllm_flash_attn.flash_attn_interface"
#: (kv_lora_rank, rope_dim) of the MLA instance compiled into vLLM's FA3 (headdim 64,
#: headdim_v 512).
FA3_MLA_DIMS = (512, 64)
#: vLLM's ``AttentionConfig.flash_attn_max_num_splits_for_cuda_graph`` default.
GRAPH_MAX_SPLITS = 32
#: KV splits a captured launch reserves room for when its batch has at most
#: ``GRAPH_WIDE_MAX_ROWS`` query rows (heads x tokens): 64 x 1024 rows x 512 float32 is
#: 128 MiB, what vLLM's cap of 32 reserves at 2048 rows (16 heads x 128 requests). A cap
#: above 32 binds only in batches of few query tiles (run 97: 128 gained at most 5% over 64
#: on long requests and lost up to 10% at 5-8k tokens).
GRAPH_WIDE_SPLITS = 64
GRAPH_WIDE_MAX_ROWS = 1024
FA3_PAGE_MULTIPLE = 16


def fa3_forward_op():
    """vLLM's FA3 forward op (``torch.ops._vllm_fa3_C.fwd``, registered by importing
    ``FA3_MODULE``), called directly where the route passes ``seqused_q``, which
    ``flash_attn_varlen_func`` does not take; its arguments in the order of that wrapper's
    own call."""
    return torch.ops._vllm_fa3_C.fwd


def graph_split_reserve(num_heads: int, num_tokens: int) -> int:
    """KV splits a captured launch of ``num_tokens`` query tokens with ``num_heads`` heads
    reserves partial outputs for (the ``num_splits`` it passes to FA3)."""
    rows = num_heads * num_tokens
    return GRAPH_WIDE_SPLITS if rows <= GRAPH_WIDE_MAX_ROWS else GRAPH_MAX_SPLITS


def fa3_scheduler_metadata_size(max_batch_size: int) -> int:
    """Entries of FA3's scheduler metadata for up to ``max_batch_size`` requests: one
    tile-count semaphore plus four int32 vectors per request rounded up to 4 (vLLM)."""
    return 1 + round_up(max_batch_size, 4) * 4


def fa3_splits_offset(batch_size: int) -> int:
    """Where FA3's per-request split counts start in its scheduler metadata (after the
    per-request query rows; ``mha_fwd_get_scheduler_metadata`` in ``hopper/flash_api.cpp``)."""
    return round_up(batch_size, 4)


def fa3_work_tiles(batch: DecodeBatch, query_tiles: int) -> int | None:
    """FA3's work tiles for ``batch`` (query tiles per request x 64-token KV tiles, summed),
    from the host's exact lengths when the batch has them, else from ``kv_tokens`` (each
    request's last KV tile counted as half full); ``None`` without either."""
    tile = policy.FA3_KV_TILE
    if batch.seq_lens_host is not None:
        # Python ints: a few us for the <= 120 requests this is counted for, where four
        # torch ops on the CPU tensor took 15-25.
        kv_tiles = sum((n + tile - 1) // tile for n in batch.seq_lens_host.tolist())
    elif batch.kv_tokens is not None:
        kv_tiles = round(batch.kv_tokens / tile + batch.batch_size / 2)
    else:
        return None
    return query_tiles * kv_tiles


def graph_splits(spec: DecodeSpec, batch: DecodeBatch, sms: int) -> tuple[int, int]:
    """(splits a captured launch reserves, cap the plan uses) for ``batch`` under CUDA
    graphs: all it reserved for long requests at narrow query tiles
    (``policy.vllm_fa3_wide_splits``), two KV tiles a split for busy batches of short
    requests (``policy.vllm_fa3_halved_splits``), else vLLM's ``GRAPH_MAX_SPLITS``."""
    reserved = graph_split_reserve(spec.num_heads, batch.num_tokens)
    if policy.vllm_fa3_wide_splits(spec, batch.max_q_len, batch.max_seq_len):
        return reserved, reserved
    planned = min(reserved, GRAPH_MAX_SPLITS)
    tiles = policy.query_tiles(spec, batch.max_q_len)
    longest = -(-batch.max_seq_len // policy.FA3_KV_TILE)
    # Every other request holds at least one KV tile: most batches are ruled out here,
    # before the host lengths are counted.
    if tiles * (longest + batch.batch_size - 1) * policy.FA3_SPLIT_MARGIN > sms:
        return reserved, planned
    work = fa3_work_tiles(batch, tiles)
    if work is not None and policy.vllm_fa3_halved_splits(
            spec, batch.max_q_len, batch.max_seq_len, work, sms):
        planned = min(planned, max(2, -(-longest // 2)))
    return reserved, planned


def graph_may_replan(spec: DecodeSpec, max_q_len: int, batch_size: int, planned: int,
                     sms: int, spill: float | None = None) -> bool:
    """Whether any lengths of a step of ``batch_size`` requests could make the route write
    its own splits under CUDA graphs (``graph_replan``): the plan has per-request splits
    (a cap ``planned`` of at least 2) and FA3's plan may spill into the band."""
    tiles = policy.query_tiles(spec, max_q_len)
    widest = fa3_splits.widest_band(spec.num_heads * max_q_len) if spill is None else spill
    return planned >= 2 and fa3_splits.may_spill(tiles * batch_size, sms, widest)


def graph_replan(spec: DecodeSpec, max_q_len: int, lens: np.ndarray, reserved: int,
                 planned: int, sms: int, spill: float | None = None) -> np.ndarray | None:
    """The splits the route writes over FA3's under CUDA graphs for a step of ``lens``
    (``[batch]`` KV lengths, host) under the cap ``planned`` of ``reserved``
    (``graph_splits``): ``fa3_splits.balanced_splits``' where the plan has per-request
    splits and FA3's may spill into the band (``spill``: the band's bound instead of
    ``fa3_splits.spill_band``'s), else ``None`` (FA3's own)."""
    if not graph_may_replan(spec, max_q_len, lens.shape[0], planned, sms, spill):
        return None
    tiles = policy.query_tiles(spec, max_q_len)
    kv_tiles = -(-lens.astype(np.int64) // policy.FA3_KV_TILE)
    return fa3_splits.balanced_splits(kv_tiles, tiles, reserved, sms,
                                      policy.query_tile_rows(spec, max_q_len), planned, spill)


class LengthOrder:
    """Persistent copies of a step's per-request tables in length order (longest first),
    for FA3 launches that read the batch in that order: FA3's persistent grid takes work
    tiles in batch order, so long requests first leave the short ones to fill the last wave
    (longest-processing-time-first list scheduling).

    FA3 reads request ``i``'s query rows at ``cu_seqlens_q[i]`` for ``seqused_q[i]`` rows
    when ``seqused_q`` is given, so a permuted offsets vector reorders the batch without
    moving query or output rows. Batches without exact host lengths, or with ragged query
    lengths, keep their order (the same buffers, so a captured launch replays either way).

    Why one packed buffer: the ordered tables of a uniform batch follow from the host's
    exact lengths (``DecodeBatch.seq_lens_host`` equals ``seq_lens``), so the host writes
    them all and one copy takes them to the device; with the block table's row gather that
    is two device operations a step, where gathering each table on the device took seven
    (run 228: the route's plan held the engine's step on the host). The same layout is
    what ``kernels.length_order`` writes in one launch when the GPU orders the batch
    (``stage(on_device=True)``).

    Attributes (views for the planned step, at fixed addresses):
        cu_seqlens_q: ``[batch + 1]`` int32, request ``order[i]``'s first query row.
        seqused_q: ``[batch]`` int32, query rows of request ``order[i]``.
        seq_lens: ``[batch]`` int32, KV length of request ``order[i]``.
        block_table: ``[batch, width]`` int32, block table row of request ``order[i]``.
        lens_host: ``[batch]`` host lengths in this order (``None`` without host lengths).
    """

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        n = self._max = max_batch_size
        # Segments at fixed offsets: offsets [n + 1], lengths [n], query rows [n], order [n].
        self._packed = torch.zeros(4 * n + 1, dtype=torch.int32, device=device)
        self._cu = self._packed[: n + 1]
        self._seq_lens = self._packed[n + 1: 2 * n + 1]
        self._q_lens = self._packed[2 * n + 1: 3 * n + 1]
        self._perm = self._packed[3 * n + 1:]
        self._table: torch.Tensor | None = None
        self.lens_host: np.ndarray | None = None

    def stage(self, batch: DecodeBatch, block_table: torch.Tensor, seq_lens: torch.Tensor,
              cu_seqlens_q: torch.Tensor, lens_host: np.ndarray | None,
              on_device: bool = False) -> None:
        """Write the step's tables in length order (or as given, see the class). With
        ``on_device`` the order of a batch the host could order is found and written on
        the GPU instead (``kernels.length_order``: the same tables in one launch); the
        host then never learns it (``lens_host`` stays ``None``)."""
        b = batch.batch_size
        width = block_table.shape[1]
        if self._table is None or self._table.shape[1] < width:
            self._table = torch.zeros(self._max, width, dtype=torch.int32,
                                      device=self._packed.device)
        self.block_table = self._table[:b, :width]
        ordered = lens_host is not None and batch.uniform_q_len and b > 1
        if ordered and on_device:
            from ..kernels.length_order import length_order

            length_order(seq_lens, block_table, batch.max_q_len, self._packed, self._table,
                         self._max)
            self.lens_host = None
        else:
            if ordered:
                order = np.argsort(-lens_host, kind="stable")
                self.lens_host = lens_host[order]
                self._stage_from_host(order, self.lens_host, batch.max_q_len)
            else:
                self.lens_host = lens_host
                torch.arange(b, out=self._perm[:b])
                torch.index_select(seq_lens, 0, self._perm[:b], out=self._seq_lens[:b])
                torch.index_select(cu_seqlens_q[:b], 0, self._perm[:b], out=self._cu[:b])
                self._cu[b:b + 1].copy_(cu_seqlens_q[b:b + 1])
                torch.index_select(torch.diff(cu_seqlens_q), 0, self._perm[:b],
                                   out=self._q_lens[:b])
            torch.index_select(block_table, 0, self._perm[:b], out=self.block_table)
        self.seq_lens = self._seq_lens[:b]
        self.cu_seqlens_q = self._cu[: b + 1]
        self.seqused_q = self._q_lens[:b]

    def _stage_from_host(self, order: np.ndarray, lens: np.ndarray, q_len: int) -> None:
        """One host-to-device copy of the ordered tables of a uniform batch of ``q_len``
        query rows a request (``order``: ``[batch]`` request indices, longest first;
        ``lens``: their lengths)."""
        n, b = self._max, order.shape[0]
        host = np.zeros(3 * n + 1 + b, dtype=np.int32)
        host[:b] = order * q_len
        host[b] = b * q_len
        host[n + 1: n + 1 + b] = lens
        host[2 * n + 1: 2 * n + 1 + b] = q_len
        host[3 * n + 1:] = order
        copy_from_host(self._packed[: host.shape[0]], host)


class VllmFA3MLARoute(DecodeRoute):
    name = "vllm-fa3-mla"
    kernel = "FlashAttention-3 MLA (vLLM bundle) flash_attn_varlen_func"
    # The kernel reads the latent and rope parts of the query as two tensors (q_v and q).
    takes_split_query = True

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.capability is None or platform.capability[0] != 9:
            return f"vLLM's FA3 MLA decode runs on SM90 only; this is {platform.describe()}"
        if not module_available(FA3_MODULE):
            return ("vllm.vllm_flash_attn is not importable (FA3 ships inside the CUDA build "
                    "of vllm)")
        if spec.q_dtype not in (torch.bfloat16, torch.float16) or spec.kv_dtype != spec.q_dtype:
            return (
                "vLLM's FA3 MLA takes bfloat16/float16 query and cache of the same dtype, got "
                f"{spec.q_dtype} / {spec.kv_dtype}; FP8 caches go to flashmla-fp8"
            )
        if (spec.kv_lora_rank, spec.rope_dim) != FA3_MLA_DIMS:
            return (
                "vLLM's FA3 MLA is compiled for kv_lora_rank 512 and rope_dim 64, got "
                f"{spec.kv_lora_rank}/{spec.rope_dim}"
            )
        if spec.block_size % FA3_PAGE_MULTIPLE:
            return (
                f"block size {spec.block_size}: vLLM's FA3 MLA needs pages of a multiple of "
                f"{FA3_PAGE_MULTIPLE} tokens; start vLLM with --block-size 64"
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

        self._fa = importlib.import_module(FA3_MODULE)
        self._tables = StagedTables(max_batch_size, device)
        #: Benchmarks: one cap on FA3's KV splits for both the plan and the launch (0: the
        #: kernel chooses, as eager steps do), instead of the rule above.
        self.max_splits_override: int | None = None
        #: Benchmarks: the plan's cap alone, bounded by what the launch reserves.
        self.planned_splits_override: int | None = None
        #: Benchmarks: write ``fa3_splits.balanced_splits`` over FA3's splits (True), keep
        #: FA3's own (False), instead of the route's rule (``None``).
        self.balanced_splits_override: bool | None = None
        #: Benchmarks: the band of FA3 plans ``balanced_splits`` replans, in waves, instead
        #: of ``fa3_splits.spill_band``'s (``math.inf``: every plan past one wave).
        self.spill_override: float | None = None
        #: Benchmarks: launch with the requests in length order (True) or as given (False)
        #: instead of ``policy.vllm_fa3_length_order``.
        self.length_order_override: bool | None = None
        #: Benchmarks: the length order and balanced splits computed on the GPU (True) or
        #: the host (False) instead of as ``policy.vllm_fa3_device_plan`` says.
        self.device_plan_override: bool | None = None
        self._split_planner = None
        self._order = LengthOrder(max_batch_size, device)
        self._ordered = False
        self._reserved_splits = self._planned_splits = 0
        self._query_offsets = StagedQueryOffsets(max_batch_size, device)
        #: FA3's scheduler metadata at a fixed address (captured launches read it). Past the
        #: step's metadata it holds zeros (vLLM: stale entries would let spare thread blocks
        #: overwrite output); only the first ``_scheduler_written`` entries were ever
        #: written, so a step zeroes only what a longer metadata left behind.
        self._scheduler = torch.zeros(fa3_scheduler_metadata_size(max_batch_size),
                                      dtype=torch.int32, device=device)
        self._scheduler_written = 0
        self._batch: DecodeBatch | None = None
        platform = platform_of(device)
        #: SMs FA3 spreads its work over (its split formula's ``num_sm``).
        self._sms = platform.sm_count or policy.HOPPER_SMS
        #: The GPU's name, which picks the band's bound (``policy.splitk_graph_min_batch``).
        self._gpu_name = platform.name

    def plan(self, batch: DecodeBatch) -> None:
        b, spec = batch.batch_size, self.spec
        self._block_table, self._seq_lens = self._tables.stage(batch)
        self._cu = cu = self._query_offsets.stage(batch)
        self._ordered = (policy.vllm_fa3_length_order(b) if self.length_order_override is None
                         else self.length_order_override)
        lens_host = None if batch.seq_lens_host is None else batch.seq_lens_host.numpy()
        on_device = self._device_plan(b)
        if self._ordered:
            self._order.stage(batch, self._block_table, self._seq_lens, cu, lens_host,
                              on_device)
            if not on_device:
                lens_host = self._order.lens_host
        self._reserved_splits, self._planned_splits = self._splits(batch)
        metadata = self._fa.get_scheduler_metadata(
            batch_size=b,
            max_seqlen_q=batch.max_q_len,
            max_seqlen_k=batch.max_seq_len,
            num_heads_q=spec.num_heads,
            num_heads_kv=1,
            headdim=spec.rope_dim,
            cache_seqlens=self._order.seq_lens if self._ordered else self._seq_lens,
            qkv_dtype=spec.kv_dtype,
            headdim_v=spec.kv_lora_rank,
            cu_seqlens_q=cu,
            page_size=spec.block_size,
            causal=True,
            num_splits=self._planned_splits,
        )
        n = metadata.shape[0]
        self._scheduler[:n].copy_(metadata)
        if n < self._scheduler_written:
            self._scheduler[n: self._scheduler_written].zero_()
        self._scheduler_written = n
        self._metadata = self._scheduler[:n]
        self._write_balanced_splits(batch, lens_host, on_device)
        self._batch = batch

    def _write_balanced_splits(self, batch: DecodeBatch, lens_host: np.ndarray | None,
                               on_device: bool) -> None:
        """Write splits per request that fill FA3's grid better than its own formula
        (``fa3_splits.balanced_splits``, searched every step: run 246 found no host time
        saved by repeating the last answer while the KV tiles stay) over FA3's, or keep
        FA3's: under CUDA graphs, where the plan has per-request splits (a cap of >= 2) and
        the host has the step's lengths (``lens_host``; in the order FA3 is launched on
        for the host's search). Searched on the host, or ``on_device`` by the GPU planner
        from the lengths FA3 reads (``_device_plan``)."""
        wanted = self.balanced_splits_override
        if wanted is None:
            wanted = self.cuda_graph and policy.VLLM_FA3_BALANCED_SPLITS
        if not wanted or lens_host is None:
            return
        b, spec = batch.batch_size, self.spec
        # FA3's metadata: each request's query rows, then its splits (what the kernel and
        # FA3's combine read), each vector padded to a multiple of 4 requests.
        offset = fa3_splits_offset(b)
        if on_device:
            if graph_may_replan(spec, batch.max_q_len, b, self._planned_splits, self._sms,
                                self.spill_override):
                if self._split_planner is None:
                    from ..kernels.fa3_split_plan import FA3SplitPlanner

                    self._split_planner = FA3SplitPlanner(self.device)
                self._split_planner.write(
                    self._order.seq_lens if self._ordered else self._seq_lens,
                    self._scheduler[offset: offset + b],
                    query_tiles=policy.query_tiles(spec, batch.max_q_len),
                    request_rows=spec.num_heads * batch.max_q_len,
                    max_splits=self._reserved_splits, sms=self._sms,
                    fa3_cap=self._planned_splits, spill=self.spill_override)
            return
        splits = graph_replan(spec, batch.max_q_len, lens_host, self._reserved_splits,
                              self._planned_splits, self._sms, self.spill_override)
        if splits is not None:
            copy_from_host(self._scheduler[offset: offset + b], splits)

    def _device_plan(self, batch_size: int) -> bool:
        """Whether the length order and balanced splits of a step of ``batch_size``
        requests are computed on the GPU (``kernels.length_order``,
        ``kernels.fa3_split_plan``; a band given as infinite keeps the host's)."""
        wanted = self.device_plan_override
        if wanted is None:
            wanted = policy.vllm_fa3_device_plan(self.spec, batch_size, self._gpu_name)
        return wanted and (self.spill_override is None or math.isfinite(self.spill_override))

    def _splits(self, batch: DecodeBatch) -> tuple[int, int]:
        """(splits the launch reserves, cap the plan uses) for ``batch``; 0 lets FA3
        choose."""
        if self.max_splits_override is not None:
            return self.max_splits_override, self.max_splits_override
        if not self.cuda_graph:
            return 0, 0
        if self.planned_splits_override is not None:
            reserved = graph_split_reserve(self.spec.num_heads, batch.num_tokens)
            return reserved, min(reserved, self.planned_splits_override)
        return graph_splits(self.spec, batch, self._sms)

    def run(
        self,
        query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scales: KVScales,
    ) -> torch.Tensor:
        check_unit_scales(self.spec, scales)
        batch, spec = self._batch, self.spec
        dc = spec.kv_lora_rank
        q_latent, q_rope = split_query(query, dc)
        cache = kv_cache.unsqueeze(-2)
        if self._ordered:
            order = self._order
            # vLLM's wrapper passes no ``seqused_q``; with it each request's rows start at
            # ``cu_seqlens_q[i]`` in any order, so the kernel reads the batch in length order.
            fa3_forward_op()(
                q_rope, cache[..., dc:], cache[..., :dc], None, None, q_latent, out,
                order.cu_seqlens_q, None, None, order.seqused_q, order.seq_lens,
                batch.max_q_len, batch.max_seq_len, order.block_table, None, None, None,
                None, None, None, None, None, spec.softmax_scale, True, -1, -1, 0.0, True,
                self._metadata, self._reserved_splits, None, 0, None, 1, 0, None,
            )
            return out
        self._fa.flash_attn_varlen_func(
            q=q_rope,
            k=cache[..., dc:],
            v=cache[..., :dc],
            q_v=q_latent,
            max_seqlen_q=batch.max_q_len,
            cu_seqlens_q=self._cu,
            max_seqlen_k=batch.max_seq_len,
            seqused_k=self._seq_lens,
            block_table=self._block_table,
            softmax_scale=spec.softmax_scale,
            causal=True,
            out=out,
            fa_version=3,
            scheduler_metadata=self._metadata,
            num_splits=self._reserved_splits,
        )
        return out
