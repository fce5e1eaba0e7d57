"""Which eligible route is preferred, per GPU generation: one ranking, built from measurements.

Eligibility (what a route *can* serve) lives with each route; this module only orders names.
The evidence for each order is in docs/benchmarks.md.
"""

from __future__ import annotations

from .platform import Platform
from .spec import DecodeSpec

REFERENCE = "torch-reference"

# SM100/SM103: TRTLLM-gen is the kernel the plugin exists for; FlashInfer's CuTe DSL MLA
# kernel takes head counts TRTLLM-gen cannot tile.
BLACKWELL = ("trtllm-gen", "flashinfer-cute-dsl", "flashinfer-fa2", REFERENCE)
# SM90: FlashInfer FA3 won or tied most shapes on the H200 (../docs/benchmarks.md);
# FlashMLA next, FA2 last among kernels.
HOPPER = ("flashinfer-fa3", "flashmla", "flashinfer-fa2", REFERENCE)
AMPERE_ADA = ("flashinfer-fa2", REFERENCE)
OTHER = (REFERENCE,)


def rank(spec: DecodeSpec, platform: Platform) -> tuple[str, ...]:
    """Route names for ``spec`` on ``platform``, most preferred first (eligibility ignored)."""
    del spec  # the per-shape Hopper policy of docs/benchmarks.md plugs in here
    if platform.kind != "cuda" or platform.capability is None:
        return OTHER
    major = platform.capability[0]
    if platform.capability in ((10, 0), (10, 3)):
        return BLACKWELL
    if major == 9:
        return HOPPER
    if platform.capability >= (8, 0):
        return AMPERE_ADA
    return OTHER
