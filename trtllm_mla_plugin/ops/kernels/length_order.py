"""A decode step's per-request tables in length order (longest first), written on the GPU in
one launch: what ``routes.vllm_fa3_mla.LengthOrder`` otherwise builds on the host from the
step's host lengths (a stable argsort, a packed array and its copy, then a device gather of
the block table's rows), the second-largest part of that route's plan after its splits
search (run 233b: ~75 us of 272 at 128 requests on the H200's host).

Each program takes one request: its rank is the number of requests longer than it, or as
long and earlier in the batch (the position a stable sort longest first gives it), and it
writes its entries at that rank and copies its block-table row there. No sort, no barrier:
the ranks of a batch are a permutation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Block-table columns a program copies per pass.
TABLE_CHUNK = 256


@triton.jit(do_not_specialize=["batch", "max_batch", "q_len", "width", "table_stride",
                               "ordered_stride"])
def _length_order_kernel(
    seq_lens_ptr, table_ptr, table_stride, packed_ptr, ordered_ptr, ordered_stride,
    batch, max_batch, q_len, width,
    BLOCK_B: tl.constexpr, CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + offs, mask=offs < batch, other=-1)
    mine = tl.load(seq_lens_ptr + i)
    ahead = (lens > mine) | ((lens == mine) & (offs < i))
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    # Packed segments (LengthOrder): offsets [max_batch + 1], lengths, query rows, order.
    tl.store(packed_ptr + rank, i * q_len)
    tl.store(packed_ptr + max_batch + 1 + rank, mine)
    tl.store(packed_ptr + 2 * max_batch + 1 + rank, q_len)
    tl.store(packed_ptr + 3 * max_batch + 1 + rank, i)
    last = tl.arange(0, 1)
    tl.store(packed_ptr + batch + last, batch * q_len + last, mask=last + i == 0)
    src = table_ptr + i.to(tl.int64) * table_stride
    dst = ordered_ptr + rank.to(tl.int64) * ordered_stride
    for start in range(0, width, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        tl.store(dst + cols, tl.load(src + cols, mask=cols < width), mask=cols < width)


def length_order(seq_lens: torch.Tensor, block_table: torch.Tensor, q_len: int,
                 packed: torch.Tensor, ordered_table: torch.Tensor, max_batch: int) -> None:
    """Write a uniform batch's tables longest first (ties in batch order), one launch.

    Args:
        seq_lens: ``[batch]`` int32 on the device, KV tokens per request.
        block_table: ``[batch, width]`` int32, rows of unit column stride.
        q_len: query rows of every request.
        packed: ``[4 * max_batch + 1]`` int32, written at fixed offsets as
            ``LengthOrder`` lays it out: query offsets ``[batch + 1]`` from 0, lengths from
            ``max_batch + 1``, query rows from ``2 * max_batch + 1``, request indices from
            ``3 * max_batch + 1``, each in length order.
        ordered_table: ``[>= batch, >= width]`` int32, row ``r`` written with the block-table
            row of the request ranked ``r``.
        max_batch: the packed segments' stride (and the one batch bound the program is
            compiled for, so a decoder compiles it once).
    """
    batch, width = block_table.shape
    if (seq_lens.shape[0] != batch or batch > max_batch or packed.numel() < 4 * max_batch + 1
            or block_table.stride(1) != 1 or ordered_table.stride(1) != 1
            or ordered_table.shape[0] < batch or ordered_table.shape[1] < width):
        raise ValueError(f"length_order: lengths {tuple(seq_lens.shape)}, table "
                         f"{tuple(block_table.shape)}, packed {packed.numel()}, ordered table "
                         f"{tuple(ordered_table.shape)} for up to {max_batch} requests")
    _length_order_kernel[(batch,)](
        seq_lens, block_table, block_table.stride(0), packed, ordered_table,
        ordered_table.stride(0), batch, max_batch, q_len, width,
        BLOCK_B=triton.next_power_of_2(max_batch), CHUNK=TABLE_CHUNK,
    )
