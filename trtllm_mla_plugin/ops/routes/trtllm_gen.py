"""Blackwell (SM100/SM103) routes through FlashInfer's
``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``: the TRTLLM-gen kernels
(``"trtllm-gen"``) and FlashInfer's CuTe DSL MLA kernel (``"flashinfer-cute-dsl"``) for head
counts TRTLLM-gen cannot tile.

Read from FlashInfer 0.7.2.post1 (``flashinfer/mla/_core.py``,
``mla/_batch_mla/_backends/trtllm_gen_backend.py``):

* query and cache must share a dtype, bfloat16 or FP8 e4m3; the output is always bfloat16.
  With an FP8 cache and a bf16 query this route quantizes the query to FP8 itself
  (saturating at +-448, as vLLM's decode does with its default ``q_scale`` of 1).
* dense decode takes (kv_lora_rank, rope) = (512, 64) or (256, 64); FlashInfer's (512, 0)
  kernel exists only for sparse MLA (``sparse_mla_top_k > 0``).
* pages of 32 or 64 tokens; the CuTe DSL path also wants the block-table width to be a
  multiple of ``128 / block_size``, so the persistent table is padded to it for both.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute, StagedTables, module_available, saturate_to_fp8

BLACKWELL_CAPABILITIES = ((10, 0), (10, 3))
# (kv_lora_rank, rope_dim) -> qk_nope_head_dim. FlashInfer 0.7.2 keeps the argument only
# for its signature (``# TODO: remove in 1.0?``); pass the value of the model family it
# names for those dims (DeepSeek-V2/V3 and the smaller MLA layout).
DENSE_MLA_DIMS: dict[tuple[int, int], int] = {(512, 64): 128, (256, 64): 64}
SUPPORTED_BLOCK_SIZES = (32, 64)

WORKSPACE_BYTES = 128 * 1024 * 1024
_workspaces: dict[torch.device, torch.Tensor] = {}


def workspace_for(device: torch.device) -> torch.Tensor:
    """The device's shared 128 MiB int8 workspace, zero-initialised once.

    Why module-level and zeroed: the kernels keep semaphore state in the workspace that
    they reset themselves after each launch, so it must start at zero and must not be
    re-allocated per call (a new allocation would be neither zeroed nor at the address a
    captured CUDA graph uses). Launches on one stream are ordered, so every decoder on the
    device can share it (vLLM does the same). int8 because the CuTe DSL path requires it;
    TRTLLM-gen views it as bytes.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buffer = _workspaces.get(device)
    if buffer is None:
        buffer = torch.zeros(WORKSPACE_BYTES, dtype=torch.int8, device=device)
        _workspaces[device] = buffer
    return buffer


def trtllm_gen_supports_num_heads(num_heads: int) -> bool:
    """Whether TRTLLM-gen MLA decode can tile ``num_heads`` query heads.

    The kernel groups heads into CTAs of ``min(heads, tileSizeQ)`` (8 up to 8 heads, 16 up
    to 32, else 64) and needs the head count divisible by that (vLLM 0.33
    ``_trtllm_gen_mla_decode_supports_num_heads``); FlashInfer also refuses 64 < heads < 128.
    """
    if 64 < num_heads < 128:
        return False
    tile = 8 if num_heads <= 8 else 16 if num_heads <= 32 else 64
    return num_heads % min(num_heads, tile) == 0


def kernel_query_dtype(spec: DecodeSpec) -> torch.dtype:
    """dtype of the query the kernel sees: the cache's (FP8 caches get an FP8 query)."""
    return torch.float8_e4m3fn if spec.fp8_kv else spec.q_dtype


def _shared_reason(spec: DecodeSpec, platform: Platform, kernel: str) -> str | None:
    if platform.capability not in BLACKWELL_CAPABILITIES:
        return (
            f"{kernel} runs on SM100/SM103 (B200, GB200, B300) only; "
            f"this is {platform.describe()}"
        )
    if not module_available("flashinfer"):
        return "flashinfer is not installed; pip install flashinfer-python==0.7.2.post1"
    dims = (spec.kv_lora_rank, spec.rope_dim)
    if dims not in DENSE_MLA_DIMS:
        extra = (
            " ((512, 0) is FlashInfer's sparse-MLA-only layout)" if dims == (512, 0) else ""
        )
        return (
            f"(kv_lora_rank, rope_dim)={dims} is not a dense {kernel} MLA layout{extra}; "
            "supported: (512, 64), (256, 64)"
        )
    if spec.block_size not in SUPPORTED_BLOCK_SIZES:
        return (
            f"block size {spec.block_size} is not supported ({kernel} MLA pages hold 32 or "
            "64 tokens); start vLLM with --block-size 64"
        )
    if spec.kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return (
            f"KV cache dtype {spec.kv_dtype} is not supported by {kernel} (bfloat16 or FP8 "
            "e4m3 only); run the model in bfloat16 (--dtype bfloat16) or use "
            "--kv-cache-dtype fp8"
        )
    if spec.q_dtype == torch.float8_e4m3fn and not spec.fp8_kv:
        return "an FP8 query needs an FP8 (e4m3) KV cache; use --kv-cache-dtype fp8"
    if spec.q_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return (
            f"query dtype {spec.q_dtype} is not supported by {kernel} (it takes bfloat16 or "
            "FP8 and writes bfloat16); run the model in bfloat16 (--dtype bfloat16)"
        )
    return None


def trtllm_gen_call_kwargs(
    *,
    spec: DecodeSpec,
    backend: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    batch_size: int,
    max_q_len: int,
    cum_seq_lens_q: torch.Tensor | None,
    scales: KVScales,
    counter: torch.Tensor | None,
) -> dict[str, Any]:
    """Keyword arguments of ``trtllm_batch_decode_with_kv_cache_mla`` for one layer.

    Pure (no launch, no device work), so a CPU test can bind them to FlashInfer's signature.

    Args:
        query: ``[num_tokens, heads, Dc + Dr]`` in the kernel's query dtype.
        kv_cache: ``[num_blocks, block_size, Dc + Dr]``; passed as ``[blocks, 1, block, D]``.
        out: ``[num_tokens, heads, Dc]`` bfloat16.
        block_tables: ``[batch, width]`` int32 with ``width % (128 / block_size) == 0``.
        seq_lens: ``[batch]`` int32.
        cum_seq_lens_q: ``[batch + 1]`` int32 for ragged query lengths, else ``None``
            (then every request has ``max_q_len`` rows and the query goes in 4-D).
        scales: FP8 scales; ``bmm1 = softmax_scale * q_scale * k_scale``, ``bmm2 = v_scale``.
        counter: persistent multi-CTA counter (TRTLLM-gen only), or ``None``.
    """
    heads, dim = spec.num_heads, spec.head_dim
    kwargs: dict[str, Any] = {
        "kv_cache": kv_cache.unsqueeze(1),
        "workspace_buffer": workspace,
        "qk_nope_head_dim": DENSE_MLA_DIMS[(spec.kv_lora_rank, spec.rope_dim)],
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_rope_head_dim": spec.rope_dim,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "max_seq_len": max_seq_len,
        "bmm1_scale": spec.softmax_scale * scales.q_scale * scales.k_scale,
        "bmm2_scale": scales.v_scale,
        "backend": backend,
    }
    if cum_seq_lens_q is None:
        kwargs["query"] = query.view(batch_size, max_q_len, heads, dim)
        kwargs["out"] = out.view(batch_size, max_q_len, heads, spec.kv_lora_rank)
    else:
        kwargs["query"] = query
        kwargs["out"] = out
        kwargs["cum_seq_lens_q"] = cum_seq_lens_q
        kwargs["max_q_len"] = max_q_len
    if counter is not None:
        kwargs["multi_ctas_kv_counter_buffer"] = counter
    return kwargs


class _TrtllmMlaRoute(DecodeRoute):
    """Shared plan/run of the two FlashInfer Blackwell MLA decode backends."""

    backend: ClassVar[str]
    fp8_query: ClassVar[bool] = True

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla

        self._decode = trtllm_batch_decode_with_kv_cache_mla
        self.max_tokens = max_batch_size * spec.max_q_len
        self.workspace = workspace_for(device)
        # The CuTe DSL path wants the table width a multiple of 128 / block_size.
        self._tables = StagedTables(max_batch_size, device, 128 // spec.block_size)
        self._cu_seqlens_q = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=device)
        self._query8 = (
            torch.empty(max_batch_size * spec.max_q_len, spec.num_heads, spec.head_dim,
                        dtype=torch.float8_e4m3fn, device=device)
            if spec.fp8_kv and spec.q_dtype != torch.float8_e4m3fn
            else None
        )
        self.counter = self._make_counter()
        self._batch: DecodeBatch | None = None

    def _make_counter(self) -> torch.Tensor | None:
        return None

    def plan(self, batch: DecodeBatch) -> None:
        b = batch.batch_size
        self._block_table, self._seq_lens = self._tables.stage(batch)
        if not batch.uniform_q_len:
            self._cu_seqlens_q[: b + 1].copy_(batch.cu_seqlens_q, non_blocking=True)
        self._batch = batch

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scales: KVScales
    ) -> torch.Tensor:
        batch = self._batch
        b = batch.batch_size
        if self._query8 is not None:
            query = saturate_to_fp8(query, self._query8)
        kwargs = trtllm_gen_call_kwargs(
            spec=self.spec,
            backend=self.backend,
            query=query,
            kv_cache=kv_cache,
            out=out,
            workspace=self.workspace,
            block_tables=self._block_table,
            seq_lens=self._seq_lens,
            max_seq_len=batch.max_seq_len,
            batch_size=b,
            max_q_len=batch.max_q_len,
            cum_seq_lens_q=None if batch.uniform_q_len else self._cu_seqlens_q[: b + 1],
            scales=scales,
            counter=self.counter,
        )
        self._decode(**kwargs)
        return out


class TrtllmGenRoute(_TrtllmMlaRoute):
    name = "trtllm-gen"
    kernel = "FlashInfer TRTLLM-gen MLA decode (trtllm_batch_decode_with_kv_cache_mla)"
    backend = "trtllm-gen"

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        reason = _shared_reason(spec, platform, "TRTLLM-gen")
        if reason is None and not trtllm_gen_supports_num_heads(spec.num_heads):
            reason = (
                f"TRTLLM-gen cannot tile {spec.num_heads} query heads per rank (needs a "
                "multiple of its 8/16/64-head tile); flashinfer-cute-dsl serves it"
            )
        return reason

    def _make_counter(self) -> torch.Tensor:
        """Multi-CTA KV semaphores, zeroed once: the kernel resets them after every launch,
        so sizing for the largest batch here means no per-step allocation or fill (which
        would break CUDA-graph replay)."""
        from flashinfer.utils import (
            get_device_sm_count,
            get_trtllm_gen_multi_ctas_kv_counter_bytes,
        )

        nbytes = get_trtllm_gen_multi_ctas_kv_counter_bytes(
            self.max_tokens, self.spec.num_heads, get_device_sm_count(self.device)
        )
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)


class CuteDslRoute(_TrtllmMlaRoute):
    name = "flashinfer-cute-dsl"
    kernel = "FlashInfer CuTe DSL MLA decode (trtllm_batch_decode_with_kv_cache_mla)"
    backend = "cute-dsl"

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        # Head counts are left to FlashInfer's own ``can_implement`` check at launch.
        return _shared_reason(spec, platform, "CuTe DSL")
