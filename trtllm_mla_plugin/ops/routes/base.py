"""The contract every decode route implements.

A route declares *what it can serve* (``unsupported_reason``); it never decides whether it
is *preferred* — that is ``ops.policy``. A route instance owns its persistent buffers,
is planned once per step (``plan``, host side, outside CUDA graphs) and run once per layer
(``run``, capturable in a CUDA graph).
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales

#: Largest finite float8_e4m3fn.
FP8_MAX = 448.0


def saturate_to_fp8(query: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``query`` ``[rows, heads, D]`` saturated to e4m3's range and stored in
    ``buffer[:rows]`` (float8_e4m3fn, persistent so a captured run writes the address it
    replays); returns that view. For routes whose kernel reads an FP8 query given a wider
    one (``DecodeRoute.fp8_query``): ``q_scale`` stays the descale of the stored values."""
    q8 = buffer[: query.shape[0]]
    q8.copy_(query.clamp(-FP8_MAX, FP8_MAX))
    return q8


def check_unit_scales(spec: DecodeSpec, scales: KVScales) -> None:
    """Raise unless ``scales`` are all 1 or the cache is FP8 (scales describe FP8 values)."""
    if not spec.fp8_kv and not scales.is_unit:
        raise ValueError(
            f"KV scales apply to FP8 caches only; pass UNIT_SCALES with a {spec.kv_dtype} cache"
        )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The CPU tensor ``host`` on ``device``, without waiting for the GPU's earlier work.

    From pageable memory: CUDA stages a pageable host-to-device copy at once and does not
    wait for the stream (run 228a on an H100: 0.05 ms of host time with the GPU busy for
    200 ms), while pinning each array through PyTorch's caching host allocator cost more
    host time (0.3 ms there; 45 us a call in run 228's engine profile) and saved nothing."""
    return host.to(device, non_blocking=True)


def copy_from_host(dst: torch.Tensor, src: np.ndarray) -> None:
    """Copy the host array ``src`` into ``dst`` (same shape; ``dst``'s dtype) as
    ``to_device`` does, without waiting for the GPU."""
    dst.copy_(torch.from_numpy(src).to(dst.dtype), non_blocking=True)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def module_available(name: str) -> bool:
    """True if ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class StagedTables:
    """Persistent int32 copies of a step's block table and sequence lengths.

    Why: a captured CUDA graph reads the addresses it saw at capture, so routes whose
    kernels take these tensors copy each step's values into buffers that stay put, and a
    graph replays after re-planning. The table grows (a new address) only when a wider one
    arrives; vLLM's width is fixed, and ``MLADecoder`` documents the rule. A batch whose
    tensors are already at fixed addresses (``DecodeBatch.persistent``) is used as it is
    when the kernel can read it (int32, unit column stride, the width a multiple of
    ``width_multiple``): two device copies fewer per step on the host.
    """

    def __init__(self, max_batch_size: int, device: torch.device, width_multiple: int = 1):
        self.max_batch_size = max_batch_size
        self.device = device
        self.width_multiple = width_multiple
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.block_table: torch.Tensor | None = None

    def adoptable(self, batch: DecodeBatch) -> bool:
        """Whether ``batch``'s own table and lengths can stand in for the staged copies."""
        table, lens = batch.block_table, batch.seq_lens
        return (batch.persistent and table.dtype == torch.int32 and lens.dtype == torch.int32
                and table.stride(-1) == 1 and table.shape[1] % self.width_multiple == 0)

    def stage(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``batch``'s tables in (or take them as they are, ``adoptable``); returns the
        ``[batch, width]`` table (width rounded up to ``width_multiple``, extra columns
        zero) and ``[batch]`` lengths views."""
        if self.adoptable(batch):
            return batch.block_table, batch.seq_lens
        b, width = batch.batch_size, batch.block_table.shape[1]
        padded = round_up(max(width, 1), self.width_multiple)
        if self.block_table is None or self.block_table.shape[1] < padded:
            self.block_table = torch.zeros(
                self.max_batch_size, padded, dtype=torch.int32, device=self.device
            )
        self.block_table[:b, :width].copy_(batch.block_table, non_blocking=True)
        if padded > width:
            # Columns past a request's length are never read; zero keeps them valid block ids.
            self.block_table[:b, width:].zero_()
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        return self.block_table[:b], self.seq_lens[:b]


class StagedQueryOffsets:
    """Persistent ``[max_batch + 1]`` int32 query-row offsets of a step's batch, for kernels
    that take ``cu_seqlens_q`` even when every request has the same number of rows.

    Why persistent: a captured CUDA graph reads the address it saw at capture. Uniform
    batches (``DecodeBatch.cu_seqlens_q`` may then be ``None``) get ``arange * max_q_len``
    computed on the device, once per query length and only as far as no earlier step wrote
    it (the values do not change between such steps); ragged ones a copy of the caller's
    offsets, always into this buffer: a graph captured on a uniform batch of some size may
    replay a ragged step of that size (vLLM pads a step's requests to a captured size).
    """

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        self._arange = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self._offsets = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device)
        #: (query length, entries) of the ``arange * query length`` prefix the buffer holds.
        self._uniform = (0, 0)

    def stage(self, batch: DecodeBatch) -> torch.Tensor:
        """Write ``batch``'s offsets in; returns the ``[batch + 1]`` view."""
        n = batch.batch_size + 1
        cu = self._offsets[:n]
        if batch.uniform_q_len:
            q_len, written = self._uniform
            if q_len != batch.max_q_len or written < n:
                torch.mul(self._arange[:n], batch.max_q_len, out=cu)
                self._uniform = (batch.max_q_len, n)
        else:
            cu.copy_(batch.cu_seqlens_q, non_blocking=True)
            self._uniform = (0, 0)
        return cu


class DecodeRoute(ABC):
    """One way of running absorbed-MLA paged decode."""

    #: Short stable identifier, e.g. ``"flashinfer-fa3"``; used by policy, logs and docs.
    name: ClassVar[str]
    #: Human-readable kernel name for logs and the doctor.
    kernel: ClassVar[str]
    #: Whether the route can plan requests in length order (``sort_by_length``, set by the
    #: decoder from ``ops.policy`` before each ``plan``).
    supports_length_sort: ClassVar[bool] = False
    sort_by_length: bool = False
    #: With an FP8 cache the kernel reads an FP8 query: the route quantises a wider query
    #: itself, and an engine may hand over an FP8 query instead (``engine_query_dtype``).
    fp8_query: ClassVar[bool] = False
    #: ``run`` accepts ``out=None`` and then returns a tensor of its own (kernels that
    #: allocate their output save a copy).
    own_output: ClassVar[bool] = False
    #: ``run`` also takes the query as its two parts ``(latent [num_tokens, heads, Dc],
    #: rope [num_tokens, heads, Dr])``, as vLLM hands them over for 16-bit caches; other
    #: routes get them joined by the decoder (``MLADecoder.query_join``: one copy of the
    #: query per layer).
    takes_split_query: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        """Why this route cannot serve ``spec`` on ``platform``; ``None`` if it can.

        Must be cheap and must not initialise CUDA beyond what ``platform`` already holds,
        nor import heavy packages (use ``module_available``).
        """

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        """``cuda_graph=True`` asks for state whose device pointers stay fixed across
        ``plan`` calls of the same batch size, so a captured ``run`` can be replayed after
        re-planning. Routes whose state is always fixed ignore it."""
        self.spec = spec
        self.device = device
        self.max_batch_size = max_batch_size
        self.cuda_graph = cuda_graph

    @abstractmethod
    def plan(self, batch: DecodeBatch) -> None:
        """Prepare the step's batch; called once per step before any layer runs."""

    @abstractmethod
    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scales: KVScales
    ) -> torch.Tensor:
        """Attend ``query`` ``[num_tokens, heads, Dc + Dr]`` (or its two parts, for routes
        with ``takes_split_query``) over ``kv_cache``
        ``[num_blocks, block_size, Dc + Dr]`` for the planned batch into ``out``
        ``[num_tokens, heads, Dc]``; returns ``out`` (``out`` is ``None`` only for routes
        with ``own_output``, which then return their own ``[num_tokens, heads, Dc]``)."""
