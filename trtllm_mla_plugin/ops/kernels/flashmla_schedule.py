"""FlashMLA's dense-decode tile schedule computed in one Triton program.

FlashMLA's SM90 dense decode (``dense_decode_fwd`` of vLLM's ``_flashmla_C``) takes its
split-KV work plan as two int32 tensors, or computes them itself with
``get_mla_metadata_kernel``: one warp whose first lane walks every SM part in turn, once
per step (9-91 us on the H200, docs/benchmarks-history.md run 85). This kernel writes the same plan
(equal in every field FlashMLA's kernels read; tests/flashmla_schedule_cases.py,
tests/gpu/test_flashmla_schedule_gpu.py) in 3-34 us (run 84). With ``fp8_layout`` it writes
the plan of FlashMLA's dense FP8 scheduler instead (``get_mla_decoding_metadata_dense_fp8``,
4-66 us per step; the same walk in an older row layout; run 86).

The plan. Each request ``j`` costs ``nb_j + OVERHEAD`` units (``nb_j = ceil(len_j / 64)``
KV blocks, at least one for the bf16 scheduler and none for a zero-length request in the
FP8 one, then ``OVERHEAD`` = 5 units, FlashMLA's ``fixed_overhead_num_blocks``). Laid
end to end the requests fill ``[0, T)``, request ``j`` the units ``[s_j, e_j)``, blocks
first. With ``q = ceil(T / parts)`` (FlashMLA's payload
less its overhead), FlashMLA's walk gives part ``i + 1`` the start ``snap(x_i + q)``, where
``snap`` moves a point in a request's overhead units to its end (the request fits whole)
and leaves any other point (a split among its blocks, or a request start). So boundaries
lie on a grid ``a + m q`` anchored at the last request end that a grid point snapped to.
A walk over the requests, chunk by chunk, finds those anchors (a step per anchor: the
first request past the anchor whose overhead holds a grid point, by one min-reduction);
then whether a part starts at a request's start, its split points (grid points among its
blocks), whether it snaps, its pieces and the index of its first boundary are closed
forms, and every part reads its two boundaries.

Output layout, FlashMLA's ``DecodingSchedMeta`` (32 bytes per part; on the H200, run 84,
this kernel's rows equal the bundled extension's own for every part with work, and the
route on them passes its float64 tests; tests/gpu/test_flashmla_schedule_gpu.py):
``[begin_req, end_req, begin_block, end_block, begin_split, first_split, last_split, 0]``
with ``end_req`` inclusive and ``end_block`` exclusive; a part with no work has
``begin_req = batch`` (the kernel returns at once for it). ``num_splits[batch + 1]`` is the
prefix sum of pieces per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: FlashMLA's KV page (``block_size_n``) and per-request cost in blocks
#: (``fixed_overhead_num_blocks``) of its dense decode scheduler.
FLASHMLA_PAGE = 64
FLASHMLA_OVERHEAD_BLOCKS = 5
#: int32 fields per part in ``DecodingSchedMeta``.
SCHED_META_INTS = 8
#: Rows of the kernel's per-request scratch (end, grid anchor, first boundary).
REQUEST_SCRATCH_ROWS = 3
_NO_HIT = tl.constexpr(2**31 - 1)


@triton.jit
def _blocks(seq_lens_ptr, idx, ok, PAGE: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    length = tl.load(seq_lens_ptr + idx, mask=ok, other=1)
    if MIN_BLOCKS == 1:
        length = tl.maximum(length, 1)
    return (length + PAGE - 1) // PAGE


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _request_boundaries(start, end, anchor, q, OVERHEAD: tl.constexpr):
    """Request ``[start, end)`` (blocks, then ``OVERHEAD`` units) under the grid
    ``anchor + m q``, ``m >= 1``: whether a part starts at its start (a grid point there,
    blocks to run), its split points (grid points among its blocks), and whether a part ends
    at its end (a grid point among its overhead units, snapped to ``end``: the grid
    re-anchors there)."""
    blocks = end - start - OVERHEAD
    starts_part = (start > anchor) & ((start - anchor) % q == 0) & (blocks > 0)
    n_split = tl.where(blocks > 0, (start + blocks - 1 - anchor) // q - (start - anchor) // q,
                       0)
    back = (end - 1 - anchor) % q
    snaps = (back < OVERHEAD) & (end - 1 - back > anchor)
    return starts_part, n_split, snaps


@triton.jit
def _next_anchor(ok, end, phase, anchor, q, OVERHEAD: tl.constexpr):
    """The smallest request end past ``anchor`` whose overhead units hold a grid point
    ``anchor + m q`` after the anchor (``phase = end % q``), or ``_NO_HIT``."""
    back = phase - 1 - anchor % q
    back = tl.where(back < 0, back + q, back)
    hit = ok & (end > anchor) & (back < OVERHEAD) & (end - 1 - back > anchor)
    return tl.min(tl.where(hit, end, _NO_HIT), axis=0)


@triton.jit
def _boundary(k, live, ends_ptr, anchors_ptr, firsts_ptr, owner_ptr, q, batch_size,
              OVERHEAD: tl.constexpr):
    """Part boundary ``k`` as (request, block, piece index): boundary 0 is the batch's
    start; a request's boundaries are its start (if a part starts there), its split points,
    then its end (the next request's start) if it snaps; past the last boundary,
    ``(batch, 0, 0)``."""
    req = tl.load(owner_ptr + k, mask=live & (k > 0), other=-1)
    has = live & (req >= 0)
    start = tl.load(ends_ptr + req - 1, mask=has & (req > 0), other=0)
    end = tl.load(ends_ptr + req, mask=has, other=OVERHEAD)
    anchor = tl.load(anchors_ptr + req, mask=has, other=0)
    t = k - tl.load(firsts_ptr + req, mask=has, other=0)
    starts_part, n_split, snaps = _request_boundaries(start, end, anchor, q, OVERHEAD)
    u = t - starts_part.to(tl.int32)
    at_start = has & starts_part & (t == 0)
    split = has & (u >= 0) & (u < n_split)
    at_end = has & (u == n_split) & snaps
    point = anchor + ((start - anchor) // q + 1 + u) * q
    req = tl.where(at_start | split, req,
                   tl.where(at_end, req + 1, tl.where(k == 0, 0, batch_size)))
    return req, tl.where(split, point - start, 0), tl.where(split, u + 1, 0)


@triton.jit(do_not_specialize=["batch_size", "num_parts"])
def _flashmla_schedule_kernel(
    seq_lens_ptr, meta_ptr, num_splits_ptr, scratch_ptr, scratch_stride, owner_ptr,
    batch_size, num_parts,
    PAGE: tl.constexpr, OVERHEAD: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr,
    FP8_LAYOUT: tl.constexpr,
):
    # The dense FP8 scheduler counts a zero-length request as no blocks, the bf16 one as one.
    MIN_BLOCKS: tl.constexpr = 0 if FP8_LAYOUT else 1
    ends_ptr = scratch_ptr
    anchors_ptr = scratch_ptr + scratch_stride
    firsts_ptr = scratch_ptr + 2 * scratch_stride
    offs = tl.arange(0, CHUNK)
    bound = tl.arange(0, 2 * PARTS)
    tl.store(owner_ptr + bound, bound * 0 - 1, mask=bound <= num_parts)
    # Pass 1: each request's end in units (inclusive prefix sum of its cost).
    total = batch_size * 0
    for start in range(0, batch_size, CHUNK):
        idx = start + offs
        ok = idx < batch_size
        cost = tl.where(ok, _blocks(seq_lens_ptr, idx, ok, PAGE, MIN_BLOCKS) + OVERHEAD, 0)
        tl.store(ends_ptr + idx, total + tl.cumsum(cost, axis=0), mask=ok)
        total += tl.sum(cost, axis=0)
    q = tl.maximum((total + num_parts - 1) // num_parts, 1)  # batch 0: no division by 0
    tl.debug_barrier()

    # Pass 2, request by request: the grid's anchor (the last request end it snapped to),
    # each request's boundaries and pieces -> num_splits, and the index of its first
    # boundary; a request holding a boundary writes its index there.
    tl.store(num_splits_ptr, 0)
    anchor = batch_size * 0
    splits = batch_size * 0
    bounds = batch_size * 0 + 1  # boundary 0 is the batch's start
    for start in range(0, batch_size, CHUNK):
        idx = start + offs
        ok = idx < batch_size
        end = tl.load(ends_ptr + idx, mask=ok, other=0)
        # The first request past the anchor whose overhead units hold a grid point after
        # the anchor (its end is the smallest such) re-anchors the grid for the requests
        # after it. Phases (units mod q) keep the division out of the loop.
        phase = end % q
        lane_anchor = offs * 0
        first = _next_anchor(ok, end, phase, anchor, q, OVERHEAD)
        while first < _NO_HIT:
            lane_anchor = tl.where((end > anchor) & (end <= first), anchor, lane_anchor)
            anchor = first
            first = _next_anchor(ok, end, phase, anchor, q, OVERHEAD)
        lane_anchor = tl.where(end > anchor, anchor, lane_anchor)
        tl.store(anchors_ptr + idx, lane_anchor, mask=ok)

        begin = end - _blocks(seq_lens_ptr, idx, ok, PAGE, MIN_BLOCKS) - OVERHEAD
        starts_part, n_split, snaps = _request_boundaries(begin, end, lane_anchor, q,
                                                          OVERHEAD)
        pieces = tl.where(ok, n_split + 1, 0)
        tl.store(num_splits_ptr + 1 + idx, splits + tl.cumsum(pieces, axis=0), mask=ok)
        splits += tl.sum(pieces, axis=0)
        held = tl.where(ok, starts_part.to(tl.int32) + n_split + snaps.to(tl.int32), 0)
        firsts = bounds + tl.cumsum(held, axis=0) - held
        tl.store(firsts_ptr + idx, firsts, mask=ok)
        tl.store(owner_ptr + firsts, idx, mask=ok & (held > 0) & (firsts <= num_parts))
        bounds += tl.sum(held, axis=0)
    tl.debug_barrier()
    # Later boundaries of a request inherit its index (requests are in order: running max).
    owner = tl.load(owner_ptr + bound, mask=bound <= num_parts, other=-1)
    owner = tl.associative_scan(owner, 0, _max)
    tl.debug_barrier()
    tl.store(owner_ptr + bound, owner, mask=bound <= num_parts)
    tl.debug_barrier()

    # Pass 3: part i runs from boundary i to boundary i + 1.
    part = tl.arange(0, PARTS)
    live = part < num_parts
    r_b, block_b, split_b = _boundary(part, live, ends_ptr, anchors_ptr, firsts_ptr,
                                      owner_ptr, q, batch_size, OVERHEAD)
    r_e, block_e, _ = _boundary(part + 1, live, ends_ptr, anchors_ptr, firsts_ptr,
                                owner_ptr, q, batch_size, OVERHEAD)
    work = live & (r_b < batch_size)
    # A part ending at a request's start ends with the whole previous request.
    last_req = tl.where(block_e == 0, r_e - 1, r_e)
    last_len = tl.load(seq_lens_ptr + last_req, mask=live & (last_req >= 0), other=0)
    row = meta_ptr + part * 8
    if FP8_LAYOUT:
        # [begin_idx, begin_seqlen, end_idx, end_seqlen, begin_n_split_idx], in tokens;
        # a part without work as FlashMLA writes it (begin_idx = batch, end_idx = batch - 1).
        tl.store(row + 0, r_b, mask=live)
        tl.store(row + 1, block_b * PAGE, mask=live)
        tl.store(row + 2, last_req, mask=live)
        tl.store(row + 3, tl.where(block_e == 0, last_len, block_e * PAGE), mask=live)
        tl.store(row + 4, split_b, mask=live)
        tl.store(row + 5, part * 0, mask=live)
        tl.store(row + 6, part * 0, mask=live)
    else:
        has_last = work & (last_req >= 0)
        last_end = tl.load(ends_ptr + last_req, mask=has_last, other=0)
        last_start = tl.load(ends_ptr + last_req - 1, mask=has_last & (last_req > 0),
                             other=0)
        # A zero-length request (a CUDA-graph padding slot) is scheduled as one block but,
        # as FlashMLA writes it, ends at block 0.
        whole = tl.where(last_len == 0, 0, last_end - last_start - OVERHEAD)
        end_block = tl.where(block_e == 0, whole, block_e)
        # FlashMLA's flags: a part holding one request marks it split at both ends if at
        # either.
        single = r_b == last_req
        first_split = tl.where(single, (block_b != 0) | (block_e != 0), block_b != 0)
        last_split = tl.where(single, first_split, block_e != 0)
        tl.store(row + 0, tl.where(work, r_b, batch_size), mask=live)
        tl.store(row + 1, tl.where(work, last_req, batch_size - 1), mask=live)
        tl.store(row + 2, tl.where(work, block_b, 0), mask=live)
        tl.store(row + 3, tl.where(work, end_block, 0), mask=live)
        tl.store(row + 4, tl.where(work, split_b, 0), mask=live)
        tl.store(row + 5, (work & first_split).to(tl.int32), mask=live)
        tl.store(row + 6, (work & last_split).to(tl.int32), mask=live)
    tl.store(row + 7, part * 0, mask=live)


def flashmla_schedule(
    seq_lens: torch.Tensor,
    tile_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    request_scratch: torch.Tensor,
    boundary_owners: torch.Tensor,
    *,
    fp8_layout: bool = False,
    overhead_blocks: int = FLASHMLA_OVERHEAD_BLOCKS,
    chunk: int = 128,
    num_warps: int = 4,
) -> None:
    """Fill FlashMLA's dense-decode schedule for ``seq_lens`` (one launch, capturable).

    Args:
        seq_lens: ``[batch]`` int32 on the device, KV tokens per request.
        tile_metadata: ``[num_sm_parts, 8]`` int32, written (FlashMLA's
            ``tile_scheduler_metadata``; ``num_sm_parts`` as FlashMLA derives it for the
            step's heads and query length).
        num_splits: ``[batch + 1]`` int32, written (prefix sum of pieces per request).
        request_scratch: ``[REQUEST_SCRATCH_ROWS, >= batch]`` int32 scratch (per request:
            its end in schedule units, the grid's anchor at it, its first boundary).
        boundary_owners: int32 scratch, at least ``num_sm_parts + 1`` entries (the request
            holding each part boundary). Separate from ``request_scratch`` so that both keep
            their allocation's alignment (Triton compiles a variant per alignment).
        fp8_layout: the schedule of FlashMLA's dense FP8 kernel
            (``get_mla_decoding_metadata_dense_fp8`` of vLLM's ``_flashmla_extension_C``)
            instead: rows ``[begin_idx, begin_seqlen, end_idx, end_seqlen, begin_split, 0,
            0, 0]`` in tokens, a zero-length request counted as no blocks.
        overhead_blocks: the cost of a request (a piece of one) in blocks beside its KV
            blocks; FlashMLA's scheduler uses 5 (``FLASHMLA_OVERHEAD_BLOCKS``), the plan
            FlashMLA's kernels were tuned with. A larger cost splits fewer requests (a grid
            point then falls in a request's overhead more often and snaps to its end), so
            fewer partial results go to FlashMLA's combine kernel; any value >= 1 gives a
            schedule FlashMLA's kernels compute correctly with. The benchmark
            (``bench_flashmla_schedule.py --sections overhead``) times other values.
        chunk, num_warps: requests per step of the request walk, and the program's warps.
    """
    batch = seq_lens.shape[0]
    parts = tile_metadata.shape[0]
    if overhead_blocks < 1:
        raise ValueError(f"overhead_blocks must be at least 1, got {overhead_blocks}")
    if tile_metadata.shape[1] != SCHED_META_INTS or num_splits.shape[0] != batch + 1:
        raise ValueError(
            f"schedule buffers [parts, {SCHED_META_INTS}] and [batch + 1] expected, got "
            f"{tuple(tile_metadata.shape)} and {tuple(num_splits.shape)} for batch {batch}"
        )
    if (request_scratch.dim() != 2 or request_scratch.shape[0] != REQUEST_SCRATCH_ROWS
            or request_scratch.shape[1] < batch or request_scratch.stride(1) != 1
            or boundary_owners.numel() < parts + 1):
        raise ValueError(
            f"scratch [{REQUEST_SCRATCH_ROWS}, >= {batch}] and >= {parts + 1} int32 "
            f"expected, got {tuple(request_scratch.shape)} and {boundary_owners.numel()}"
        )
    _flashmla_schedule_kernel[(1,)](
        seq_lens, tile_metadata, num_splits, request_scratch, request_scratch.stride(0),
        boundary_owners, batch, parts,
        PAGE=FLASHMLA_PAGE, OVERHEAD=overhead_blocks, CHUNK=chunk,
        PARTS=triton.next_power_of_2(parts), FP8_LAYOUT=fp8_layout, num_warps=num_warps,
    )
