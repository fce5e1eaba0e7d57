"""The plugin's own decode kernel (``ops.kernels.balanced_mla_decode``, Triton): KV pages
split evenly over a fixed number of CTAs whatever the lengths. On the H200 it is 1.3-2.1x
faster than FlashInfer FA3 on FP8 caches with 16 heads and batches of 32+, and slower than
FA3/FlashMLA on bf16 caches (docs/benchmarks-history.md, runs 6-10).

Eligibility: CUDA SM80+ with Triton; power-of-two latent and RoPE widths (Triton tiles);
bf16/fp16 queries with a cache of the same dtype or FP8 e4m3; up to 16 query tokens per
request. Which batches it serves is ``ops.policy``'s call (SM90 only, from measurements).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..platform import Platform
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import (
    DecodeRoute,
    StagedQueryOffsets,
    StagedTables,
    check_unit_scales,
    module_available,
)

MAX_Q_LEN = 16
#: Rows (heads x query tokens) one CTA multiplies at once; bounds the fp32 accumulator
#: (rows x kv_lora_rank) held in registers.
MAX_TILE_ROWS = 64
#: Budget for the split-KV scratch (partial outputs); the CTA count shrinks to fit it.
MAX_SCRATCH_BYTES = 256 * 1024**2


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class LaunchConfig:
    """Kernel tile and grid choices (measured on the H200, docs/benchmarks-history.md).

    Attributes:
        ctas_per_sm: CTAs the pages are spread over, per SM (one wave when they fit).
        block_n: KV tokens per inner-loop tile (divides the page size).
        num_warps: warps per CTA.
        num_stages: software-pipeline depth of the KV tile loads.
        min_tokens_per_cta: small batches spread over fewer CTAs, at least this many KV
            tokens each (fewer partial results to merge).
    """

    ctas_per_sm: int = 2
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    min_tokens_per_cta: int = 256


def default_config(spec: DecodeSpec) -> LaunchConfig:
    rows = tile_heads(spec) * padded_q_len(spec)
    return LaunchConfig(num_warps=4 if rows <= 16 else 8,
                        block_n=min(32, spec.block_size))


def padded_q_len(spec: DecodeSpec) -> int:
    return 1 << (spec.max_q_len - 1).bit_length()


def tile_heads(spec: DecodeSpec) -> int:
    """Heads per CTA: as many as fit ``MAX_TILE_ROWS`` rows, at least 16 rows (tl.dot)."""
    q = padded_q_len(spec)
    heads = 1 << (spec.num_heads - 1).bit_length()
    return max(min(heads, MAX_TILE_ROWS // q), max(1, 16 // q))


class TritonBalancedRoute(DecodeRoute):
    name = "triton-balanced"
    kernel = "trtllm_mla_plugin page-balanced split-KV decode (Triton)"

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.kind != "cuda" or platform.capability is None:
            return f"the Triton decode kernel needs a CUDA GPU; this is {platform.describe()}"
        if platform.capability < (8, 0):
            return f"the Triton decode kernel needs SM80 or newer; this is {platform.describe()}"
        if not module_available("triton"):
            return "triton is not installed (it comes with torch on Linux: pip install triton)"
        if not (_power_of_two(spec.kv_lora_rank) and 64 <= spec.kv_lora_rank <= 512):
            return (f"kv_lora_rank={spec.kv_lora_rank}: the Triton kernel needs a power of two "
                    "in [64, 512]")
        if not (_power_of_two(spec.rope_dim) and spec.rope_dim >= 16):
            return f"rope_dim={spec.rope_dim}: the Triton kernel needs a power of two >= 16"
        if not (_power_of_two(spec.block_size) and spec.block_size >= 16):
            return f"block size {spec.block_size}: the Triton kernel needs a power of two >= 16"
        if spec.q_dtype not in (torch.bfloat16, torch.float16):
            return f"the Triton kernel takes bfloat16/float16 queries, got {spec.q_dtype}"
        if spec.kv_dtype not in (spec.q_dtype, torch.float8_e4m3fn):
            return (f"the Triton kernel reads a {spec.q_dtype} or FP8 e4m3 cache, "
                    f"got {spec.kv_dtype}")
        if spec.max_q_len > MAX_Q_LEN:
            return f"max_q_len={spec.max_q_len}: the Triton kernel takes up to {MAX_Q_LEN}"
        return None

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        from ..kernels import balanced_mla_decode as kernels

        self._kernels = kernels
        #: Launch configuration, read at each ``plan`` (benchmarks replace it between plans).
        self.config = default_config(spec)
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        n = max_batch_size
        i32 = {"dtype": torch.int32, "device": device}
        self._cu_q = StagedQueryOffsets(n, device)
        #: [batch + 1] KV-page prefix sums of the planned batch; persistent so a captured
        #: launch reads each step's values.
        self._page_start = torch.zeros(n + 1, **i32)
        self._tables = StagedTables(n, device)
        #: Split-KV scratch: partial outputs and their LSEs (fp32), grown in ``plan``.
        self._part_out = torch.empty(0, dtype=torch.float32, device=device)
        self._part_lse = torch.empty(0, dtype=torch.float32, device=device)
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._launch: dict[str, int] = {}

    def _num_ctas(self) -> int:
        spec = self.spec
        per_cta = 2 * padded_q_len(spec) * spec.num_heads * (spec.kv_lora_rank + 1) * 4
        return max(1, min(self._sms * self.config.ctas_per_sm, MAX_SCRATCH_BYTES // per_cta))

    def plan(self, batch: DecodeBatch) -> None:
        spec, config = self.spec, self.config
        b, page = batch.batch_size, spec.block_size
        if self.cuda_graph:
            block_table, seq_lens = self._tables.stage(batch)
        else:
            block_table = batch.block_table.to(torch.int32)
            seq_lens = batch.seq_lens.to(torch.int32)
        cu_q, page_start = self._cu_q.stage(batch), self._page_start[: b + 1]
        pages = (seq_lens + (page - 1)) // page
        torch.cumsum(pages, 0, dtype=torch.int32, out=page_start[1:])
        num_ctas = self._num_ctas()
        rows = num_ctas * 2 * padded_q_len(spec) * spec.num_heads
        if self._part_lse.numel() < rows:
            self._part_out = torch.empty(rows * spec.kv_lora_rank, dtype=torch.float32,
                                         device=self.device)
            self._part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)
        self._tensors = (block_table, seq_lens, cu_q, page_start)
        self._launch = {
            "kv_lora_rank": spec.kv_lora_rank,
            "max_q_len": padded_q_len(spec),
            "block_h": tile_heads(spec),
            "num_ctas": num_ctas,
            "min_pages": max(1, config.min_tokens_per_cta // page),
            "search_steps": self.max_batch_size.bit_length() + 1,
            "block_n": config.block_n,
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
        }

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scales: KVScales
    ) -> torch.Tensor:
        spec = self.spec
        check_unit_scales(spec, scales)
        block_table, seq_lens, cu_q, page_start = self._tensors
        return self._kernels.balanced_mla_decode(
            query, kv_cache, block_table, seq_lens, cu_q, page_start, out,
            self._part_out, self._part_lse,
            softmax_scale=spec.softmax_scale * scales.q_scale,
            k_scale=scales.k_scale,
            v_scale=scales.v_scale,
            **self._launch,
        )
