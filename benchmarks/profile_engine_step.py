"""Where a decode step of the real vLLM engine goes, per attention backend: host phases, CUDA
runtime calls and GPU kernels.

Usage (on the GPU machine, with a CUDA vLLM importable)::

    python benchmarks/profile_engine_step.py --out DIR [--heads 16] [--kv auto,fp8]
        [--batch 32] [--backends TRTLLM_MLA,FLASHMLA] [--layers 24] [--steps 32] [--mtp K]
    python benchmarks/profile_engine_step.py --summarize DIR/trace-*.json.gz   # on any machine

Per (KV dtype, backend) one engine in its own process, the model and engine settings of
``bench_engine.py`` (CUDA graphs for decode, no torch.compile, block 64). The engine core runs
in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees its host work and
its kernels, with vLLM's profiling scopes on (``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``) and
these wrapped in scopes here: the model runner's ``execute_model``, ``sample_tokens`` and
attention-metadata build, and the plugin's ``MLADecoder.plan``. After a prefill and a warm-up,
``generate(1 + steps)`` runs once untimed by the profiler (the step from the difference with
``generate(1 + short)``, as in bench_engine; the GPU's clock and power sampled meanwhile,
``gpu_clocks``) and once under ``torch.profiler``.

The trace is summarised per decode step (``summarize``; medians over steps where a scope
runs once per step): each scope's host time, CUDA runtime calls (count and time: graph and
kernel launches, copies, synchronisations), GPU busy time (the union of kernel, copy and
memset intervals) and the kernels by time. Writes ``DIR/profile-<tag>.json`` (the summary)
and ``DIR/trace-<tag>.json.gz`` (the Chrome trace), and prints a comparison.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import bench_engine  # this folder is on sys.path when a file of it runs as a script
from gpu_clocks import ClockSampler

#: Scopes wrapped here (where the class has the method), on top of vLLM's own ones. The
#: engine core's step is the unit; vLLM 0.33 may run either model runner.
STEP_SCOPE = "engine core: step"
SCOPES = {
    ("vllm.v1.engine.core", "EngineCore", "step"): STEP_SCOPE,
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"): STEP_SCOPE,
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"):
        "runner: execute_model",
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"):
        "runner: execute_model",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"):
        "runner: sample_tokens",
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"):
        "runner: sample_tokens",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_build_attention_metadata"):
        "runner: attention metadata",
    ("trtllm_mla_plugin.ops.decoder", "MLADecoder", "plan"): "trtllm_mla: MLADecoder.plan",
}
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def wrap_scopes() -> None:
    """Put each method of ``SCOPES`` inside a ``torch.profiler.record_function`` scope."""
    import functools
    import importlib

    import torch

    for (module, cls_name, method), scope in SCOPES.items():
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            original = getattr(cls, method)
        except (ImportError, AttributeError):
            continue

        @functools.wraps(original)
        def wrapped(*a, _original=original, _scope=scope, **k):
            with torch.profiler.record_function(_scope):
                return _original(*a, **k)

        setattr(cls, method, wrapped)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(trace: dict, top: int = 15, eager: bool = False) -> dict:
    """Per-decode-step figures of a Chrome trace of several engine steps.

    Decode steps are the engine-core steps that launch a CUDA graph (the recompute prefill
    before them runs eagerly); ``eager`` (an ``enforce_eager`` engine, which launches no
    graph): every step after the first, the recompute prefill. Host scopes: the median
    over decode steps of each scope's time within a step. CUDA runtime calls and GPU work:
    totals over the decode steps' span divided by their number; GPU busy time is the union
    of kernel, copy and memset intervals, so concurrent streams count once. GPU work counts
    by when the host launched it (the runtime call of the same ``correlation``) where the
    trace says: the GPU runs behind the host, so work of the steps before the span (the
    prefill's, in run 228) can execute inside it, and the last step's after it.
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events
                    if e["name"] == STEP_SCOPE and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    launches = [e["ts"] for e in events
                if e.get("cat") == "cuda_runtime" and e["name"] == "cudaGraphLaunch"]
    if eager:
        decode = steps[1:]
    else:
        decode = [s for s in steps
                  if any(s["ts"] <= t <= s["ts"] + s["dur"] for t in launches)]
    if len(decode) < 3:
        kind = "eager" if eager else "CUDA-graph"
        raise ValueError(f"trace holds {len(decode)} {kind} decode steps; need at least 3")
    window = (decode[0]["ts"], decode[-1]["ts"] + decode[-1]["dur"])
    n = len(decode)
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}

    def host_time(e: dict) -> float:
        """When the host launched GPU event ``e`` (its own start where the trace does not
        link it to a launch)."""
        return launched.get(e.get("args", {}).get("correlation"), e["ts"])

    in_step: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    runtime: dict[str, list[float]] = defaultdict(list)
    kernels: dict[str, list[float]] = defaultdict(list)
    gpu: list[tuple[float, float]] = []
    for e in events:
        cat = e.get("cat", "")
        if not window[0] <= (host_time(e) if cat in GPU_CATEGORIES else e["ts"]) <= window[1]:
            continue
        if cat == "user_annotation":
            for i, st in enumerate(decode):
                if st["ts"] <= e["ts"] <= st["ts"] + st["dur"]:
                    in_step[e["name"]][i] += e["dur"]
                    break
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime[e["name"]].append(e["dur"])
        elif cat in GPU_CATEGORIES:
            kernels[e["name"][:100]].append(e["dur"])
            gpu.append((e["ts"], e["ts"] + e["dur"]))
    busy = _union_us(gpu)

    def per_step(d: dict[str, list[float]]) -> list[dict]:
        rows = [dict(name=k, calls_per_step=round(len(v) / n, 2),
                     us_per_step=round(sum(v) / n, 1)) for k, v in d.items()]
        return sorted(rows, key=lambda r: -r["us_per_step"])

    scopes = [dict(name=k, median_us_per_step=round(statistics.median(v), 1))
              for k, v in in_step.items()]
    return dict(
        decode_steps=n,
        step_median_us=round(statistics.median(st["dur"] for st in decode), 1),
        step_period_us=round(statistics.median(
            b["ts"] - a["ts"] for a, b in itertools.pairwise(decode)), 1),
        gpu_busy_us_per_step=round(busy / n, 1),
        gpu_busy_fraction=round(busy / (window[1] - window[0]), 3),
        scopes=sorted(scopes, key=lambda r: -r["median_us_per_step"]),
        runtime=per_step(runtime)[:top],
        kernels=per_step(kernels)[:top],
    )


def worker(args: argparse.Namespace) -> None:
    """One engine: prefill, time, profile, summarise."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    import torch
    from vllm import SamplingParams

    backend, _ = bench_engine.set_route(args.backend)
    wrap_scopes()
    args.output_len = args.steps
    llm = bench_engine.make_llm(args, backend, args.batch, [args.batch],
                                gpu_memory=args.gpu_memory or bench_engine.GPU_MEMORY_ALONE)
    prompts = bench_engine.make_prompts(args, args.batch)
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    bench_engine.timed_generate(llm, prompts, args.short_len)  # warm-up
    short_s = min(bench_engine.timed_generate(llm, prompts, args.short_len) for _ in range(2))
    with ClockSampler() as clocks:
        long_s = min(bench_engine.timed_generate(llm, prompts, args.steps) for _ in range(2))
    step_ms = (long_s - short_s) / (args.steps - args.short_len) * 1e3

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        bench_engine.timed_generate(llm, prompts, args.steps)
    raw = Path(f"/tmp/trace-{os.getpid()}.json")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    raw.unlink()
    tag = Path(args.result).stem
    with gzip.open(Path(args.result).with_name(f"trace-{tag}.json.gz"), "wt") as f:
        json.dump(trace, f)
    summary = dict(backend=args.backend, kv=args.kv, heads=args.heads, batch=args.batch,
                   layers=args.layers, step_ms_unprofiled=round(step_ms, 3),
                   clocks_unprofiled=clocks.summary.brief() if clocks.summary else None)
    try:
        summary.update(summarize(trace, top=args.top, eager=args.eager))
    except ValueError as error:
        summary["error"] = str(error)
    Path(args.result).write_text(json.dumps(summary, indent=1))
    sys.stdout.flush()
    os._exit(0)  # engine teardown can hang after the results are out


def print_comparison(summaries: list[dict]) -> None:
    for s in summaries:
        if "error" in s:
            print(f"\n== {s['backend']} kv={s['kv']}: step {s['step_ms_unprofiled']:.3f} ms "
                  f"unprofiled; {s['error']}")
            continue
        where = f" kv={s['kv']} h{s['heads']} b{s['batch']}" if s["kv"] else ""
        unprofiled = (f"{s['step_ms_unprofiled']:.3f} ms unprofiled, "
                      if s["step_ms_unprofiled"] == s["step_ms_unprofiled"] else "")
        print(f"\n== {s['backend']}{where}: decode step {unprofiled}"
              f"{s['step_median_us']:.0f} us profiled; GPU busy "
              f"{s['gpu_busy_us_per_step']:.0f} us/step "
              f"({s['gpu_busy_fraction']:.0%} of the time)")
        if s.get("clocks_unprofiled"):
            print(f"  GPU over the unprofiled steps: {s['clocks_unprofiled']}")
        print("  host scopes (median per decode step):")
        for r in s["scopes"][:12]:
            print(f"    {r['median_us_per_step']:9.1f} us  {r['name']}")
        for title, key, k in (("CUDA runtime", "runtime", 8), ("GPU", "kernels", 10)):
            print(f"  {title}:")
            for r in s[key][:k]:
                print(f"    {r['us_per_step']:9.1f} us/step {r['calls_per_step']:7.2f} "
                      f"calls/step  {r['name']}")


def file_tag(backend: str) -> str:
    """``backend`` in a file name: ``TRTLLM_MLA@vllm-fa3-mla`` -> ``TRTLLM_MLA-vllm-fa3-mla``
    (the device tool brings back plain names only)."""
    return backend.replace("@", "-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("profile-out"))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv", default="auto,fp8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--backends", default="TRTLLM_MLA,FLASHMLA")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--short-len", type=int, default=8)
    bench_engine.add_shared_args(ap)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per engine")
    ap.add_argument("--top", type=int, default=15,
                    help="kernels and runtime calls kept per summary, by time")
    ap.add_argument("--summarize", nargs="+", metavar="TRACE",
                    help="only summarise these trace-*.json.gz files (no GPU needed; "
                         "--eager for traces of enforce_eager engines)")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.summarize:
        summaries = []
        for path in args.summarize:
            with gzip.open(path, "rt") as f:
                summary = dict(backend=Path(path).name, kv="", heads="", batch="",
                               step_ms_unprofiled=float("nan"),
                               **summarize(json.load(f), top=args.top, eager=args.eager))
            summaries.append(summary)
        print_comparison(summaries)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    model = bench_engine.build_model(args.out, args.heads, args.layers,
                                     args.max_prompt + args.steps, mtp=args.mtp > 0)
    summaries = []
    for kv in args.kv.split(","):
        for backend in args.backends.split(","):
            tag = (f"h{args.heads}-{kv}-b{args.batch}{'-eager' if args.eager else ''}"
                   f"{f'-mtp{args.mtp}' if args.mtp else ''}-{file_tag(backend)}")
            result = args.out / f"profile-{tag}.json"
            cmd = [sys.executable, __file__, "--worker", "--model", str(model),
                   "--heads", str(args.heads), "--kv", kv, "--backend", backend,
                   "--batch", str(args.batch), "--steps", str(args.steps),
                   "--short-len", str(args.short_len), "--layers", str(args.layers),
                   "--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt),
                   "--seed", str(args.seed), "--result", str(result), "--top", str(args.top),
                   *(["--eager"] if args.eager else []),
                   *(["--mtp", str(args.mtp)] if args.mtp else [])]
            t0 = time.time()
            with open(args.out / f"log-{tag}.txt", "w") as log:
                try:
                    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
            print(f"[{time.time() - t0:.0f}s] {tag}: rc={rc}", flush=True)
            if rc == 0 and result.exists():
                summaries.append(json.loads(result.read_text()))
    print_comparison(summaries)


if __name__ == "__main__":
    main()
