"""Page-balanced split-KV MLA decode in Triton: every CTA reads the same number of KV pages.

Why: FlashInfer's FA3 planner and vLLM's Triton kernel split each *request*; on ragged
batches the CTA holding a long request finishes last (docs/benchmarks-history.md, "The ragged
gap"). Here the batch's pages are laid end to end (request 0's pages, then request 1's, ...)
and cut into equal ranges, one per CTA, as FlashMLA's scheduler does, but computed from a
``[batch + 1]`` page prefix sum alone so it stays valid under CUDA graphs. The grid has
``num_ctas`` CTAs; small batches give pages to fewer of them (``min_pages`` each at least)
so fewer partial results need merging.

A CTA walks the requests its range touches. A request that lies wholly inside one CTA's
range is written to the output directly; a request cut by range borders leaves one partial
result (output normalised by its own softmax sum, plus the base-2 log-sum-exp) per CTA it
touches, and ``_merge_partials_kernel`` combines them. A CTA has at most two cut requests
(its first and its last), so partial slots are ``[num_ctas, 2, ...]``.

Row ``t`` of a request with ``L`` keys and ``n`` query rows sees keys ``< L - n + t + 1``
(bottom-right causal), as ``ops.reference``. The cache may be FP8 e4m3: tiles are widened
to the query's dtype in registers, ``k_scale`` folds into the score scale and ``v_scale``
into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
#: The decode kernel's last compiled variant (benchmarks read its registers, spills, PTX).
last_compiled = None


@triton.jit
def _find_segment(prefix_ptr, value, count, SEARCH_STEPS: tl.constexpr):
    """The ``i`` with ``prefix[i] <= value < prefix[i + 1]`` (``prefix`` non-decreasing,
    ``count + 1`` entries, ``prefix[0] <= value < prefix[count]``); binary search."""
    lo = value * 0
    hi = lo + count
    for _ in tl.static_range(SEARCH_STEPS):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        right = tl.load(prefix_ptr + mid) <= value
        lo = tl.where(active & right, mid, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    return lo


@triton.jit
def _partial_row(cta, slot, t, heads, num_heads, MAX_Q: tl.constexpr):
    """Row of a partial result in the ``[num_ctas, 2, MAX_Q, heads]`` scratch; slot 0 holds
    the cut request a CTA's range starts in, slot 1 the one it ends in."""
    return ((cta * 2 + slot) * MAX_Q + t).to(tl.int64) * num_heads + heads


@triton.jit
def _active_ctas(total_pages, num_ctas, min_pages):
    """CTAs that get pages: at most ``num_ctas``, each with ``min_pages`` or more (small
    batches use fewer CTAs, so fewer partial results to merge)."""
    return tl.maximum(tl.minimum(num_ctas, (total_pages + min_pages - 1) // min_pages), 1)


@triton.jit
def _cta_pages(page_start_ptr, batch_size, num_ctas, min_pages, cta,
               SEARCH_STEPS: tl.constexpr):
    """This CTA's share of the batch's pages, ``[p_begin, p_end)``, and the request the
    share starts in."""
    total_pages = tl.load(page_start_ptr + batch_size).to(tl.int64)
    ctas = _active_ctas(total_pages, num_ctas, min_pages)
    p_begin = tl.minimum((cta * total_pages) // ctas, total_pages)
    p_end = tl.minimum(((cta + 1) * total_pages) // ctas, total_pages)
    req = _find_segment(page_start_ptr, p_begin, batch_size, SEARCH_STEPS)
    return p_begin, p_end, req


@triton.jit
def _segment(page_start_ptr, seq_lens_ptr, cu_q_ptr, req, p, p_end, PAGE: tl.constexpr):
    """Request ``req``'s part of a CTA's pages from page ``p``: its page bounds, the end of
    the part (``seg_p1``), its query rows (``q0``, ``q_len``) and the part's KV tokens
    ``[tok_lo, tok_hi)``."""
    req_p0 = tl.load(page_start_ptr + req).to(tl.int64)
    req_p1 = tl.load(page_start_ptr + req + 1).to(tl.int64)
    seg_p1 = tl.minimum(req_p1, p_end)
    seq_len = tl.load(seq_lens_ptr + req)
    q0 = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q0
    tok_lo = (p - req_p0) * PAGE
    tok_hi = tl.minimum((seg_p1 - req_p0) * PAGE, seq_len)
    return req_p0, req_p1, seg_p1, seq_len, q0, q_len, tok_lo, tok_hi


@triton.jit(do_not_specialize=["batch_size", "num_heads", "num_ctas", "min_pages"])
def _balanced_decode_kernel(
    q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr, page_start_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    batch_size, num_heads, num_ctas, min_pages,
    stride_q_row, stride_q_head,
    stride_kv_block, stride_kv_token,
    stride_bt,
    stride_out_row, stride_out_head,
    qk_scale_log2, v_scale,
    DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, MAX_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    head_tile = tl.program_id(0)
    cta = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_H * MAX_Q
    rows = tl.arange(0, ROWS)
    row_t = rows // BLOCK_H
    row_h = head_tile * BLOCK_H + rows % BLOCK_H
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)

    p_begin, p_end, req = _cta_pages(page_start_ptr, batch_size, num_ctas, min_pages, cta,
                                     SEARCH_STEPS)
    p = p_begin
    while p < p_end:
        req_p0, req_p1, seg_p1, seq_len, q0, q_len, tok_lo, tok_hi = _segment(
            page_start_ptr, seq_lens_ptr, cu_q_ptr, req, p, p_end, PAGE)

        row_ok = (row_t < q_len) & (row_h < num_heads)
        q_rows = (q0 + row_t).to(tl.int64) * stride_q_row + row_h * stride_q_head
        q_c = tl.load(q_ptr + q_rows[:, None] + offs_c[None, :], mask=row_ok[:, None], other=0.0)
        q_r = tl.load(q_ptr + q_rows[:, None] + DC + offs_r[None, :], mask=row_ok[:, None],
                      other=0.0)
        visible = seq_len - q_len + row_t + 1

        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DC], tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        for start in range(tok_lo, tok_hi, BLOCK_N):
            block = tl.load(bt_row + start // PAGE).to(tl.int64)
            tokens = start + offs_n
            in_page = (start % PAGE) + offs_n
            kv_rows = kv_ptr + block * stride_kv_block + in_page.to(tl.int64) * stride_kv_token
            tok_ok = tokens < tok_hi
            k_c = tl.load(kv_rows[:, None] + offs_c[None, :], mask=tok_ok[:, None], other=0.0)
            k_r = tl.load(kv_rows[:, None] + DC + offs_r[None, :], mask=tok_ok[:, None],
                          other=0.0)
            k_c = k_c.to(q_c.dtype)
            k_r = k_r.to(q_c.dtype)
            s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
            s = s * qk_scale_log2
            s = tl.where(tokens[None, :] < visible[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            prob = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, 1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(k_c.dtype), k_c)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        whole = (p == req_p0) & (seg_p1 == req_p1)
        if whole:
            out_rows = (q0 + row_t).to(tl.int64) * stride_out_row + row_h * stride_out_head
            tl.store(out_ptr + out_rows[:, None] + offs_c[None, :],
                     (o * v_scale).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            part = _partial_row(cta, tl.where(p == p_begin, 0, 1), row_t, row_h, num_heads, MAX_Q)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)
            tl.store(part_out_ptr + part[:, None] * DC + offs_c[None, :], o,
                     mask=row_ok[:, None])
        p = seg_p1
        req += 1


@triton.jit(do_not_specialize=["batch_size", "num_heads", "num_ctas", "min_pages"])
def _merge_partials_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, cu_q_ptr, page_start_ptr,
    batch_size, num_heads, num_ctas, min_pages,
    stride_out_row, stride_out_head, v_scale,
    DC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, MAX_Q: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    head_tile = tl.program_id(0)
    row = tl.program_id(1)
    col_tile = tl.program_id(2)
    req = _find_segment(cu_q_ptr, row, batch_size, SEARCH_STEPS)
    t = row - tl.load(cu_q_ptr + req)
    # At least 1: a batch of empty (padding) requests has no pages and no partials.
    total_pages = tl.maximum(tl.load(page_start_ptr + batch_size).to(tl.int64), 1)
    ctas = _active_ctas(total_pages, num_ctas, min_pages)
    req_p0 = tl.load(page_start_ptr + req).to(tl.int64)
    req_p1 = tl.load(page_start_ptr + req + 1).to(tl.int64)
    # The CTA whose range holds page p: the largest c with c * total // ctas <= p.
    first = ((req_p0 + 1) * ctas - 1) // total_pages
    last = (req_p1 * ctas - 1) // total_pages
    if last > first:
        heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_heads
        cols = col_tile * BLOCK_C + tl.arange(0, BLOCK_C)
        m = tl.full([BLOCK_H], -1.0e30, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        weight_sum = tl.zeros([BLOCK_H], tl.float32)
        for cta in range(first, last + 1):
            # A CTA with an empty range (more CTAs than pages) wrote no partial.
            begin = (cta * total_pages) // ctas
            # Slot 1 when the CTA's range starts before the request (the request is its last).
            part = _partial_row(cta, tl.where(begin < req_p0, 1, 0), t, heads, num_heads, MAX_Q)
            has_pages = heads * 0 + begin < ((cta + 1) * total_pages) // ctas
            lse = tl.load(part_lse_ptr + part, mask=head_ok & has_pages, other=float("-inf"))
            o = tl.load(part_out_ptr + part[:, None] * DC + cols[None, :],
                        mask=(head_ok & has_pages & (lse > float("-inf")))[:, None],
                        other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + w[:, None] * o
            weight_sum = weight_sum * alpha + w
            m = m_new
        acc = acc / tl.where(weight_sum > 0.0, weight_sum, 1.0)[:, None]
        out_rows = row.to(tl.int64) * stride_out_row + heads * stride_out_head
        tl.store(out_ptr + out_rows[:, None] + cols[None, :],
                 (acc * v_scale).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


def balanced_mla_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    page_start: torch.Tensor,
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    *,
    kv_lora_rank: int,
    max_q_len: int,
    block_h: int,
    num_ctas: int,
    min_pages: int,
    search_steps: int,
    softmax_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Launch the decode and merge kernels.

    Args:
        query: ``[num_tokens, heads, Dc + Dr]`` bf16/fp16 (real values; fold a query scale
            into ``softmax_scale``), rows grouped by request as ``cu_seqlens_q`` says.
        kv_cache: ``[num_blocks, page, Dc + Dr]``, the query's dtype or FP8 e4m3; the last
            dim contiguous.
        block_table: ``[batch, max_blocks]`` int32.
        seq_lens: ``[batch]`` int32, keys per request including its query tokens.
        cu_seqlens_q: ``[batch + 1]`` int32 query-row offsets (``max_q_len`` at most each).
        page_start: ``[batch + 1]`` int32 prefix sum of ``ceil(seq_lens / page)``.
        out: ``[num_tokens, heads, Dc]`` output in the query's dtype; last dim contiguous.
        part_out: ``[num_ctas * 2 * max_q_len * heads * Dc]`` float32 scratch.
        part_lse: ``[num_ctas * 2 * max_q_len * heads]`` float32 scratch.
        block_h: heads per CTA (power of two); ``block_h * max_q_len`` rows per tile,
            ``max_q_len`` a power of two here (pad it up).
        num_ctas: most CTAs the pages are spread over (fixed per decoder, so graphs can
            replay); fewer when the batch has under ``min_pages`` pages per CTA.
        search_steps: binary-search steps over ``batch + 1`` offsets, at least
            ``max_batch.bit_length() + 1`` (fixed per decoder: it is compiled in).
    """
    batch = seq_lens.shape[0]
    _, heads, head_dim = query.shape
    page = kv_cache.shape[1]
    head_tiles = triton.cdiv(heads, block_h)
    global last_compiled
    last_compiled = _balanced_decode_kernel[(head_tiles, num_ctas)](
        query, kv_cache, block_table, seq_lens, cu_seqlens_q, page_start,
        out, part_out, part_lse,
        batch, heads, num_ctas, min_pages,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        softmax_scale * k_scale * LOG2E, v_scale,
        DC=kv_lora_rank, DR=head_dim - kv_lora_rank, PAGE=page, BLOCK_N=block_n,
        BLOCK_H=block_h, MAX_Q=max_q_len, SEARCH_STEPS=search_steps,
        num_warps=num_warps, num_stages=num_stages,
    )
    merge_partials(out, part_out, part_lse, cu_seqlens_q, page_start, num_ctas=num_ctas,
                   min_pages=min_pages, max_q_len=max_q_len, search_steps=search_steps,
                   v_scale=v_scale)
    return out


def merge_partials(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    page_start: torch.Tensor,
    *,
    num_ctas: int,
    min_pages: int,
    max_q_len: int,
    search_steps: int,
    v_scale: float = 1.0,
) -> None:
    """Combine the partial results of the requests cut between CTAs into ``out``
    ``[num_tokens, heads, Dc]`` (the decode kernels wrote the uncut ones directly); the
    other arguments as the decode launch that filled ``part_out`` / ``part_lse`` had them."""
    num_tokens, heads, kv_lora_rank = out.shape
    merge_h = min(triton.next_power_of_2(heads), 16)
    merge_c = min(kv_lora_rank, 128)
    merge_grid = (triton.cdiv(heads, merge_h), num_tokens, kv_lora_rank // merge_c)
    _merge_partials_kernel[merge_grid](
        out, part_out, part_lse, cu_seqlens_q, page_start,
        page_start.shape[0] - 1, heads, num_ctas, min_pages,
        out.stride(0), out.stride(1), v_scale,
        DC=kv_lora_rank, BLOCK_H=merge_h, BLOCK_C=merge_c, MAX_Q=max_q_len,
        SEARCH_STEPS=search_steps,
        num_warps=4,
    )
