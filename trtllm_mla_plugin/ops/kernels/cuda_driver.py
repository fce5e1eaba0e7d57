"""Load a cubin and launch its kernels on torch's current stream through the CUDA driver API.

Why ctypes on ``libcuda``: every machine that runs a CUDA torch has the driver library, and
its C ABI is stable; no extra package is needed. Launches go to
``torch.cuda.current_stream()``, so they order with torch's work and are recorded when a
CUDA graph is being captured (a captured launch keeps the argument values it was given).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

#: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``
_MAX_DYNAMIC_SHARED = 8
#: ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an id, padding to 8 bytes, a 64-byte value union whose
    first member here is the int ``programmaticStreamSerializationAllowed``. Tests compare
    the layout with cuda.h's."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                        ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    if hasattr(lib, "cuLaunchKernelEx"):
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(msg))
        name = msg.value.decode() if msg.value else "unknown error"
        raise RuntimeError(f"CUDA driver: {what} failed with {result} ({name})")


def _make_primary_context_current(index: int) -> None:
    """torch runs on each device's primary context; make it current on this thread (torch
    may not have touched the device from this thread yet)."""
    lib = _libcuda()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class CubinModule:
    """The kernels of one cubin, loaded on one CUDA device."""

    def __init__(self, cubin: Path, device: torch.device) -> None:
        torch.cuda.init()
        self.device = torch.device(device)
        self._index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device())
        _make_primary_context_current(self._index)
        self._image = ctypes.create_string_buffer(Path(cubin).read_bytes())  # kept alive
        self._module = ctypes.c_void_p()
        _check(_libcuda().cuModuleLoadData(ctypes.byref(self._module), self._image),
               f"loading {Path(cubin).name}")
        self._functions: dict[str, ctypes.c_void_p] = {}
        #: Whether programmatic dependent launches work here (None: not tried yet).
        self.programmatic: bool | None = None if hasattr(_libcuda(), "cuLaunchKernelEx") else False
        self._attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)

    def function(self, name: str, dynamic_shared_bytes: int = 0) -> ctypes.c_void_p:
        """Kernel ``name`` (an ``extern "C"`` entry point), allowed ``dynamic_shared_bytes``
        of dynamic shared memory (above 48 KiB it must be raised explicitly)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            _check(_libcuda().cuModuleGetFunction(ctypes.byref(fn), self._module,
                                                  name.encode()), f"finding kernel {name}")
            self._functions[name] = fn
        if dynamic_shared_bytes > 48 * 1024:
            _check(_libcuda().cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED,
                                                 dynamic_shared_bytes),
                   f"allowing {dynamic_shared_bytes} bytes of shared memory to {name}")
        return fn

    def launch(self, fn: ctypes.c_void_p, grid: tuple[int, int], threads: int,
               shared_bytes: int, params: ctypes.Structure,
               programmatic: bool = False) -> None:
        """Launch ``fn`` with one by-value argument, the struct ``params``, on torch's
        current stream of this module's device. ``programmatic``: allowed to start before
        the previous kernel on the stream has finished (it must wait for it itself, with
        ``griddepcontrol.wait``); where the driver refuses that on the first try, every
        launch is a plain one."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        if programmatic and self.programmatic is not False:
            config = LaunchConfig(grid[0], grid[1], 1, threads, 1, 1, shared_bytes, stream,
                                  ctypes.pointer(self._attr), 1)
            result = _libcuda().cuLaunchKernelEx(ctypes.byref(config), fn, args, None)
            if result == 0:
                self.programmatic = True
                return
            if self.programmatic:  # worked before: a real failure
                _check(result, "cuLaunchKernelEx")
            self.programmatic = False
        _check(_libcuda().cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, shared_bytes,
                                         stream, args, None), "cuLaunchKernel")
