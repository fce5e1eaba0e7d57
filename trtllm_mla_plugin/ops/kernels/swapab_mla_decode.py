"""Split-KV MLA decode in Triton with the products turned around ("swap AB") so that Hopper
warpgroup MMA (``wgmma``, 64-row minimum) can issue them. Experimental (issue 11): not a
decode route yet; run 21 timed it at 0.76-0.97x the best peer for 16 heads and 0.57-0.69x
for 32 (docs/benchmarks-history.md).

Why: with 16 heads and one query token the score product ``Q @ K^T`` has 16 rows, below
wgmma's M = 64, so Triton falls back to ``mma.sync`` (``balanced_mla_decode``: 224-255
registers, latency-bound). Here the KV tile is the tall operand:

* ``S^T [BLOCK_N, ROWS] = K [BLOCK_N, Dc + Dr] @ Q^T [Dc + Dr, ROWS]`` (M = BLOCK_N >= 64
  tokens, N = ROWS = heads x query tokens of the tile, 16..64);
* softmax along the token axis (axis 0 of ``S^T``);
* ``O^T [Dc, ROWS] += V^T [Dc, BLOCK_N] @ P^T [BLOCK_N, ROWS]`` (M = Dc = 512), where
  ``V^T`` is the same shared-memory tile as ``K``'s first ``Dc`` columns, read transposed.

The schedule, the partial-result layout and the combine are ``balanced_mla_decode``'s
(imported): the batch's KV pages are cut into equal ranges, one per CTA; a request wholly
inside one range is written out directly, a cut one leaves per-CTA partials that
``_merge_partials_kernel`` combines. Row ``t`` of a request with ``L`` keys and ``n`` query
tokens sees keys ``< L - n + t + 1`` (bottom-right causal), as ``ops.reference``.

KV tiles come by TMA (``use_tma``, the default: tensor descriptors over the cache seen as
``[num_blocks * page, D]``) or by masked pointer loads. TMA tiles read whole pages, so the
cache slots past a request's length must hold finite values (vLLM allocates its caches
with ``torch.zeros``, ``v1/worker/utils.py`` ``allocate_kv_cache``; reused slots hold
earlier finite entries).

Cache: the query's dtype (bf16/fp16), or FP8 (e4m3) with a per-tensor scale read with a
bf16 query: the FP8 tile comes by TMA (half the bytes), is widened to bf16 in registers and
feeds wgmma as its register operand A (K for the scores, V^T for the output); the scale is
folded into the score scale and the output. On sm_90 that path spills inside the KV loop
(the widened tile lives in registers across the softmax; docs/benchmarks-history.md), so it is a
correctness baseline for an FP8 kernel, not a fast one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .balanced_mla_decode import LOG2E, _cta_pages, _partial_row, _segment, merge_partials

#: Columns (heads x padded query tokens) per CTA at most. At 64 the [Dc, 64] fp32
#: accumulator (128 registers per thread at 8 warps) makes ptxas spill inside the KV loop
#: (sm_90, Triton 3.9: benchmarks/triton_ptx_probe.py); at 32 the loop is spill-free.
MAX_COLUMNS = 32
#: The decode kernel's last compiled variant (benchmarks read ``n_regs``, ``n_spills``,
#: ``asm["ptx"]``).
last_compiled = None


@triton.jit(do_not_specialize=["batch_size", "num_heads", "num_ctas", "min_pages"])
def _swapab_decode_kernel(
    q_ptr, kv_ptr, kc_desc, kr_desc, block_table_ptr, seq_lens_ptr, cu_q_ptr, page_start_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    batch_size, num_heads, num_ctas, min_pages,
    stride_q_row, stride_q_head,
    stride_kv_block, stride_kv_token,
    stride_bt,
    stride_out_row, stride_out_head,
    qk_scale_log2, v_scale,
    DC: tl.constexpr, DR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, MAX_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    head_tile = tl.program_id(0)
    cta = tl.program_id(1)
    ROWS: tl.constexpr = BLOCK_H * MAX_Q
    # Columns of S^T / O^T: query token major, head minor (the partial-row order).
    cols = tl.arange(0, ROWS)
    col_t = cols // BLOCK_H
    col_h = head_tile * BLOCK_H + cols % BLOCK_H
    offs_c = tl.arange(0, DC)
    offs_r = tl.arange(0, DR)
    offs_n = tl.arange(0, BLOCK_N)

    p_begin, p_end, req = _cta_pages(page_start_ptr, batch_size, num_ctas, min_pages, cta,
                                     SEARCH_STEPS)
    p = p_begin
    while p < p_end:
        req_p0, req_p1, seg_p1, seq_len, q0, q_len, tok_lo, tok_hi = _segment(
            page_start_ptr, seq_lens_ptr, cu_q_ptr, req, p, p_end, PAGE)

        col_ok = (col_t < q_len) & (col_h < num_heads)
        q_cols = (q0 + col_t).to(tl.int64) * stride_q_row + col_h * stride_q_head
        # Loaded row-major and transposed in shared memory: Q^T [D, ROWS] is the narrow (N)
        # operand, K-major as wgmma reads it.
        q_c = tl.load(q_ptr + q_cols[:, None] + offs_c[None, :], mask=col_ok[:, None],
                      other=0.0)
        q_r = tl.load(q_ptr + q_cols[:, None] + DC + offs_r[None, :], mask=col_ok[:, None],
                      other=0.0)
        qt_c = tl.trans(q_c)
        qt_r = tl.trans(q_r)
        visible = seq_len - q_len + col_t + 1

        m_i = tl.full([ROWS], -1.0e30, tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([DC, ROWS], tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        for start in range(tok_lo, tok_hi, BLOCK_N):
            tokens = start + offs_n
            tok_ok = tokens < tok_hi
            if USE_TMA:
                # One page's rows of the [num_blocks * PAGE, D] cache: the TMA unit copies
                # the tile to shared memory with no per-thread addresses (the pointer path's
                # addresses make ptxas spill). Rows past ``tok_hi`` are read too: their
                # probabilities are 0, so they must only be finite (0 * NaN is NaN).
                block = tl.load(bt_row + start // PAGE)
                row = (block * PAGE + start % PAGE).to(tl.int32)
                k_c = kc_desc.load([row, 0])
                k_r = kr_desc.load([row, DC])
            elif BLOCK_N <= PAGE:
                block = tl.load(bt_row + start // PAGE).to(tl.int64)
                kv_rows = (kv_ptr + block * stride_kv_block
                           + ((start % PAGE) + offs_n).to(tl.int64) * stride_kv_token)
            else:
                # The tile spans pages: one block id per token (masked past the range, whose
                # page may lie beyond the table's width).
                blocks = tl.load(bt_row + tokens // PAGE, mask=tok_ok, other=0).to(tl.int64)
                kv_rows = (kv_ptr + blocks * stride_kv_block
                           + (tokens % PAGE).to(tl.int64) * stride_kv_token)
            if not USE_TMA:
                k_c = tl.load(kv_rows[:, None] + offs_c[None, :], mask=tok_ok[:, None],
                              other=0.0)
                k_r = tl.load(kv_rows[:, None] + DC + offs_r[None, :], mask=tok_ok[:, None],
                              other=0.0)
            # An FP8 cache is widened to the query's dtype in registers (exact: every e4m3
            # value is a bf16 value); its scale is folded into qk_scale_log2 and v_scale
            # (applied where results are written, partials by the merge, as in
            # balanced_mla_decode).
            # wgmma takes the tall operand (K, and V^T below) from registers.
            k_c = k_c.to(q_c.dtype)
            k_r = k_r.to(q_r.dtype)
            s = tl.dot(k_c, qt_c)
            s = tl.dot(k_r, qt_r, s)
            s = s * qk_scale_log2
            s = tl.where(tokens[:, None] < visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            prob = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(prob, 0)
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(k_c), prob.to(k_c.dtype), acc)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[None, :]
        whole = (p == req_p0) & (seg_p1 == req_p1)
        if whole:
            out_cols = (q0 + col_t).to(tl.int64) * stride_out_row + col_h * stride_out_head
            tl.store(out_ptr + out_cols[None, :] + offs_c[:, None],
                     (o * v_scale).to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
        else:
            part = _partial_row(cta, tl.where(p == p_begin, 0, 1), col_t, col_h, num_heads,
                                MAX_Q)
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=col_ok)
            tl.store(part_out_ptr + part[None, :] * DC + offs_c[:, None], o,
                     mask=col_ok[None, :])
        p = seg_p1
        req += 1


@dataclass(frozen=True)
class SwapABConfig:
    """Tile and grid choices of one head count / query length.

    Attributes:
        block_n: KV tokens per tile, the M side of the score product (64 or 128; wgmma
            needs 64+). A tile larger than a page gathers a block id per token.
        block_h: heads per CTA; ``block_h * max_q`` (the N side) is a power of two >= 16.
        num_warps: 4 (one warpgroup) or 8; the ``[Dc, ROWS]`` fp32 accumulator is spread
            over them (``Dc * ROWS / (32 * num_warps)`` registers per thread).
        num_stages: software-pipeline depth of the KV tile loads (a 64 x 576 bf16 tile is
            72 KiB of shared memory per stage).
        ctas_per_sm: CTAs per SM the pages are spread over (head tiles share them).
        min_tokens_per_cta: small batches use fewer CTAs, at least this many tokens each.
        use_tma: load KV tiles with TMA tensor descriptors (needs ``block_n <= page`` and
            pages laid end to end); ``False``: masked pointer loads (``cp.async``).
    """

    block_n: int = 64
    block_h: int = 16
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 1
    min_tokens_per_cta: int = 256
    use_tma: bool = True


def padded_q_len(q_len: int) -> int:
    return 1 << (max(q_len, 1) - 1).bit_length()


def launch_config(heads: int, q_len: int, page: int = 64, **overrides) -> SwapABConfig:
    """Default tiles for ``heads`` query heads and up to ``q_len`` query tokens: at most
    ``MAX_COLUMNS`` columns per CTA (more heads are tiled over the grid), at least 16; 4
    warps at 16 columns, 8 at 32; TMA tiles unless ``block_n`` exceeds the page."""
    mq = padded_q_len(q_len)
    block_h = max(min(triton.next_power_of_2(heads), MAX_COLUMNS // mq), max(1, 16 // mq))
    rows = block_h * mq
    config = replace(SwapABConfig(block_h=block_h, num_warps=4 if rows <= 16 else 8),
                     **overrides)
    if "use_tma" not in overrides and config.block_n > page:
        config = replace(config, use_tma=False)
    return config


def search_steps(batch: int) -> int:
    """Binary-search steps over ``batch + 1`` page offsets (a compile-time constant; at
    least 12 so batch sizes up to 2047 share one compiled kernel)."""
    return max(12, batch.bit_length() + 1)


def compile_signature(
    heads: int, q_len: int, config: SwapABConfig, dtype: str = "bf16", dc: int = 512,
    dr: int = 64, page: int = 64, batch: int = 128, kv_dtype: str | None = None,
) -> tuple[dict[str, str], dict[str, int], tuple[str, ...]]:
    """``(signature, constexprs, 16-aligned args)`` of ``_swapab_decode_kernel`` as the JIT
    specialises it for these shapes (for ahead-of-time compiles without a GPU).
    ``kv_dtype``: the cache's Triton type (``"fp8e4nv"`` for e4m3), default ``dtype``."""
    ptr, kv = f"*{dtype}", kv_dtype or dtype
    sig = {"q_ptr": ptr, "kv_ptr": f"*{kv}", "out_ptr": ptr, "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32", "qk_scale_log2": "fp32", "v_scale": "fp32"}
    if config.use_tma:
        sig["kc_desc"] = f"tensordesc<{kv}[{config.block_n},{dc}]>"
        sig["kr_desc"] = f"tensordesc<{kv}[{config.block_n},{dr}]>"
    sig.update({n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "cu_q_ptr",
                                    "page_start_ptr")})
    ints = ("batch_size", "num_heads", "num_ctas", "min_pages", "stride_q_row",
            "stride_q_head", "stride_kv_block", "stride_kv_token", "stride_bt",
            "stride_out_row", "stride_out_head")
    sig.update({n: "i32" for n in ints})
    consts = {"DC": dc, "DR": dr, "PAGE": page, "BLOCK_N": config.block_n,
              "BLOCK_H": config.block_h, "MAX_Q": padded_q_len(q_len),
              "SEARCH_STEPS": search_steps(batch), "USE_TMA": config.use_tma}
    if not config.use_tma:
        consts.update(kc_desc=None, kr_desc=None)
    # Pointers are 16-byte aligned and these strides multiples of 16 for 576-wide rows.
    aligned = ("q_ptr", "kv_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr",
               "block_table_ptr", "seq_lens_ptr", "cu_q_ptr", "page_start_ptr",
               "stride_q_row", "stride_q_head", "stride_kv_block", "stride_kv_token",
               "stride_out_row", "stride_out_head")
    return sig, consts, aligned


@dataclass
class SwapABPlan:
    """Per-batch state of a decode: persistent across layers of one step (and, kept alive,
    across CUDA-graph replays when ``page_start``/``cu_q`` are refilled in place).

    Attributes:
        cu_q: ``[batch + 1]`` int32 query-row offsets.
        page_start: ``[batch + 1]`` int32 prefix sum of ``ceil(seq_lens / page)``.
        part_out: ``[num_ctas * 2 * max_q * heads * Dc]`` float32 partial outputs.
        part_lse: ``[num_ctas * 2 * max_q * heads]`` float32 partial base-2 LSEs.
    """

    cu_q: torch.Tensor
    page_start: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    num_ctas: int
    max_q: int
    config: SwapABConfig


def plan_swapab(
    seq_lens: torch.Tensor,
    num_heads: int,
    page: int,
    *,
    q_len: int = 1,
    cu_seqlens_q: torch.Tensor | None = None,
    kv_lora_rank: int = 512,
    num_splits: int | None = None,
    config: SwapABConfig | None = None,
) -> SwapABPlan:
    """Offsets, page prefix sums and split-KV scratch for one batch (device-side only: no
    host sync).

    Args:
        seq_lens: ``[batch]`` int32 keys per request, this step's query tokens included.
        q_len: query tokens per request (the largest when ``cu_seqlens_q`` is given).
        cu_seqlens_q: ``[batch + 1]`` int32 query-row offsets, ``None``: ``q_len`` each.
        num_splits: CTAs the pages are spread over per head tile; default fills the GPU's
            SMs ``config.ctas_per_sm`` times over with all head tiles (8 without a GPU).
    """
    cfg = config or launch_config(num_heads, q_len, page)
    device = seq_lens.device
    b = seq_lens.shape[0]
    max_q = padded_q_len(q_len)
    if cu_seqlens_q is None:
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=device) * q_len
    else:
        cu_q = cu_seqlens_q.to(torch.int32)
    page_start = torch.zeros(b + 1, dtype=torch.int32, device=device)
    torch.cumsum((seq_lens.to(torch.int32) + (page - 1)) // page, 0, dtype=torch.int32,
                 out=page_start[1:])
    if num_splits is None:
        head_tiles = triton.cdiv(num_heads, cfg.block_h)
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = max(1, sms * cfg.ctas_per_sm // head_tiles)
        else:
            num_splits = 8
    rows = num_splits * 2 * max_q * num_heads
    return SwapABPlan(
        cu_q=cu_q, page_start=page_start,
        part_out=torch.empty(rows * kv_lora_rank, dtype=torch.float32, device=device),
        part_lse=torch.empty(rows, dtype=torch.float32, device=device),
        num_ctas=num_splits, max_q=max_q, config=cfg,
    )


def kv_descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> tuple:
    """TMA descriptors over ``kv_cache [num_blocks, page, D]`` seen as ``[num_blocks * page,
    D]``: tiles ``[block_n, kv_lora_rank]`` (latent) and ``[block_n, D - kv_lora_rank]``
    (RoPE, loaded at column ``kv_lora_rank``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    blocks, page, d = kv_cache.shape
    if block_n > page or page % block_n:
        raise ValueError(f"TMA tiles of {block_n} tokens must divide the page ({page})")
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) != page * kv_cache.stride(1):
        raise ValueError("TMA needs pages laid end to end with a contiguous last dim; "
                         f"strides {kv_cache.stride()}")
    if blocks * page >= 2**31:
        raise ValueError("TMA row coordinates are int32: at most 2**31 cache rows")
    shape, strides = [blocks * page, d], [kv_cache.stride(1), 1]
    return (TensorDescriptor(kv_cache, shape, strides, [block_n, kv_lora_rank]),
            TensorDescriptor(kv_cache, shape, strides, [block_n, d - kv_lora_rank]))


def swapab_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    kv_lora_rank: int = 512,
    k_scale: float = 1.0,
    plan: SwapABPlan | None = None,
    num_splits: int | None = None,
    config: SwapABConfig | None = None,
) -> torch.Tensor:
    """Absorbed-MLA decode over a paged latent cache, swap-AB tiles, split-KV + combine.

    Args:
        q: ``[batch, q_len, heads, Dc + Dr]`` bf16/fp16 (every request ``q_len`` tokens),
            or ``[num_tokens, heads, Dc + Dr]`` with ``cu_seqlens_q``; last dim contiguous.
        kv_cache: ``[num_blocks, page, Dc + Dr]`` in ``q``'s dtype or ``float8_e4m3fn``
            (real value = stored x ``k_scale``, for keys and values alike), last dim
            contiguous; values are the first ``Dc`` (``kv_lora_rank``) features of a row.
        block_table: ``[batch, max_blocks]`` int32 physical block ids.
        seq_lens: ``[batch]`` int32 keys per request including its query tokens.
        softmax_scale: multiplies ``q . k`` before softmax.
        out: ``q``'s shape with ``Dc`` as last dim (``[batch, q_len, heads, Dc]`` or
            ``[num_tokens, heads, Dc]``), ``q``'s dtype; written in place and returned.
        cu_seqlens_q: ``[batch + 1]`` int32 query-row offsets for a 3-D ``q``.
        k_scale: the cache's dequantisation scale (real = stored x ``k_scale``; FP8).
        plan: from ``plan_swapab`` for this batch (made here when ``None``, with
            ``num_splits`` and ``config``).
    """
    if q.dim() == 4:
        b, t, heads, d = q.shape
        q3, out3 = q.reshape(b * t, heads, d), out.view(b * t, heads, kv_lora_rank)
    else:
        if cu_seqlens_q is None:
            raise ValueError("a 3-D query needs cu_seqlens_q")
        q3, out3 = q, out
        t = None
    _, heads, head_dim = q3.shape
    batch, page = seq_lens.shape[0], kv_cache.shape[1]
    if kv_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"the swap-AB kernel reads a {q.dtype} or float8_e4m3fn cache, got "
                         f"{kv_cache.dtype}")
    if plan is None:
        # A 3-D query's longest request is read back from the device here (a sync); pass a
        # plan from ``plan_swapab`` to avoid it.
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if t is None else t
        plan = plan_swapab(seq_lens, heads, page, q_len=max_q, cu_seqlens_q=cu_seqlens_q,
                           kv_lora_rank=kv_lora_rank, num_splits=num_splits, config=config)
    cfg = plan.config
    kc_desc = kr_desc = None
    if cfg.use_tma:
        kc_desc, kr_desc = kv_descriptors(kv_cache, kv_lora_rank, cfg.block_n)
    min_pages = max(1, cfg.min_tokens_per_cta // page)
    steps = search_steps(batch)
    head_tiles = triton.cdiv(heads, cfg.block_h)
    global last_compiled
    last_compiled = _swapab_decode_kernel[(head_tiles, plan.num_ctas)](
        q3, kv_cache, kc_desc, kr_desc, block_table, seq_lens, plan.cu_q, plan.page_start,
        out3, plan.part_out, plan.part_lse,
        batch, heads, plan.num_ctas, min_pages,
        q3.stride(0), q3.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        out3.stride(0), out3.stride(1),
        softmax_scale * LOG2E * k_scale, k_scale,
        DC=kv_lora_rank, DR=head_dim - kv_lora_rank, PAGE=page, BLOCK_N=cfg.block_n,
        BLOCK_H=cfg.block_h, MAX_Q=plan.max_q, SEARCH_STEPS=steps, USE_TMA=cfg.use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    merge_partials(out3, plan.part_out, plan.part_lse, plan.cu_q, plan.page_start,
                   num_ctas=plan.num_ctas, min_pages=min_pages, max_q_len=plan.max_q,
                   search_steps=steps, v_scale=k_scale)
    return out
