"""The plugin's CUDA split-KV decode kernel (``ops.kernels.splitk_mla_decode``): 16 query
rows per warp tile (mma.sync m16n8k16), so 16 heads fill a tile without padding; the
page-balanced schedule is computed inside the kernel from one prefix sum per step, and a
request inside one CTA's range is written without a combine pass.

Eligibility: SM90 (where it was written and is measured), ``nvcc`` to compile it at first
use or a build of it in the plugin's cache (``--build-kernels``), DeepSeek-style latent
512 + RoPE 64, a bf16/fp16 query over a cache of the same dtype or of FP8 e4m3 (read with
the 16-bit query: bf16-query accuracy, unlike FlashMLA's FP8 kernel), pages of a multiple
of 32 tokens, up to 1024 requests per step and 16 query tokens per request. Which batches
it serves is ``ops.policy``'s call (``hopper_prefers_splitk``: 8-16 query rows per
request, large batches; measured on the H200 in docs/benchmarks.md);
``TRTLLM_MLA_DECODE_ROUTE=cuda-splitk`` forces it.
"""

from __future__ import annotations

import torch

from ..kernels.nvcc_build import cached_cubin, find_nvcc
from ..kernels.splitk_mla_decode import (
    CAPABILITY,
    DTYPE_NAMES,
    FP8,
    MAX_BATCH,
    SOURCE,
    TILE_TOKENS,
    SplitKMLADecode,
)
from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute, StagedQueryOffsets, StagedTables, check_unit_scales

MAX_Q_LEN = 16


class CudaSplitKRoute(DecodeRoute):
    name = "cuda-splitk"
    kernel = "trtllm_mla_plugin split-KV decode, mma.sync 16-row tiles (CUDA C++, nvcc JIT)"
    # The kernel reads vLLM's two query parts where they lie (strides per part): no join.
    takes_split_query = True

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.kind != "cuda" or platform.capability != CAPABILITY:
            return ("the CUDA split-KV kernel is built and measured for SM90 (Hopper); this is "
                    f"{platform.describe()}")
        if (spec.kv_lora_rank, spec.rope_dim) != (512, 64):
            return (f"kv_lora_rank={spec.kv_lora_rank}, rope_dim={spec.rope_dim}: the CUDA "
                    "split-KV kernel is compiled for 512 + 64 (DeepSeek-V2/V3, Kimi-K2)")
        if spec.q_dtype not in DTYPE_NAMES or spec.kv_dtype not in (spec.q_dtype, FP8):
            return (f"the CUDA split-KV kernel reads a bf16/fp16 query over a cache of the same "
                    f"dtype or FP8 e4m3, got {spec.q_dtype} query and {spec.kv_dtype} cache")
        if spec.block_size % TILE_TOKENS:
            return (f"block size {spec.block_size}: the CUDA split-KV kernel needs a multiple "
                    f"of {TILE_TOKENS}")
        if spec.max_q_len > MAX_Q_LEN:
            return f"max_q_len={spec.max_q_len}: the CUDA split-KV kernel takes up to {MAX_Q_LEN}"
        if find_nvcc() is None and cached_cubin(SOURCE, CAPABILITY) is None:
            return ("the CUDA split-KV kernel compiles at first use and needs nvcc (install the "
                    "CUDA toolkit, put nvcc on PATH or set CUDA_HOME), or a build of it made "
                    "where nvcc is: python -m trtllm_mla_plugin --build-kernels, with the "
                    "cache directory brought along (TRTLLM_MLA_CACHE_DIR)")
        return None

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        # A decoder sized for more requests than the kernel takes still holds this route for
        # the batches the policy gives it (at most MAX_BATCH).
        self.kernel_batch = min(max_batch_size, MAX_BATCH)
        self.kernel_launcher = SplitKMLADecode(device, spec.num_heads, spec.max_q_len,
                                               spec.block_size, self.kernel_batch,
                                               spec.q_dtype, kv_dtype=spec.kv_dtype)
        self._cu_q = StagedQueryOffsets(max_batch_size, device)
        self._tables = StagedTables(max_batch_size, device)
        self._tensors: tuple[torch.Tensor, ...] = ()

    def plan(self, batch: DecodeBatch) -> None:
        if batch.batch_size > self.kernel_batch:
            raise ValueError(f"{batch.batch_size} requests: the CUDA split-KV kernel takes up "
                             f"to {self.kernel_batch} per step; pick another route")
        if self.cuda_graph:
            block_table, seq_lens = self._tables.stage(batch)
        else:
            block_table = batch.block_table.to(torch.int32).contiguous()
            seq_lens = batch.seq_lens.to(torch.int32)
        cu_q = self._cu_q.stage(batch)
        self.kernel_launcher.plan(seq_lens)
        self._tensors = (block_table, seq_lens, cu_q)

    def run(
        self,
        query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        out: torch.Tensor,
        scales: KVScales,
    ) -> torch.Tensor:
        check_unit_scales(self.spec, scales)
        block_table, seq_lens, cu_q = self._tensors
        target = out if out.is_contiguous() else torch.empty_like(out)
        self.kernel_launcher.run(query, kv_cache, block_table, seq_lens, cu_q,
                                 target, self.spec.softmax_scale, scales.q_scale,
                                 scales.k_scale, scales.v_scale)
        if target is not out:
            out.copy_(target)
        return out
