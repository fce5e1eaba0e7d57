"""Pure-torch absorbed-MLA paged decode: the CPU route and the oracle of every test.

Runs on any device and dtype. Arithmetic happens in float32, or float64 when the query is
float64 (the tests' oracle), and the result is cast to the query dtype
(bfloat16 for an FP8 query) or to ``out``'s.
"""

from __future__ import annotations

import torch

from .spec import UNIT_SCALES, KVScales

#: Elements of the gathered cache rows (``[rows, span, D]``) the reference holds at once:
#: 1 GiB in float64, so that the tests' float64 oracle of long batches fits beside them on
#: an 80 GB GPU (run 232, H100: the unchunked gather asked for 22.5 GiB a tensor).
CHUNK_ELEMENTS = 1 << 27


def query_positions(
    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner request and visible key count of every query row.

    Row ``t`` of a request with ``L`` cached tokens and ``n`` query tokens sees keys
    ``[0, L - n + t]`` (causal inside the request, the last row sees all ``L``).

    Returns:
        ``(request [num_tokens] int64, visible [num_tokens] int64)``.
    """
    device = seq_lens.device
    lens = seq_lens.to(torch.int64)
    if cu_seqlens_q is None:
        q_len = num_tokens // lens.shape[0]
        request = torch.arange(lens.shape[0], device=device).repeat_interleave(q_len)
        offset = torch.arange(num_tokens, device=device) % q_len
        n = torch.full_like(request, q_len)
    else:
        cu = cu_seqlens_q.to(device=device, dtype=torch.int64)
        rows = torch.arange(num_tokens, device=device)
        request = torch.searchsorted(cu[1:], rows, right=True)
        offset = rows - cu[request]
        n = (cu[1:] - cu[:-1])[request]
    visible = lens[request] - n + offset + 1
    return request, visible


def mla_decode_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    scales: KVScales = UNIT_SCALES,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode over a paged latent cache.

    Args:
        query: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]``; latent query
            (``q_nope`` absorbed through ``W_UK``, then ``q_pe``).
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``; per token the
            compressed KV ``c_kv`` then the rotated ``k_pe``. FP8 allowed (dequantised with
            ``scales``).
        block_table: ``[batch, max_blocks]`` integer physical block ids.
        seq_lens: ``[batch]`` cached tokens per request, this step's tokens included.
        softmax_scale: multiplies ``q . k`` before softmax.
        kv_lora_rank: ``Dc``; values are the first ``Dc`` features of each cache entry.
        cu_seqlens_q: ``[batch + 1]`` query row offsets; ``None`` means every request has
            ``num_tokens // batch`` rows.
        max_seq_len: bound on ``seq_lens`` used to size the gather (defaults to the block
            table's capacity).
        scales: FP8 dequantisation scales of query and cache.
        out: optional ``[num_tokens, num_heads, kv_lora_rank]`` written in place.

    Returns:
        ``[num_tokens, num_heads, kv_lora_rank]`` in ``query.dtype`` (bfloat16 for an FP8
        query), or ``out``.
    """
    num_tokens, num_heads, _ = query.shape
    block_size = kv_cache.shape[1]
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    request, visible = query_positions(seq_lens, cu_seqlens_q, num_tokens)

    capacity = block_table.shape[1] * block_size
    span = min(capacity, max_seq_len) if max_seq_len is not None else capacity
    num_blocks = -(-span // block_size)
    pages = block_table[:, :num_blocks].to(torch.int64)
    q = query.to(compute) * scales.q_scale
    result = q.new_empty(num_tokens, num_heads, kv_lora_rank)
    # Query rows in chunks: each row's keys are gathered whole ([rows, span, D] in
    # ``compute``), which for 180 rows over 32k tokens in float64 is 27 GB a tensor.
    chunk = max(1, CHUNK_ELEMENTS // (span * kv_cache.shape[-1]))
    positions = torch.arange(span, device=query.device)
    for start in range(0, num_tokens, chunk):
        rows_of = slice(start, min(start + chunk, num_tokens))
        # [rows, num_blocks * block_size, D]: each row's request cache laid out contiguously.
        rows = kv_cache[pages[request[rows_of]]].flatten(1, 2)[:, :span].to(compute)
        scores = torch.einsum("thd,tsd->ths", q[rows_of], rows * scales.k_scale)
        scores *= softmax_scale
        mask = positions[None, :] >= visible[rows_of, None]
        scores.masked_fill_(mask[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # A row that sees no key (padding) yields NaN from softmax; define it as zero.
        probs = torch.nan_to_num(probs, nan=0.0)
        values = rows[..., :kv_lora_rank] * scales.v_scale
        result[rows_of] = torch.einsum("ths,tsd->thd", probs, values)
    if out is None:
        # An FP8 query gives bfloat16 output (as MLADecoder.output_dtype says); rounding the
        # result to FP8 would lose all but 3 mantissa bits.
        fp8_query = query.dtype == torch.float8_e4m3fn
        return result.to(torch.bfloat16 if fp8_query else query.dtype)
    out.copy_(result)  # one rounding, straight to the output's dtype
    return out
