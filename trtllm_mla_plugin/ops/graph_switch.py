"""Work in a CUDA graph that a replay runs only when device memory says so: CUDA graph
conditional nodes, so one captured graph can hold several decode routes and each replay run
the one its step's plan picked.

``if_node(flag)`` takes torch's own capture (``torch.cuda.CUDAGraph.begin_capture_to_if_node``,
torch 2.13 and later: vLLM 0.33's torch 2.14) where there is one, else the same steps
through the CUDA driver API (``kernels.graph_if_node``: its kernel that reads the flag is
compiled with ``nvcc`` at first use, as the cuda-splitk route's kernel is); a block's node
and the kernel that reads its flag then sit on the path of the work around it.
``switch_node(index, branches)`` (the driver API only) holds every branch in one node and
reads ``index`` in a kernel that runs when the replay starts, off that path.

Not used by the decoder: a node costs too much for a per-step route switch. Run 240 (H100,
driver 580.159.04, torch 2.11 through the driver API; ``benchmarks/conditional_node_cost.py``):
each node of either kind adds 8.5-9.6 us to a replay over the bare kernel (1.5 us), where
replays of run 180's shapes show a switch in every layer gaining only at about 0.25 us a call
(``docs/bench-2026-12-05/run228-criteria.txt``, addenda 6-7). Kept for the probe
(``benchmarks/graph_switch_probe.py``) and to measure again on newer drivers and torch.
Open in the probe (run 240, not explained): with ten calls in one graph, the first of two
if-nodes' blocks did not run though a one-call graph ran it; three shapes failed to capture
(``cuStreamBeginCaptureToGraph``: 401).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")

#: The ``torch.cuda.CUDAGraph`` methods of torch's if-node capture.
TORCH_IF_NODE_METHODS = ("get_currently_capturing_graph", "begin_capture_to_if_node",
                         "end_capture_to_conditional_node")


def torch_has_if_nodes() -> bool:
    """Whether this torch captures if-nodes itself."""
    return all(hasattr(torch.cuda.CUDAGraph, m) for m in TORCH_IF_NODE_METHODS)


def if_node_support() -> str | None:
    """``None`` where ``if_node`` can capture on this machine, else why not (cheap: no
    compilation, no CUDA work)."""
    if torch_has_if_nodes():
        return None
    from .kernels.graph_if_node import missing_driver_functions

    missing = missing_driver_functions()
    if missing:
        return (f"torch {torch.__version__} has no if-node capture and the CUDA driver lacks "
                f"{', '.join(missing)} (needs a driver of CUDA 12.4 or later)")
    why = _driver_way_missing()
    return None if why is None else f"torch {torch.__version__} has no if-node capture; {why}"


def _driver_way_missing() -> str | None:
    """What the driver-API way lacks here besides the driver (``None``: nothing)."""
    from .kernels.nvcc_build import find_nvcc

    if not hasattr(torch.cuda, "use_mem_pool"):
        return f"torch {torch.__version__} has no torch.cuda.use_mem_pool"
    if find_nvcc() is None:
        return ("the driver-API way compiles its kernels with nvcc, which is not here "
                "(CUDA_HOME or PATH)")
    return None


def switch_node_support() -> str | None:
    """``None`` where ``switch_node`` can capture on this machine, else why not."""
    from .kernels.graph_if_node import SWITCH_MIN_DRIVER, driver_version

    version = driver_version()
    if version is None or version < SWITCH_MIN_DRIVER:
        return f"CUDA driver {version}: switch nodes need {SWITCH_MIN_DRIVER} (CUDA 12.8)"
    return _driver_way_missing()


def prepare_if_nodes(device: torch.device | str, driver: bool = False) -> None:
    """What ``if_node`` (and, with ``driver``, ``switch_node``) needs on ``device`` made
    ready; call before capture (the driver-API way loads its kernels and makes a stream,
    which capture does not allow; torch's own needs nothing)."""
    if driver or not torch_has_if_nodes():
        from .kernels.graph_if_node import prepare

        prepare(torch.device(device))


def _check_capturing(what: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    """``ValueError`` unless ``value`` is a 0-dim CUDA tensor of ``dtype``; ``RuntimeError``
    unless the current stream captures a CUDA graph."""
    if value.dim() != 0 or value.dtype != dtype or not value.is_cuda:
        raise ValueError(f"{what} takes a 0-dim {dtype} CUDA tensor, got {value.dtype} of "
                         f"shape {tuple(value.shape)} on {value.device}")
    if not torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what} is for CUDA graph capture; the current stream is not "
                           "capturing")


def switch_node(index: torch.Tensor, branches: Sequence[Callable[[], T]]) -> list[T]:
    """Under CUDA graph capture: the work each of ``branches`` issues, in one switch node
    whose replay runs branch ``index`` only.

    Args:
        index: ``[]`` (0-dim) ``torch.int32`` on the capturing device, at a fixed address:
            read when each replay starts (write it before ``replay``); a value outside
            ``range(len(branches))`` runs none.
        branches: callables issuing each branch's work (called once each, at capture).

    Returns each branch's result. Raises ``RuntimeError`` outside capture or on a device
    not readied by ``prepare_if_nodes(device, driver=True)``.
    """
    _check_capturing("switch_node", index, torch.int32)
    from .kernels.graph_if_node import driver_switch_node

    return driver_switch_node(index, branches)


@contextmanager
def if_node(flag: torch.Tensor) -> Iterator[None]:
    """While the current stream captures a CUDA graph, the work the block issues goes into
    an if-node: a replay runs it only while ``flag`` is true.

    Args:
        flag: ``[]`` (0-dim) ``torch.bool`` on the capturing device, at a fixed address:
            the graph reads it at each replay (write it before ``replay``).

    Raises ``RuntimeError`` outside capture (callers run the work they want directly) and,
    for the driver-API way, on a device not readied by ``prepare_if_nodes``.
    """
    _check_capturing("if_node", flag, torch.bool)
    if torch_has_if_nodes():
        graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        graph.begin_capture_to_if_node(flag)
        try:
            yield
        finally:
            graph.end_capture_to_conditional_node()
        return
    from .kernels.graph_if_node import driver_if_node

    with driver_if_node(flag):
        yield
