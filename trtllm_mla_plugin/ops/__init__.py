"""Engine-agnostic MLA decode: routes per GPU generation and a pure-torch reference.

Imports no engine (vLLM) and no kernel package at import time.
"""

from .decoder import (
    MLADecoder,
    QueryJoin,
    RouteChoice,
    choose_route,
    engine_query_dtype,
    join_query_parts,
    mla_decode,
    route_set,
    small_prefill_choice,
    small_prefill_spec,
)
from .platform import Platform, platform_of
from .reference import mla_decode_reference
from .spec import UNIT_SCALES, DecodeBatch, DecodeSpec, KVScales

__all__ = [
    "UNIT_SCALES",
    "DecodeBatch",
    "DecodeSpec",
    "KVScales",
    "MLADecoder",
    "Platform",
    "QueryJoin",
    "RouteChoice",
    "choose_route",
    "engine_query_dtype",
    "join_query_parts",
    "mla_decode",
    "mla_decode_reference",
    "platform_of",
    "route_set",
    "small_prefill_choice",
    "small_prefill_spec",
]
