"""``ops.graph_switch`` and its driver-API way (``kernels.graph_if_node``) without a GPU: the
structs and constants against cuda.h, the flag kernel's build, and when each way is taken.
Capture and replay are tested on the GPU (tests/gpu/test_graph_switch_gpu.py)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch
from test_splitk_kernel_cpu import _cuda_header

from trtllm_mla_plugin.ops import graph_switch
from trtllm_mla_plugin.ops.kernels import graph_if_node, nvcc_build
from trtllm_mla_plugin.ops.kernels.graph_if_node import (
    ConditionalParams,
    EdgeData,
    GraphNodeParams,
    KernelNodeParams,
)

NEEDS_HEADER = pytest.mark.skipif(_cuda_header() is None or shutil.which("g++") is None,
                                  reason="needs the CUDA toolkit's cuda.h and g++")


def _offsets_program(struct: str, fields: list[str], label: str) -> str:
    return (f'  std::printf("{label} %zu\\n", sizeof({struct}));\n'
            + "".join(f'  std::printf("{label}.{n} %zu\\n", offsetof({struct}, {n}));\n'
                      for n in fields))


@NEEDS_HEADER
def test_node_params_and_constants_match_cuda_h(tmp_path):
    structs = {"cond": ("CUDA_CONDITIONAL_NODE_PARAMS", ConditionalParams),
               "kernel": ("CUDA_KERNEL_NODE_PARAMS_v3", KernelNodeParams),
               "edge": ("CUgraphEdgeData", EdgeData)}
    prog = tmp_path / "cond.cpp"
    prog.write_text(
        "#include <cstddef>\n#include <cstdio>\n#include <cuda.h>\nint main() {\n"
        + "".join(_offsets_program(c_name, [f[0] for f in cls._fields_], label)
                  for label, (c_name, cls) in structs.items())
        + '  std::printf("node %zu %zu %zu %zu\\n", sizeof(CUgraphNodeParams), '
        "offsetof(CUgraphNodeParams, kernel), offsetof(CUgraphNodeParams, conditional), "
        "offsetof(CUgraphNodeParams, reserved2));\n"
        '  std::printf("consts %d %d %d %d %d %d %d\\n", (int)CU_GRAPH_NODE_TYPE_KERNEL, '
        "(int)CU_GRAPH_NODE_TYPE_CONDITIONAL, (int)CU_GRAPH_COND_TYPE_IF, "
        "(int)CU_GRAPH_COND_TYPE_SWITCH, (int)CU_STREAM_CAPTURE_STATUS_ACTIVE, "
        "(int)CU_STREAM_SET_CAPTURE_DEPENDENCIES, (int)CU_STREAM_CAPTURE_MODE_RELAXED);\n}\n")
    exe = tmp_path / "cond"
    subprocess.run(["g++", f"-I{_cuda_header().parent}", "-o", str(exe), str(prog)], check=True)
    got = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()}
    for label, (_, cls) in structs.items():
        assert got[label] == [ctypes.sizeof(cls)], label
        for name, *_ in cls._fields_:
            assert got[f"{label}.{name}"] == [getattr(cls, name).offset], (label, name)
    assert got["node"] == [ctypes.sizeof(GraphNodeParams), GraphNodeParams.kernel.offset,
                           GraphNodeParams.conditional.offset,
                           GraphNodeParams.reserved2.offset]
    assert got["consts"] == [graph_if_node.NODE_TYPE_KERNEL,
                             graph_if_node.NODE_TYPE_CONDITIONAL, graph_if_node.COND_TYPE_IF,
                             graph_if_node.COND_TYPE_SWITCH, graph_if_node.CAPTURE_ACTIVE,
                             graph_if_node.SET_CAPTURE_DEPENDENCIES,
                             graph_if_node.CAPTURE_MODE_RELAXED]


@NEEDS_HEADER
def test_driver_functions_are_declared_in_cuda_h_with_the_argument_counts_used():
    """Each driver entry point the capture calls is a ``CUresult`` function of cuda.h taking
    as many arguments as its ctypes declaration (``_api``) passes."""
    text = _cuda_header().read_text()
    declared = {"cuStreamGetCaptureInfo_v3": 7, "cuGraphConditionalHandleCreate": 5,
                "cuGraphAddNode_v2": 6, "cuStreamUpdateCaptureDependencies_v2": 5,
                "cuStreamBeginCaptureToGraph": 6, "cuStreamEndCapture": 2, "cuCtxGetCurrent": 1}
    assert set(declared) == set(graph_if_node.DRIVER_FUNCTIONS)
    # cuda.h names the unversioned function and maps it to the versioned symbol.
    aliases = dict(re.findall(r"#define (cu\w+)\s+(?:__CUDA_API_PTSZ\()?(cu\w+_v\d)\)?", text))
    for symbol, count in declared.items():
        plain = next((a for a, s in aliases.items() if s == symbol), symbol)
        match = re.search(rf"CUresult CUDAAPI {plain}\(([^;]*)\);", text)
        assert match, symbol
        assert len(match.group(1).split(",")) == count, (symbol, match.group(1))


@pytest.mark.skipif(nvcc_build.find_nvcc() is None, reason="needs nvcc")
def test_flag_kernel_builds_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))
    cubin = nvcc_build.build_cubin(graph_if_node.SOURCE, (9, 0))
    assert b"set_if_flag" in cubin.read_bytes()
    assert b"set_switch_index" in cubin.read_bytes()


@pytest.mark.parametrize("flag", [torch.zeros(2, dtype=torch.bool),
                                  torch.zeros((), dtype=torch.int32),
                                  torch.zeros((), dtype=torch.bool)],
                         ids=["1-dim", "int32", "cpu"])
def test_if_node_takes_a_0_dim_bool_cuda_flag(flag):
    with pytest.raises(ValueError, match=r"0-dim torch\.bool CUDA tensor"), \
            graph_switch.if_node(flag):
        pass


@pytest.mark.parametrize("index", [torch.zeros(2, dtype=torch.int32),
                                   torch.zeros((), dtype=torch.bool),
                                   torch.zeros((), dtype=torch.int32)],
                         ids=["1-dim", "bool", "cpu"])
def test_switch_node_takes_a_0_dim_int32_cuda_index(index):
    with pytest.raises(ValueError, match=r"0-dim torch\.int32 CUDA tensor"):
        graph_switch.switch_node(index, [lambda: None])


def test_switch_node_support_needs_a_cuda_12_8_driver(monkeypatch):
    monkeypatch.setattr(graph_if_node, "driver_version", lambda: 12040)
    assert "12080" in graph_switch.switch_node_support()
    monkeypatch.setattr(graph_if_node, "driver_version", lambda: None)
    assert "12080" in graph_switch.switch_node_support()
    monkeypatch.setattr(graph_if_node, "driver_version", lambda: 13000)
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    if hasattr(torch.cuda, "use_mem_pool"):
        assert "nvcc" in graph_switch.switch_node_support()
        monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: "/usr/bin/nvcc")
        assert graph_switch.switch_node_support() is None


def test_support_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(graph_switch, "torch_has_if_nodes", lambda: True)
    assert graph_switch.if_node_support() is None
    monkeypatch.setattr(graph_switch, "torch_has_if_nodes", lambda: False)
    monkeypatch.setattr(graph_if_node, "missing_driver_functions",
                        lambda: ["cuGraphConditionalHandleCreate"])
    assert "cuGraphConditionalHandleCreate" in graph_switch.if_node_support()
    monkeypatch.setattr(graph_if_node, "missing_driver_functions", lambda: [])
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    if hasattr(torch.cuda, "use_mem_pool"):
        assert "nvcc" in graph_switch.if_node_support()
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: "/usr/bin/nvcc")
    if hasattr(torch.cuda, "use_mem_pool"):
        assert graph_switch.if_node_support() is None


def test_prepare_is_a_no_op_where_torch_captures(monkeypatch):
    """With torch's own capture, ``prepare_if_nodes`` touches no CUDA (it runs on this
    CPU-only machine)."""
    monkeypatch.setattr(graph_switch, "torch_has_if_nodes", lambda: True)
    graph_switch.prepare_if_nodes("cuda:0")
