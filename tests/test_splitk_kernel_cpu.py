"""The CUDA split-KV decode kernel without a GPU: it compiles for SM90 with no register
spills, its schedule (the kernel's own helpers, host-compiled) covers every tile once and
combines exactly the partials the decode CTAs wrote, the launch struct matches the C++
layout, the route states what it cannot serve, and a build made where nvcc is (the
doctor's ``--build-kernels``) serves a machine without it. The kernel's numbers are checked
on the GPU (tests/gpu/test_decode_routes_gpu.py, tests/gpu/test_splitk_gpu.py)."""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from trtllm_mla_plugin import doctor
from trtllm_mla_plugin.ops import policy
from trtllm_mla_plugin.ops.kernels import nvcc_build
from trtllm_mla_plugin.ops.kernels import splitk_mla_decode as sk
from trtllm_mla_plugin.ops.platform import Platform
from trtllm_mla_plugin.ops.routes import ROUTES
from trtllm_mla_plugin.ops.spec import DecodeSpec

HARNESS = Path(__file__).with_name("cuda") / "splitk_schedule_harness.cu"
NVCC = nvcc_build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
H200 = Platform("cuda", (9, 0), "NVIDIA H200")


def _ptxas_report(out: Path, defines: tuple[str, ...] = ()) -> dict[str, tuple[int, int, int]]:
    """Entry point -> (registers, spill store bytes, spill load bytes) from ptxas -v."""
    cmd = [*nvcc_build.compile_command(NVCC, sk.SOURCE, out, (9, 0), defines), "-Xptxas",
           "-v"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report: dict[str, tuple[int, int, int]] = {}
    name = None
    spills = (0, 0)
    for line in done.stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            report[name] = (int(m.group(1)), *spills)
    return report


@pytest.fixture(scope="module")
def ptxas_report(tmp_path_factory) -> dict[str, tuple[int, int, int]]:
    return _ptxas_report(tmp_path_factory.mktemp("cubin") / "splitk.cubin")


VARIANTS = [(fp8, stages) for fp8 in (False, True) for stages in sk.STAGES[fp8]]


@needs_nvcc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("fp8_kv,stages", VARIANTS)
def test_every_entry_point_compiles_for_sm90_without_spills(ptxas_report, dtype, groups,
                                                            fp8_kv, stages):
    decode = ptxas_report[sk.decode_kernel_name(dtype, fp8_kv, groups, stages)]
    combine = ptxas_report[f"splitk_mla_combine_{sk.DTYPE_NAMES[dtype]}_rg{groups}"]
    for regs, spill_st, spill_ld in (decode, combine):
        assert regs <= 255 and spill_st == 0 and spill_ld == 0
    # One CTA of 128 * groups threads must fit the SM's 64K registers.
    assert decode[0] * 128 * groups <= 65536
    assert sk.decode_shared_bytes(stages, groups, fp8_kv) <= 227 * 1024


@needs_nvcc
def test_fused_merge_build_compiles_without_spills(tmp_path):
    """``SplitKConfig(fuse_max_splits=...)``'s build: the merge at the end of the decode
    kernel keeps every entry point within 255 registers, without spills."""
    defines = sk.build_defines(sk.SplitKConfig(fuse_max_splits=8))
    assert defines == ("SPLITK_FUSE_MAX_SPLITS=8",)
    assert sk.build_defines(sk.SplitKConfig()) == ()
    report = _ptxas_report(tmp_path / "fused.cubin", defines)
    assert len(report) == 24
    for name, (regs, spill_st, spill_ld) in report.items():
        assert regs <= 255 and spill_st == 0 and spill_ld == 0, name


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("harness") / "schedule"
    subprocess.run([NVCC, *nvcc_build.target_flags((9, 0)), "-DSPLITK_SCHEDULE_ONLY", "-O1",
                    "-std=c++17", "-o", str(exe), str(HARNESS)], check=True,
                   capture_output=True)
    return exe


def _schedule(exe: Path, num_ctas: int, min_tiles: int, tiles: list[int]):
    text = f"{num_ctas} {min_tiles} {len(tiles)}\n" + " ".join(map(str, tiles)) + "\n"
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    active, ranges = 0, []
    written, read = defaultdict(list), defaultdict(list)
    for line in filter(None, out):
        kind, *vals = line.split()
        vals = [int(v) for v in vals]
        if kind == "active":
            active = vals[0]
        elif kind == "range":
            ranges.append((vals[1], vals[2]))
        elif kind == "W":
            written[vals[0]].append(vals[1])
        else:
            read[vals[0]].append(vals[1])
    return active, ranges, written, read


def _batches(seed: int):
    rng = random.Random(seed)
    yield [5, 100, 1]
    yield [0, 3, 0, 0, 7]          # requests without tiles (padding) between real ones
    yield [2048]                   # one long request over every CTA
    yield [1] * 1000               # many one-tile requests
    for _ in range(40):
        b = rng.choice([1, 2, 7, 32, 100, 257, 1024])
        hi = rng.choice([1, 8, 128, 2048])
        yield [rng.randint(0, hi) if rng.random() < 0.05 else rng.randint(1, hi)
               for _ in range(b)]


@needs_nvcc
@pytest.mark.parametrize("num_ctas,min_tiles", [(132, 4), (264, 1), (132, 16), (7, 2)])
def test_schedule_covers_every_tile_once_and_combines_what_was_written(harness, num_ctas,
                                                                       min_tiles):
    for tiles in _batches(num_ctas * 1000 + min_tiles):
        total = sum(tiles)
        active, ranges, written, read = _schedule(harness, num_ctas, min_tiles, tiles)
        if total == 0:
            assert not ranges
            continue
        assert 1 <= active <= num_ctas and len(ranges) == active
        assert active == max(1, min(num_ctas, -(-total // min_tiles)))
        # ranges are non-empty and tile [0, total) end to end
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(s < e for s, e in ranges)
        assert all(ranges[i][1] == ranges[i + 1][0] for i in range(active - 1))
        starts = [0]
        for n in tiles:
            starts.append(starts[-1] + n)
        for i, n in enumerate(tiles):
            owners = {c for c, (s, e) in enumerate(ranges)
                      if n and s < starts[i + 1] and e > starts[i]}
            if len(owners) <= 1:
                assert i not in written and i not in read
            else:
                # one partial per CTA the request spans, and the combine reads exactly those
                assert len(written[i]) == len(owners)
                assert sorted(written[i]) == sorted(read[i])
                assert {slot // 2 for slot in written[i]} == owners
        all_slots = [slot for slots in written.values() for slot in slots]
        assert len(all_slots) == len(set(all_slots))  # no two partials share a slot
        assert all(0 <= slot < 2 * num_ctas for slot in all_slots)


def test_host_sizes_the_combine_as_the_kernel_reads_it():
    """The combine grid (4 items per request, then helper items) and its shared memory
    (weights, then the heavy-request search) come from constants the host repeats: they
    must be the kernel's."""
    source = sk.SOURCE.read_text()

    def constant(name: str) -> int:
        return int(re.search(rf"constexpr int {name} = (\d+);", source).group(1))

    def define(name: str) -> int:
        return int(re.search(rf"#define {name} (\d+)", source).group(1))

    assert constant("kHeavySplits") == sk.HEAVY_SPLITS
    assert constant("kHelperParts") == sk.HELPER_PARTS
    assert sk.COMBINE_CHUNKS * 128 == sk.KV_LORA_RANK
    assert sk.SplitKConfig().helped_requests == define("SPLITK_HELPED_REQUESTS")
    assert sk.SCAN_INTS >= 130 and "130 ints" in source
    assert sk.build_defines(sk.SplitKConfig(helped_requests=0)) == ("SPLITK_HELPED_REQUESTS=0",)


def _c_struct_layout(tmp_path: Path) -> tuple[int, dict[str, int]]:
    source = sk.SOURCE.read_text()
    struct = re.search(r"struct SplitKParams \{.*?\};", source, re.S).group(0)
    names = re.findall(r"(\w+);", struct)
    prog = tmp_path / "layout.cpp"
    prog.write_text(
        "#include <cstddef>\n#include <cstdio>\ntypedef unsigned short u16;\n"
        "typedef long long i64;\n" + struct + "\nint main() {\n"
        '  std::printf("size %zu\\n", sizeof(SplitKParams));\n'
        + "".join(f'  std::printf("{n} %zu\\n", offsetof(SplitKParams, {n}));\n'
                  for n in names) + "}\n")
    exe = tmp_path / "layout"
    subprocess.run([shutil.which("g++") or "c++", "-o", str(exe), str(prog)], check=True)
    lines = subprocess.run([str(exe)], capture_output=True, text=True,
                           check=True).stdout.split()
    values = dict(zip(lines[::2], map(int, lines[1::2]), strict=True))
    return values.pop("size"), values


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="needs a C++ compiler")
def test_launch_struct_matches_the_cxx_layout(tmp_path):
    size, offsets = _c_struct_layout(tmp_path)
    assert ctypes.sizeof(sk.SplitKParams) == size
    assert [f[0] for f in sk.SplitKParams._fields_] == list(offsets)
    for name, offset in offsets.items():
        assert getattr(sk.SplitKParams, name).offset == offset, name


def _spec(**kw) -> DecodeSpec:
    base = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, block_size=64,
                q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, softmax_scale=0.1)
    base.update(kw)
    return DecodeSpec(**base)


def test_route_serves_bf16_and_fp16_deepseek_shapes_on_sm90(monkeypatch):
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.find_nvcc",
                        lambda: "/usr/bin/nvcc")
    reason = ROUTES["cuda-splitk"].unsupported_reason
    for kw in ({}, {"q_dtype": torch.float16, "kv_dtype": torch.float16},
               {"num_heads": 128, "block_size": 32}, {"max_q_len": 4},
               {"kv_dtype": torch.float8_e4m3fn},
               {"q_dtype": torch.float16, "kv_dtype": torch.float8_e4m3fn}):
        assert reason(_spec(**kw), H200) is None, kw


@pytest.mark.parametrize("kw,platform,words", [
    ({}, Platform("cuda", (10, 0), "NVIDIA B200"), "SM90"),
    ({}, Platform("cuda", (8, 0), "NVIDIA A100"), "SM90"),
    ({}, Platform("cpu", None, "cpu"), "SM90"),
    ({"q_dtype": torch.float8_e4m3fn, "kv_dtype": torch.float8_e4m3fn}, H200, "same dtype"),
    ({"block_size": 16}, H200, "multiple of 32"),
    ({"kv_lora_rank": 256}, H200, "512 + 64"),
    ({"max_q_len": 17}, H200, "up to 16"),
])
def test_route_says_what_it_cannot_serve(monkeypatch, kw, platform, words):
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.find_nvcc",
                        lambda: "/usr/bin/nvcc")
    assert words in ROUTES["cuda-splitk"].unsupported_reason(_spec(**kw), platform)


def test_route_without_nvcc_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))  # no build there
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.find_nvcc", lambda: None)
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    reason = ROUTES["cuda-splitk"].unsupported_reason(_spec(), H200)
    assert "nvcc" in reason and "CUDA_HOME" in reason and "--build-kernels" in reason


def test_build_without_nvcc_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    with pytest.raises(RuntimeError, match=r"nvcc.*CUDA_HOME.*--build-kernels"):
        nvcc_build.build_cubin(sk.SOURCE, (9, 0))
    assert doctor.main(["--build-kernels"]) == 1


@needs_nvcc
def test_a_kernel_built_where_nvcc_is_serves_a_machine_without_it(monkeypatch, tmp_path,
                                                                  capsys):
    """``--build-kernels`` (no GPU) leaves the SM90 cubin in the cache; without nvcc the
    route is then eligible and the build step finds that cubin instead of compiling."""
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))
    assert doctor.main(["--build-kernels"]) == 0
    built = Path(capsys.readouterr().out.split("split-KV kernel for SM90: ")[1].split()[0])
    assert built.parent == tmp_path / "cubin" and built.read_bytes()[:4] == b"\x7fELF"
    assert "built" in doctor.splitk_kernel_status(H200)

    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.find_nvcc", lambda: None)
    assert ROUTES["cuda-splitk"].unsupported_reason(_spec(), H200) is None
    calls = []
    monkeypatch.setattr(nvcc_build.subprocess, "run", lambda *a, **k: calls.append(a))
    assert nvcc_build.build_cubin(sk.SOURCE, (9, 0)) == built and not calls
    # Another source text (or other flags) is another kernel: the build does not serve it.
    assert nvcc_build.cached_cubin(sk.SOURCE, (9, 0), ("SPLITK_DIAG_EMPTY",)) is None
    assert nvcc_build.cached_cubin(sk.SOURCE, (8, 0)) is None


def test_doctor_says_how_the_split_kv_kernel_gets_built(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))  # nothing built
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(nvcc_build, "_nvcc_version", lambda nvcc: "Cuda compilation tools")
    line = doctor.splitk_kernel_status(H200)
    assert "compiles with /opt/cuda/bin/nvcc" in line and "2 stages, 2 CTAs per SM" in line
    h100 = Platform("cuda", (9, 0), "NVIDIA H100 80GB HBM3", 132)
    assert "3 stages, 1 CTA per SM" in doctor.splitk_kernel_status(h100)
    monkeypatch.setattr(nvcc_build, "find_nvcc", lambda: None)
    line = doctor.splitk_kernel_status(H200)
    assert "not available" in line and "FlashMLA" in line and "--build-kernels" in line
    assert doctor.splitk_kernel_status(Platform("cuda", (10, 0), "NVIDIA B200")) is None
    assert doctor.splitk_kernel_status(Platform("cpu", None, "cpu")) is None


@needs_nvcc
def test_build_compiles_once_and_reuses_the_cubin(monkeypatch, tmp_path):
    monkeypatch.setenv("TRTLLM_MLA_CACHE_DIR", str(tmp_path))
    first = nvcc_build.build_cubin(sk.SOURCE, (9, 0))
    assert first.exists() and first.read_bytes()[:4] == b"\x7fELF"
    calls = []
    monkeypatch.setattr(nvcc_build.subprocess, "run", lambda *a, **k: calls.append(a))
    assert nvcc_build.build_cubin(sk.SOURCE, (9, 0)) == first and not calls
    assert not list(tmp_path.rglob("*.tmp"))


def test_sm90_builds_use_the_arch_specific_target():
    assert nvcc_build.target_flags((9, 0)) == ("-gencode=arch=compute_90a,code=sm_90a",)
    assert nvcc_build.target_flags((8, 0)) == ("-gencode=arch=compute_80,code=sm_80",)


def test_policy_ranks_the_kernel_only_where_it_was_measured_to_win():
    """16-bit caches with 9-16 query rows per request (run 46), and 8 (under CUDA graphs
    from 33 requests, runs 141-142; with lengths known, runs 147-149); never FP8 caches
    (0.38x FlashMLA FP8), fewer than 8 or 32 or more rows per request."""
    assert any("cuda-splitk" in r for r in policy.rankings(_spec(), H200))
    eight = _spec(num_heads=8)
    assert any("cuda-splitk" in r for r in policy.rankings(eight, H200, cuda_graph=True,
                                                           max_batch_size=256))
    assert any("cuda-splitk" in r for r in policy.rankings(eight, H200))
    for spec in (_spec(num_heads=128), _spec(max_q_len=2), _spec(num_heads=4),
                 _spec(kv_dtype=torch.float8_e4m3fn)):
        for ranking in (*policy.rankings(spec, H200),
                        *policy.rankings(spec, H200, cuda_graph=True, max_batch_size=256)):
            assert "cuda-splitk" not in ranking


def _cuda_header() -> Path | None:
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if NVCC is not None:
        roots.append(str(Path(NVCC).resolve().parent.parent))
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda.h").exists():
            return Path(root) / "include" / "cuda.h"
    return None


@pytest.mark.skipif(_cuda_header() is None or shutil.which("g++") is None,
                    reason="needs the CUDA toolkit's cuda.h and g++")
def test_launch_config_structs_match_cuda_h(tmp_path):
    from trtllm_mla_plugin.ops.kernels.cuda_driver import LaunchAttribute, LaunchConfig

    config_fields = [f[0] for f in LaunchConfig._fields_]
    prog = tmp_path / "launch.cpp"
    prog.write_text(
        "#include <cstddef>\n#include <cstdio>\n#include <cuda.h>\nint main() {\n"
        '  std::printf("attr %zu %zu %zu\\n", sizeof(CUlaunchAttribute), '
        "offsetof(CUlaunchAttribute, value), offsetof(CUlaunchAttribute, "
        "value.programmaticStreamSerializationAllowed));\n"
        '  std::printf("config %zu\\n", sizeof(CUlaunchConfig));\n'
        + "".join(f'  std::printf("{n} %zu\\n", offsetof(CUlaunchConfig, {n}));\n'
                  for n in config_fields)
        + '  std::printf("psa %d\\n", '
        '(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n'
        "}\n")
    exe = tmp_path / "launch"
    subprocess.run(["g++", f"-I{_cuda_header().parent}", "-o", str(exe), str(prog)], check=True)
    lines = [line.split() for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()]
    got = {line[0]: [int(v) for v in line[1:]] for line in lines}
    assert got["attr"] == [ctypes.sizeof(LaunchAttribute), LaunchAttribute.value.offset,
                           LaunchAttribute.value.offset]
    assert got["config"] == [ctypes.sizeof(LaunchConfig)]
    for name in config_fields:
        assert got[name] == [getattr(LaunchConfig, name).offset], name
    from trtllm_mla_plugin.ops.kernels.cuda_driver import PROGRAMMATIC_STREAM_SERIALIZATION
    assert got["psa"] == [PROGRAMMATIC_STREAM_SERIALIZATION]


def test_route_refuses_batches_beyond_the_kernel(monkeypatch):
    """A decoder built for more requests than the kernel takes still holds the route (the
    policy gives it at most MAX_BATCH); a larger batch forced onto it is refused with the
    fix, not computed."""
    from trtllm_mla_plugin.ops import DecodeBatch
    from trtllm_mla_plugin.ops.routes import cuda_splitk

    built = {}

    class FakeKernel:
        def __init__(self, device, heads, max_q_len, page_size, max_batch, dtype, **kw):
            built["max_batch"] = max_batch

        def plan(self, seq_lens):
            built["planned"] = seq_lens.shape[0]

    monkeypatch.setattr(cuda_splitk, "SplitKMLADecode", FakeKernel)
    route = cuda_splitk.CudaSplitKRoute(_spec(), torch.device("cpu"), 4096)
    assert built["max_batch"] == sk.MAX_BATCH
    lens = torch.full((sk.MAX_BATCH + 1,), 64, dtype=torch.int32)
    too_many = DecodeBatch(torch.zeros(sk.MAX_BATCH + 1, 1, dtype=torch.int32), lens, 64)
    with pytest.raises(ValueError, match="takes up to 1024 per step; pick another route"):
        route.plan(too_many)
    ok = DecodeBatch(torch.zeros(8, 1, dtype=torch.int32), lens[:8], 64)
    route.plan(ok)
    assert built["planned"] == 8


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200",
                                 ""])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("fp8_kv", [False, True])
def test_default_launch_is_compiled_and_fits_the_sm(gpu, groups, fp8_kv):
    stages, ctas = sk.default_launch(groups, fp8_kv, gpu)
    assert stages in sk.STAGES[fp8_kv]
    assert ctas * sk.decode_shared_bytes(stages, groups, fp8_kv) <= 227 * 1024
    # One row group: 1 CTA per SM on the H100 with a 16-bit cache (runs 252-255), else 2.
    one_cta = groups == 2 or ("H100" in gpu and not fp8_kv)
    assert ctas == (1 if one_cta else 2)
