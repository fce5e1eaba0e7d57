"""Input checks shared by every route: cheap (shapes, dtypes, devices; no device sync),
each failure a ``ValueError`` naming the argument and the fix."""

from __future__ import annotations

import torch

from .spec import DecodeBatch, DecodeSpec

SUPPORTED_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                      torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_spec(spec: DecodeSpec) -> None:
    if spec.num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {spec.num_heads}")
    if spec.kv_lora_rank < 1 or spec.rope_dim < 0:
        raise ValueError(
            f"kv_lora_rank must be >= 1 and rope_dim >= 0, got {spec.kv_lora_rank}, {spec.rope_dim}"
        )
    if spec.block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {spec.block_size}")
    if spec.q_dtype not in SUPPORTED_Q_DTYPES:
        raise ValueError(
            f"query dtype {spec.q_dtype} is not supported; use bfloat16 or float16"
        )
    if spec.max_q_len < 1:
        raise ValueError(f"max_q_len must be >= 1, got {spec.max_q_len}")


def check_batch(spec: DecodeSpec, batch: DecodeBatch, max_batch_size: int) -> None:
    bt, lens = batch.block_table, batch.seq_lens
    if bt.dim() != 2 or lens.dim() != 1 or bt.shape[0] != lens.shape[0]:
        raise ValueError(
            "block_table must be [batch, max_blocks] and seq_lens [batch]; got "
            f"{tuple(bt.shape)} and {tuple(lens.shape)}"
        )
    if bt.dtype not in INDEX_DTYPES or lens.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"block_table and seq_lens must be int32 (got {bt.dtype}, {lens.dtype}); "
            "convert with .to(torch.int32)"
        )
    if lens.shape[0] > max_batch_size:
        raise ValueError(
            f"batch of {lens.shape[0]} requests exceeds max_batch_size={max_batch_size} "
            "the decoder was built for; build it with a larger max_batch_size"
        )
    if batch.max_seq_len > bt.shape[1] * spec.block_size:
        raise ValueError(
            f"max_seq_len={batch.max_seq_len} exceeds the block table's capacity "
            f"({bt.shape[1]} blocks x {spec.block_size} tokens); the block table is too narrow"
        )
    if batch.max_q_len > spec.max_q_len:
        raise ValueError(
            f"batch has max_q_len={batch.max_q_len} but the decoder was built for "
            f"max_q_len={spec.max_q_len}; raise DecodeSpec.max_q_len"
        )
    if batch.cu_seqlens_q is not None and batch.cu_seqlens_q.shape != (lens.shape[0] + 1,):
        raise ValueError(
            f"cu_seqlens_q must be [batch + 1] = [{lens.shape[0] + 1}], "
            f"got {tuple(batch.cu_seqlens_q.shape)}"
        )
    for name, host, size in (
        ("seq_lens_host", batch.seq_lens_host, lens.shape[0]),
        ("cu_seqlens_q_host", batch.cu_seqlens_q_host, lens.shape[0] + 1),
    ):
        if host is not None and (
            host.device.type != "cpu" or host.shape != (size,) or host.dtype not in INDEX_DTYPES
        ):
            raise ValueError(
                f"{name} must be a CPU int32 tensor of shape [{size}]; got "
                f"{host.dtype} {tuple(host.shape)} on {host.device}"
            )


def check_run_inputs(
    spec: DecodeSpec,
    batch: DecodeBatch,
    query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """``query``: ``[num_tokens, heads, Dc + Dr]``, or its two parts ``([num_tokens, heads,
    Dc], [num_tokens, heads, Dr])`` as an engine may hold them (``MLADecoder.run``)."""
    d = spec.head_dim
    if isinstance(query, tuple):
        parts = query
        widths = (spec.kv_lora_rank, spec.rope_dim)
        what = "query parts must be [num_tokens, {h}, {w}] (latent, rope)"
    else:
        parts, widths = (query,), (d,)
        what = "query must be [num_tokens, {h}, {w}] (heads, kv_lora_rank + rope_dim)"
    for part, width in zip(parts, widths, strict=True):
        if part.dim() != 3 or part.shape[1:] != (spec.num_heads, width):
            raise ValueError(
                what.format(h=spec.num_heads, w=width) + f"; got {tuple(part.shape)}"
            )
        if part.shape[0] != batch.num_tokens:
            raise ValueError(
                f"query has {part.shape[0]} rows but the planned batch has {batch.num_tokens}"
            )
    if kv_cache.dim() != 3 or kv_cache.shape[1:] != (spec.block_size, d):
        raise ValueError(
            f"kv_cache must be [num_blocks, {spec.block_size}, {d}] (block_size, "
            f"kv_lora_rank + rope_dim); got {tuple(kv_cache.shape)}"
        )
    for part in parts:
        if part.dtype != spec.q_dtype or kv_cache.dtype != spec.kv_dtype:
            raise ValueError(
                f"dtype mismatch: decoder built for query {spec.q_dtype} / cache "
                f"{spec.kv_dtype}, got {part.dtype} / {kv_cache.dtype}"
            )
        if part.device != kv_cache.device:
            raise ValueError(f"query on {part.device} but kv_cache on {kv_cache.device}")
    if any(part.stride(-1) != 1 for part in parts) or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last dimension; call .contiguous()")
    if out is not None and out.shape != (batch.num_tokens, spec.num_heads, spec.kv_lora_rank):
        raise ValueError(
            f"out must be [{batch.num_tokens}, {spec.num_heads}, {spec.kv_lora_rank}], "
            f"got {tuple(out.shape)}"
        )
