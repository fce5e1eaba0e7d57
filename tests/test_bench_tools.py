"""The benchmarks' bookkeeping, on the CPU: the decode-step summary of a profiler trace
(``profile_engine_step.summarize``), the per-round backend order of ``bench_engine`` and the
alternating plugin / FLASHMLA FP8 timing of ``bench_decode --paired``, the paired
engine ratios of ``summarize_engine``, how the FlashMLA peer is timed and scored, the
random sets' filters and ``graph_routes_ab``'s alternation, the 16-row band's bound replay
(``band16_bound_replay``), the GPU clock sampler (``gpu_clocks``, against a stand-in
``nvidia-smi``) and ``sustained_decode``'s summary."""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import random
import sys
import time
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decode
import bench_engine
import decode_kernels
import gpu_clocks
import profile_engine_step
import summarize_engine
import sustained_decode
import torch
from profile_engine_step import STEP_SCOPE, summarize


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def _trace() -> dict:
    """An eager prefill step, then three decode steps that each launch a CUDA graph."""
    ev = [
        _x(STEP_SCOPE, "user_annotation", 0, 1000),  # prefill: no graph launch
        _x("kernel-prefill", "kernel", 100, 800),
        _x(STEP_SCOPE, "user_annotation", 1000, 500),
        _x(STEP_SCOPE, "gpu_user_annotation", 1000, 500),  # GPU-side copy: not a step
        _x("cudaGraphLaunch", "cuda_runtime", 1100, 40),
        _x("runner: sample_tokens", "user_annotation", 1200, 100),
        _x("decode", "kernel", 1150, 150),
        _x("combine", "kernel", 1250, 150),  # overlaps the one before: counted once
        _x(STEP_SCOPE, "user_annotation", 1600, 400),
        _x("cudaGraphLaunch", "cuda_runtime", 1700, 30),
        _x("runner: sample_tokens", "user_annotation", 1650, 50),
        _x("runner: sample_tokens", "user_annotation", 1900, 30),  # same step: 80 in all
        _x("decode", "kernel", 1750, 50),
        _x(STEP_SCOPE, "user_annotation", 2100, 600),
        _x("cudaGraphLaunch", "cuda_runtime", 2200, 50),
        _x("runner: sample_tokens", "user_annotation", 2150, 120),
        _x("decode", "kernel", 2300, 300),
    ]
    return {"traceEvents": ev}


def test_summary_counts_graph_decode_steps_only():
    s = summarize(_trace())
    assert s["decode_steps"] == 3
    assert s["step_median_us"] == 500  # of 500, 400, 600
    assert s["step_period_us"] == 550  # starts 1000, 1600, 2100
    # GPU union over the decode steps: 250 + 50 + 300 (the prefill kernel is outside)
    assert s["gpu_busy_us_per_step"] == 200
    assert s["gpu_busy_fraction"] == pytest.approx(600 / 1700, abs=1e-3)
    scopes = {r["name"]: r["median_us_per_step"] for r in s["scopes"]}
    assert scopes["runner: sample_tokens"] == 100  # of 100, 80, 120
    kernels = {r["name"]: r for r in s["kernels"]}
    assert kernels["decode"]["calls_per_step"] == 1.0
    assert kernels["decode"]["us_per_step"] == pytest.approx(500 / 3, abs=0.1)
    runtime = {r["name"]: r for r in s["runtime"]}
    assert runtime["cudaGraphLaunch"]["us_per_step"] == 40


def test_summary_counts_gpu_work_by_its_launch():
    """GPU work linked to its launch (``correlation``) counts with the step that launched
    it: a prefill kernel still running inside the decode span is left out, and the last
    step's kernel that ends after the span is counted (run 228's first decode steps held
    the prefill's copies)."""
    trace = _trace()
    ev = trace["traceEvents"]
    for e in ev:
        if e["name"] == "kernel-prefill":
            e.update(ts=1100, dur=400, args={"correlation": 7})  # runs inside step 1
        if e["name"] == "decode" and e["ts"] == 2300:
            e.update(ts=2500, dur=300, args={"correlation": 9})  # ends after the span
    ev.append(_x("cudaLaunchKernel", "cuda_runtime", 500, 10) | {"args": {"correlation": 7}})
    ev.append(_x("cudaLaunchKernel", "cuda_runtime", 2250, 10) | {"args": {"correlation": 9}})
    s = summarize(trace)
    kernels = {r["name"]: r for r in s["kernels"]}
    assert "kernel-prefill" not in kernels
    assert kernels["decode"]["us_per_step"] == pytest.approx(500 / 3, abs=0.1)
    assert s["gpu_busy_us_per_step"] == 200  # 250 + 50 + 300, the prefill kernel left out


def test_summary_needs_decode_steps():
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != "cudaGraphLaunch"]
    with pytest.raises(ValueError, match="0 CUDA-graph decode steps"):
        summarize(trace)


def test_eager_summary_counts_every_step_after_the_recompute():
    """An eager engine launches no graph: its decode steps are those after the first."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["name"] != "cudaGraphLaunch"]
    s = summarize(trace, eager=True)
    assert s["decode_steps"] == 3 and s["step_median_us"] == 500
    assert s["gpu_busy_us_per_step"] == 200


def test_union_of_intervals():
    assert profile_engine_step._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert profile_engine_step._union_us([]) == 0


def test_backend_order_rotates_per_round():
    names = ["TRTLLM_MLA", "FLASHMLA", "FLASH_ATTN_MLA"]
    firsts = [bench_engine.rotated(names, r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(names)
    assert all(sorted(bench_engine.rotated(names, r)) == sorted(names) for r in range(5))


class _FakeKernel:
    def __init__(self, value: float, route: str = "flashmla-fp8") -> None:
        self.absent = None
        self.value = value
        self.obj = type("Decoder", (), {"route": type("Route", (), {"name": route})})()

    def call(self, cache) -> torch.Tensor:
        return torch.full((2, 3), self.value)


def test_paired_timing_alternates_and_keeps_each_sides_median(monkeypatch, tmp_path):
    """Plugin (side 0) and peer (side 1) are timed A B, B A, A B ...; each side's median
    is kept; the outputs are compared bit for bit."""
    order = []
    plugin_times = iter([10.0, 30.0, 11.0])  # median 11
    peer_times = iter([12.0, 12.5, 99.0])  # median 12.5
    monkeypatch.setattr(bench_decode, "make_case",
                        lambda shape, seed, device: type("C", (), {"name": "x", "caches": [0]}))
    monkeypatch.setattr(bench_decode, "decoder_kernel", lambda *a, **k: _FakeKernel(1.0))
    monkeypatch.setattr(bench_decode, "flashmla_fp8_peer", lambda case: _FakeKernel(2.0))
    monkeypatch.setattr(bench_decode, "capture_graph", lambda fn, case: fn)

    def time_replays(graph):
        side = 0 if graph.__self__.value == 1.0 else 1
        order.append(side)
        return next(plugin_times if side == 0 else peer_times)

    monkeypatch.setattr(bench_decode, "time_replays", time_replays)
    summary = []
    with open(tmp_path / "p.csv", "w", newline="") as f:
        writer = bench_decode.csv.DictWriter(f, fieldnames=bench_decode.PAIRED_FIELDS)
        bench_decode.bench_paired((16, 4, 4096, "u", 1, "fp8", 64), 0, "cpu", writer, 3,
                                  "grid", summary)
    assert order == [0, 1, 1, 0, 0, 1]
    assert summary == [("grid", "x", 11.0, 12.5, False)]  # 1.0 vs 2.0 outputs differ


def test_rounds_time_a_shapes_kernels_in_rotated_order_and_keep_each_median(monkeypatch,
                                                                           tmp_path):
    """``bench_decode --rounds 3``: every kernel that runs is captured once, then timed in
    three rounds, each starting at the next kernel; its row keeps the median round; an
    absent kernel and one that fails to capture keep their own rows and join no round."""
    class Case:
        name, lens_host, q_len, caches = "x", [4096] * 4, 1, [0]

    kernels = [bench_decode.Kernel("plugin-graph[vllm-fa3-mla]"),
               bench_decode.Kernel("flashmla", absent="not eligible: test"),
               bench_decode.Kernel("broken"), bench_decode.Kernel("peer:vllm-fa3-mla")]
    us = {"plugin-graph[vllm-fa3-mla]": [30.0, 10.0, 11.0], "peer:vllm-fa3-mla": [12.0, 99.0, 13.0]}
    for k in kernels:
        k.call = k

    def capture(call, case):
        if call.name == "broken":
            raise RuntimeError("capture failed")
        return call

    order = []
    monkeypatch.setattr(bench_decode, "ROUNDS", 3)
    monkeypatch.setattr(bench_decode, "make_case", lambda shape, seed, device: Case)
    monkeypatch.setattr(bench_decode, "bytes_flops", lambda case: (10**6, 10**9))
    monkeypatch.setattr(bench_decode, "CHECK_MAX_TOKENS", 0)  # no reference
    monkeypatch.setattr(bench_decode, "kernels_for", lambda case, mode: kernels)
    monkeypatch.setattr(bench_decode, "capture_graph", capture)
    monkeypatch.setattr(bench_decode, "time_replays",
                        lambda graph: order.append(graph.name) or us[graph.name].pop(0))
    summary = []
    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["pass_no", "shape", "heads", "batch", "ctx",
                                               "lens", "q_len", "kv", "block", "kv_tokens",
                                               "max_len", "spread", "bytes", "flops", "kernel",
                                               "status", "us", "pct_copy", "tflops", "rel_err"])
        writer.writeheader()
        bench_decode.bench_shape((16, 4, 4096, "u", 1, "bf16", 64), 0, "cpu", writer, 1,
                                 summary, "graph")
    timed = ["plugin-graph[vllm-fa3-mla]", "peer:vllm-fa3-mla"]
    assert order == timed + timed[::-1] + timed
    with open(tmp_path / "d.csv", newline="") as f:
        rows = {r["kernel"]: r for r in csv.DictReader(f)}
    assert rows["plugin-graph[vllm-fa3-mla]"]["us"] == "11.00"
    assert rows["peer:vllm-fa3-mla"]["us"] == "13.00"
    assert rows["flashmla"]["status"].startswith("absent") and rows["flashmla"]["us"] == ""
    assert rows["broken"]["status"] == "error: RuntimeError: capture failed"
    assert summary[0][3] == 11.0 and summary[0][4] == ("peer:vllm-fa3-mla", 13.0)


def test_paired_engines_share_a_process_per_round_and_alternate():
    names = ["TRTLLM_MLA", "FLASHMLA"]
    assert bench_engine.round_engines(names, 0, paired=True) == ["TRTLLM_MLA,FLASHMLA"]
    assert bench_engine.round_engines(names, 1, paired=True) == ["FLASHMLA,TRTLLM_MLA"]
    assert bench_engine.round_engines(names, 1, paired=False) == ["FLASHMLA", "TRTLLM_MLA"]
    assert bench_engine.alternating(names, 3) == [names, names[::-1], names]


def test_step_row_differences_the_two_generate_lengths():
    args = type("A", (), {"heads": 16, "kv": "fp8", "output_len": 336, "short_len": 16})()
    row = bench_engine.step_row(args, "FLASHMLA", 128, short_s=0.5, dt=3.7)
    assert row["step_ms"] == "10.000"  # (3.7 - 0.5) s / 320 steps
    assert row["decode_tokens_per_s"] == "12800"
    assert row["backend"] == "FLASHMLA" and row["status"] == "ok"


def _output(first_ts: float, last_ts: float, tokens: int) -> object:
    """A ``RequestOutput`` stand-in whose ``metrics`` is vLLM's own ``RequestStateStats``."""
    from vllm.v1.metrics.stats import RequestStateStats

    stats = RequestStateStats(first_token_ts=first_ts, last_token_ts=last_ts,
                              num_generation_tokens=tokens)
    return type("R", (), {"metrics": stats})()


def test_core_decode_step_reads_the_engine_cores_token_timestamps():
    """Per request (last - first token) / (tokens - 1), the median over requests; requests
    without timestamps (stats off) or with one token do not count."""
    pytest.importorskip("vllm")
    outs = [_output(10.0, 10.32, 33), _output(10.0, 10.96, 33), _output(11.0, 11.64, 33),
            _output(12.0, 12.0, 1), type("R", (), {"metrics": None})()]
    assert bench_engine.core_decode_step_s(outs) == pytest.approx(0.02)  # 0.01, 0.03, 0.02
    assert bench_engine.core_decode_step_s(outs[3:]) is None


def test_step_row_keeps_the_fastest_core_step_and_every_repeat():
    args = type("A", (), {"heads": 16, "kv": "fp8", "output_len": 336, "short_len": 16})()
    core = bench_engine.CoreTiming(steps=[0.012, 0.008, None],
                                   quantiles=[(0.009, 0.010, 0.020), None, (0.004, 0.005, 0.006)])
    row = bench_engine.step_row(args, "FLASHMLA", 128, short_s=0.5, dt=3.7, core=core)
    assert row["step_ms"] == "10.000"  # the difference estimate is unchanged
    assert row["core_step_ms"] == "8.000" and row["core_steps_each_ms"] == "12.000;8.000"
    assert row["core_decode_tokens_per_s"] == "16000"
    assert row["core_median_step_ms"] == "5.000"
    assert row["core_step_quantiles_each_ms"] == "9.000/10.000/20.000;4.000/5.000/6.000"
    assert row["core_median_decode_tokens_per_s"] == "25600"
    plain = bench_engine.step_row(args, "FLASHMLA", 128, 0.5, 3.7)
    assert "core_step_ms" not in plain and "core_median_step_ms" not in plain


def test_step_quantiles_take_each_steps_median_interval():
    """Deciles by linear interpolation between order statistics (numpy's default
    percentile): steps of 1..10 ms give 1.9 / 5.5 / 9.1 ms; one step gives none."""
    steps = [[t * 1e-3, t * 4e-3, 4] for t in (7, 1, 10, 4, 2, 9, 3, 8, 6, 5)]
    p10, p50, p90 = bench_engine.step_quantiles_s(steps)
    assert (p10, p50, p90) == pytest.approx((1.9e-3, 5.5e-3, 9.1e-3))
    assert bench_engine.step_quantiles_s(steps[:1]) is None


def test_core_timing_takes_each_repeats_steps_and_starts_afresh():
    """Per repeat: the requests' first-to-last step and the percentiles of the steps the
    clock recorded during that repeat only."""
    pytest.importorskip("vllm")
    intervals = [[1.0, 1.0, 1]] * 5  # left over from an untimed generate
    core = bench_engine.CoreTiming(intervals)
    core.start()
    intervals += [[0.002, 0.004, 2], [0.004, 0.008, 2]]
    core.add([_output(10.0, 10.06, 4)])
    assert core.steps == [pytest.approx(0.02)]
    assert core.quantiles == [pytest.approx((0.0022, 0.003, 0.0038))]


def test_paired_ratio_by_the_core_column():
    rows = [dict(round="0", heads="16", kv="fp8", batch="32", backend=b, status="ok",
                 decode_tokens_per_s=d, core_decode_tokens_per_s=c,
                 core_median_decode_tokens_per_s=m)
            for b, d, c, m in (("TRTLLM_MLA", "100", "110", "90"),
                               ("FLASHMLA", "100", "100", "100"))]
    [by_diff] = summarize_engine.paired_points([rows])
    [by_core] = summarize_engine.paired_points([rows], "core_decode_tokens_per_s")
    [by_median] = summarize_engine.paired_points([rows], "core_median_decode_tokens_per_s")
    assert by_diff.ratios == (1.0,) and by_core.ratios == pytest.approx((1.1,))
    assert by_median.ratios == pytest.approx((0.9,))


def test_paired_ratio_by_each_engines_fastest_decile():
    """``--core-fast``: per engine the lowest 10th percentile of its repeats' steps, as
    tokens/s (batch 32: 3.2 ms -> 10000), not its median or its fastest median."""
    rows = [dict(round="0", heads="16", kv="fp8", batch="32", backend=b, status="ok",
                 core_step_quantiles_each_ms=q)
            for b, q in (("TRTLLM_MLA", "4.0/5.0/6.0;3.2/6.0/9.0"),
                         ("FLASHMLA", "3.6/3.7/3.8;4.0/4.5/5.0"))]
    rows.append(dict(rows[0], backend="TRTLLM_MLA", round="1",
                     core_step_quantiles_each_ms=""))
    fast = summarize_engine.with_fastest_decile(rows)
    assert fast[0][summarize_engine.FAST_COLUMN] == "10000"
    assert fast[1][summarize_engine.FAST_COLUMN] == "8889"
    assert summarize_engine.FAST_COLUMN not in fast[2]
    [point] = summarize_engine.paired_points([fast], summarize_engine.FAST_COLUMN)
    assert point.ratios == pytest.approx((3.6 / 3.2,), rel=1e-4)


class _FakeLLM:
    """Stands in for ``vllm.LLM`` in the worker: records when it is timed and generates the
    requested number of tokens, advancing ``clock`` by 1 ms per token."""

    def __init__(self, name: str, calls: list, clock: list) -> None:
        self.name, self.calls, self.clock = name, calls, clock

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((self.name, params.max_tokens))
        self.clock[0] += 1e-3 * params.max_tokens
        out = type("O", (), {"token_ids": [0] * params.max_tokens})()
        return [type("R", (), {"outputs": [out]})() for _ in prompts]


@pytest.mark.parametrize(("gpu_memory", "share"), [(None, 0.45), (0.4, 0.4)])
def test_paired_worker_times_both_engines_alternately(monkeypatch, tmp_path, gpu_memory, share):
    """``--backend A,B``: both engines live in one process, each started with only its own
    forced route and its share of GPU memory (``--gpu-memory``, else 0.45), timed A B then
    B A; one row per engine and batch."""
    pytest.importorskip("vllm")

    from trtllm_mla_plugin.vllm_backend.decode_spec import ROUTE_ENV_VAR

    calls, started, clock = [], [], [0.0]

    class _SlowerEachRepeat(_FakeLLM):
        """Repeat r of an engine's timed pair (short, full) runs at (r + 1) ms per token."""

        def generate(self, prompts, params, use_tqdm=False):
            timed = sum(1 for name, n in self.calls if name == self.name and n > 1)
            if params.max_tokens > 1:
                self.clock[0] += 1e-3 * params.max_tokens * (timed // 2)
            return super().generate(prompts, params, use_tqdm)

    def make_llm(args, backend, max_num_seqs, capture, gpu_memory=0.6):
        started.append((backend, os.environ.get(ROUTE_ENV_VAR), gpu_memory))
        return _SlowerEachRepeat(backend, calls, clock)

    monkeypatch.setattr(bench_engine.time, "perf_counter", lambda: clock[0])

    monkeypatch.delenv(ROUTE_ENV_VAR, raising=False)
    monkeypatch.setattr(bench_engine, "make_llm", make_llm)
    monkeypatch.setattr(bench_engine, "attention_layer_us", lambda *a, **k: ("flashmla", 10.0))
    monkeypatch.setattr(gpu_clocks, "ClockSampler", _FixedClocks)
    monkeypatch.setattr(_FixedClocks, "regions", 0)
    monkeypatch.setattr(bench_engine, "gpu_memory_used_mib", lambda: [61_440, 512])

    def stop(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", stop)
    args = type("A", (), dict(
        backend="TRTLLM_MLA@flashmla,FLASHMLA", batches="2", heads=16, kv="auto",
        output_len=6, short_len=2, repeats=2, min_prompt=4, max_prompt=8, seed=0, layers=2,
        eager=False, result=str(tmp_path / "r.json"), gpu_memory=gpu_memory))()
    with pytest.raises(SystemExit):
        bench_engine.worker(args)
    assert started == [("TRTLLM_MLA", "flashmla", share), ("FLASHMLA", None, share)]
    timed = [c for c in calls if c[1] > 1]  # after the one-token prefills
    assert [name for name, _ in timed] == ["TRTLLM_MLA", "TRTLLM_MLA", "FLASHMLA", "FLASHMLA",
                                           "FLASHMLA", "FLASHMLA", "TRTLLM_MLA", "TRTLLM_MLA"]
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["backend"] for r in rows] == ["TRTLLM_MLA@flashmla", "FLASHMLA"]
    assert rows[0]["route"] == "flashmla" and "route" not in rows[1]
    # Fastest of each length: the first repeat, 1 ms per generated token ...
    assert [r["step_ms"] for r in rows] == ["1.000", "1.000"]
    # ... and each repeat's own estimate, in order.
    assert [r["steps_each_ms"] for r in rows] == ["1.000;2.000", "1.000;2.000"]
    # The GPU's clock over each engine's two timed 1 + N runs (two samples each), nothing
    # sampled around the shorter runs.
    assert _FixedClocks.regions == 4
    assert [(r["sm_mhz"], r["power_w"], r["power_capped"]) for r in rows] == [
        ("1868", "675", "0.50"), ("1868", "675", "0.50")]
    # The memory in use after the timed runs: the fullest GPU's, both engines together.
    assert [r["gpu_mem_mib"] for r in rows] == ["61440", "61440"]


class _FixedClocks(gpu_clocks.ClockSampler):
    """``gpu_clocks.ClockSampler`` without ``nvidia-smi``: two samples per timed region,
    one at 1755 MHz power-capped, one at 1980 MHz."""

    regions = 0

    def __enter__(self):
        _FixedClocks.regions += 1
        self.samples = [gpu_clocks.Sample(1755.0, 700.0, 60.0, True, False),
                        gpu_clocks.Sample(1980.0, 650.0, 58.0, False, False)]
        return self

    def __exit__(self, *exc):
        return None


def test_engine_table_shows_each_engines_most_memory_in_use(capsys):
    """``print_medians``: the median step over rounds and the most memory any round held;
    rows from before the column (no ``gpu_mem_mib``) print ``-``."""
    rows = [dict(status="ok", heads=128, kv="auto", backend="TRTLLM_MLA", batch="32",
                 step_ms=ms, gpu_mem_mib=mib)
            for ms, mib in (("4.0", "70000"), ("5.0", "73728"), ("6.0", ""))]
    rows.append(dict(status="ok", heads=128, kv="auto", backend="FLASHMLA", batch="32",
                     step_ms="8.0"))
    rows.append(dict(status="failed (1): out of memory", heads=128, kv="auto",
                     backend="FLASH_ATTN_MLA"))
    bench_engine.print_medians(rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[-3:] == ["GiB", "in", "use"]
    assert lines[1].split() == ["128", "auto", "TRTLLM_MLA", "32", "6400", "5.000",
                                "4.00-6.00", "3", "72.0"]
    assert lines[2].split()[-2:] == ["1", "-"]
    assert len(lines) == 3


def test_next_engine_waits_for_the_gpu_memory_of_the_last():
    readings = iter([[70_000], [30_000], [3_000]])
    slept = []
    assert bench_engine.wait_for_free_gpu(lambda: next(readings), sleep=slept.append)
    assert slept == [2.0, 2.0]
    assert not bench_engine.wait_for_free_gpu(lambda: [70_000], timeout_s=4,
                                              sleep=lambda s: None)
    assert bench_engine.wait_for_free_gpu(lambda: None)  # no nvidia-smi: no wait


def test_engine_processes_left_behind_by_a_worker_are_killed(monkeypatch, tmp_path):
    """A worker that exits while a child of its own (an engine process) lives on: the child
    must be gone when ``engine_rows`` returns (left alone, vLLM's engine processes held
    their GPU memory for minutes, run 38)."""
    import textwrap

    fake = tmp_path / "fake_worker.py"
    fake.write_text(textwrap.dedent(f"""
        import json, subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
        result = sys.argv[sys.argv.index("--result") + 1]
        open(result, "w").write(json.dumps([{{"status": "ok",
                                              "core": "--core-steps" in sys.argv}}]))
    """))
    monkeypatch.setattr(bench_engine, "__file__", str(fake))
    monkeypatch.setattr(bench_engine, "wait_for_free_gpu", lambda: True)
    args = type("A", (), dict(out=tmp_path, batches="2", output_len=6, short_len=2,
                              repeats=1, min_prompt=4, max_prompt=8, seed=0, layers=2,
                              timeout=60, eager=False, core_steps=True, gpu_memory=None))()
    rows = bench_engine.engine_rows(args, tmp_path / "model", 16, "auto", "TRTLLM_MLA", 0)
    assert rows == [{"status": "ok", "core": True, "round": 0}]
    pid = int((tmp_path / "child.pid").read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the worker's child outlived it"


def test_a_bench_stopped_from_outside_kills_its_running_engines(tmp_path):
    """SIGTERM to the bench (what ``timeout`` sends) while a worker runs: the worker's own
    process group, engine processes included, is gone after the bench exits (run 52: left
    alive, they held the GPU's memory and the next job ran out)."""
    import signal
    import subprocess
    import textwrap

    fake = tmp_path / "fake_worker.py"
    fake.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(tmp_path / "child.pid")!r}, "w").write(str(child.pid))
        time.sleep(120)
    """))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(bench_engine.__file__).parent)!r})
        import bench_engine
        bench_engine.__file__ = {str(fake)!r}
        bench_engine.wait_for_free_gpu = lambda: True
        args = type("A", (), dict(out=__import__("pathlib").Path({str(tmp_path)!r}),
                                  batches="2", output_len=6, short_len=2, repeats=1,
                                  min_prompt=4, max_prompt=8, seed=0, layers=2, timeout=100,
                                  eager=False, core_steps=False, gpu_memory=None))()
        bench_engine.stop_on_sigterm()
        bench_engine.engine_rows(args, "model", 16, "auto", "TRTLLM_MLA", 0)
    """))
    bench = subprocess.Popen([sys.executable, str(driver)])
    pid_file = tmp_path / "child.pid"
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    assert _alive(pid)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=30) == 128 + signal.SIGTERM
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the running worker's engine process outlived the bench"


def _alive(pid: int) -> bool:
    """Running (a killed process may stay a zombie until its new parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _paired_round(rnd: int, first: str, second: str, tps: dict[str, float], batch: int = 256,
                  ) -> list[dict]:
    """Two rows of one paired round, in creation order, as bench_engine writes them."""
    return [dict(round=str(rnd), heads="16", kv="fp8", backend=name, batch=str(batch),
                 decode_tokens_per_s=str(tps[name]), status="ok") for name in (first, second)]


def test_paired_ratio_cancels_the_creation_order_effect():
    """Rounds where the engine created first runs 5% faster whatever its backend, the
    plugin created first in four rounds of six: the plain geometric mean leans toward
    the plugin; the balanced estimate recovers the true ratio (0.98) and the order effect."""
    rows = []
    for rnd, plugin_first in enumerate((True, False, True, True, False, True)):
        order = ("TRTLLM_MLA", "FLASHMLA") if plugin_first else ("FLASHMLA", "TRTLLM_MLA")
        tps = {"FLASHMLA": 1000.0, "TRTLLM_MLA": 980.0}
        tps[order[0]] *= 1.05 * (1 + 0.001 * rnd)  # a little noise so the variance is > 0
        rows += _paired_round(rnd, *order, tps)
    rows.append(dict(rows[0], status="failed: out of memory"))  # ignored
    (point,) = summarize_engine.paired_points([rows])
    assert point.other == "FLASHMLA" and point.batch == 256 and len(point.ratios) == 6
    assert point.plugin_first == (True, False, True, True, False, True)
    assert point.ratios[1] == pytest.approx(980 / (1050 * 1.001))
    assert point.geomean > 0.99  # biased toward the plugin, created first more often
    assert point.balanced == pytest.approx(0.98, rel=2e-3)
    assert point.created_first == pytest.approx(1.05, rel=5e-3)
    assert point.low < 0.98 < point.high


def test_paired_ratio_pools_files_and_needs_both_orders_for_an_interval():
    """Rounds restart at 0 in every file (one bench per device call): each file's rounds
    count separately. With one creation order only there is no balanced estimate."""
    one = _paired_round(0, "TRTLLM_MLA", "FLASH_ATTN_MLA", {"TRTLLM_MLA": 11.0,
                                                             "FLASH_ATTN_MLA": 10.0}, 32)
    two = _paired_round(0, "TRTLLM_MLA", "FLASH_ATTN_MLA", {"TRTLLM_MLA": 12.0,
                                                             "FLASH_ATTN_MLA": 10.0}, 32)
    (point,) = summarize_engine.paired_points([one, two])
    assert point.ratios == pytest.approx((1.1, 1.2))
    assert point.balanced is None and point.low is None and point.created_first is None
    assert point.geomean == pytest.approx((1.1 * 1.2) ** 0.5)


def test_paired_ratio_takes_a_forced_route_as_the_plugin():
    """``TRTLLM_MLA@ROUTE`` is the plugin against vLLM's backend, and against the plugin's
    own choice (``TRTLLM_MLA``) it is the one compared; the point names it."""
    forced = _paired_round(0, "TRTLLM_MLA@flashmla", "FLASH_ATTN_MLA",
                           {"TRTLLM_MLA@flashmla": 9.9, "FLASH_ATTN_MLA": 10.0}, 160)
    (point,) = summarize_engine.paired_points([forced])
    assert point.ratios == pytest.approx((0.99,)) and point.plugin_first == (True,)
    assert point.other == "FLASH_ATTN_MLA (TRTLLM_MLA@flashmla over it)"
    ab = _paired_round(0, "TRTLLM_MLA", "TRTLLM_MLA@vllm-fa3-mla",
                       {"TRTLLM_MLA": 10.0, "TRTLLM_MLA@vllm-fa3-mla": 10.5}, 128)
    (point,) = summarize_engine.paired_points([ab])
    assert point.ratios == pytest.approx((1.05,)) and point.plugin_first == (False,)
    assert point.other == "TRTLLM_MLA (TRTLLM_MLA@vllm-fa3-mla over it)"


def test_paired_ratio_of_two_forced_routes_takes_the_one_named_over(tmp_path, capsys):
    """Two forced routes of the plugin (the pair phases' FA3 over ``cuda-splitk``): no side
    without ``over``; with it, that route over the other, from the CSV as from the rows."""
    rows = []
    for rnd, order in enumerate((("TRTLLM_MLA@vllm-fa3-mla", "TRTLLM_MLA@cuda-splitk"),
                                 ("TRTLLM_MLA@cuda-splitk", "TRTLLM_MLA@vllm-fa3-mla"))):
        rows += _paired_round(rnd, *order, {"TRTLLM_MLA@vllm-fa3-mla": 1040.0,
                                            "TRTLLM_MLA@cuda-splitk": 1000.0}, 48)
    assert summarize_engine.paired_points([rows]) == []
    (point,) = summarize_engine.paired_points([rows], over="TRTLLM_MLA@cuda-splitk")
    assert point.ratios == pytest.approx((1 / 1.04, 1 / 1.04))
    assert point.plugin_first == (False, True)
    path = tmp_path / "engine.csv"
    bench_engine.write_csv(path, rows)
    summarize_engine.main("--over", "TRTLLM_MLA@vllm-fa3-mla", str(path))
    table = capsys.readouterr().out
    assert ("| 48 | TRTLLM_MLA@cuda-splitk (TRTLLM_MLA@vllm-fa3-mla over it) | 2 | "
            "1.040*, 1.040 | 1.040 | 1.040 (-" in table)


def test_paired_table_reads_the_csv_bench_engine_writes(tmp_path, capsys):
    """bench_engine.write_csv -> summarize_engine.main: the columns it needs survive."""
    rows = []
    for rnd, order in enumerate((("TRTLLM_MLA", "FLASHMLA"), ("FLASHMLA", "TRTLLM_MLA"))):
        rows += _paired_round(rnd, *order, {"TRTLLM_MLA": 1100.0, "FLASHMLA": 1000.0})
    path = tmp_path / "engine.csv"
    bench_engine.write_csv(path, rows)
    summarize_engine.main(str(path))
    table = capsys.readouterr().out
    assert "| 16 | fp8 | 256 | FLASHMLA | 2 | 1.100*, 1.100 | 1.100 | 1.100 (-" in table


def test_fixed_cost_fit_recovers_a_known_line():
    import fit_fixed_cost

    # 9 us fixed, 3.5 TB/s (MB/us): us = 9 + MB / 3.5, with a little symmetric noise
    pts = [(mb, 9.0 + mb / 3.5 + (0.2 if i % 2 else -0.2)) for i, mb in
           enumerate((10, 20, 40, 80, 160, 320, 640, 1280))]
    fixed, tbps = fit_fixed_cost.fit(pts)
    assert abs(fixed - 9.0) < 0.3 and abs(tbps - 3.5) < 0.02


def test_case_lengths_kinds():
    g = torch.Generator().manual_seed(0)
    assert bench_decode.case_lengths("u", 4096, 3, 1, g) == [4096] * 3
    assert bench_decode.case_lengths("o0.03", 65536, 96, 1, g) == [65536] + [1966] * 95
    ragged = bench_decode.case_lengths("r0.50", 4096, 200, 2, g)
    assert len(ragged) == 200 and min(ragged) >= 2048 and max(ragged) <= 4096
    assert min(bench_decode.case_lengths("r", 64, 200, 4, g)) >= 4  # never below q_len


@pytest.mark.parametrize("eager", [False, True])
def test_engines_run_with_cuda_graphs_unless_eager(monkeypatch, eager):
    """``--eager`` starts vLLM with ``enforce_eager`` and no capture sizes; otherwise
    decode batches of the timed sizes are captured. Stats (the engine core's token
    timestamps) only with ``--core-steps``."""
    vllm = pytest.importorskip("vllm")
    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kw: seen.update(kw))
    args = type("A", (), dict(model="m", kv="auto", max_prompt=64, output_len=8,
                              eager=eager, core_steps=eager))()
    bench_engine.make_llm(args, "TRTLLM_MLA", 32, [32, 8])
    assert seen["disable_log_stats"] is (not eager)
    if eager:
        assert seen["enforce_eager"] is True and "compilation_config" not in seen
    else:
        assert "enforce_eager" not in seen
        assert seen["compilation_config"]["cudagraph_capture_sizes"] == [8, 32]


def test_flashmla_peer_schedules_once_per_captured_step(monkeypatch):
    """vLLM's FLASHMLA hands each step an empty FlashMLA schedule that the step's first
    layer fills on the GPU (inside the captured graph). The bench's peer does the same once
    per captured graph of calls (one step) and reuses it within; before run 80 it filled one
    schedule outside the graph and left FlashMLA's 26 us schedule kernel out (run 78)."""
    import types

    import decode_kernels

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec

    made, used = [], []

    def get_mla_metadata():
        made.append(object())
        return made[-1], None

    def flash_mla_with_kvcache(**kw):
        used.append(kw["tile_scheduler_metadata"])
        return torch.zeros(2, 1, 16, 512), None

    fake = types.SimpleNamespace(get_mla_metadata=get_mla_metadata,
                                 flash_mla_with_kvcache=flash_mla_with_kvcache)
    monkeypatch.setattr(decode_kernels, "importlib",
                        types.SimpleNamespace(import_module=lambda name: fake))
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    spec = DecodeSpec(16, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1)
    batch = DecodeBatch(torch.zeros(2, 4, dtype=torch.int32),
                        torch.tensor([100, 200], dtype=torch.int32), 200)
    case = decode_kernels.Case("h16 b2", spec, batch, torch.zeros(2, 16, 576), [], [100, 200], 1)
    peer = decode_kernels.flashmla_peer(case)
    cache = torch.zeros(4, 64, 576)
    for phase in (False, False, True, True, True, False, True, True):  # warm-up, 2 graphs
        capturing[0] = phase
        assert peer.call(cache).shape == (2, 16, 512)
    assert len(made) == 3
    assert used == [made[0]] * 2 + [made[1]] * 3 + [made[1]] + [made[2]] * 2


def test_query_parts_are_the_engines_and_flashmla_peer_concatenates_them(monkeypatch):
    """``--query-parts``: the query reaches a decoder as vLLM's MLA layer hands it over
    (contiguous latent part, rope part a strided view of the projection), with the same
    values; a CPU decoder given the parts decodes as given the whole; vLLM's FLASHMLA peer
    concatenates them inside the timed call, as its ``forward_mqa`` does."""
    import types

    import decode_kernels

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, MLADecoder

    torch.manual_seed(0)
    query = torch.randn(6, 16, 576)
    ql_nope, q_pe = decode_kernels.engine_query_parts(query, 512)
    assert ql_nope.is_contiguous() and not q_pe.is_contiguous()
    assert q_pe.stride()[1] == decode_kernels.QK_NOPE_DIM + 64
    assert torch.equal(torch.cat((ql_nope, q_pe), -1), query)

    spec = DecodeSpec(16, 512, 64, 64, torch.float32, torch.float32, 0.1, max_q_len=3)
    lens = torch.tensor([70, 130], dtype=torch.int32)
    batch = DecodeBatch(torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), lens, 130,
                        cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32), max_q_len=3,
                        num_tokens=6)
    cache = torch.randn(6, 64, 576)
    dec = MLADecoder(spec, torch.device("cpu"), 2)
    dec.plan(batch)
    assert torch.allclose(dec.run((ql_nope, q_pe), cache), dec.run(query, cache))

    seen = []

    def flash_mla_with_kvcache(**kw):
        seen.append(kw["q"].clone())
        return torch.zeros(2, 3, 16, 512), None

    fake = types.SimpleNamespace(get_mla_metadata=lambda: (None, None),
                                 flash_mla_with_kvcache=flash_mla_with_kvcache)
    monkeypatch.setattr(decode_kernels, "importlib",
                        types.SimpleNamespace(import_module=lambda name: fake))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(decode_kernels, "QUERY_PARTS", True)
    case = decode_kernels.Case("h16 b2 q3", spec, batch, query, [], [70, 130], 3)
    cats = []
    real_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or real_cat(*a, **k))
    decode_kernels.flashmla_peer(case).call(cache)
    assert cats == [1] and torch.equal(seen[0], query.view(2, 3, 16, 576))


def test_policy_scores_flashmla_as_the_engine_runs_it(tmp_path):
    """``evaluate_policy`` scores vLLM's FLASHMLA by the plugin's ``flashmla`` row in files
    of runs before 80 (FlashMLA's schedule kernel once per step, as vLLM runs it; those peer
    rows left it out), and by the peer's own row from run 80 on (the route writes its own
    schedule from run 85 and is no stand-in for vLLM's FLASHMLA)."""
    import evaluate_policy

    rows = ("pass_no,shape,kernel,status,us,kv\n"
            "1,s,flashmla,ok,20.0,bf16\n"
            "1,s,peer:vllm-flashmla,ok,17.0,bf16\n"
            "1,s,peer:vllm-fa3-mla,ok,18.0,bf16\n")
    for name, peer in (("run79-random-1.csv", 20.0), ("run80-random-20.csv", 17.0),
                       ("random-1.csv", 17.0)):
        path = tmp_path / name
        path.write_text(rows)
        timed = evaluate_policy.timed_rows(str(path))["s"]
        assert float(timed["peer:vllm-flashmla"]["us"]) == peer, name
        assert float(timed["vllm-fa3-mla"]["us"]) == 18.0  # stood in for by vLLM's FA3 peer


def test_twin_scores_the_decoder_by_its_routes_forced_row_and_counts_the_gaps(tmp_path,
                                                                               capsys):
    """``evaluate_policy --twin``: each shape scored by the forced row of the route the
    decoder's row ran (its own row where there is none, as for ``cuda-splitk``); the small
    shapes (twin under 40 us) where the two differ by more than 1 us, counted each way."""
    import evaluate_policy

    path = tmp_path / "run300-random-1.csv"
    path.write_text(
        "pass_no,shape,kernel,status,us,kv\n"
        "1,a bf16 ,plugin-graph[vllm-fa3-mla],ok,12.0,bf16\n"   # 2 us over its twin
        "1,a bf16 ,vllm-fa3-mla,ok,10.0,bf16\n"
        "1,a bf16 ,peer:vllm-fa3-mla,ok,10.0,bf16\n"
        "1,a bf16 ,peer:vllm-flashmla,ok,11.0,bf16\n"
        "1,b bf16 ,plugin-graph[cuda-splitk],ok,20.0,bf16\n"    # no forced twin
        "1,b bf16 ,peer:vllm-fa3-mla,ok,22.0,bf16\n"
        "1,b bf16 ,peer:vllm-flashmla,ok,30.0,bf16\n"
        "1,c bf16 ,plugin-graph[flashmla],ok,45.0,bf16\n"       # twin of 48 us: not small
        "1,c bf16 ,flashmla,ok,48.0,bf16\n"
        "1,c bf16 ,peer:vllm-fa3-mla,ok,60.0,bf16\n"
        "1,c bf16 ,peer:vllm-flashmla,ok,49.0,bf16\n")
    measured = {s: r for r, s, _ in evaluate_policy.ratios(str(path), {}, "measured")}
    twin = {s: (r, n) for r, s, n in evaluate_policy.ratios(str(path), {}, "twin")}
    assert measured["a bf16 "] == pytest.approx(10 / 12)
    assert twin["a bf16 "] == (pytest.approx(1.0), "vllm-fa3-mla")
    assert twin["b bf16 "] == (pytest.approx(1.1), "plugin-graph[cuda-splitk]")
    assert twin["c bf16 "] == (pytest.approx(49 / 48), "flashmla")
    assert evaluate_policy.twin_gaps(evaluate_policy.timed_rows(str(path))) == (1, 1, 0)
    evaluate_policy.main("--twin", "-", str(path))
    assert ("decoder row against its twin, twins under 40 us: 1 pairs, decoder slower by "
            "> 1 us in 1, faster in 0") in capsys.readouterr().out


def test_oracle_scores_the_faster_route_per_shape_plus_its_node_cost(tmp_path):
    """``evaluate_policy --oracle``: per bf16 shape the fastest of the ``vllm-fa3-mla`` and
    ``flashmla`` rows and the decoder's own ``plugin-graph[...]`` row where it ran another
    route (``cuda-splitk``) with ``node_us`` added, over the best peer; shapes missing either
    of the two routes' rows are not scored."""
    import evaluate_policy

    rows = ("pass_no,shape,kernel,status,us,kv\n"
            "1,a,vllm-fa3-mla,ok,20.0,bf16\n1,a,flashmla,ok,30.0,bf16\n"
            "1,a,peer:vllm-fa3-mla,ok,21.0,bf16\n1,a,peer:vllm-flashmla,ok,33.0,bf16\n"
            "1,b,vllm-fa3-mla,ok,50.0,bf16\n1,b,flashmla,ok,40.0,bf16\n"
            "1,b,peer:vllm-fa3-mla,ok,50.0,bf16\n1,b,peer:vllm-flashmla,ok,44.0,bf16\n"
            "1,c,flashmla,ok,40.0,bf16\n1,c,peer:vllm-flashmla,ok,44.0,bf16\n"
            "1,d,vllm-fa3-mla,ok,30.0,bf16\n1,d,flashmla,ok,35.0,bf16\n"
            "1,d,plugin-graph[cuda-splitk],ok,25.0,bf16\n"
            "1,d,peer:vllm-fa3-mla,ok,30.0,bf16\n1,d,peer:vllm-flashmla,ok,36.0,bf16\n"
            # a second timing of a route the oracle already has is not a candidate
            "1,b,plugin-graph[flashmla],ok,30.0,bf16\n")
    path = tmp_path / "random-1.csv"
    path.write_text(rows)
    got = sorted(evaluate_policy.ratios(str(path), {}, "oracle", node_us=2.0), key=lambda x: x[1])
    assert [(s, n) for _, s, n in got] == [("a", "vllm-fa3-mla"), ("b", "flashmla"),
                                           ("d", "plugin-graph[cuda-splitk]")]
    assert [r for r, _, _ in got] == pytest.approx([21.0 / 22.0, 44.0 / 42.0, 30.0 / 27.0])
    vs_fa3 = evaluate_policy.ratios(str(path), {}, "oracle", vs="peer:vllm-fa3-mla")
    assert sorted(r for r, _, _ in vs_fa3) == pytest.approx([21.0 / 20.0, 30.0 / 25.0,
                                                             50.0 / 40.0])


def test_oracle_picks_by_the_engine_time_with_the_query_join(tmp_path):
    """With ``--query-join``, the oracle picks the route whose time with its join is lower:
    FlashMLA, 1 us faster raw but reading the query whole, loses to vLLM's FA3 kernel, which
    reads it in parts, once the join is added (the pick by raw time scored this shape at
    the joined FlashMLA's time)."""
    import evaluate_policy

    head = "pass_no,shape,heads,batch,q_len,block,kv,kernel,status,us\n"
    row = "1,h128 b225 q2 bf16 p64,128,225,2,64,bf16,"
    path = tmp_path / "random-1.csv"
    path.write_text(head + "".join(f"{row}{k},ok,{us}\n" for k, us in (
        ("vllm-fa3-mla", 211.6), ("flashmla", 210.6), ("peer:vllm-fa3-mla", 210.0),
        ("peer:vllm-flashmla", 210.8))))
    (ratio, _, name), = evaluate_policy.ratios(str(path), {}, "oracle", join="fused")
    assert name == "vllm-fa3-mla" and ratio == pytest.approx(210.0 / 211.6)


def test_switch_scores_the_eager_rules_pick_among_the_graph_routes(tmp_path):
    """``evaluate_policy --switch``: per bf16 shape the eager rule's ranking from the
    shape's lengths, FlashInfer's FA3 read as vLLM's, its first route among the graph
    decoder's (``cuda-splitk`` by the decoder's row where the graph ran it), plus
    ``node_us``; shapes without both graph routes' rows are not scored."""
    import evaluate_policy

    head = "pass_no,shape,heads,batch,q_len,block,kv,kernel,status,us\n"
    short = "1,h16 b8 300 u q1 bf16 p64,16,8,1,64,bf16,"
    long = "1,h64 b4 40000 u q1 bf16 p64,64,4,1,64,bf16,"
    body = "".join(f"{short}{k},ok,{us}\n" for k, us in (
        ("vllm-fa3-mla", 20.0), ("flashmla", 25.0), ("peer:vllm-fa3-mla", 20.0)))
    body += "".join(f"{long}{k},ok,{us}\n" for k, us in (
        ("vllm-fa3-mla", 110.0), ("flashmla", 100.0), ("peer:vllm-fa3-mla", 105.0)))
    path = tmp_path / "random-1.csv"
    path.write_text(head + body)
    lens = {"h16 b8 300 u q1 bf16 p64": [300] * 8, "h64 b4 40000 u q1 bf16 p64": [40000] * 4}
    got = {s: (r, n) for r, s, n in evaluate_policy.ratios(str(path), lens, "switch",
                                                              node_us=1.0)}
    # The eager rule ranks FlashInfer's FA3 first for the short batch (read as vLLM's FA3
    # kernel, not the FlashMLA that follows it) and vLLM's FA3 kernel first for the long
    # one (few requests, many KV tokens), though FlashMLA is faster there: a rule, not the
    # oracle.
    expected = {"h16 b8 300 u q1 bf16 p64": "vllm-fa3-mla",
                "h64 b4 40000 u q1 bf16 p64": "vllm-fa3-mla"}
    assert {s: n for s, (_, n) in got.items()} == expected
    us = {("h16 b8 300 u q1 bf16 p64", "vllm-fa3-mla"): 20.0,
          ("h16 b8 300 u q1 bf16 p64", "flashmla"): 25.0,
          ("h64 b4 40000 u q1 bf16 p64", "vllm-fa3-mla"): 110.0,
          ("h64 b4 40000 u q1 bf16 p64", "flashmla"): 100.0}
    peer = {"h16 b8 300 u q1 bf16 p64": 20.0, "h64 b4 40000 u q1 bf16 p64": 105.0}
    for shape, (ratio, name) in got.items():
        assert ratio == pytest.approx(peer[shape] / (us[shape, name] + 1.0))


def test_graph_bounds_search_replays_each_bound_and_restores_the_policy(tmp_path,
                                                                         monkeypatch):
    """``evaluate_policy --search-graph-bounds``: each bound combination replays the
    CUDA-graph rule (b40 goes to vLLM's FA3 kernel only under a batch bound of >= 40, b200
    only under >= 256), the best fit comes first, the check files are scored under the same
    bounds, and ``ops.policy``'s bounds are today's again afterwards. The H200's own band
    bound (65), which the grid does not vary, would send b40 to FA3 under every bound: the
    search is checked without it."""
    import evaluate_policy

    from trtllm_mla_plugin.ops import policy

    monkeypatch.setattr(policy, "SPLITK_GRAPH_BANDS_BY_GPU", {})

    head = "pass_no,shape,heads,batch,q_len,block,kv,kernel,status,us\n"

    def shape_rows(name: str, batch: int, fa3_us: float, flashmla_us: float) -> str:
        row = f"1,h16 b{batch} {name} bf16 p64,16,{batch},1,64,bf16,"
        return "".join(f"{row}{k},ok,{us}\n" for k, us in (
            ("vllm-fa3-mla", fa3_us), ("flashmla", flashmla_us),
            ("peer:vllm-fa3-mla", fa3_us), ("peer:vllm-flashmla", flashmla_us)))

    fit = tmp_path / "random-1.csv"
    fit.write_text(head + shape_rows("a", 40, 10.0, 20.0) + shape_rows("b", 200, 40.0, 20.0))
    check = tmp_path / "random-2.csv"
    check.write_text(head + shape_rows("c", 40, 30.0, 15.0))
    today = {name: getattr(policy, name) for name in evaluate_policy.GRAPH_BOUND_GRID}
    results = evaluate_policy.search_graph_bounds([str(fit)], [str(check)], {})
    assert {name: getattr(policy, name) for name in today} == today
    by_bounds = {tuple(b.values()): (f, c) for b, f, c in results}
    assert len(by_bounds) == len(results) == math.prod(
        len(v) for v in evaluate_policy.GRAPH_BOUND_GRID.values())
    best_bounds, best_fit, best_check = results[0]
    assert 40 <= best_bounds["VLLM_FA3_GRAPH_MAX_BATCH"] <= 192
    assert best_fit == pytest.approx((1.0, 1.0, 2))  # the faster kernel on both shapes
    assert best_check == pytest.approx((0.5, 0.5, 1))  # b40 on FA3, here 2x slower
    # Today's bounds (32 requests; 16 rows per request: the length-order bound leaves them
    # to cuda-splitk, FlashMLA behind it): both shapes on FlashMLA, the check shape too.
    fit_today, check_today = by_bounds[tuple(today.values())]
    assert fit_today == pytest.approx((math.sqrt(0.5), 0.5, 2))
    assert check_today == pytest.approx((1.0, 1.0, 1))
    # A bound of 256 requests sends b200 to FA3 as well.
    assert by_bounds[(256, 1 << 30, 0, 0, False)][0] == pytest.approx((math.sqrt(0.5), 0.5, 2))


def test_overhead_sweep_times_each_plan_beside_the_peers(monkeypatch, tmp_path, capsys):
    """``bench_flashmla_schedule.py --sections overhead`` bookkeeping with stand-ins: every
    overhead's plan is installed and planned before it is timed, its extra pieces and its
    output's difference to the first plan's are written, and FA3's time over the route's
    is summarised per overhead."""
    pytest.importorskip("triton")
    import types

    import bench_flashmla_schedule as bfs

    class Schedule:
        overhead_blocks = 5

        @property
        def buffers(self):
            extra = 3 if self.overhead_blocks == 5 else 0
            return None, torch.tensor([0, 4 + extra])

        def num_parts(self, rows):
            return 132 // -(-rows // 64)

    class Route:
        cuda_graph = False

        def __init__(self):
            self.planned, self._schedule = [], Schedule()

        def plan(self, batch):
            self.planned.append(self._schedule.overhead_blocks)

    route = Route()
    case = types.SimpleNamespace(name="h16 b4", batch=types.SimpleNamespace(batch_size=4),
                                 caches=[0], q_len=1, lens_host=[9, 70, 1, 3000],
                                 spec=types.SimpleNamespace(num_heads=16))
    kernel = types.SimpleNamespace(
        call=lambda cache: torch.full((2,), 1.0 + 0.01 * (route._schedule.overhead_blocks != 5)),
        obj=types.SimpleNamespace(route=route))
    monkeypatch.setattr(bfs.bd, "make_case", lambda shape, seed, device: case)
    monkeypatch.setattr(bfs.bd, "random_set", lambda *a, **k: [])
    monkeypatch.setattr(bfs, "LOSS_REGION", [("shape",)])
    monkeypatch.setattr(bfs.dk, "decoder_kernel", lambda *a, **k: kernel)
    peer = types.SimpleNamespace(call="fa3")
    monkeypatch.setattr(bfs.dk, "vllm_fa3_mla_peer", lambda case: peer)
    monkeypatch.setattr(bfs.dk, "flashmla_peer", lambda case: types.SimpleNamespace(call=None))
    monkeypatch.setattr(bfs.bd, "time_graph", lambda call, case: 20.0 if call == "fa3"
                        else 25.0 if route._schedule.overhead_blocks == 5 else 16.0)
    out = tmp_path / "o.csv"
    bfs.overhead_sweep(torch.device("cpu"), 1, 0, [5, 32], out)
    assert route.planned == [5, 32]
    with open(out, newline="") as f:
        rows = list(bench_decode.csv.DictReader(f))
    assert [(r["kernel"], r["us"], r["extra_pieces"]) for r in rows] == [
        ("flashmla@5", "25.00", "3"), ("flashmla@32", "16.00", "0"),
        ("peer:vllm-fa3-mla", "20.00", "")]
    assert rows[0]["rel_diff"] == "0.0e+00" and rows[1]["rel_diff"] == "1.0e-02"
    printed = capsys.readouterr().out
    assert "overhead 5: vLLM FA3 / flashmla route over 1 shapes: geomean 0.800" in printed
    assert "overhead 32: vLLM FA3 / flashmla route over 1 shapes: geomean 1.250" in printed
    logged = [json.loads(line)
              for line in out.with_suffix(".shapes.jsonl").read_text().splitlines()]
    assert logged == [dict(shape="h16 b4", lens=[9, 70, 1, 3000], q_len=1, heads=16,
                           parts=132)]


def _overhead_files(tmp_path, name: str, shapes: list[tuple]) -> Path:
    """A ``--sections overhead`` CSV and its ``.shapes.jsonl``: (shape, lens, parts, route
    time per cost, FA3 time)."""
    out = tmp_path / f"{name}.csv"
    with open(out, "w", newline="") as f, open(out.with_suffix(".shapes.jsonl"), "w") as log:
        w = bench_decode.csv.DictWriter(f, fieldnames=["shape", "kernel", "us"])
        w.writeheader()
        for shape, lens, parts, times, fa3 in shapes:
            for cost, us in times.items():
                w.writerow(dict(shape=shape, kernel=f"flashmla@{cost}", us=us))
            w.writerow(dict(shape=shape, kernel="peer:vllm-fa3-mla", us=fa3))
            log.write(json.dumps(dict(shape=shape, lens=lens, parts=parts)) + "\n")
    return out


def test_overhead_fit_keeps_rules_that_never_lose_and_checks_them_on_other_shapes(
        tmp_path, capsys):
    """Cost 32 wins 20% on batches of at least one request per part and loses 30% on
    small batches: the fixed cost 32 is dropped (a fit shape 30% slower than FlashMLA's
    own plan), a rule by requests per part is kept and scored on the check file."""
    import fit_flashmla_overhead as fit

    def shapes(b_values, seed):
        out = []
        for i, b in enumerate(b_values):
            big = b >= 132
            out.append((f"s{seed}-{i}", [500] * b, 132,
                        {5: 10.0, 32: 8.0 if big else 13.0}, 9.0))
        return out

    fit_csv = _overhead_files(tmp_path, "fit", shapes([3, 40, 140, 300], 1))
    check_csv = _overhead_files(tmp_path, "check", shapes([7, 200], 2))
    loaded = fit.load(fit_csv)
    assert [len(s.lens) for s in loaded] == [3, 40, 140, 300]
    assert loaded[0].route_us == {5: 10.0, 32: 13.0} and loaded[0].mean_blocks == 8
    fit.main([str(fit_csv), str(check_csv), "--top", "50"])
    printed = capsys.readouterr().out
    assert "fixed 32 " not in printed
    kept = [line for line in printed.splitlines() if "requests >= 1.0 parts -> 32" in line]
    # On the fit file two of four shapes gain 1.25, on the check file one of two.
    assert len(kept) == 2 and "vs own plan 1.118 (worst 1.000)" in kept[0]
    assert "vs own plan 1.118 (worst 1.000)" in kept[1]
    assert "vs vLLM FA3 1.006 (worst 0.900)" in kept[1]  # sqrt(9 / 10 * 9 / 8)


def test_fa3_split_sweep_plans_and_times_each_cap_on_small_batches(monkeypatch, tmp_path):
    """``bench_fa3_graph_splits``: random shapes of more than ``MAX_TILES`` query tiles are
    left out; per shape the route is re-planned at each cap before it is run and timed, and
    its rows come with the peers' and the cap-32 output's difference."""
    import bench_fa3_graph_splits as sweep_bench
    import decode_kernels

    small, big = (16, 2, 4096, "u", 1, "bf16", 64), (64, 16, 4096, "u", 1, "bf16", 64)
    assert sweep_bench.query_tiles(small) == 2 and sweep_bench.query_tiles(big) == 16
    monkeypatch.setattr(sweep_bench, "FIXED", [])
    monkeypatch.setattr(bench_decode, "random_set", lambda seed, count, keep: [(1, small),
                                                                                (2, big)])
    made = []

    def make_case(shape, seed, device):
        made.append(shape)
        return type("C", (), {"name": f"b{shape[1]}", "caches": [0], "batch": "batch"})()

    class Route:
        max_splits_override = None
        planned = None
        cuda_graph = True

        def plan(self, batch):
            self.planned = self.max_splits_override or 64  # None: the route's rule

    route = Route()

    def decoder_kernel(name, case, route_name, cuda_graph=False):
        def call(cache):
            return torch.full((2,), float(route.planned) if cuda_graph else 1.0)

        obj = type("D", (), {"route": route})()
        return decode_kernels.Kernel(name, call, obj=obj)

    def peer(case):
        return decode_kernels.Kernel("peer", lambda cache: torch.ones(2))

    timed = []

    def time_graph(fn, case):
        out = fn(0)
        timed.append(float(out[0]))
        return 100.0 / float(out[0])  # the cap's time: 100 / cap (peers: 100)

    monkeypatch.setattr(bench_decode, "make_case", make_case)
    monkeypatch.setattr(bench_decode, "time_graph", time_graph)
    monkeypatch.setattr(decode_kernels, "decoder_kernel", decoder_kernel)
    monkeypatch.setattr(decode_kernels, "vllm_fa3_mla_peer", peer)
    monkeypatch.setattr(decode_kernels, "flashmla_peer", peer)
    out = tmp_path / "s.csv"
    sweep_bench.sweep("cpu", [5], 2, [32, 128, "rule"], out)
    assert made == [small]
    # The peers, then each cap as planned; "rule" hands the choice back to the route.
    assert timed == [1.0, 1.0, 1.0, 32.0, 128.0, 64.0]
    assert route.max_splits_override is None
    with open(out, newline="") as f:
        rows = list(bench_decode.csv.DictReader(f))
    assert [(r["kernel"], r["us"], r["tiles"]) for r in rows] == [
        ("vllm-fa3-mla@32", "3.12", "2"), ("vllm-fa3-mla@128", "0.78", "2"),
        ("vllm-fa3-mla@rule", "1.56", "2"),
        ("vllm-fa3-mla-eager", "100.00", "2"), ("peer:vllm-fa3-mla", "100.00", "2"),
        ("peer:vllm-flashmla", "100.00", "2")]
    assert float(rows[1]["rel_diff"]) == pytest.approx(3.0)  # |128 - 32| / 32


def test_mid_random_draws_between_the_two_split_rules():
    """``bench_fa3_graph_splits.mid_random``: seeded, each shape a longest request of
    2k-8k tokens and at most four FA3 query tiles in all, heads and query lengths drawn
    across 8-128 and 1-4."""
    import bench_fa3_graph_splits as sweep_bench

    shapes = sweep_bench.mid_random(7, 60)
    assert shapes == sweep_bench.mid_random(7, 60) != sweep_bench.mid_random(8, 60)
    assert len({seed for seed, _ in shapes}) == 60
    for _, (heads, b, ctx, _, q_len, _, _) in shapes:
        assert 2048 <= ctx <= 8191 and b * -(-heads * q_len // 64) <= 4
    assert {s[0] for _, s in shapes} == {8, 16, 32, 64, 128}
    assert {s[4] for _, s in shapes} == {1, 2, 3, 4}


def test_host_profile_names_what_the_plan_spends_its_time_in():
    """``bench_plan_host --host-profile``: a plan that spends its host time in one call (a
    stand-in decoder on the CPU sleeping in ``slow_part``) shows that call at the top of
    the table, once a plan (200 plans; the warm-up outside the profile)."""
    import time

    import bench_plan_host

    def slow_part():
        time.sleep(0.0005)

    class Decoder:
        def plan(self, batch):
            slow_part()

    table = bench_plan_host.host_profile(Decoder(), itertools.repeat(None), calls=200, top=5)
    # A function's row: "ncalls tottime percall cumtime percall filename:lineno(function)"
    # or "... {built-in method ...}".
    rows = [line for line in table.splitlines()
            if line.split()[:1] and line.split()[0].isdigit() and ("{" in line or ".py:" in line)]
    assert "time.sleep" in rows[0] and rows[0].split()[0] == "200", table
    assert any("slow_part" in r and r.split()[0] == "200" for r in rows), table


def test_decode_stream_lengthens_every_request_by_a_token_in_place():
    """``bench_plan_host.decode_stream``: each step the same fixed-address tensors, every
    length (device and host) one token longer, the longest and the total following; a
    batch without host lengths keeps none."""
    import bench_plan_host

    from trtllm_mla_plugin.ops import DecodeBatch

    lens = torch.tensor([5, 70, 64], dtype=torch.int32)
    batch = DecodeBatch(torch.zeros(3, 2, dtype=torch.int32), lens.clone(), 70,
                        kv_tokens=139, seq_lens_host=lens.clone(), persistent=True)
    steps = bench_plan_host.decode_stream(batch)
    seen = [next(steps) for _ in range(4)]
    for i, step in enumerate(seen):
        assert step.seq_lens.data_ptr() == batch.seq_lens.data_ptr()
        assert step.max_seq_len == 70 + i and step.kv_tokens == 139 + 3 * i
    assert seen[-1].seq_lens.tolist() == seen[-1].seq_lens_host.tolist() == [8, 73, 67]
    bare = bench_plan_host.decode_stream(
        DecodeBatch(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([9], dtype=torch.int32),
                    9))
    next(bare)
    later = next(bare)
    assert later.seq_lens_host is None and later.kv_tokens is None
    assert later.seq_lens.tolist() == [10] and later.max_seq_len == 10


def test_plan_host_block_table_holds_every_step_of_the_stream():
    """``bench_plan_host``: the block table ``main`` builds stays wide enough for every step
    it takes from a case's ``decode_stream`` (run 238 stopped on its 8192-token table at
    the first step past 8192), and the count of steps is what ``main`` takes."""
    import bench_plan_host

    from trtllm_mla_plugin.ops import DecodeSpec
    from trtllm_mla_plugin.ops.validation import check_batch

    spec = DecodeSpec(16, 512, 64, 64, torch.bfloat16, torch.bfloat16, 1 / 192**0.5)
    for reps, profile in ((400, True), (20, False)):
        steps = bench_plan_host.stream_steps(reps, profile)
        assert steps == 2 * (reps + 1) + (bench_plan_host.PROFILE_CALLS + 1) * profile
        width = bench_plan_host.table_width(steps)
        batch = bench_plan_host.batch_for(8, 16, random.Random(8), width, "cpu")
        batch = replace(batch, max_seq_len=8192)  # the longest a draw can be
        stream = bench_plan_host.decode_stream(batch)
        for _ in range(steps):
            check_batch(spec, next(stream), 8)
        with pytest.raises(ValueError, match="too narrow"):
            for _ in range(bench_plan_host.table_width(0) * 64):
                check_batch(spec, next(stream), 8)


def test_host_profile_plans_successive_steps_of_the_stream():
    """``host_profile`` hands the decoder each step of a ``decode_stream`` as it comes (the
    lengths it sees grow a token a plan), so a plan that repeats an earlier step's work
    for unchanged tiles is profiled at decode's rate, not on every call."""
    import bench_plan_host

    from trtllm_mla_plugin.ops import DecodeBatch

    seen = []

    class Decoder:
        def plan(self, batch):
            seen.append(batch.seq_lens_host.tolist())

    lens = torch.tensor([10, 20], dtype=torch.int32)
    batch = DecodeBatch(torch.zeros(2, 2, dtype=torch.int32), lens.clone(), 20,
                        kv_tokens=30, seq_lens_host=lens.clone(), persistent=True)
    bench_plan_host.host_profile(Decoder(), bench_plan_host.decode_stream(batch), calls=5)
    assert seen == [[10 + i, 20 + i] for i in range(6)]  # the warm-up, then five steps


def test_chosen_shapes_keep_the_grid_and_filter_the_draws():
    """``bench_decode.chosen_shapes``: the grid shapes by index (their case seed), then the
    seeds' bf16 draws within the query-row and batch filters that ``keep`` accepts (case
    seed ``1000 x seed`` + place in the draw, as ``random_set`` gives them)."""
    ap = argparse.ArgumentParser()
    bench_decode.add_shape_options(ap, count=40, request_rows=(1, 512), batches=(1, 1024))
    args = ap.parse_args(["--grid", "3,44", "--seeds", "500,501"])
    draws = bench_decode.random_set(500, 40, keep=bench_decode.BF, request_rows=(1, 512),
                                    batches=(1, 1024))
    draws += bench_decode.random_set(501, 40, keep=bench_decode.BF, request_rows=(1, 512),
                                     batches=(1, 1024))
    everything = bench_decode.chosen_shapes(args)
    assert everything == [(3, bench_decode.FULL[3]), (44, bench_decode.FULL[44]), *draws]
    wanted = bench_decode.shape_name(draws[5][1])
    kept = bench_decode.chosen_shapes(args, lambda s: bench_decode.shape_name(s) == wanted)
    assert kept == [(3, bench_decode.FULL[3]), (44, bench_decode.FULL[44]), draws[5]]
    narrow = ap.parse_args(["--seeds", "500", "--batches", "1-8"])
    assert all(shape[1] <= 8 for _, shape in bench_decode.chosen_shapes(narrow))
    wide = ap.parse_args(["--seeds", "500,501", "--count", "400", "--rows", "3073-16384"])
    wide_shapes = [shape for _, shape in bench_decode.chosen_shapes(wide)]
    assert wide_shapes and all(3073 <= h * b * q <= 16384 for h, b, _, _, q, *_ in wide_shapes)


def test_graph_switch_probe_summary_scores_the_faster_flagged_route(tmp_path):
    """``graph_switch_probe --summarize``: per shape the flags' cost over each route's own
    graph and, beside the decoder's score, the score of the faster route behind the flags
    (the faster of vLLM's calls over it); then both scores' geometric mean and worst."""
    import graph_switch_probe as probe

    path = tmp_path / "switch.csv"
    rows = [("s1", "plugin", 20.0), ("s1", "A", 20.0), ("s1", "B", 12.0),
            ("s1", "switch:A", 21.0), ("s1", "switch:B", 13.0),
            ("s1", "peer:vllm-flashmla", 14.0), ("s1", "peer:vllm-fa3-mla", 13.0),
            ("s2", "plugin", 100.0), ("s2", "A", 100.0), ("s2", "B", 120.0),
            ("s2", "switch:A", 102.0), ("s2", "switch:B", 121.0),
            ("s2", "peer:vllm-fa3-mla", 105.0)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["shape", "batch", "kernel", "rounds_us", "median_us", "checks"])
        w.writerow(["s1", 8, "check", "", "", "ran_0_rel_diff=0.0"])
        for shape, kernel, us in rows:
            w.writerow([shape, 8, kernel, f"{us}", f"{us}", ""])
    lines = probe.summary(probe.read_results(path))
    assert lines[0] == ("s1, flags over A +1.00 us, flags over B +1.00 us, decoder 0.650, "
                        "per-step pick 1.000")
    assert lines[1] == ("s2, flags over A +2.00 us, flags over B +1.00 us, decoder 1.050, "
                        "per-step pick 1.029")
    g_dec, g_pick = math.sqrt(0.65 * 1.05), math.sqrt(1.0 * 105 / 102)
    assert lines[2] == f"decoder: geomean {g_dec:.3f} worst 0.650 n 2"
    assert lines[3] == f"per-step pick: geomean {g_pick:.3f} worst 1.000 n 2"


def test_graph_switch_probe_summary_scores_the_switch_node_beside_the_if_nodes(tmp_path):
    """With ``node:*`` rows (one switch node), the probe reads their cost over each route
    and their per-step pick beside the if-nodes' (``switch:*``)."""
    import graph_switch_probe as probe

    times = {"plugin": 20.0, "A": 20.0, "B": 12.0, "switch:A": 23.0, "switch:B": 15.0,
             "node:A": 20.5, "node:B": 12.5, "peer:vllm-fa3-mla": 13.0}
    line = probe.shape_line("s1", times)
    assert line == ("s1, flags over A +3.00 us, flags over B +3.00 us, node over A +0.50 us, "
                    "node over B +0.50 us, decoder 0.650, per-step pick 0.867, "
                    "per-step pick (node) 1.040")
    lines = probe.summary({"s1": times})
    assert lines[1:] == ["decoder: geomean 0.650 worst 0.650 n 1",
                         "per-step pick: geomean 0.867 worst 0.867 n 1",
                         "per-step pick (node): geomean 1.040 worst 1.040 n 1"]


def test_flashmla_fp8_builder_plan_schedules_the_step_into_fixed_buffers():
    """``bench_plan_host``'s stand-in for vLLM's FLASHMLA builder on an FP8 cache asks
    FlashMLA's dense FP8 scheduler for the step's lengths with ``max query x heads`` query
    tokens per KV head, and copies its two outputs into buffers that keep their address
    from step to step (stand-ins for the FlashMLA ops, on the CPU)."""
    import types

    import bench_plan_host

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec

    calls = []

    def scheduler(lens, q_tokens, heads_k):
        calls.append((lens.tolist(), q_tokens, heads_k))
        b = lens.numel()
        return (torch.full((3, 8), b, dtype=torch.int32),
                torch.arange(b + 1, dtype=torch.int32) * 2)

    ops = types.SimpleNamespace(get_mla_decoding_metadata_dense_fp8=scheduler)
    interface = types.SimpleNamespace(get_mla_metadata=lambda: (object(), None))
    spec = DecodeSpec(16, 512, 64, 64, torch.float8_e4m3fn, torch.float8_e4m3fn, 0.1)
    plan = bench_plan_host.VllmFlashMLAFP8BuilderPlan(spec, torch.device("cpu"), 8, ops,
                                                      interface)
    addresses = (plan.tiles.data_ptr(), plan.splits.data_ptr())
    for lens in ([300, 70, 4096], [5, 6, 7, 8, 9]):
        seq = torch.tensor(lens, dtype=torch.int32)
        table = torch.zeros(len(lens), 64, dtype=torch.int32)
        plan.plan(DecodeBatch(table, seq, max(lens)))
        b = len(lens)
        assert calls[-1] == (lens, 16, 1)
        assert plan.tiles[:3].eq(b).all() and plan.splits[: b + 1].tolist() == [
            2 * i for i in range(b + 1)]
    assert (plan.tiles.data_ptr(), plan.splits.data_ptr()) == addresses


def test_engine_attention_share_times_the_query_as_the_engine_hands_it(monkeypatch):
    """``bench_engine``'s attention share times the plugin's layer on vLLM's two query
    parts (a route that reads the query whole pays the join there, as in the engine)."""
    seen = {}

    class Planned(Exception):
        pass

    def layer_decoder(*args, **kwargs):
        seen.update(kwargs)
        raise Planned

    monkeypatch.setattr(bench_engine, "layer_decoder", layer_decoder)
    with pytest.raises(Planned):
        bench_engine.attention_layer_us(16, "auto", [300, 900], "cuda-splitk")
    assert seen.get("query_parts") is True


def test_random_set_filters_keep_the_draws_own_case_seeds():
    """``--random-request-rows`` / ``--random-batches`` / ``--random-rows``: a filtered set is
    the part of the whole draw inside the ranges, each shape with the case seed it has
    unfiltered."""
    whole = bench_decode.random_set(83, 400, keep=bench_decode.BF)
    kept = bench_decode.random_set(83, 400, keep=bench_decode.BF, request_rows=(9, 16),
                                   batches=(17, 127))
    assert kept and len(kept) < len(whole)
    assert kept == [(seed, s) for seed, s in whole
                    if 9 <= s[0] * s[4] <= 16 and 17 <= s[1] <= 127]
    # --random-rows: the batch's query rows, requests x heads x query tokens.
    rows = bench_decode.random_set(83, 400, keep=bench_decode.BF, rows=(2049, 8192))
    assert rows and rows == [(seed, s) for seed, s in whole
                             if 2049 <= s[0] * s[1] * s[4] <= 8192]
    assert bench_decode.int_range("33-95") == (33, 95)
    assert bench_decode.int_range("7") == (7, 7)
    with pytest.raises(argparse.ArgumentTypeError, match="empty range"):
        bench_decode.int_range("9-3")


def test_graph_routes_ab_rotates_the_order_and_scores_by_median(monkeypatch, tmp_path):
    """``graph_routes_ab``: each round starts at the next kernel; a kernel's score is the
    faster of vLLM's two calls over its median round; the bound table switches routes at
    each bound; ``--summarize`` reads the written file back to the same results."""
    import graph_routes_ab as ab

    order = []
    monkeypatch.setattr(bench_decode, "capture_graph", lambda call, case: call)
    monkeypatch.setattr(bench_decode, "time_replays", lambda graph: (order.append(graph.name)
                                                                     or graph.us.pop(0)))
    ks = [bench_decode.Kernel(name) for name in ("flashmla", "cuda-splitk", *ab.PEERS)]
    for k, us in zip(ks, ([10, 50, 10], [8, 8, 9], [12, 12, 12], [20, 20, 20]), strict=True):
        k.call = k  # the stand-in graph is the kernel itself
        k.us = list(us)
    times = ab.time_alternating(ks, None, rounds=3)
    names = [k.name for k in ks]
    assert order == names + names[1:] + names[:1] + names[2:] + names[:2]
    assert times["flashmla"] == [10, 50, 10] and times["cuda-splitk"] == [8, 8, 9]
    medians = {name: sorted(v)[1] for name, v in times.items()}
    assert ab.score(medians, "flashmla") == pytest.approx(12 / 10)
    assert ab.score(medians, "cuda-splitk") == pytest.approx(12 / 8)
    assert ab.score({"flashmla": 1.0}, "flashmla") is None
    # pages of 32 tokens: vLLM's FLASHMLA absent, its FA3 call the only one
    assert ab.score({"plugin": 10.0, ab.PEERS[1]: 12.0}, "plugin") == pytest.approx(1.2)
    results = [(40, medians), (100, {**medians, "cuda-splitk": 24.0})]
    out = tmp_path / "ab.csv"
    with open(out, "w") as f:
        f.write("shape,batch,kernel,rounds_us,median_us,rel_diff\n")
        for i, (b, med) in enumerate(results):
            f.writelines(f"s{i},{b},{name},,{us},0\n" for name, us in med.items())
    assert ab.read_results(out) == results
    assert ab.read_results_by_shape(out) == {"s0": results[0], "s1": results[1]}
    printed = io.StringIO()
    with redirect_stdout(printed):
        ab.summarize(results, ["flashmla", "cuda-splitk"], ["s0", "s1"])
    lines = printed.getvalue().splitlines()
    # from 33: both shapes on cuda-splitk (1.5 and 0.5); from 48: flashmla at b40 (1.2)
    assert "from 33 requests, flashmla below (batches >= 33): geomean 0.866" in lines[-7]
    assert "from 48 requests, flashmla below (batches >= 33): geomean 0.775" in lines[-5]
    # over all shapes: cuda-splitk 1.5 and 0.5 (s1 under the aim, listed), flashmla 1.2 twice
    assert "all shapes: flashmla geomean 1.200 worst 1.200 n 2, under 0.98: 0" in lines
    at = lines.index("all shapes: cuda-splitk geomean 0.866 worst 0.500 n 2, under 0.98: 1")
    assert lines[at + 1] == "  s1 0.500"


def test_graph_routes_ab_scores_each_rows_bound_between_fa3_and_flashmla():
    """With both ``vllm-fa3-mla`` and ``flashmla`` timed, ``summarize`` scores "FA3 up to X
    query rows (requests x heads x query tokens, read from the shape name), FlashMLA past
    it" for each X of ``ROWS_BOUNDS``, with the count under 0.95."""
    import graph_routes_ab as ab

    assert ab.query_rows("h128 b32 9951 r0.04 q1 bf16 p64") == 4096
    assert ab.query_rows("h64 b25 1414 r0.19 q4 bf16 p64") == 6400
    peers = {ab.PEERS[0]: 100.0, ab.PEERS[1]: 120.0}
    results = [(32, {**peers, "vllm-fa3-mla": 80.0, "flashmla": 125.0}),   # 4096 rows
               (25, {**peers, "vllm-fa3-mla": 200.0, "flashmla": 100.0})]  # 6400 rows
    printed = io.StringIO()
    with redirect_stdout(printed):
        ab.summarize(results, ["vllm-fa3-mla", "flashmla"],
                     ["h128 b32 9951 r0.04 q1 bf16 p64", "h64 b25 1414 r0.19 q4 bf16 p64"])
    lines = printed.getvalue().splitlines()
    # 3072: FlashMLA for both (0.8, 1.0); 4096: FA3 for the first (1.25, 1.0); 6144 and up:
    # FA3 for both (1.25, 0.5)
    assert ("vllm-fa3-mla up to 3072 query rows, flashmla past it: geomean 0.894 worst 0.800 "
            "n 2, under 0.95: 1") in lines
    assert ("vllm-fa3-mla up to 4096 query rows, flashmla past it: geomean 1.118 worst 1.000 "
            "n 2, under 0.95: 0") in lines
    assert ("vllm-fa3-mla up to 16384 query rows, flashmla past it: geomean 0.791 worst 0.500 "
            "n 2, under 0.95: 1") in lines


def test_graph_routes_ab_replays_todays_graph_rule_per_gpu_on_forced_rows():
    """``summarize(..., replay_gpu=NAME)`` scores each shape on the forced row of the route
    the shipped CUDA-graph rule picks on that GPU (h16 b40: vLLM's FA3 below the H200's
    band bound of 65, ``cuda-splitk`` on a card without an entry; h128 b32, 4096 rows: FA3
    on both) and leaves out shapes whose route was not timed (h8 b40: ``cuda-splitk``)."""
    import graph_routes_ab as ab

    peers = {ab.PEERS[0]: 100.0, ab.PEERS[1]: 120.0}
    names = ["h16 b40 2k u q1 bf16 p64", "h128 b32 4k u q1 bf16 p64",
             "h8 b40 2k u q1 bf16 p64"]
    results = [(40, {**peers, "vllm-fa3-mla": 100.0, "cuda-splitk": 125.0, "flashmla": 200.0}),
               (32, {**peers, "vllm-fa3-mla": 80.0, "flashmla": 125.0}),
               (40, {**peers, "vllm-fa3-mla": 100.0})]
    assert ab.shipped_rule_route(names[0], results[0][1], "NVIDIA H200") == "vllm-fa3-mla"
    assert ab.shipped_rule_route(names[0], results[0][1], "NVIDIA H800") == "cuda-splitk"
    assert ab.shipped_rule_route(names[1], results[1][1], "NVIDIA H800") == "vllm-fa3-mla"
    assert ab.shipped_rule_route(names[2], results[2][1], "NVIDIA H200") is None
    assert ab.shipped_rule_route("h16 b40 2k u q1 fp8 p64", results[0][1], "NVIDIA H200") is None
    for gpu, line in (
            ("NVIDIA H200", "geomean 1.118 worst 1.000 n 2 (1 left out: its route not timed), "
                            "under 0.98: 0"),
            ("NVIDIA H800", "geomean 1.000 worst 0.800 n 2 (1 left out: its route not timed), "
                            "under 0.98: 1\n  h16 b40 2k u q1 bf16 p64 0.800 (cuda-splitk)")):
        printed = io.StringIO()
        with redirect_stdout(printed):
            ab.summarize(results, ["vllm-fa3-mla"], names, replay_gpu=gpu)
        assert printed.getvalue().startswith(f"today's rule on {gpu}, replayed: {line}\n")


def test_graph_routes_ab_times_the_decoder_itself_as_plugin(monkeypatch):
    """``--routes plugin`` is the CUDA-graph decoder with no route forced (the policy's pick,
    as the engine runs it); other names are routes forced; both with the engine's query."""
    import graph_routes_ab as ab

    made = []
    monkeypatch.setattr(ab, "decoder_kernel", lambda name, case, route, **kw: made.append(
        (name, route, kw)) or bench_decode.Kernel(name))
    monkeypatch.setattr(ab, "flashmla_peer", lambda case: bench_decode.Kernel(ab.PEERS[0]))
    monkeypatch.setattr(ab, "vllm_fa3_mla_peer", lambda case: bench_decode.Kernel(ab.PEERS[1]))
    ks = ab.kernels(None, ["plugin", "flashmla"])
    assert [k.name for k in ks] == ["plugin", "flashmla", *ab.PEERS]
    assert [(name, route) for name, route, _ in made] == [("plugin", None),
                                                           ("flashmla", "flashmla")]
    assert all(kw == {"engine_query": True, "cuda_graph": True} for *_, kw in made)


def test_splitk_build_ab_parses_variants_and_picks_shapes():
    """``splitk_build_ab``: ``default`` is the plain build, ``helped=N`` sets the launch
    config (its define follows from it), other tokens are defines; fewer than two variants
    is an error. Named sets come first with case seed 1, then the filtered random draw."""
    import splitk_build_ab as ab

    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKConfig, build_defines

    old, new, both = ab.parse_variants("helped=0;default; SPLITK_X=1,helped=2")
    assert (old.name, old.config.helped_requests, old.defines) == ("helped=0", 0, ())
    assert build_defines(old.config) == ("SPLITK_HELPED_REQUESTS=0",)
    assert (new.config, new.defines) == (SplitKConfig(), ())
    assert (both.config.helped_requests, both.defines) == (2, ("SPLITK_X=1",))
    with pytest.raises(argparse.ArgumentTypeError, match="two variants"):
        ab.parse_variants("default;")
    shapes = ab.shapes_for("short,heavy", "97", 400, (9, 16), (33, 127))
    named = len(ab.SHAPE_SETS["short"]) + len(ab.SHAPE_SETS["heavy"])
    assert shapes[:named] == [(1, s) for s in ab.SHAPE_SETS["short"] + ab.SHAPE_SETS["heavy"]]
    assert shapes[named:] == bench_decode.random_set(97, 400, keep=bench_decode.BF,
                                                     request_rows=(9, 16), batches=(33, 127))
    assert len(shapes) > named


def test_an_unknown_route_variant_is_refused_with_the_known_ones():
    """``--extra-routes ROUTE:VARIANT`` names a variant of ``ROUTE_VARIANTS`` or stops
    before anything is built."""
    with pytest.raises(ValueError, match="vllm-fa3-mla:sorted, vllm-fa3-mla:balanced"):
        decode_kernels.extra_route_kernel("vllm-fa3-mla:wide", case=None)
    # Every setting a variant forces is one its route sets up (a misspelt name would only
    # add an attribute that nothing reads).
    import inspect

    from trtllm_mla_plugin.ops.routes import ROUTES

    for (route, _), settings in decode_kernels.ROUTE_VARIANTS.items():
        init = inspect.getsource(ROUTES[route].__init__)
        assert all(f"self.{name}:" in init or f"self.{name} =" in init for name in settings)


def test_spill_band_replay_swaps_in_the_variant_only_where_the_band_now_replans(tmp_path):
    """``spill_band_replay``: a 32-row batch at 1.45 waves of FA3's plan (inside
    ``NARROW_SPILL``) scores the decoder with the variant's time; a 64-row one at the same
    waves (past ``SPILL``, not narrow) keeps the decoder's; each past-band shape is listed
    with the variant over the median of its own-plan timings."""
    import spill_band_replay

    head = "pass_no,shape,heads,batch,q_len,block,kv,kernel,status,us\n"
    lens = [4800, 2400] * 64
    rows = []
    for shape, heads, batch in (("n bf16 p64", 32, 128), ("w bf16 p64", 128, 64)):
        for kernel, us in (("plugin-graph[vllm-fa3-mla]", 100.0), ("vllm-fa3-mla", 104.0),
                           ("vllm-fa3-mla-own", 98.0), ("route:vllm-fa3-mla:balanced", 80.0),
                           ("peer:vllm-fa3-mla", 110.0), ("peer:vllm-flashmla", 90.0)):
            rows.append(f"1,{shape},{heads},{batch},1,64,bf16,{kernel},ok,{us}\n")
    (tmp_path / "random-1.csv").write_text(head + "".join(rows))
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text(json.dumps({"shape": "n bf16 p64", "lens": lens}) + "\n"
                      + json.dumps({"shape": "w bf16 p64", "lens": lens[:64]}) + "\n")
    plans = spill_band_replay.fa3_plans({"heads": 32, "batch": 128, "q_len": 1, "block": 64},
                                        lens)
    assert plans["past"] and plans["now"] and 1.35 < plans["waves"] <= 1.5
    wide = spill_band_replay.fa3_plans({"heads": 128, "batch": 64, "q_len": 1, "block": 64},
                                       lens[:64])
    assert wide["past"] and not wide["now"] and wide["waves"] > 1.35
    out = io.StringIO()
    with redirect_stdout(out):
        spill_band_replay.main(str(shapes), str(tmp_path / "random-1.csv"))
    text = out.getvalue()
    listed = {line.split()[-3]: line.split()[:5] for line in text.splitlines()
              if line.endswith(" bf16 p64")}
    assert listed["n"] == ["1.250", "1.45", "32", "3600", "replans"]
    assert listed["w"][0] == "1.250" and listed["w"][4] == "-"
    # Timed: 90/100 twice; band now: 90/80 for the narrow shape, 90/100 for the wide one.
    assert "random timed: 2 shapes, geomean 0.9000, worst 0.900" in text
    assert f"random band now: 2 shapes, geomean {math.sqrt(0.9 * 90 / 80):.4f}" in text


def test_spill_band_replay_draws_again_the_lengths_a_run_timed():
    """``spill_band_replay seeds``: the lengths drawn again for run 153's random set 101 sum
    to each shape's ``kv_tokens`` and peak at its ``max_len``, as the run wrote them."""
    import csv

    import spill_band_replay

    path = Path(__file__).resolve().parents[1] / "docs/bench-2026-12-03/run153-graph-random-101.csv"
    lens = spill_band_replay.seed_lengths([str(path)])
    with open(path, newline="") as f:
        rows = {r["shape"]: r for r in csv.DictReader(f) if r["kv"] == "bf16"}
    assert rows and set(rows) <= set(lens)
    for shape, r in rows.items():
        assert (sum(lens[shape]), max(lens[shape])) == (int(r["kv_tokens"]), int(r["max_len"]))


def test_shape_list_reads_the_names_bench_decode_writes(tmp_path):
    shapes = [(64, 52, 757, "u", 2, "bf16", 64), (16, 128, 8 * 1024, "r0.35", 1, "bf16", 64)]
    path = tmp_path / "check.txt"
    path.write_text("".join(f"{7000 + i} {bench_decode.shape_name(s)}\n"
                            for i, s in enumerate(shapes)) + "\n")
    assert bench_decode.read_shape_list(path) == [(7000, shapes[0]), (7001, shapes[1])]
    assert bench_decode.shape_name(shapes[1]) == "h16 b128 8k r0.35 q1 bf16 p64"


def test_one_wave_shapes_draws_what_the_route_replans_and_controls_it_declines():
    """``one_wave_shapes.py``: the drawn shapes are batches the CUDA-graph decoder runs on
    vLLM's FA3 kernel whose plan the route replans into one wave past the band; the
    controls are the same kind of batch past the spread bound, which it keeps."""
    import one_wave_shapes
    from spill_band_replay import route_plan_inputs

    from trtllm_mla_plugin.ops import fa3_splits, policy

    cases = one_wave_shapes.draw(301, 4, 2, (1.5, 2.0), 0.0)
    paged_32 = one_wave_shapes.draw(301, 1, 0, (1.5, 2.0), 0.0, block=32)
    assert len(cases) == 6 and paged_32[0][1][6] == 32
    assert len({seed for seed, _ in cases}) == 6
    assert all(301_000_000 < seed < 302_000_000 for seed, _ in cases)
    for i, (case_seed, shape) in enumerate(cases[:4] + paged_32 + cases[4:]):
        heads, b, ctx, kind, q, _, block = shape
        g = torch.Generator(device="cpu").manual_seed(case_seed)
        lens = bench_decode.case_lengths(kind, ctx, b, q, g)
        kv_tiles, tiles, reserved, planned, rows = route_plan_inputs(heads, b, q, block, lens)
        own = fa3_splits.fa3_splits(kv_tiles, tiles, planned, policy.HOPPER_SMS)
        assert tiles * own.sum() > fa3_splits.SPILL * policy.HOPPER_SMS
        plan = fa3_splits.balanced_splits(kv_tiles, tiles, reserved, policy.HOPPER_SMS, rows,
                                          planned)
        spread = kv_tiles.max() / kv_tiles.mean()
        if i < 5:
            assert plan is not None and tiles * plan.sum() <= policy.HOPPER_SMS
            assert spread < fa3_splits.one_wave_max_spread(int(kv_tiles.max()))
        else:
            assert plan is None and 1.5 <= spread < 2.0


def write_timings_csv(path: Path, timings: dict[str, dict[str, float]]) -> Path:
    """A bench_decode.py CSV at ``path`` of first-pass ``ok`` rows: ``{shape: {kernel:
    us}}``, with the shape's columns its name gives."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pass_no", "shape", "heads", "batch", "q_len", "kv", "block", "kernel",
                    "status", "us"])
        for shape, rows in timings.items():
            heads, batch, _ctx, _kind, q_len, kv, block = bench_decode.parse_shape_name(shape)
            for kernel, us in rows.items():
                w.writerow([1, shape, heads, batch, q_len, kv, block, kernel, "ok", us])
    return path


def test_one_wave_replay_scores_forced_one_wave_plans_and_the_rule_that_takes_them(tmp_path):
    """``one_wave_replay.py``: of three batches past the band, the two whose forced plan runs
    in one wave are scored (FA3's own plan over the forced one), split by whether the rule
    takes them (longest 40 KV tiles at spread 1.83: taken; 44 tiles: declined); a batch in
    one wave by FA3's own plan is left out; ``as_run`` scores taken ones on the route's row."""
    import one_wave_replay

    short = ("h64 b66 2560 r0.25 q2 bf16 p64", [2560] * 26 + [640] * 40)
    longer = ("h64 b66 2816 r0.25 q2 bf16 p64", [2816] * 26 + [704] * 40)
    even = ("h64 b66 700 u q2 bf16 p64", [700] * 66)
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text("".join(json.dumps({"shape": s, "lens": lens}) + "\n"
                              for s, lens in (short, longer, even)))
    timings = {short[0]: {"vllm-fa3-mla-own": 120.0, "route:vllm-fa3-mla:balanced": 100.0,
                          "vllm-fa3-mla": 96.0, "peer:vllm-fa3-mla": 130.0,
                          "peer:vllm-flashmla": 125.0, "plugin-graph[vllm-fa3-mla]": 100.0},
               longer[0]: {"vllm-fa3-mla-own": 95.0, "route:vllm-fa3-mla:balanced": 100.0,
                           "vllm-fa3-mla": 95.0},
               even[0]: {"vllm-fa3-mla-own": 50.0, "route:vllm-fa3-mla:balanced": 40.0,
                         "vllm-fa3-mla": 50.0}}
    path = write_timings_csv(tmp_path / "list.csv", timings)
    found = {t["shape"]: t for t in one_wave_replay.one_wave_timings(shapes, [path])}
    assert set(found) == {short[0], longer[0]}
    assert found[short[0]]["taken"] and found[short[0]]["longest"] == 40
    assert found[short[0]]["ratio"] == pytest.approx(1.2)
    # The faster of vLLM's calls (125 us) over the decoder's 100 and FA3's own plan's 120.
    assert found[short[0]]["decoder"] == pytest.approx(1.25)
    assert found[short[0]]["decoder_own"] == pytest.approx(125 / 120)
    assert not found[longer[0]]["taken"] and found[longer[0]]["longest"] == 44
    assert found[longer[0]]["spread"] == pytest.approx(44 / (26 * 44 + 40 * 11) * 66)
    assert one_wave_replay.band_summary(list(found.values())) == [
        ("taken", 1.75, 2.0, 1, pytest.approx(1.2), pytest.approx(1.2), 0),
        ("declined", 1.75, 2.0, 1, pytest.approx(0.95), pytest.approx(0.95), 1)]
    as_run = one_wave_replay.one_wave_timings(shapes, [path], as_run=True)
    assert {t["shape"]: t["ratio"] for t in as_run} == {
        short[0]: pytest.approx(120 / 96), longer[0]: pytest.approx(0.95)}


def test_engine_steps_replay_names_the_plan_of_every_decode_step():
    """``engine_steps_replay.py``: the decode steps of a batch are planned on their growing
    lengths; 26 requests of 60 KV tiles and 40 of 22 at 128 heads (spread 1.62, FA3's plan
    1.39 waves) run in one wave past the band, 66 equal requests of 22 tiles keep FA3's
    plan (one wave already), and 44 requests of 38 tiles with 20 of 64 (FA3 cuts the long
    ones in two: 1.27 waves, inside the band) are replanned in the band."""
    import engine_steps_replay as replay

    steps = replay.replay_steps(128, 64, [3830] * 26 + [1398] * 40, 4)
    assert [s["kind"] for s in steps] == [replay.ONE_WAVE] * 4
    assert steps[-1]["longest"] == 60
    assert steps[-1]["spread"] == pytest.approx(60 * 66 / (26 * 60 + 40 * 22))
    assert steps[-1]["waves"] == pytest.approx(184 / 132)
    even = replay.replay_steps(128, 64, [1400] * 66, 2)
    assert [s["kind"] for s in even] == [replay.KEEP] * 2
    assert even[0]["waves"] == pytest.approx(1.0)
    band = replay.replay_steps(128, 64, [2400] * 44 + [4090] * 20, 2)
    assert band[0]["waves"] == pytest.approx(2 * (44 + 2 * 20) / 132)
    assert [s["kind"] for s in band] == [replay.BAND] * 2


def test_graph_rows_table_groups_the_decoder_and_forced_routes_by_rows_and_batch(tmp_path):
    """``graph_rows_table.py``: bf16 shapes on 64-token pages grouped by query rows per
    request and batch band, each scored as the faster of vLLM's calls over its time; pages
    of 32 tokens and FP8 shapes left out; a shape timed in two files counts twice."""
    import graph_rows_table as table

    timings = {
        "h64 b36 4000 u q3 bf16 p64": {"plugin-graph[vllm-fa3-mla]": 110.0,
                                       "vllm-fa3-mla": 108.0, "flashmla": 95.0,
                                       "peer:vllm-fa3-mla": 105.0, "peer:vllm-flashmla": 100.0},
        "h64 b44 4000 u q3 bf16 p64": {"plugin-graph[vllm-fa3-mla]": 80.0,
                                       "vllm-fa3-mla": 80.0, "flashmla": 90.0,
                                       "peer:vllm-flashmla": 88.0},
        "h64 b36 4000 u q3 bf16 p32": {"plugin-graph[vllm-fa3-mla]": 50.0,
                                       "peer:vllm-fa3-mla": 60.0},
        "h64 b36 4000 u q3 fp8 p64": {"plugin-graph[flashmla-fp8]": 50.0,
                                      "peer:vllm-flashmla-fp8": 60.0},
    }
    slower = {**timings, "h64 b36 4000 u q3 bf16 p64": {
        **timings["h64 b36 4000 u q3 bf16 p64"], "plugin-graph[vllm-fa3-mla]": 125.0}}
    paths = [str(write_timings_csv(tmp_path / f"run{run}.csv", t))
             for run, t in ((1, timings), (2, slower))]
    assert table.batch_band(36) == (33, 40) and table.batch_band(44) == (41, 48)
    assert {t["q_len"] for t in table.graph_timings(paths)} == {3}
    lines = table.group_table(table.graph_timings(paths))
    assert [(x["rows"], x["band"], x["shapes"]) for x in lines] == [
        (192, (33, 40), 2), (192, (41, 48), 2)]
    narrow, wide = lines
    assert narrow["decoders"] == {"vllm-fa3-mla": 2}
    assert narrow["plugin-graph"] == (pytest.approx((100 / 110 * 100 / 125) ** 0.5), 2, 2,
                                      pytest.approx(100 / 125))
    assert narrow["flashmla"] == (pytest.approx(100 / 95), 0, 2, pytest.approx(100 / 95))
    assert narrow["vllm-fa3-mla"] == (pytest.approx(100 / 108), 2, 2, pytest.approx(100 / 108))
    assert wide["plugin-graph"] == (pytest.approx(88 / 80), 0, 2, pytest.approx(88 / 80))
    assert wide["flashmla"] == (pytest.approx(88 / 90), 2, 2, pytest.approx(88 / 90))
    # FlashMLA forced over FA3 forced: faster at b36 (108 / 95), slower at b44 (80 / 90).
    assert narrow[table.PAIR] == (pytest.approx(108 / 95), 2, 2)
    assert wide[table.PAIR] == (pytest.approx(80 / 90), 0, 2)
    # One band over both batch sizes (``--total``), and a band that holds neither.
    total, = table.group_table(table.graph_timings(paths), ((33, 1024),))
    assert (total["band"], total["shapes"]) == ((33, 1024), 4)
    assert total["plugin-graph"] == (
        pytest.approx((100 / 110 * 100 / 125 * 88 / 80 * 88 / 80) ** 0.25), 2, 4,
        pytest.approx(100 / 125))
    assert table.group_table(table.graph_timings(paths), ((1, 32),)) == []


def test_graph_rows_table_adds_the_engines_query_join_to_each_call(tmp_path):
    """``graph_rows_table.py --query-join``: the decoder's and the forced routes' rows that
    read the query whole pay the given join, vLLM's FLASHMLA pays ``torch.cat``, FA3 rows
    (vLLM's and the decoder's on it) pay nothing. h16 b64 q1: 1024 query rows, 2 x 1024 x
    1152 = 2,359,296 bytes moved; fused 1.7 us + 2,359,296 B at 3716 GB/s = 2.3349 us, cat
    1.7 us + at 938 GB/s = 4.2153 us (``JOIN_COSTS``, run 220)."""
    import graph_rows_table as table

    timings = {
        "h16 b64 4096 u q1 bf16 p64": {"plugin-graph[cuda-splitk]": 90.0, "vllm-fa3-mla": 85.0,
                                       "flashmla": 95.0, "peer:vllm-fa3-mla": 86.0,
                                       "peer:vllm-flashmla": 84.0},
        "h16 b40 900 u q1 bf16 p64": {"plugin-graph[vllm-fa3-mla]": 24.0,
                                      "peer:vllm-fa3-mla": 24.5, "peer:vllm-flashmla": 40.0},
    }
    path = str(write_timings_csv(tmp_path / "run180.csv", timings))
    plain, = (t for t in table.graph_timings([path]) if t["batch"] == 64)
    assert plain["plugin-graph"] == pytest.approx(84 / 90)
    fused, short = sorted(table.graph_timings([path], join="fused"), key=lambda t: -t["batch"])
    vllm = min(86.0, 84.0 + 4.2153)  # FLASHMLA's call with torch.cat: FA3's is faster now
    assert fused["plugin-graph"] == pytest.approx(vllm / (90 + 2.3349), rel=1e-4)
    assert fused["flashmla"] == pytest.approx(vllm / (95 + 2.3349), rel=1e-4)
    assert fused["vllm-fa3-mla"] == pytest.approx(vllm / 85, rel=1e-4)
    assert short["plugin-graph"] == pytest.approx(24.5 / 24.0)


def test_mtp_engines_capture_their_decode_batches_in_tokens():
    """``--mtp K``: the capture sizes count ``1 + K`` tokens a request, and both dicts are
    what vLLM's own config classes accept (``CompilationConfig``, ``SpeculativeConfig``'s
    fields)."""
    pytest.importorskip("vllm")
    import dataclasses

    from vllm.config import CompilationConfig, SpeculativeConfig

    args = argparse.Namespace(eager=False, mtp=2)
    mode = bench_engine.engine_mode_args(args, "TRTLLM_MLA", [160, 64, 160])
    assert mode["compilation_config"]["cudagraph_capture_sizes"] == [192, 480]
    CompilationConfig(**mode["compilation_config"])
    spec = mode["speculative_config"]
    assert spec == {"method": "mtp", "num_speculative_tokens": 2,
                    "attention_backend": "TRTLLM_MLA"}
    assert set(spec) <= {f.name for f in dataclasses.fields(SpeculativeConfig)}
    plain = bench_engine.engine_mode_args(argparse.Namespace(eager=False, mtp=0), "FLASHMLA",
                                          [32])
    assert plain["compilation_config"]["cudagraph_capture_sizes"] == [32]
    assert "speculative_config" not in plain
    eager = bench_engine.engine_mode_args(argparse.Namespace(eager=True, mtp=3), "FLASHMLA", [8])
    assert eager["enforce_eager"] and eager["speculative_config"]["num_speculative_tokens"] == 3


def _fake_nvidia_smi(folder: Path, old_driver: bool) -> Path:
    """An ``nvidia-smi`` for the sampler's tests: answers one query (the field probe), or
    with ``--loop-ms`` prints a sample every 20 ms until stopped, alternately power-capped
    at 1755 MHz / 699.1 W and not at 1980 MHz / 650 W. ``old_driver``: refuses the
    ``clocks_event_reasons`` field names as drivers before 535 do."""
    smi = folder / "nvidia-smi"
    refuse = "*clocks_event_reasons*" if old_driver else "*no-such-field*"
    smi.write_text(f"""#!/bin/bash
q=""; loop=""
for a in "$@"; do
  case "$a" in --query-gpu=*) q="${{a#--query-gpu=}}";; --loop-ms=*) loop=1;; esac
done
case "$q" in {refuse}) echo "Field is not a valid field to query." ; exit 2;; esac
if [ -z "$loop" ]; then echo "1980, 100.00, 40, Not Active, Not Active, Not Active"; exit 0; fi
i=0
while true; do
  if [ $((i % 2)) = 0 ]; then echo "1755, 699.10, 61, Active, Not Active, Not Active"
  else echo "1980, 650.00, 60, Not Active, Not Active, Not Active"; fi
  i=$((i + 1)); sleep 0.02
done
""")
    smi.chmod(0o755)
    return smi


@pytest.mark.parametrize("old_driver", [False, True])
def test_clock_sampler_reads_nvidia_smi_while_the_region_runs(monkeypatch, tmp_path,
                                                              old_driver):
    _fake_nvidia_smi(tmp_path, old_driver)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with gpu_clocks.ClockSampler(interval_ms=20) as sampler:
        time.sleep(1.0)
    n = len(sampler.samples)
    assert n >= 3
    assert sampler._fields_used == gpu_clocks.FIELD_SETS[1 if old_driver else 0]
    summary = sampler.summary
    assert (summary.samples, summary.sm_mhz_min, summary.power_w_max, summary.temp_c_max) == (
        n, 1755.0, 699.1, 61.0)
    assert summary.power_capped == pytest.approx(((n + 1) // 2) / n)
    assert summary.slowdown == 0.0
    assert "power-capped" in summary.brief()


def test_clock_sampler_without_nvidia_smi_samples_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    ran = False
    with gpu_clocks.ClockSampler() as sampler:
        ran = True
    assert ran and sampler.samples == [] and sampler.summary is None


def test_clock_samples_parse_what_nvidia_smi_prints():
    fields = gpu_clocks.FIELD_SETS[0]
    text = ("1980, 512.30, 45, Not Active, Not Active, Not Active\n"
            "1755, [N/A], 47, Active, Not Active, Active\n"
            "Unable to determine the device handle\n"
            "1830, 600.00, 46, Active, Not")  # cut off when the sampler was stopped
    a, b = gpu_clocks.parse_samples(text, fields)
    assert a == gpu_clocks.Sample(1980.0, 512.3, 45.0, False, False)
    assert b == gpu_clocks.Sample(1755.0, None, 47.0, True, True)
    summary = gpu_clocks.summarize([a, b])
    assert (summary.sm_mhz, summary.power_w, summary.power_capped, summary.slowdown) == (
        1867.5, 512.3, 0.5, 0.5)
    assert summary.columns() == {"sm_mhz": "1868", "power_w": "512", "power_capped": "0.50"}
    # A driver that names no reasons: no share is claimed.
    [c] = gpu_clocks.parse_samples("1980, 500, 40", gpu_clocks.FIELD_SETS[2])
    assert gpu_clocks.summarize([c]).power_capped is None
    assert gpu_clocks.summarize([]) is None


def test_sustained_summary_takes_each_routes_median_block_and_compares_to_the_first(capsys):
    rows = []
    for block, (flashmla, fa3) in enumerate([(760, 790), (770, 780), (900, 785)]):
        for route, burst, sustained, mhz in (("flashmla", 750, flashmla, 1700),
                                             ("vllm-fa3-mla", 780, fa3, 1800)):
            rows += [dict(route=route, mode="burst", us_per_layer=str(burst), sm_mhz="1980"),
                     dict(route=route, mode="sustained", us_per_layer=str(sustained),
                          sm_mhz=str(mhz + block))]
    table = sustained_decode.medians(rows)
    assert table[("flashmla", "sustained")] == dict(us=770.0, sm_mhz=1701.0, blocks=3)
    assert table[("vllm-fa3-mla", "burst")] == dict(us=780.0, sm_mhz=1980.0, blocks=3)
    sustained_decode.print_summary(rows)
    out = capsys.readouterr().out.splitlines()
    fa3 = next(line for line in out if line.strip().startswith("vllm-fa3-mla")).split()
    # burst us, MHz, sustained us, MHz, sustained/burst, vs the first route burst, sustained
    assert fa3[1:] == ["780.0", "1980", "785.0", "1801", f"{785 / 780:.3f}",
                       f"{780 / 750:.3f}", f"{785 / 770:.3f}"]


def test_sustain_replays_each_graph_for_its_seconds_before_the_timing(monkeypatch):
    """``--sustain S``: the timed replays come after S seconds of the same graph's replays,
    the host waiting for the GPU between them; without it the timing starts at once."""
    import triton.testing

    log = []

    class _Graph:
        def replay(self):
            log.append("replay")

    def do_bench(fn, warmup, rep, return_mode):
        log.append("timed")
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(bench_decode.torch.cuda, "synchronize", lambda: log.append("sync"))
    assert bench_decode.time_replays(_Graph()) == 200.0
    assert log == ["timed"]
    log.clear()
    monkeypatch.setattr(bench_decode, "SUSTAIN_S", 0.05)
    t0 = time.perf_counter()
    assert bench_decode.time_replays(_Graph()) == 200.0
    assert time.perf_counter() - t0 >= 0.05
    assert log[-1] == "timed" and log.count("timed") == 1
    busy = log[:-1]
    assert busy.count("replay") >= 4 and busy.count("replay") == 4 * busy.count("sync")
    assert busy[:5] == ["replay"] * 4 + ["sync"]


def test_sustained_decode_times_each_routes_step_graph_in_alternating_blocks(monkeypatch,
                                                                             tmp_path, capsys):
    """``sustained_decode.py`` end to end with the GPU's parts stood in for: one graph of
    ``--layers`` decodes per route on the engine's lengths in vLLM's query form, blocks
    alternating A B, B A, both modes per block, times per layer, clocks beside them."""
    import triton.testing

    planned, running, captured = [], [None], []

    class _Decoder:
        def __init__(self, route):
            self.route = type("R", (), {"name": route})()

        def run(self, query, cache):
            captured[-1].route = self.route.name  # the graph being captured runs this route

    def layer_decoder(heads, kv, lens, route, q_len, query_parts):
        planned.append((heads, kv, len(lens), min(lens), route, q_len, query_parts))
        return _Decoder(route), "query", "cache"

    class _Graph:
        route = None

        def replay(self):
            running[0] = self.route

    class _Capture:
        def __init__(self, graph):
            self.graph = graph

        def __enter__(self):
            captured.append(self.graph)

        def __exit__(self, *exc):
            return None

    class _Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            self.route = running[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):  # ms per replay of 24 layers: 24 or 19.2 per route
            return 24.0 if end.route == "flashmla" else 19.2

    monkeypatch.setattr(bench_engine, "layer_decoder", layer_decoder)
    monkeypatch.setattr(sustained_decode.time, "sleep", lambda s: None)
    monkeypatch.setattr(sustained_decode, "ClockSampler", _FixedClocks)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _Capture)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def do_bench(fn, warmup, rep, return_mode):
        fn()
        return 12.0 if running[0] == "flashmla" else 24.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(sys, "argv", [
        "sustained_decode.py", "--out", str(tmp_path), "--heads", "128", "--batch", "5",
        "--q-len", "3", "--min-prompt", "100", "--max-prompt", "200", "--output-len", "20",
        "--layers", "24", "--blocks", "2", "--seconds", "0.01"])
    sustained_decode.main()
    assert [p[4] for p in planned] == ["vllm-fa3-mla", "flashmla"]
    assert all(p[:3] == (128, "auto", 5) and p[3] >= 110 and p[5:] == (3, True)
               for p in planned)
    with open(tmp_path / "sustained.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["block"], r["route"], r["mode"]) for r in rows] == [
        ("0", "vllm-fa3-mla", "burst"), ("0", "vllm-fa3-mla", "sustained"),
        ("0", "flashmla", "burst"), ("0", "flashmla", "sustained"),
        ("1", "flashmla", "burst"), ("1", "flashmla", "sustained"),
        ("1", "vllm-fa3-mla", "burst"), ("1", "vllm-fa3-mla", "sustained")]
    per_layer = {(r["route"], r["mode"]): r["us_per_layer"] for r in rows}
    assert per_layer == {("vllm-fa3-mla", "burst"): "1000.0", ("flashmla", "burst"): "500.0",
                         ("vllm-fa3-mla", "sustained"): "800.0",
                         ("flashmla", "sustained"): "1000.0"}
    assert all(r["sm_mhz"] == "1868" and int(r["replays"]) >= (r["mode"] == "sustained")
               for r in rows)
    flashmla = next(line for line in capsys.readouterr().out.splitlines()
                    if line.strip().startswith("flashmla")).split()
    assert flashmla[-2:] == ["0.500", "1.250"]  # FlashMLA / FA3: burst, sustained


def test_query_concat_bench_joins_equal_torch_cat_on_the_engines_parts():
    """``bench_query_concat.py``: every join it times writes what ``torch.cat`` writes for
    vLLM's parts (a strided rope view); vLLM's fused op joins the set only where the build
    has it (not vLLM's CPU build)."""
    import bench_query_concat
    import decode_kernels

    torch.manual_seed(0)
    query = torch.randn(5, 3, 576, dtype=torch.bfloat16)
    latent, rope = decode_kernels.engine_query_parts(query, 512)
    ways = bench_query_concat.joins(latent, rope)
    assert {"torch.cat", "two_copies"} <= set(ways)
    for name, join in ways.items():
        assert torch.equal(join(), query), name


def test_profile_engine_worker_forces_the_named_route(monkeypatch):
    """``profile_engine_step --backends TRTLLM_MLA@vllm-fa3-mla``: the worker builds the
    engine as ``TRTLLM_MLA`` with the route forced through the plugin's variable, and the
    files carry the name without '@'. The engine is a stand-in that records what it is
    built with, then stops the worker."""
    pytest.importorskip("vllm")
    from trtllm_mla_plugin.vllm_backend.decode_spec import ROUTE_ENV_VAR

    for var in ("VLLM_USE_FLASHINFER_SAMPLER", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_CUSTOM_SCOPES_FOR_PROFILING", ROUTE_ENV_VAR):
        monkeypatch.setenv(var, "")
    seen = {}

    class Built(Exception):
        pass

    def make_llm(args, backend, *a, **k):
        seen.update(backend=backend, route=os.environ[ROUTE_ENV_VAR])
        raise Built

    monkeypatch.setattr(profile_engine_step, "wrap_scopes", lambda: None)
    monkeypatch.setattr(bench_engine, "make_llm", make_llm)
    args = argparse.Namespace(backend="TRTLLM_MLA@vllm-fa3-mla", steps=32, batch=8,
                              gpu_memory=None)
    with pytest.raises(Built):
        profile_engine_step.worker(args)
    assert seen == dict(backend="TRTLLM_MLA", route="vllm-fa3-mla")
    assert profile_engine_step.file_tag(args.backend) == "TRTLLM_MLA-vllm-fa3-mla"


def test_band16_bound_replay_moves_only_the_band_below_the_bound(tmp_path, capsys):
    """``band16_bound_replay``: from a graph_routes_ab file (``plugin`` / ``median_us``) and
    a bench_decode file (``plugin-graph[cuda-splitk]`` / ``us``), each band shape scores
    the faster vLLM call over cuda-splitk, or over FA3 below the bound where it has more
    than 8 rows a request; shapes outside the band (32 rows, 20 requests) are left out."""
    import band16_bound_replay as replay

    ab = tmp_path / "ab.csv"
    ab.write_text("shape,batch,kernel,rounds_us,median_us,rel_diff\n" + "".join(
        f"{shape},0,{kernel},x,{us},0\n" for shape, times in {
            "h16 b40 500 u q1 bf16 p64": (30, 20, 20, 35),
            "h16 b200 4000 u q1 bf16 p64": (100, 110, 110, 120),
            "h8 b40 500 u q1 bf16 p64": (25, 20, 20, 40),
            "h32 b40 500 u q1 bf16 p64": (50, 20, 20, 40),
            "h16 b20 500 u q1 bf16 p64": (30, 20, 20, 40),
        }.items() for kernel, us in zip(
            ("plugin", "vllm-fa3-mla", "peer:vllm-fa3-mla", "peer:vllm-flashmla"), times,
            strict=True)))
    bench = tmp_path / "bench.csv"
    bench.write_text("pass_no,shape,kernel,us,status\n" + "".join(
        f"1,h16 b50 1000 r0.5 q1 bf16 p64,{kernel},{us},ok\n" for kernel, us in (
            ("plugin-graph[cuda-splitk]", 40), ("vllm-fa3-mla", 32),
            ("peer:vllm-fa3-mla", 32), ("peer:vllm-flashmla", 45))))
    ratios = replay.band_ratios([str(ab), str(bench)])
    assert sorted(ratios) == ["h16 b200 4000 u q1 bf16 p64", "h16 b40 500 u q1 bf16 p64",
                              "h16 b50 1000 r0.5 q1 bf16 p64", "h8 b40 500 u q1 bf16 p64"]
    order = sorted(ratios)
    scored = {s: replay.with_bound({s: ratios[s]}, 97)[0] for s in order}
    assert scored == pytest.approx({"h16 b200 4000 u q1 bf16 p64": 1.1,
                                    "h16 b40 500 u q1 bf16 p64": 1.0,
                                    "h16 b50 1000 r0.5 q1 bf16 p64": 1.0,
                                    "h8 b40 500 u q1 bf16 p64": 0.8})
    assert sorted(replay.with_bound(ratios, 0)) == pytest.approx([20 / 30, 0.8, 0.8, 1.1])
    assert sorted(replay.with_bound(ratios, 97, eight_rows=True)) == pytest.approx(
        [1.0, 1.0, 1.0, 1.1])
    replay.main("--bounds", "97", f"g={ab},{bench}")
    line = capsys.readouterr().out.strip()
    assert line.startswith("FA3 below   97: g: 4 shapes") and "under 1" in line
    assert f"{math.exp((math.log(1.1) + math.log(0.8)) / 4):.3f} worst 0.800" in line
    replay.main("--bounds", "0,97", "--with-8-rows", "--rows", "8-8", f"g={ab},{bench}")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["FA3 below    0: g: 1 shapes 0.800 worst 0.800 under 1; "
                     "all: 1 shapes 0.800 worst 0.800 under 1",
                     "FA3 below   97: g: 1 shapes 1.000 worst 1.000 under 0; "
                     "all: 1 shapes 1.000 worst 1.000 under 0"]
    # --batches 41-200 keeps the shapes of 41-200 requests: b50 (1.0, on FA3 below 97) and
    # b200 (1.1, on cuda-splitk); the three b40 shapes drop out
    replay.main("--bounds", "97", "--batches", "41-200", f"g={ab},{bench}")
    line = capsys.readouterr().out.strip()
    assert line.startswith("FA3 below   97: g: 2 shapes ")
    assert f"{math.sqrt(1.1):.3f} worst 1.000 under 0" in line


def test_fit_switch_rule_span_is_the_span_of_the_routes_own_plan(monkeypatch):
    """``fit_switch_rule.route_plan_span``: for a batch the ``vllm-fa3-mla`` route replans
    (128 requests of 1-8.6k tokens, 16 heads, under CUDA graphs), the estimated span of the
    splits the route itself writes into FA3's metadata (the route run on the CPU with a
    stand-in FA3 module)."""
    import fit_switch_rule
    import numpy as np
    from test_vllm_fa3_contract import FA3_MODULE, FakeFA3

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, fa3_splits
    from trtllm_mla_plugin.ops.routes import vllm_fa3_mla

    monkeypatch.setitem(sys.modules, FA3_MODULE, FakeFA3(metadata_len=1 + 128 * 4))
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    spec = DecodeSpec(16, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1, 1)
    route = vllm_fa3_mla.VllmFA3MLARoute(spec, torch.device("cpu"), 128, cuda_graph=True)
    lens = [int(x) for x in np.random.default_rng(3).integers(1024, 8600, 128)]
    host = torch.tensor(lens, dtype=torch.int32)
    route.plan(DecodeBatch(torch.zeros(128, 140, dtype=torch.int32), host, max(lens),
                           kv_tokens=sum(lens), seq_lens_host=host.clone(), persistent=True))
    offset = vllm_fa3_mla.fa3_splits_offset(128)
    written = route._scheduler[offset: offset + 128].numpy().astype(np.float64)
    assert written.max() > 1  # the route replanned (the stand-in's own metadata is all 1)
    tiles = -(-np.asarray(sorted(lens, reverse=True)) // 64)  # the route's launch order
    expected = fa3_splits.estimated_span(tiles, written[:, None], 1, route._sms,
                                         fa3_splits.split_cost_tiles(16.0))[0]
    assert fit_switch_rule.route_plan_span(16, 1, lens, route._sms) == pytest.approx(expected)
    # Without the replan: FA3's formula under the cap the route planned with.
    own = fa3_splits.fa3_splits(tiles, 1, route._planned_splits, route._sms)
    formula = fa3_splits.estimated_span(tiles, own.astype(np.float64)[:, None], 1, route._sms,
                                        fa3_splits.split_cost_tiles(16.0))[0]
    assert formula > expected  # the replan was worth making
    assert fit_switch_rule.route_plan_span(16, 1, lens, route._sms, replan=False) == (
        pytest.approx(formula))


def test_fit_switch_rule_recovers_a_linear_log_ratio_and_scores_its_picks():
    """``fit_switch_rule.fit`` returns the coefficients of a log time ratio that is linear
    in ``features``; ``scores`` picks FlashMLA where the fitted line is negative and scores
    each pick, FA3 alone and the faster per shape against the best peer."""
    import random

    import fit_switch_rule as rule
    import numpy as np

    rng = random.Random(5)
    truth = np.array([0.3, -0.5, 0.2, 0.01, 0.05, 0.02, -0.1])
    shapes = []
    for i in range(60):
        lens = [rng.randint(100, 20000) for _ in range(rng.randint(2, 300))]
        s = rule.Shape(f"s{i}", rng.choice([8, 16, 64, 128]), rng.randint(1, 4), lens,
                       span=rng.uniform(300.0, 900.0), fa3_us=100.0, flashmla_us=0.0,
                       best_peer_us=90.0)
        s.flashmla_us = 100.0 * math.exp(float(np.dot(rule.features(s), truth)))
        shapes.append(s)
    coef = rule.fit(shapes)
    assert coef == pytest.approx(truth, abs=1e-9)
    got = rule.scores(shapes, coef)
    for s, r, fa, best in zip(shapes, got["rule"], got["fa3 only"], got["oracle"],
                              strict=True):
        assert fa == pytest.approx(0.9)
        assert best == pytest.approx(90.0 / min(100.0, s.flashmla_us))
        assert r == pytest.approx(best)  # the exact line picks the faster every time


def test_conditional_node_cost_is_each_kinds_median_over_plains(tmp_path):
    """``conditional_node_cost``: a kind's cost is its median us per call over the rounds
    less ``plain``'s median, read back from its ``--out`` file."""
    import conditional_node_cost as cost

    path = tmp_path / "cost.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "calls", "rounds_us"])
        w.writerow(["plain", 64, "2.0 2.2 2.1"])
        w.writerow(["if", 64, "4.0 3.1 3.2"])
        w.writerow(["switch", 64, "2.3 2.4 9.0"])
    got = cost.costs(cost.read(path))
    assert got == pytest.approx({"if": 3.2 - 2.1, "switch": 2.4 - 2.1})


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.sh")))
def test_gpu_run_scripts_parse(script):
    """The GPU machine's phase scripts parse (``bash -n``); a syntax error would cost a
    device call."""
    import subprocess

    proc = subprocess.run(["bash", "-n", str(BENCHMARKS / script)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
