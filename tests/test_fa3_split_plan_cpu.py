"""The ``vllm-fa3-mla`` route's GPU plan without a GPU: the planner of FA3's splits
(``kernels.fa3_split_plan``) under Triton's CPU interpreter on random decode steps against
the host's ``fa3_splits.balanced_splits``, the length order (``kernels.length_order``)
against numpy's stable argsort, the route's whole plan both ways
(tests/fa3_split_plan_cases.py), and both kernels compiled for Hopper, the planner's
float64 spans kept out of fused multiply-adds (the host rounds each product). On the GPU
the same cases and the route's graph replays on the GPU plan run in
tests/gpu/test_cuda_graph_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from triton_cpu import compile_for_hopper, interpreted

HERE = Path(__file__).resolve().parent


def _interpreted_cases(*args: str) -> str:
    """The last line ``tests/fa3_split_plan_cases.py ARGS`` prints under Triton's CPU
    interpreter (it fails the test on any step that differs)."""
    proc = interpreted(str(HERE / "fa3_split_plan_cases.py"), *args, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_planner_equals_host_plan_under_interpreter():
    line = _interpreted_cases("400", "--seed", "11", "--device", "cpu")
    assert line.startswith("400 steps equal to the host's plan")
    # Every way a step can end was reached: kept, replanned in the band and past it (one
    # wave), and batch sizes the host turns away without a launch.
    counts = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
    for outcome in ("kept", "not launched", "replanned in the band", "replanned past the band"):
        assert int(counts.get(outcome, 0)) >= 10, line


def test_length_order_equals_stable_argsort_under_interpreter():
    line = _interpreted_cases("12", "--seed", "4", "--length-order", "--device", "cpu")
    assert line.startswith("length order: 12 batches equal to numpy's")
    assert int(line.split(", ")[-1].split()[0]) >= 6, line  # ties broken in batch order


def test_route_plans_the_same_on_the_gpu_plan():
    """The ``vllm-fa3-mla`` route's plan on the CPU (its FA3 module a stand-in): the GPU
    plan orders the tables as the host does, and the planner reads the lengths in the
    order FA3 runs them and writes where the host's splits go."""
    line = _interpreted_cases("150", "--seed", "3", "--route")
    assert line.startswith("route: 150 steps, the same plan either way")
    assert int(line.split(", ")[-1].split()[0]) >= 20, line


def test_planner_compiles_for_hopper_without_fma():
    pytest.importorskip("triton")
    from trtllm_mla_plugin.ops.kernels import fa3_split_plan as kernels

    sig = {"seq_lens_ptr": "*i32", "sizes_ptr": "*i32", "consts_ptr": "*fp64",
           "splits_ptr": "*i32"}
    sig.update({name: "i32" for name in ("batch", "query_tiles", "request_rows", "max_splits",
                                         "fa3_cap", "sms", "num_sizes", "narrow_band",
                                         "wide_band")})
    consts = {"BLOCK_B": 256, "SIZES_BLOCK": 128, "CHUNK": kernels.SIZE_CHUNK, "KV_TILE": 64,
              "NARROW_ROWS": 48, "NARROW_MIN_MEAN_TILES": 32, "CHEAP_ROWS": 16,
              "MIN_SPLIT_TILES": 16, "SHORT_MAX_TILES": 40}
    compiled = compile_for_hopper(kernels._fa3_balanced_splits_kernel, sig, consts,
                                  num_warps=kernels.NUM_WARPS, enable_fp_fusion=False)
    ptx = compiled.asm["ptx"]
    assert "mul.rn.f64" in ptx or "mul.f64" in ptx  # the spans are float64
    assert "fma.rn.f64" not in ptx


def test_length_order_compiles_for_hopper():
    pytest.importorskip("triton")
    from trtllm_mla_plugin.ops.kernels import length_order as kernels

    sig = {"seq_lens_ptr": "*i32", "table_ptr": "*i32", "table_stride": "i32",
           "packed_ptr": "*i32", "ordered_ptr": "*i32", "ordered_stride": "i32",
           "batch": "i32", "max_batch": "i32", "q_len": "i32", "width": "i32"}
    consts = {"BLOCK_B": 1024, "CHUNK": kernels.TABLE_CHUNK}
    compiled = compile_for_hopper(kernels._length_order_kernel, sig, consts, num_warps=4)
    assert "st.global" in compiled.asm["ptx"]
