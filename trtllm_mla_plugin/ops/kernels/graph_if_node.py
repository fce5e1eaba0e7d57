"""Capture work into a CUDA graph if-node through the CUDA driver API: ``ops.graph_switch``'s
way for torch builds whose ``torch.cuda.CUDAGraph`` has no ``begin_capture_to_if_node``
(before 2.13; the GPU machine's torch 2.11).

The steps are those of PyTorch's own ``CUDAGraph::begin_capture_to_if_node``: a condition
handle on the graph being captured, a kernel (``cuda/graph_if_flag.cu``) that sets it from a
flag in device memory so that each replay reads the flag as it is then, an if-node after
that kernel, whose body graph a side stream then captures, and the capture's dependencies
moved past the node. Allocations made in the body go to a memory pool of this module: the
graph's own pool admits only its capture's streams, and the side stream's capture is
another; like a graph's pool, it is kept for the life of the process.

The body may hold kernels, memsets and copies only (no events, host calls or other streams:
CUDA's rule for conditional bodies).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from .cuda_driver import CubinModule, _check, _libcuda
from .nvcc_build import build_cubin

SOURCE = Path(__file__).parent / "cuda" / "graph_if_flag.cu"

#: ``CU_GRAPH_NODE_TYPE_CONDITIONAL``, ``CU_GRAPH_COND_TYPE_IF`` (cuda.h)
NODE_TYPE_CONDITIONAL = 13
COND_TYPE_IF = 0
#: ``CU_STREAM_CAPTURE_STATUS_ACTIVE``, ``CU_STREAM_SET_CAPTURE_DEPENDENCIES``,
#: ``CU_STREAM_CAPTURE_MODE_RELAXED`` (cuda.h)
CAPTURE_ACTIVE = 1
SET_CAPTURE_DEPENDENCIES = 1
CAPTURE_MODE_RELAXED = 2
#: Driver entry points the capture calls (the versioned names cuda.h maps to).
DRIVER_FUNCTIONS = ("cuStreamGetCaptureInfo_v3", "cuGraphConditionalHandleCreate",
                    "cuGraphAddNode_v2", "cuStreamUpdateCaptureDependencies_v2",
                    "cuStreamBeginCaptureToGraph", "cuStreamEndCapture", "cuCtxGetCurrent")


class ConditionalParams(ctypes.Structure):
    """``CUDA_CONDITIONAL_NODE_PARAMS`` (cuda.h). Tests compare the layout with cuda.h's."""

    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class GraphNodeParams(ctypes.Structure):
    """``CUgraphNodeParams`` (cuda.h) with its union as the conditional member: a type, 12
    reserved bytes, a 232-byte union, 8 reserved bytes."""

    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3),
                ("conditional", ConditionalParams),
                ("union_rest", ctypes.c_char * (232 - ctypes.sizeof(ConditionalParams))),
                ("reserved2", ctypes.c_longlong)]


class IfFlagParams(ctypes.Structure):
    """``IfFlagParams`` of ``cuda/graph_if_flag.cu``."""

    _fields_ = [("handle", ctypes.c_uint64), ("flag", ctypes.c_void_p)]


def missing_driver_functions() -> list[str]:
    """Those of ``DRIVER_FUNCTIONS`` this machine's ``libcuda`` lacks (all of them where
    there is no driver)."""
    try:
        lib = _libcuda()
    except OSError:
        return list(DRIVER_FUNCTIONS)
    return [name for name in DRIVER_FUNCTIONS if not hasattr(lib, name)]


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
def _setter(device_index: int) -> tuple[CubinModule, ctypes.c_void_p]:
    device = torch.device("cuda", device_index)
    module = CubinModule(build_cubin(SOURCE, torch.cuda.get_device_capability(device)),
                         device)
    return module, module.function("set_if_flag")


@cache
def _body_pool(device_index: int) -> torch.cuda.MemPool:
    return torch.cuda.MemPool()


@cache
def _side_stream(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", device_index))


def prepare(device: torch.device) -> None:
    """Build and load the flag kernel, and make the body's stream and memory pool, for
    ``device``: outside capture, where loading a module and creating a stream are allowed
    (``driver_if_node`` raises on a device not prepared)."""
    index = _index(device)
    _setter(index)
    _body_pool(index)
    _side_stream(index)
    _prepared.add(index)


_prepared: set[int] = set()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capture_info(stream: int) -> tuple[int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_void_p, int]:
    """``stream``'s capture status, graph, current dependencies (nodes and edge data, arrays
    the driver owns) and their count."""
    status, capture_id = ctypes.c_int(), ctypes.c_uint64()
    graph, deps, edges, count = (ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(),
                                 ctypes.c_size_t())
    _check(_api().cuStreamGetCaptureInfo_v3(
        stream, ctypes.byref(status), ctypes.byref(capture_id), ctypes.byref(graph),
        ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count)),
        "cuStreamGetCaptureInfo")
    return status.value, graph, deps, edges, count.value


@contextmanager
def driver_if_node(flag: torch.Tensor) -> Iterator[None]:
    """While the current stream captures a CUDA graph: the work the block issues is captured
    into an if-node that a replay runs only while ``flag`` (a 0-dim ``torch.bool`` CUDA
    tensor, read at replay from its address) is true. Raises ``RuntimeError`` outside
    capture or on a device not ``prepare``d."""
    index = _index(flag.device)
    if index not in _prepared:
        raise RuntimeError(f"driver_if_node: call prepare(cuda:{index}) before capture (it "
                           "loads a kernel and makes a stream, which capture does not allow)")
    lib = _api()
    stream = torch.cuda.current_stream(flag.device).cuda_stream
    status, graph, _, _, _ = _capture_info(stream)
    if status != CAPTURE_ACTIVE:
        raise RuntimeError("driver_if_node: the current stream is not capturing a CUDA graph")
    ctx, handle = ctypes.c_void_p(), ctypes.c_uint64()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    _check(lib.cuGraphConditionalHandleCreate(ctypes.byref(handle), graph, ctx, 0, 0),
           "cuGraphConditionalHandleCreate")
    module, setter = _setter(index)
    module.launch(setter, (1, 1), 1, 0, IfFlagParams(handle.value, flag.data_ptr()))
    _, graph, deps, edges, count = _capture_info(stream)
    params = GraphNodeParams(type=NODE_TYPE_CONDITIONAL)
    params.conditional = ConditionalParams(handle=handle.value, type=COND_TYPE_IF, size=1,
                                           ctx=ctx)
    node = ctypes.c_void_p()
    _check(lib.cuGraphAddNode_v2(ctypes.byref(node), graph, deps, edges, count,
                                 ctypes.byref(params)), "cuGraphAddNode (if-node)")
    body = params.conditional.phGraph_out[0]
    _check(lib.cuStreamUpdateCaptureDependencies_v2(stream, ctypes.byref(node), None, 1,
                                                    SET_CAPTURE_DEPENDENCIES),
           "cuStreamUpdateCaptureDependencies")
    side = _side_stream(index)
    _check(lib.cuStreamBeginCaptureToGraph(side.cuda_stream, body, None, None, 0,
                                           CAPTURE_MODE_RELAXED), "cuStreamBeginCaptureToGraph")
    try:
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(_body_pool(index), flag.device):
            yield
    finally:
        ended = ctypes.c_void_p()
        _check(lib.cuStreamEndCapture(side.cuda_stream, ctypes.byref(ended)),
               "cuStreamEndCapture (if-node body)")
