"""Capture work into CUDA graph conditional nodes through the CUDA driver API:
``ops.graph_switch``'s way for torch builds whose ``torch.cuda.CUDAGraph`` has no
``begin_capture_to_if_node`` (before 2.13; the GPU machine's torch 2.11), and for what
torch's way has not: a switch node (one node, one body per branch, CUDA 12.8 drivers on)
and the kernel that sets a node's condition placed at the graph's start.

The steps are those of PyTorch's own ``CUDAGraph::begin_capture_to_if_node``: a condition
handle on the graph being captured, a kernel (``cuda/graph_if_flag.cu``) that sets it from
device memory so that each replay reads the value as it is then, the conditional node after
that kernel, whose body graphs a side stream then captures, and the capture's dependencies
moved past the node. ``setter_at_root`` adds that kernel as a root node of the graph instead
of in the stream's order: it then runs when the replay starts, beside the first layers'
work, and the node waits on it without a kernel launch on the path of the layers (the
value must then be written before the replay, as a plan does). Allocations made in a body
go to a memory pool of this module: the graph's own pool admits only its capture's
streams, and the side stream's capture is another; like a graph's pool, it is kept for the
life of the process.

A body may hold kernels, memsets and copies only (no events, host calls or other streams:
CUDA's rule for conditional bodies).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch

from .cuda_driver import CubinModule, _check, _libcuda
from .nvcc_build import build_cubin

SOURCE = Path(__file__).parent / "cuda" / "graph_if_flag.cu"

#: ``CU_GRAPH_NODE_TYPE_KERNEL``, ``CU_GRAPH_NODE_TYPE_CONDITIONAL``, ``CU_GRAPH_COND_TYPE_IF``,
#: ``CU_GRAPH_COND_TYPE_SWITCH`` (cuda.h)
NODE_TYPE_KERNEL = 0
NODE_TYPE_CONDITIONAL = 13
COND_TYPE_IF = 0
COND_TYPE_SWITCH = 2
#: ``CU_STREAM_CAPTURE_STATUS_ACTIVE``, ``CU_STREAM_SET_CAPTURE_DEPENDENCIES``,
#: ``CU_STREAM_CAPTURE_MODE_RELAXED`` (cuda.h)
CAPTURE_ACTIVE = 1
SET_CAPTURE_DEPENDENCIES = 1
CAPTURE_MODE_RELAXED = 2
#: Driver entry points the capture calls (the versioned names cuda.h maps to).
DRIVER_FUNCTIONS = ("cuStreamGetCaptureInfo_v3", "cuGraphConditionalHandleCreate",
                    "cuGraphAddNode_v2", "cuStreamUpdateCaptureDependencies_v2",
                    "cuStreamBeginCaptureToGraph", "cuStreamEndCapture", "cuCtxGetCurrent")
#: The first driver version (``cuDriverGetVersion``) with switch nodes: CUDA 12.8.
SWITCH_MIN_DRIVER = 12080

T = TypeVar("T")


class ConditionalParams(ctypes.Structure):
    """``CUDA_CONDITIONAL_NODE_PARAMS`` (cuda.h). Tests compare the layouts with cuda.h's."""

    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v3`` (cuda.h)."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint),
                ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _NodeParamsUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("kernel", KernelNodeParams),
                ("conditional", ConditionalParams)]


class GraphNodeParams(ctypes.Structure):
    """``CUgraphNodeParams`` (cuda.h): a type, 12 reserved bytes, a 232-byte union (its
    kernel and conditional members here), 8 reserved bytes."""

    _anonymous_ = ("params",)
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3),
                ("params", _NodeParamsUnion), ("reserved2", ctypes.c_longlong)]


class EdgeData(ctypes.Structure):
    """``CUgraphEdgeData`` (cuda.h); all zero: a full dependency."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class IfFlagParams(ctypes.Structure):
    """``IfFlagParams`` of ``cuda/graph_if_flag.cu``."""

    _fields_ = [("handle", ctypes.c_uint64), ("flag", ctypes.c_void_p)]


class SwitchIndexParams(ctypes.Structure):
    """``SwitchIndexParams`` of ``cuda/graph_if_flag.cu``."""

    _fields_ = [("handle", ctypes.c_uint64), ("index", ctypes.c_void_p)]


def missing_driver_functions() -> list[str]:
    """Those of ``DRIVER_FUNCTIONS`` this machine's ``libcuda`` lacks (all of them where
    there is no driver)."""
    try:
        lib = _libcuda()
    except OSError:
        return list(DRIVER_FUNCTIONS)
    return [name for name in DRIVER_FUNCTIONS if not hasattr(lib, name)]


def driver_version() -> int | None:
    """``cuDriverGetVersion`` (12080 for CUDA 12.8), ``None`` where there is no driver."""
    try:
        lib = _libcuda()
    except OSError:
        return None
    version = ctypes.c_int()
    _check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
    return version.value


@cache
def _api() -> ctypes.CDLL:
    lib = _libcuda()
    p, vp = ctypes.POINTER, ctypes.c_void_p
    lib.cuStreamGetCaptureInfo_v3.argtypes = [vp, p(ctypes.c_int), p(ctypes.c_uint64), p(vp),
                                              p(vp), p(vp), p(ctypes.c_size_t)]
    lib.cuGraphConditionalHandleCreate.argtypes = [p(ctypes.c_uint64), vp, vp, ctypes.c_uint,
                                                   ctypes.c_uint]
    lib.cuGraphAddNode_v2.argtypes = [p(vp), vp, vp, vp, ctypes.c_size_t, p(GraphNodeParams)]
    lib.cuStreamUpdateCaptureDependencies_v2.argtypes = [vp, p(vp), vp, ctypes.c_size_t,
                                                         ctypes.c_uint]
    lib.cuStreamBeginCaptureToGraph.argtypes = [vp, vp, vp, vp, ctypes.c_size_t, ctypes.c_int]
    lib.cuStreamEndCapture.argtypes = [vp, p(vp)]
    return lib


@cache
def _setters(device_index: int) -> CubinModule:
    device = torch.device("cuda", device_index)
    module = CubinModule(build_cubin(SOURCE, torch.cuda.get_device_capability(device)),
                         device)
    for name in ("set_if_flag", "set_switch_index"):
        module.function(name)
    return module


@cache
def _body_pool(device_index: int) -> torch.cuda.MemPool:
    with torch.cuda.device(device_index):  # a pool belongs to the device current at creation
        return torch.cuda.MemPool()


@cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", device_index))


_prepared: set[int] = set()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def prepare(device: torch.device) -> None:
    """Build and load the setter kernels, and make the bodies' stream and memory pool, for
    ``device``: outside capture, where loading a module and creating a stream are allowed
    (the capture functions raise on a device not prepared)."""
    index = _index(device)
    _setters(index)
    _body_pool(index)
    _side_stream(index)
    _prepared.add(index)


def _capture_info(stream: int) -> tuple[int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, int]:
    """``stream``'s capture status, graph, current dependencies (nodes and edge data, arrays
    the driver owns; edge data ``NULL`` where every edge is a full one) and their count."""
    status, capture_id = ctypes.c_int(), ctypes.c_uint64()
    graph, deps, edges, count = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(),
                                 ctypes.c_size_t())
    _check(_api().cuStreamGetCaptureInfo_v3(
        stream, ctypes.byref(status), ctypes.byref(capture_id), ctypes.byref(graph),
        ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count)),
        "cuStreamGetCaptureInfo")
    return status.value, graph, deps, edges, count.value


def _conditional_node(device: torch.device, kind: int, count: int, setter: str,
                      setter_params: ctypes.Structure, setter_at_root: bool) -> list[int]:
    """Adds to the graph the current stream captures a conditional node of ``kind`` with
    ``count`` bodies, its value set by kernel ``setter`` (one by-value argument,
    ``setter_params``, whose ``handle`` is filled in here), and moves the capture past it.
    Returns the body graphs."""
    index = _index(device)
    if index not in _prepared:
        raise RuntimeError(f"graph_if_node: call prepare(cuda:{index}) before capture (it "
                           "loads a kernel and makes a stream, which capture does not allow)")
    lib = _api()
    stream = torch.cuda.current_stream(device).cuda_stream
    status, graph, _, _, _ = _capture_info(stream)
    if status != CAPTURE_ACTIVE:
        raise RuntimeError("graph_if_node: the current stream is not capturing a CUDA graph")
    ctx, handle = ctypes.c_void_p(), ctypes.c_uint64()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    _check(lib.cuGraphConditionalHandleCreate(ctypes.byref(handle), graph, ctx, 0, 0),
           "cuGraphConditionalHandleCreate")
    setter_params.handle = handle.value
    module = _setters(index)
    function = module.function(setter)
    if not setter_at_root:
        module.launch(function, (1, 1), 1, 0, setter_params)
        _, graph, deps, edges, count_deps = _capture_info(stream)
    else:
        args = (ctypes.c_void_p * 1)(ctypes.addressof(setter_params))
        kernel = GraphNodeParams(type=NODE_TYPE_KERNEL)
        kernel.kernel = KernelNodeParams(func=function, gridDimX=1, gridDimY=1, gridDimZ=1,
                                         blockDimX=1, blockDimY=1, blockDimZ=1,
                                         kernelParams=ctypes.addressof(args), ctx=ctx)
        root = ctypes.c_void_p()
        _check(lib.cuGraphAddNode_v2(ctypes.byref(root), graph, None, None, 0,
                                     ctypes.byref(kernel)), "cuGraphAddNode (setter)")
        _, graph, stream_deps, stream_edges, n = _capture_info(stream)
        nodes = ctypes.cast(stream_deps, ctypes.POINTER(ctypes.c_void_p))
        deps = (ctypes.c_void_p * (n + 1))(*(nodes[i] for i in range(n)), root.value)
        edges = None
        if stream_edges:
            given = ctypes.cast(stream_edges, ctypes.POINTER(EdgeData))
            edges = (EdgeData * (n + 1))(*(given[i] for i in range(n)), EdgeData())
        count_deps = n + 1
    params = GraphNodeParams(type=NODE_TYPE_CONDITIONAL)
    params.conditional = ConditionalParams(handle=handle.value, type=kind, size=count,
                                           ctx=ctx)
    node = ctypes.c_void_p()
    _check(lib.cuGraphAddNode_v2(ctypes.byref(node), graph, deps, edges, count_deps,
                                 ctypes.byref(params)), "cuGraphAddNode (conditional)")
    bodies = [params.conditional.phGraph_out[i] for i in range(count)]
    _check(lib.cuStreamUpdateCaptureDependencies_v2(stream, ctypes.byref(node), None, 1,
                                                    SET_CAPTURE_DEPENDENCIES),
           "cuStreamUpdateCaptureDependencies")
    return bodies


@contextmanager
def _capturing_into(body: int, device: torch.device) -> Iterator[None]:
    """The block's work on the current device captured into graph ``body`` (on the side
    stream, its allocations from this module's pool)."""
    index = _index(device)
    lib = _api()
    side = _side_stream(index)
    _check(lib.cuStreamBeginCaptureToGraph(side.cuda_stream, body, None, None, 0,
                                           CAPTURE_MODE_RELAXED), "cuStreamBeginCaptureToGraph")
    try:
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(_body_pool(index), device):
            yield
    finally:
        ended = ctypes.c_void_p()
        _check(lib.cuStreamEndCapture(side.cuda_stream, ctypes.byref(ended)),
               "cuStreamEndCapture (conditional body)")


@contextmanager
def driver_if_node(flag: torch.Tensor, setter_at_root: bool = False) -> Iterator[None]:
    """While the current stream captures a CUDA graph: the work the block issues is captured
    into an if-node that a replay runs only while ``flag`` (a 0-dim ``torch.bool`` CUDA
    tensor, read at replay from its address) is true. ``setter_at_root``: the kernel that
    reads the flag is a root node of the graph (module docstring). Raises ``RuntimeError``
    outside capture or on a device not ``prepare``d."""
    (body,) = _conditional_node(flag.device, COND_TYPE_IF, 1, "set_if_flag",
                                IfFlagParams(0, flag.data_ptr()), setter_at_root)
    with _capturing_into(body, flag.device):
        yield


def driver_switch_node(index: torch.Tensor, branches: Sequence[Callable[[], T]],
                       setter_at_root: bool = True) -> list[T]:
    """While the current stream captures a CUDA graph: one switch node whose body ``i``
    holds the work ``branches[i]()`` issues; a replay runs the body ``index`` names (a
    0-dim ``torch.int32`` CUDA tensor, read at replay from its address; none for a value
    outside the branches). Returns each branch's result (from capture). Needs a CUDA 12.8
    driver (``SWITCH_MIN_DRIVER``)."""
    bodies = _conditional_node(index.device, COND_TYPE_SWITCH, len(branches),
                               "set_switch_index", SwitchIndexParams(0, index.data_ptr()),
                               setter_at_root)
    results = []
    for body, branch in zip(bodies, branches, strict=True):
        with _capturing_into(body, index.device):
            results.append(branch())
    return results
