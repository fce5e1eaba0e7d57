"""Which machine a decode runs on: CPU, or a CUDA GPU of some compute capability."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class Platform:
    """The device a decode route would run on.

    Attributes:
        kind: ``"cuda"`` or ``"cpu"`` (anything else torch knows is treated as ``"other"``).
        capability: CUDA compute capability ``(major, minor)``, ``None`` off CUDA.
        name: device name for messages, e.g. ``"NVIDIA H200"``.
        sm_count: streaming multiprocessors (132 on an H200), ``None`` off CUDA; rules that
            model how a kernel plans its work over the SMs read it.
    """

    kind: str
    capability: tuple[int, int] | None = None
    name: str = ""
    sm_count: int | None = None

    @property
    def sm(self) -> int | None:
        """Capability as one number (90 for SM90), ``None`` off CUDA."""
        if self.capability is None:
            return None
        return self.capability[0] * 10 + self.capability[1]

    def describe(self) -> str:
        if self.kind != "cuda":
            return self.kind
        return f"{self.name} (SM{self.sm})"


CPU = Platform(kind="cpu", name="cpu")


@cache
def _cuda_platform(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    return Platform("cuda", (props.major, props.minor), props.name, props.multi_processor_count)


def platform_of(device: torch.device | str) -> Platform:
    """Platform of ``device``; queries CUDA only for CUDA devices."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_platform(index)
    return Platform(kind="other", name=device.type)
