"""The plugin's FlashMLA schedule kernel without a GPU: under Triton's CPU interpreter on
random batches, checked against what FlashMLA's decode and combine kernels need and
against FlashMLA's own scheduler, transcribed (tests/flashmla_schedule_cases.py), and
compiled for Hopper. On the H200 the FlashMLA route runs on it against float64 and the
layout is checked against FlashMLA's own schedule (tests/gpu/test_flashmla_schedule_gpu.py).
The interpreter runs one program sequentially, so the kernel's barriers between its passes
are checked only there (``test_kernel_gives_flashmla_schedules``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from flashmla_schedule_cases import OVERHEAD, blocks, check_schedule, flashmla_greedy
from triton_cpu import compile_for_hopper, interpreted

HERE = Path(__file__).resolve().parent


def test_schedule_kernel_under_interpreter():
    proc = interpreted(str(HERE / "flashmla_schedule_cases.py"), "80")
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert ("80 cases valid and equal to FlashMLA's own (bf16 and FP8), and to its walk at "
            "other costs per request") in proc.stdout


def test_empty_batch_gives_empty_parts():
    """A batch of no requests (never planned by the route) writes parts without work
    instead of dividing by zero."""
    code = ("from flashmla_schedule_cases import plugin_schedule as s; "
            "rows, splits = s([], 4); print(rows, splits)")
    proc = interpreted("-c", code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([[0, -1, 0, 0, 0, 0, 0, 0]] * 4) + " [0]"


SCHEDULE_BUFFERS_SCRIPT = """
import types, torch
from flashmla_schedule_cases import (flashmla_fp8_greedy, flashmla_greedy, same_fp8_schedule,
                                     same_schedule)
torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(
    multi_processor_count=132)
from trtllm_mla_plugin.ops.routes.flashmla import FlashMLASchedule
lens = [0, 5000, 64, 65, 1, 30000, 700]
for fp8, heads, q_len in ((False, 16, 1), (False, 128, 2), (True, 64, 4), (True, 16, 1)):
    schedule = FlashMLASchedule(16, torch.device("cpu"), fp8_layout=fp8)
    schedule.plan(len(lens), heads * q_len)
    schedule.write(torch.tensor(lens, dtype=torch.int32))
    meta, splits = (t.tolist() for t in schedule.buffers)
    parts = 132 // -(-heads * q_len // 64)
    want = (flashmla_fp8_greedy if fp8 else flashmla_greedy)(lens, parts)
    assert len(meta) == parts
    assert (same_fp8_schedule(meta, splits, *want) if fp8
            else same_schedule(lens, meta, splits, *want)), (fp8, heads, q_len)
# Another cost per request reaches the kernel.
schedule = FlashMLASchedule(16, torch.device("cpu"), overhead_blocks=40)
schedule.plan(len(lens), 16)
schedule.write(torch.tensor(lens, dtype=torch.int32))
meta, splits = (t.tolist() for t in schedule.buffers)
assert same_schedule(lens, meta, splits, *flashmla_greedy(lens, 132, 40))
assert not same_schedule(lens, meta, splits, *flashmla_greedy(lens, 132))
print("schedule buffers ok")
"""


def test_route_schedule_buffers_write_flashmla_schedules():
    """``FlashMLASchedule``, the routes' persistent buffers and launch, for the bf16 and
    the FP8 route: FlashMLA's part count for the query rows, the step's views, FlashMLA's
    plan in them (the interpreter, a stand-in 132-SM device)."""
    proc = interpreted("-c", SCHEDULE_BUFFERS_SCRIPT, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "schedule buffers ok" in proc.stdout


def test_checker_accepts_flashmla_and_refuses_broken_schedules():
    """The checker the kernel is judged by: FlashMLA's own schedules pass it; a block
    given to two parts, a missing block, or a wrong piece count does not."""
    rng = random.Random(3)
    for _ in range(200):
        b = rng.choice([1, 3, 17, 64])
        lens = [rng.randint(1, 9000) for _ in range(b)]
        parts = rng.choice([132, 66, 16, 1])
        rows, splits = flashmla_greedy(lens, parts)
        bound = -(-sum(n + OVERHEAD for n in blocks(lens)) // parts) + OVERHEAD
        assert check_schedule(lens, rows, splits) <= bound
    lens = [1000, 300]  # 16 and 5 blocks
    rows = [[0, 0, 0, 8, 0, 1, 1], [0, 1, 8, 5, 1, 1, 0]]
    assert check_schedule(lens, rows, [0, 2, 3]) == 8 + OVERHEAD + 5 + OVERHEAD  # part 1
    for bad_rows, bad_splits in (
        ([[0, 0, 0, 9, 0, 1, 1], [0, 1, 8, 5, 1, 1, 0]], [0, 2, 3]),  # block 8 twice
        ([[0, 0, 0, 7, 0, 1, 1], [0, 1, 8, 5, 1, 1, 0]], [0, 2, 3]),  # block 7 missing
        (rows, [0, 1, 2]),  # request 0 has two pieces
        ([[0, 0, 0, 8, 0, 1, 1], [0, 1, 8, 5, 0, 1, 0]], [0, 2, 3]),  # piece 0 twice
    ):
        with pytest.raises(AssertionError):
            check_schedule(lens, bad_rows, bad_splits)


def test_overhead_below_one_block_is_refused():
    pytest.importorskip("triton")
    import torch

    from trtllm_mla_plugin.ops.kernels.flashmla_schedule import flashmla_schedule

    ints = {"dtype": torch.int32}
    with pytest.raises(ValueError, match="overhead_blocks must be at least 1"):
        flashmla_schedule(torch.ones(2, **ints), torch.zeros(4, 8, **ints),
                          torch.zeros(3, **ints), torch.zeros(3, 2, **ints),
                          torch.zeros(5, **ints), overhead_blocks=0)


def test_schedule_kernel_compiles_for_hopper():
    pytest.importorskip("triton")
    from trtllm_mla_plugin.ops.kernels import flashmla_schedule as kernels

    sig = {"seq_lens_ptr": "*i32", "meta_ptr": "*i32", "num_splits_ptr": "*i32",
           "scratch_ptr": "*i32", "scratch_stride": "i32", "owner_ptr": "*i32",
           "batch_size": "i32", "num_parts": "i32"}
    consts = {"PAGE": 64, "OVERHEAD": 5, "CHUNK": 128, "PARTS": 256, "FP8_LAYOUT": False}
    compiled = compile_for_hopper(kernels._flashmla_schedule_kernel, sig, consts, num_warps=4)
    assert "bar.sync" in compiled.asm["ptx"]  # the barrier between the two passes
