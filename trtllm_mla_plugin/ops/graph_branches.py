"""Several decode routes inside one captured CUDA graph, one of them run per replay.

Why: an engine captures one CUDA graph per batch size before it has seen any lengths, so a
route fixed at capture serves every later step of that size, short contexts and long alike
(on the H200 vLLM's FA3 MLA kernel and FlashMLA trade places by up to 1.6x with the context
length, docs/benchmarks.md). Captured behind a CUDA graph conditional node (a SWITCH node,
driver 12.8+), every route of the set is in the graph, and an ``int32`` in persistent device
memory, written by the host-side ``plan`` of each step before the replay, picks the one that
runs.

How: the CUDA driver API through ``ctypes`` (``libcuda.so.1``), which every torch build can
reach, and one one-thread kernel compiled with NVRTC (shipped with torch's CUDA wheels) that
copies the branch index into the node's condition (``cudaGraphSetConditional``). Per
captured call that is one tiny kernel and one conditional node. Branches are captured on a
side stream into the node's body graphs (``cuStreamBeginCaptureToGraph``); what they
allocate comes from a memory pool of their own, so nothing they use is handed back to
eager code while a graph may still replay it.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable, Sequence

import torch

from ..log import get_logger

logger = get_logger(__name__)

# cuda.h (CUDA 12.8+): CUgraphNodeType, CUgraphConditionalNodeType, CUstreamCaptureStatus,
# CUstreamCaptureMode, CUstreamUpdateCaptureDependencies_flags.
_NODE_TYPE_CONDITIONAL = 13
_COND_TYPE_SWITCH = 2
_CAPTURE_STATUS_ACTIVE = 1
_CAPTURE_MODE_THREAD_LOCAL = 1
_SET_CAPTURE_DEPENDENCIES = 1
#: The driver API version whose entry points are used (SWITCH nodes: CUDA 12.8).
_API_VERSION = 12080

_SET_BRANCH_SOURCE = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);
extern "C" __global__ void set_branch(cudaGraphConditionalHandle handle, const int* index) {
  cudaGraphSetConditional(handle, (unsigned int)*index);
}
"""


class _ConditionalParams(ctypes.Structure):
    """``CUDA_CONDITIONAL_NODE_PARAMS``."""

    _fields_ = [
        ("handle", ctypes.c_uint64),
        ("type", ctypes.c_int),
        ("size", ctypes.c_uint),
        ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)),
        ("ctx", ctypes.c_void_p),
    ]


class _NodeParamsUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("conditional", _ConditionalParams)]


class _NodeParams(ctypes.Structure):
    """``CUgraphNodeParams``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("reserved0", ctypes.c_int * 3),
        ("u", _NodeParamsUnion),
        ("reserved2", ctypes.c_longlong),
    ]


class _Driver:
    """The few CUDA driver and NVRTC entry points conditional capture needs."""

    def __init__(self, device: torch.device) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        vp, u64, sz, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
        self.cu.cuGetErrorString.argtypes = [i32, ctypes.POINTER(ctypes.c_char_p)]
        self.cu.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp), i32,
                                                u64, ctypes.POINTER(i32)]
        # Entry points as of CUDA 12.8 (their signature at that version, whatever newer
        # versions the driver also has).
        self.cuCtxGetCurrent = self._proc("cuCtxGetCurrent", ctypes.POINTER(vp))
        self.cuModuleLoadData = self._proc("cuModuleLoadData", ctypes.POINTER(vp), vp)
        self.cuModuleGetFunction = self._proc("cuModuleGetFunction", ctypes.POINTER(vp), vp,
                                              ctypes.c_char_p)
        self.cuLaunchKernel = self._proc("cuLaunchKernel", vp, *[ctypes.c_uint] * 7, vp,
                                         ctypes.POINTER(vp), ctypes.POINTER(vp))
        self.cuStreamGetCaptureInfo = self._proc(
            "cuStreamGetCaptureInfo", vp, ctypes.POINTER(i32), ctypes.POINTER(u64),
            ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(vp), ctypes.POINTER(sz))
        self.cuGraphConditionalHandleCreate = self._proc(
            "cuGraphConditionalHandleCreate", ctypes.POINTER(u64), vp, vp, ctypes.c_uint,
            ctypes.c_uint)
        self.cuGraphAddNode = self._proc("cuGraphAddNode", ctypes.POINTER(vp), vp, vp, vp, sz,
                                         ctypes.POINTER(_NodeParams))
        self.cuStreamUpdateCaptureDependencies = self._proc(
            "cuStreamUpdateCaptureDependencies", vp, ctypes.POINTER(vp), vp, sz, ctypes.c_uint)
        self.cuStreamBeginCaptureToGraph = self._proc("cuStreamBeginCaptureToGraph", vp, vp,
                                                      vp, vp, sz, i32)
        self.cuStreamEndCapture = self._proc("cuStreamEndCapture", vp, ctypes.POINTER(vp))
        with torch.cuda.device(device):
            torch.zeros(1, device=device)  # makes torch's context current on this thread
            major, minor = torch.cuda.get_device_capability(device)
            self.set_branch = self._compile_set_branch(f"{major}{minor}")

    def _proc(self, name: str, *argtypes) -> Callable[..., int]:
        fn, found = ctypes.c_void_p(), ctypes.c_int()
        self.check(self.cu.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), _API_VERSION,
                                               0, ctypes.byref(found)),
                   f"cuGetProcAddress({name})")
        if not fn.value:
            raise RuntimeError(f"the CUDA driver has no {name} of CUDA {_API_VERSION}")
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(fn.value)

    def check(self, result: int, what: str) -> None:
        if result != 0:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(result, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise RuntimeError(f"{what} failed: CUDA error {result} ({text})")

    def _compile_set_branch(self, arch: str) -> ctypes.c_void_p:
        nvrtc = _load_nvrtc()
        prog = ctypes.c_void_p()
        src = _SET_BRANCH_SOURCE.encode()
        if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"set_branch.cu", 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture=sm_{arch}".encode())
        if nvrtc.nvrtcCompileProgram(prog, 1, opts):
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the branch selector: {log.value!r}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
        self._cubin = cubin  # the module keeps pointing into it
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cuModuleLoadData(ctypes.byref(module), ctypes.cast(cubin, ctypes.c_void_p)),
                   "cuModuleLoadData")
        self.check(self.cuModuleGetFunction(ctypes.byref(fn), module, b"set_branch"),
                   "cuModuleGetFunction")
        self._module = module
        return fn


def _load_nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "0").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for root in {os.path.dirname(os.path.dirname(torch.__file__))}:
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        names += sorted(glob.glob(os.path.join(root, "nvidia", "*", "*", "lib",
                                               "libnvrtc.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("NVRTC (libnvrtc) not found; it ships with torch's CUDA wheels")


_DRIVERS: dict[int, _Driver | Exception] = {}


def _driver(device: torch.device) -> _Driver:
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _DRIVERS.get(index)
    if found is None:
        try:
            found = _Driver(torch.device("cuda", index))
        except Exception as error:  # recorded: the caller falls back once, not per call
            found = error
        _DRIVERS[index] = found
    if isinstance(found, Exception):
        raise found
    return found


def conditional_graphs_available(device: torch.device | None = None) -> bool:
    """Whether captured CUDA graphs on ``device`` can hold conditional nodes here: a CUDA
    device, a driver with the 12.8 graph API, NVRTC to build the branch selector. The
    first call per device compiles the selector (a fraction of a second)."""
    if (torch.version.cuda is None or not torch.cuda.is_available()
            or not hasattr(torch.cuda, "use_mem_pool")):
        return False
    try:
        _driver(torch.device("cuda") if device is None else device)
    except Exception as error:
        logger.warning("CUDA graph conditional nodes unavailable (%s: %s); CUDA-graph "
                       "decoders keep one route per batch size", type(error).__name__, error)
        return False
    return True


class GraphBranches:
    """The branch index in persistent device memory, and the capture of a set of branches
    behind one SWITCH node reading it.

    Why persistent: a captured graph reads the index's address at every replay, so
    ``select`` writes it in place (stream-ordered, no host synchronisation) and the next
    replay runs that branch only.
    """

    def __init__(self, count: int, device: torch.device) -> None:
        if count < 2:
            raise ValueError(f"GraphBranches needs at least two branches, got {count}")
        self.count = count
        self.device = device
        #: ``[1]`` int32: the branch the next replay runs.
        self.index = torch.zeros(1, dtype=torch.int32, device=device)
        self.selected: int | None = None
        # Made here, outside any capture: the stream the bodies are captured on, and the
        # pool their allocations come from (kept for as long as a graph may replay them).
        cuda = device.type == "cuda"
        self._side_stream = torch.cuda.Stream(device) if cuda else None
        self._pool = torch.cuda.MemPool() if cuda else None

    def select(self, index: int) -> None:
        """Make ``index`` the branch that replays run (call outside capture, before the
        replay, on the stream that replays)."""
        if not 0 <= index < self.count:
            raise IndexError(f"branch {index} of {self.count}")
        if index != self.selected:
            self.index.fill_(index)
            self.selected = index

    def capture(self, branches: Sequence[Callable[[], object]]) -> None:
        """Capture each callable as one body of a SWITCH node on ``index`` (the current
        stream must be capturing). Each branch must leave its result where the graph's
        later nodes read it (an output buffer shared by all branches)."""
        if len(branches) != self.count:
            raise ValueError(f"{len(branches)} branches for {self.count}")
        cu = _driver(self.device)
        check = cu.check
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        status, graph = ctypes.c_int(), ctypes.c_void_p()
        check(cu.cuStreamGetCaptureInfo(stream, ctypes.byref(status), None,
                                           ctypes.byref(graph), None, None, None),
              "cuStreamGetCaptureInfo")
        if status.value != _CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("GraphBranches.capture needs a capturing stream")
        ctx = ctypes.c_void_p()
        check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        handle = ctypes.c_uint64()
        check(cu.cuGraphConditionalHandleCreate(ctypes.byref(handle), graph, ctx, 0, 0),
              "cuGraphConditionalHandleCreate")
        arg_handle = ctypes.c_uint64(handle.value)
        arg_index = ctypes.c_void_p(self.index.data_ptr())
        args = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(arg_handle), ctypes.c_void_p),
                                     ctypes.cast(ctypes.byref(arg_index), ctypes.c_void_p))
        check(cu.cuLaunchKernel(cu.set_branch, 1, 1, 1, 1, 1, 1, 0, stream, args, None),
              "launching the branch selector")
        deps, edges, count = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_size_t()
        check(cu.cuStreamGetCaptureInfo(stream, ctypes.byref(status), None,
                                           ctypes.byref(graph), ctypes.byref(deps),
                                           ctypes.byref(edges), ctypes.byref(count)),
              "cuStreamGetCaptureInfo")
        params = _NodeParams()
        params.type = _NODE_TYPE_CONDITIONAL
        params.u.conditional.handle = handle.value
        params.u.conditional.type = _COND_TYPE_SWITCH
        params.u.conditional.size = self.count
        params.u.conditional.ctx = ctx
        node = ctypes.c_void_p()
        check(cu.cuGraphAddNode(ctypes.byref(node), graph, deps, edges, count,
                                   ctypes.byref(params)), "adding the conditional node")
        bodies = [params.u.conditional.phGraph_out[i] for i in range(self.count)]
        check(cu.cuStreamUpdateCaptureDependencies(stream, ctypes.byref(node), None, 1,
                                                      _SET_CAPTURE_DEPENDENCIES),
              "cuStreamUpdateCaptureDependencies")
        side = ctypes.c_void_p(self._side_stream.cuda_stream)
        for body, branch in zip(bodies, branches, strict=True):
            check(cu.cuStreamBeginCaptureToGraph(side, ctypes.c_void_p(body), None, None, 0,
                                                 _CAPTURE_MODE_THREAD_LOCAL),
                  "capturing a branch")
            try:
                with torch.cuda.stream(self._side_stream), torch.cuda.use_mem_pool(self._pool):
                    branch()
            finally:
                ended = ctypes.c_void_p()
                check(cu.cuStreamEndCapture(side, ctypes.byref(ended)), "ending a branch")
