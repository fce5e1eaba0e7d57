"""What a decode call is: the static layer configuration and one step's batch.

``DecodeSpec`` is fixed for a group of layers for the life of an engine (heads, latent
dims, block size, dtypes); routes declare eligibility against it. ``DecodeBatch`` changes
every step and is shared by every layer of that step; routes plan against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class DecodeSpec:
    """Static configuration of absorbed-MLA decode for one group of layers.

    Attributes:
        num_heads: query heads on this rank (after tensor parallelism).
        kv_lora_rank: latent width ``Dc`` (512 for DeepSeek-V2/V3, Kimi-K2).
        rope_dim: decoupled RoPE width ``Dr`` (64 for DeepSeek-V2/V3).
        block_size: tokens per KV-cache block (page).
        q_dtype: dtype of the query handed to ``run``.
        kv_dtype: dtype of the paged cache (``torch.float8_e4m3fn`` for FP8 KV).
        softmax_scale: scale of ``q . k`` before softmax (``1/sqrt(qk_head_dim)``).
        max_q_len: largest number of query tokens of one request in a step (1 for plain
            decode, 1 + k for speculative decoding with k draft tokens).
    """

    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    softmax_scale: float
    max_q_len: int = 1

    @property
    def head_dim(self) -> int:
        """Width of a query row and of a cache entry: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def fp8_kv(self) -> bool:
        return self.kv_dtype in FP8_DTYPES


@dataclass
class DecodeBatch:
    """One step's decode requests, in the order their query rows appear.

    Attributes:
        block_table: ``[batch, max_blocks]`` int32, physical block ids per request.
        seq_lens: ``[batch]`` int32, tokens in the cache per request *including* this
            step's query tokens (vLLM's convention).
        cu_seqlens_q: ``[batch + 1]`` int32 prefix sums of query tokens per request, or
            ``None`` when every request has exactly one query token.
        max_q_len: largest query length in the batch (1 without speculative decoding).
        max_seq_len: host-side bound on ``seq_lens`` (kernels size grids from it).
        num_tokens: query rows, ``cu_seqlens_q[-1]`` or ``batch``.
        kv_tokens: host-side ``sum(seq_lens)`` when the caller has it (e.g. from vLLM's
            ``seq_lens_cpu``); lets the SM90 policy pick a route per batch without a
            device-to-host copy. ``None``: the decoder counts it only when it matters.
        seq_lens_host: ``[batch]`` int32 on the CPU, equal to ``seq_lens`` (exact, not an
            upper bound), or ``None``. Routes whose planner works on the host (FlashInfer
            FA2/FA3) plan from it instead of copying ``seq_lens`` back from the device,
            which would wait for the GPU every step.
        cu_seqlens_q_host: ``[batch + 1]`` int32 on the CPU, equal to ``cu_seqlens_q``;
            needed with ``seq_lens_host`` when ``cu_seqlens_q`` is given.
        persistent: ``block_table``, ``seq_lens`` and ``cu_seqlens_q`` are views (from
            row 0) of buffers the caller keeps at fixed addresses and rewrites in place every
            step, as vLLM's model runner keeps its inputs for CUDA graphs (vLLM's own MLA
            backends hand them to captured kernels as they are). Routes then read them
            directly instead of staging copies into buffers of their own. Leave ``False``
            for tensors made per step: a graph captured on them would replay stale values.
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    cu_seqlens_q: torch.Tensor | None = None
    max_q_len: int = 1
    num_tokens: int | None = None
    kv_tokens: int | None = None
    seq_lens_host: torch.Tensor | None = None
    cu_seqlens_q_host: torch.Tensor | None = None
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.cu_seqlens_q is None:
            self.num_tokens = self.batch_size * self.max_q_len
        elif self.num_tokens is None:
            raise ValueError(
                "DecodeBatch: num_tokens is required with cu_seqlens_q; pass the number of "
                "query rows (cu_seqlens_q[-1]) from the host so no device sync is needed"
            )

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def host_lengths(self) -> bool:
        """The host holds every length a host-side planner needs (no device copy)."""
        return self.seq_lens_host is not None and (
            self.cu_seqlens_q is None or self.cu_seqlens_q_host is not None
        )

    @property
    def uniform_q_len(self) -> bool:
        """Every request has ``max_q_len`` query tokens (rows reshape to a 4-D query)."""
        return self.num_tokens == self.batch_size * self.max_q_len


@dataclass(frozen=True)
class KVScales:
    """Per-tensor FP8 scales: real value = stored value * scale.

    Every route reads the query as ``query * q_scale`` (whatever its dtype; pass 1.0 for a
    query in real values), the cache's score role as ``cache * k_scale`` and its value role
    as ``cache[..., :kv_lora_rank] * v_scale`` (in MLA both roles are one latent cache, so
    engines pass ``v_scale == k_scale``). A route that must quantise a wider query to FP8
    stores ``query`` saturated to the FP8 range and keeps ``q_scale`` in the score scale.
    """

    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def is_unit(self) -> bool:
        return self.q_scale == 1.0 and self.k_scale == 1.0 and self.v_scale == 1.0


UNIT_SCALES = KVScales()


def split_query(query: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_lora_rank: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latent [num_tokens, heads, Dc], rope [num_tokens, heads, Dr])`` of ``query``
    ``[num_tokens, heads, Dc + Dr]`` (views, no copy), or the two parts as an engine hands
    them over (``DecodeRoute.takes_split_query``), as they are."""
    if isinstance(query, tuple):
        return query
    return query[..., :kv_lora_rank], query[..., kv_lora_rank:]
