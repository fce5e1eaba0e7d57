"""FlashMLA's dense-decode tile schedule computed in one parallel Triton program.

FlashMLA's SM90 dense decode (``dense_decode_fwd`` of vLLM's ``_flashmla_C``) takes its
split-KV work plan as two int32 tensors, or computes them itself with
``get_mla_metadata_kernel``: one warp whose first lane walks every SM part in turn
(25.8 us on the H200 at one request, docs/benchmarks.md run 78), once per step. This
kernel writes a plan with the same contract and the same load bound from prefix sums, every
part at once, so the step pays one short launch instead.

The plan. Each request ``j`` costs ``nb_j + OVERHEAD`` units (``nb_j = ceil(len_j / 64)``
KV blocks, at least one, then ``OVERHEAD`` = 5 units for the work a piece costs beyond its
blocks, FlashMLA's ``fixed_overhead_num_blocks``). Laid end to end the requests fill
``[0, T)``, request ``j`` the units ``[s_j, e_j)``; part ``i`` takes ``[i q, (i + 1) q)`` with
``q = ceil(T / parts)``. A boundary in a request's overhead units moves on to the next
request's start, so a request's last piece is never split off its overhead, every piece
holds at least one block, and no part costs more than ``q + OVERHEAD`` (blocks plus
``OVERHEAD`` per piece): FlashMLA's own bound (``payload = ceil(T / parts) + OVERHEAD``).
Request ``j`` is split at every multiple of ``q`` in ``(s_j, s_j + nb_j)``, so it has
``ceil((s_j + nb_j) / q) - floor(s_j / q)`` pieces. On uniform batches the pieces are
FlashMLA's; on random batches their count is a median 1.00 and a 90th percentile 1.03-1.04
times FlashMLA's (up to 1.4-1.7 on a few small batches; tests/flashmla_schedule_cases.py). Pieces
matter: each writes float32 partials (256 KB at 128 query rows) that a combine kernel reads.

Output layout, FlashMLA's ``DecodingSchedMeta`` (32 bytes per part; on the H200, run 81, the
bundled extension's own rows for parts with work matched its scheduler as transcribed in
tests/flashmla_schedule_cases.py, and the route on this kernel's first form passed its
float64 tests; tests/gpu/test_flashmla_schedule_gpu.py):
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


@triton.jit
def _blocks(seq_lens_ptr, idx, ok, PAGE: tl.constexpr):
    length = tl.load(seq_lens_ptr + idx, mask=ok, other=1)
    return (tl.maximum(length, 1) - 1) // PAGE + 1


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _position(ends_ptr, owner_ptr, boundary, x, total, live, batch_size, OVERHEAD: tl.constexpr):
    """Boundary ``boundary`` (at unit ``x``) as (request, block), with its request's start."""
    inside = live & (x < total)
    req = tl.load(owner_ptr + boundary, mask=inside, other=0)
    start = tl.load(ends_ptr + req - 1, mask=inside & (req > 0), other=0)
    blocks = tl.load(ends_ptr + req, mask=inside, other=0) - start - OVERHEAD
    u = x - start
    in_blocks = inside & (u < blocks)
    req = tl.where(in_blocks, req, tl.where(inside, req + 1, batch_size))
    return req, tl.where(in_blocks, u, 0), start


@triton.jit(do_not_specialize=["batch_size", "num_parts"])
def _flashmla_schedule_kernel(
    seq_lens_ptr, meta_ptr, num_splits_ptr, ends_ptr, owner_ptr, batch_size, num_parts,
    PAGE: tl.constexpr, OVERHEAD: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr,
):
    offs = tl.arange(0, CHUNK)
    # Boundary k (at unit k q) is owned by the request it falls in; -1 until scattered.
    bound = tl.arange(0, 2 * PARTS)
    tl.store(owner_ptr + bound, bound * 0 - 1, mask=bound <= num_parts)
    # Pass 1: each request's end in units (inclusive prefix sum of its cost).
    total = batch_size * 0
    for start in range(0, batch_size, CHUNK):
        idx = start + offs
        ok = idx < batch_size
        cost = tl.where(ok, _blocks(seq_lens_ptr, idx, ok, PAGE) + OVERHEAD, 0)
        tl.store(ends_ptr + idx, total + tl.cumsum(cost, axis=0), mask=ok)
        total += tl.sum(cost, axis=0)
    q = tl.maximum((total + num_parts - 1) // num_parts, 1)  # batch 0: no division by 0
    tl.debug_barrier()

    # Pass 2: pieces per request -> num_splits; each request that holds a boundary writes
    # its index at the first one (no two requests share a boundary).
    tl.store(num_splits_ptr, 0)
    splits = batch_size * 0
    for start in range(0, batch_size, CHUNK):
        idx = start + offs
        ok = idx < batch_size
        end = tl.load(ends_ptr + idx, mask=ok, other=0)
        begin = end - _blocks(seq_lens_ptr, idx, ok, PAGE) - OVERHEAD
        pieces = tl.where(ok, (end - OVERHEAD + q - 1) // q - begin // q, 0)
        tl.store(num_splits_ptr + 1 + idx, splits + tl.cumsum(pieces, axis=0), mask=ok)
        splits += tl.sum(pieces, axis=0)
        first = (begin + q - 1) // q
        tl.store(owner_ptr + first, idx, mask=ok & (first * q < end) & (first <= num_parts))
    tl.debug_barrier()
    # Later boundaries of a request inherit its index (requests are in order: running max).
    owner = tl.load(owner_ptr + bound, mask=bound <= num_parts, other=-1)
    owner = tl.associative_scan(owner, 0, _max)
    tl.debug_barrier()
    tl.store(owner_ptr + bound, owner, mask=bound <= num_parts)
    tl.debug_barrier()

    # Pass 3: part i runs from boundary i to boundary i + 1, each as (request, block); a
    # boundary in a request's overhead units moves on to the next request's start, one at
    # or past T is (batch, 0).
    part = tl.arange(0, PARTS)
    live = part < num_parts
    r_b, block_b, start_b = _position(ends_ptr, owner_ptr, part, part * q, total, live,
                                      batch_size, OVERHEAD)
    r_e, block_e, _ = _position(ends_ptr, owner_ptr, part + 1, part * q + q, total, live,
                                batch_size, OVERHEAD)
    empty = (r_b == r_e) & (block_b == block_e)

    # A part ending at a request's start ends with the whole previous request.
    work = empty == 0
    last_req = tl.where(block_e == 0, r_e - 1, r_e)
    has_last = live & work & (last_req >= 0)
    last_end = tl.load(ends_ptr + last_req, mask=has_last, other=0)
    last_start = tl.load(ends_ptr + last_req - 1, mask=has_last & (last_req > 0), other=0)
    end_block = tl.where(block_e == 0, last_end - last_start - OVERHEAD, block_e)
    # FlashMLA's flags: a part holding one request marks it split at both ends if at either.
    single = r_b == last_req
    first_split = tl.where(single, (block_b != 0) | (block_e != 0), block_b != 0)
    last_split = tl.where(single, first_split, block_e != 0)
    begin_split = tl.where(block_b != 0, part - start_b // q, 0)

    row = meta_ptr + part * 8
    tl.store(row + 0, tl.where(work, r_b, batch_size), mask=live)
    tl.store(row + 1, tl.where(work, last_req, batch_size - 1), mask=live)
    tl.store(row + 2, tl.where(work, block_b, 0), mask=live)
    tl.store(row + 3, tl.where(work, end_block, 0), mask=live)
    tl.store(row + 4, tl.where(work, begin_split, 0), mask=live)
    tl.store(row + 5, (work & first_split).to(tl.int32), mask=live)
    tl.store(row + 6, (work & last_split).to(tl.int32), mask=live)
    tl.store(row + 7, part * 0, mask=live)


def flashmla_schedule(
    seq_lens: torch.Tensor,
    tile_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    request_ends: torch.Tensor,
    boundary_owners: torch.Tensor,
    *,
    chunk: int = 128,
) -> None:
    """Fill FlashMLA's dense-decode schedule for ``seq_lens`` (one launch, capturable).

    Args:
        seq_lens: ``[batch]`` int32 on the device, KV tokens per request.
        tile_metadata: ``[num_sm_parts, 8]`` int32, written (FlashMLA's
            ``tile_scheduler_metadata``; ``num_sm_parts`` as FlashMLA derives it for the
            step's heads and query length).
        num_splits: ``[batch + 1]`` int32, written (prefix sum of pieces per request).
        request_ends: int32 scratch, at least ``batch`` entries (each request's end in
            schedule units).
        boundary_owners: int32 scratch, at least ``num_sm_parts + 1`` entries (the request
            each part boundary falls in). Separate from ``request_ends`` so that both keep
            their allocation's alignment (Triton compiles a variant per alignment).
    """
    batch = seq_lens.shape[0]
    parts = tile_metadata.shape[0]
    if tile_metadata.shape[1] != SCHED_META_INTS or num_splits.shape[0] != batch + 1:
        raise ValueError(
            f"schedule buffers [parts, {SCHED_META_INTS}] and [batch + 1] expected, got "
            f"{tuple(tile_metadata.shape)} and {tuple(num_splits.shape)} for batch {batch}"
        )
    if request_ends.numel() < batch or boundary_owners.numel() < parts + 1:
        raise ValueError(
            f"scratch of {request_ends.numel()} and {boundary_owners.numel()} int32 for "
            f"batch {batch} and {parts} parts"
        )
    _flashmla_schedule_kernel[(1,)](
        seq_lens, tile_metadata, num_splits, request_ends, boundary_owners, batch, parts,
        PAGE=FLASHMLA_PAGE, OVERHEAD=FLASHMLA_OVERHEAD_BLOCKS, CHUNK=chunk,
        PARTS=triton.next_power_of_2(parts), num_warps=4,
    )
