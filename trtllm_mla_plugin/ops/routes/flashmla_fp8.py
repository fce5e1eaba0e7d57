"""Hopper route for FP8 (e4m3) caches through FlashMLA's dense FP8 decode kernel, as bundled
in vLLM (``vllm/_flashmla_extension_C.abi3.so``: ``get_mla_decoding_metadata_dense_fp8`` and
``fwd_kvcache_mla_fp8``), the kernel vLLM's own FLASHMLA backend runs for
``--kv-cache-dtype fp8`` on SM90.

Read from vLLM 0.33.0 (``v1/attention/backends/mla/flashmla.py``, ``v1/attention/ops/
flashmla.py``) and FlashMLA's ``flash_fwd_mla_fp8`` interface:

* query ``[batch, q_len, heads, 576]`` and cache ``[blocks, 64, 1, 576]``, both
  ``float8_e4m3fn``; output ``[batch, q_len, heads, 512]`` bfloat16, allocated by the kernel;
* ``descale_q`` / ``descale_k``: float32 ``[1]`` device tensors (real = stored * descale);
  the cache's descale serves both its K and V roles;
* scheduling metadata from the step's lengths: ``tile_scheduler_metadata [parts, 8]`` and
  ``num_splits [batch + 1]`` int32, written in ``plan`` into persistent buffers so that
  captured launches read each step's split. The plugin's kernel writes them
  (``kernels.flashmla_schedule`` with ``fp8_layout``: the plan of FlashMLA's FP8 scheduler,
  ``get_mla_decoding_metadata_dense_fp8``, which vLLM's FLASHMLA builder runs and copies
  into its buffers every step).

The query is read in FP8. An engine hands it over already quantised (vLLM's fused
concat + quantise, see ``engine_query_dtype``); a bf16 query is quantised here (saturating
at +-448, ``q_scale`` kept as its descale); fp16 models are not served (the kernel writes
bf16). The FP8 query costs accuracy: about
1.4e-2 to 2.4e-2 relative to float64, against ~2e-3 for the bf16-query routes
(docs/benchmarks.md); ``flashinfer-fa3`` and ``triton-balanced`` read FP8 caches with a bf16
query when that accuracy matters.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..platform import Platform
from ..spec import FP8_DTYPES, DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute, StagedTables, module_available, saturate_to_fp8
from .flashmla import FlashMLASchedule, RightAlignedQuery, flashmla_shape_reason

EXTENSION_MODULE = "vllm._flashmla_extension_C"
FP8 = torch.float8_e4m3fn


class FlashMLAFP8Route(DecodeRoute):
    name = "flashmla-fp8"
    kernel = "FlashMLA dense FP8 (vLLM bundle) fwd_kvcache_mla_fp8"
    fp8_query: ClassVar[bool] = True
    own_output: ClassVar[bool] = True

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        if platform.capability != (9, 0):
            return f"FlashMLA's dense FP8 decode runs on SM90 only; this is {platform.describe()}"
        if not spec.fp8_kv:
            return f"this route reads FP8 (e4m3) caches only, got {spec.kv_dtype}; see flashmla"
        if not module_available(EXTENSION_MODULE):
            return (f"{EXTENSION_MODULE} is not importable (FlashMLA's FP8 kernel ships inside "
                    "the CUDA build of vllm)")
        if spec.q_dtype not in (torch.bfloat16, *FP8_DTYPES):
            return (f"query dtype {spec.q_dtype}: FlashMLA's FP8 kernel takes bfloat16 or FP8 "
                    "queries and writes bfloat16; run the model in bfloat16 (--dtype bfloat16)")
        return flashmla_shape_reason(spec)

    def __init__(
        self,
        spec: DecodeSpec,
        device: torch.device,
        max_batch_size: int,
        cuda_graph: bool = False,
    ) -> None:
        super().__init__(spec, device, max_batch_size, cuda_graph)
        import importlib

        importlib.import_module(EXTENSION_MODULE)
        self._ops = torch.ops._flashmla_extension_C
        self._tables = StagedTables(max_batch_size, device)
        self._query = RightAlignedQuery(spec, max_batch_size, FP8, device)
        #: FP8 copy of a wider query (persistent: captured runs write it).
        self._query8 = (
            None if spec.q_dtype == FP8 else
            torch.empty(max_batch_size * spec.max_q_len, spec.num_heads, spec.head_dim,
                        dtype=FP8, device=device)
        )
        self._schedule = FlashMLASchedule(max_batch_size, device, fp8_layout=True)
        #: float32 [1] descale tensors by value. Why cached: the kernel reads them through
        #: a pointer, so they must outlive a captured launch, and making one per call would
        #: copy from the host on every layer.
        self._descales: dict[float, torch.Tensor] = {}
        self._batch: DecodeBatch | None = None

    def plan(self, batch: DecodeBatch) -> None:
        b, m = batch.batch_size, batch.max_q_len
        self._block_table, self._seq_lens = self._tables.stage(batch)
        self._query.plan(batch)
        self._schedule.plan(b, m * self.spec.num_heads)
        self._schedule.write(self._seq_lens)
        self._batch = batch

    def _descale(self, value: float) -> torch.Tensor:
        tensor = self._descales.get(value)
        if tensor is None:
            # torch.full launches a fill kernel (no host copy), so this is capture-safe too.
            tensor = torch.full((1,), value, dtype=torch.float32, device=self.device)
            self._descales[value] = tensor
        return tensor

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        out: torch.Tensor | None,
        scales: KVScales,
    ) -> torch.Tensor:
        spec = self.spec
        if self._query8 is not None:
            query = saturate_to_fp8(query, self._query8)
        tiles, splits = self._schedule.buffers
        result, _ = self._ops.fwd_kvcache_mla_fp8(
            self._query.gather(query),
            kv_cache.unsqueeze(-2),
            spec.kv_lora_rank,
            self._seq_lens,
            self._block_table,
            spec.softmax_scale,
            True,  # causal inside each request (the kernel ignores it for one query token)
            tiles,
            splits,
            self._descale(scales.q_scale),
            self._descale(scales.k_scale),
        )
        if scales.v_scale != scales.k_scale:
            # The kernel dequantises values with the cache's K descale.
            result.mul_(scales.v_scale / scales.k_scale)
        if out is None and not self._query.ragged:
            return result.view(-1, spec.num_heads, spec.kv_lora_rank)
        if out is None:
            out = result.new_empty(query.shape[0], spec.num_heads, spec.kv_lora_rank)
        return self._query.scatter(result, out)
