"""The pure-torch route: serves any device and configuration, slowly. CPU's route."""

from __future__ import annotations

import torch

from ..platform import Platform
from ..reference import mla_decode_reference
from ..spec import DecodeBatch, DecodeSpec, KVScales
from .base import DecodeRoute


class TorchReferenceRoute(DecodeRoute):
    name = "torch-reference"
    kernel = "pure-torch reference (trtllm_mla_plugin.ops.reference)"

    @classmethod
    def unsupported_reason(cls, spec: DecodeSpec, platform: Platform) -> str | None:
        return None

    def plan(self, batch: DecodeBatch) -> None:
        self._batch = batch

    def run(
        self, query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scales: KVScales
    ) -> torch.Tensor:
        batch = self._batch
        return mla_decode_reference(
            query,
            kv_cache,
            batch.block_table,
            batch.seq_lens,
            self.spec.softmax_scale,
            self.spec.kv_lora_rank,
            cu_seqlens_q=batch.cu_seqlens_q,
            max_seq_len=batch.max_seq_len,
            scales=scales,
            out=out,
        )
