"""Every decode route the plugin knows, by name. Importing this imports no kernel package."""

from __future__ import annotations

from .base import DecodeRoute
from .cuda_splitk import CudaSplitKRoute
from .flashinfer_mla import FlashInferFA2Route, FlashInferFA3Route
from .flashmla import FlashMLARoute
from .flashmla_fp8 import FlashMLAFP8Route
from .torch_reference import TorchReferenceRoute
from .triton_balanced import TritonBalancedRoute
from .trtllm_gen import CuteDslRoute, TrtllmGenRoute
from .vllm_fa3_mla import VllmFA3MLARoute

ROUTES: dict[str, type[DecodeRoute]] = {
    route.name: route
    for route in (
        TrtllmGenRoute,
        CuteDslRoute,
        FlashMLAFP8Route,
        FlashInferFA3Route,
        FlashMLARoute,
        VllmFA3MLARoute,
        TritonBalancedRoute,
        FlashInferFA2Route,
        CudaSplitKRoute,
        TorchReferenceRoute,
    )
}

__all__ = ["ROUTES", "DecodeRoute"]
