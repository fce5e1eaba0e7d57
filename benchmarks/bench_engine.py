"""Decode throughput of the real vLLM engine (CUDA) with TRTLLM_MLA and vLLM's own MLA backends.

Usage (on the GPU machine, with a CUDA vLLM importable)::

    python benchmarks/bench_engine.py --out DIR [--heads 16,128] [--batches 32,128,256]
        [--kv auto,fp8] [--backends TRTLLM_MLA,FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA]
        [--output-len 64]

FLASH_ATTN_MLA (FA3 MLA) is what vLLM 0.33 selects for MLA on SM90 with a bf16 cache;
FLASHMLA is its pick for FP8 caches (FLASH_ATTN_MLA refuses them).

``--rounds R`` starts every engine R times, the backends interleaved within each round (the
order shifted by one per round), and reports each point's median: engine-to-engine spread on
a small model is large (run 15: up to 40% between two engines running the same kernel).
A discarded warm-up engine runs first (``--no-warmup-engine`` skips it): the first engine
of a bench ran its host code up to 1.9x slower than later ones on the same machine (run 26's
profile: every CUDA driver call and vLLM's own scheduler and sampler alike; runs 24 and 27:
the first backend of the order was the slowest at b32 whichever it was).

``--paired`` (two backends): per round one process holds both engines at once (each with
45% of GPU memory, the creation order rotated per round) and times them alternately, A B
then B A per repeat, so that a drift of the machine's state over minutes falls on both;
runs 31-32 saw one backend's step move by up to 33% between its own separate starts.

A backend ``TRTLLM_MLA@ROUTE`` runs the plugin with its decode route forced
(``TRTLLM_MLA_DECODE_ROUTE=ROUTE``), e.g. ``TRTLLM_MLA@flashinfer-fa3``.

Model: a random-weight DeepSeek-V3-style model built locally (``testing.tiny_model``), with
DeepSeek-V3's attention per rank (latent 512 + rope 64, q_lora 1536 replaced by none,
16 heads as at TP 8, 128 heads as with data-parallel attention), ``--layers`` dense layers
and a small MLP so that attention is a large share of a decode step (reported).

Method, per (heads, KV dtype, backend) one engine in its own process (CUDA graphs for decode
batches, or none with ``--eager``; no torch.compile so that engine start stays short; block
size 64; prefix caching on), per batch size B: B prompts with lengths uniform in
[--min-prompt, --max-prompt] (seed fixed, the same for every backend), then

1. ``generate(max_tokens=1)``: prefills every prompt (and caches its KV);
2. ``generate(max_tokens=1 + S)`` and ``generate(max_tokens=1 + N)`` (S = --short-len):
   the same prompts again; prefix caching turns each prefill into a step that recomputes
   every prompt's last token over its cached prefix, followed by S or N decode steps.

Decode step time = (t(N) - t(S)) / (N - S), each t the fastest of --repeats runs: the
difference cancels the recompute step (a context-attention prefill over every cached
prefix, which at b256 and 1k-8k prompts costs more than many decode steps and goes through
the prefill path, not decode) and every fixed cost. Decode tokens/s = B / step. Column
``steps_each_ms``: every repeat's own estimate, to tell an engine instance's spread between
its repeats from the spread between instances (rounds).
Columns ``sm_mhz``, ``power_w`` (medians) and ``power_capped`` (share of samples with the
power cap limiting the clock): ``nvidia-smi`` sampled over the timed ``generate(1 + N)``
repeats (``gpu_clocks``), empty without it. Column ``gpu_mem_mib``: the GPU's memory in use
(``nvidia-smi``) right after a batch's timed runs: an engine alone in its process holds
its ``gpu_memory_utilization`` share plus what vLLM's memory profiling did not see (the
chunked-context prefill's transients: run 320); with ``--paired``, both engines together.
``tokens_per_s`` / ``tpot_ms`` are the whole ``generate(1 + N)`` (recompute step
included), as in run 13. The attention share is the plugin decoder's own time for one
layer at that batch (``ops.MLADecoder`` on the same lengths and a 16-bit query in vLLM's
two parts, CUDA-graph timed; one 576-wide query until the forty-seventh session) x layers
/ decode step, for TRTLLM_MLA rows.

``--core-steps`` (engines log stats) adds a second estimate that leaves the recompute step
and each call's request setup out instead of differencing them away: vLLM's engine-core
timestamps of each request's first and last token in the timed ``generate(1 + N)``
(``RequestOutput.metrics``), N decode steps apart, median over requests (``core_step_ms``,
fastest repeat; ``core_steps_each_ms``; ``core_decode_tokens_per_s``;
``summarize_engine.py --core``), and the decode steps one by one (each step's interval
since the previous token, from vLLM's per-iteration stats, ``run_engine.record_step_intervals``):
per repeat their 10th, 50th and 90th percentile (``core_step_quantiles_each_ms``), the
fastest repeat's median (``core_median_step_ms``, ``core_median_decode_tokens_per_s``,
``summarize_engine.py --core-median``). Why: at FP8 b32/b128 one engine's repeats scattered
by a median 15-35% by both estimates (runs 89-90, 94-95), at bf16 b128/b256 by 1-2% (runs
51-54); the percentiles tell a few slow steps (a median that holds) from uniformly slower
ones.

Writes ``DIR/engine.csv`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

FIELDS = ["round", "heads", "kv", "backend", "batch", "output_len", "decode_s", "tokens_per_s",
          "tpot_ms", "short_len", "short_s", "step_ms", "decode_tokens_per_s", "route",
          "attn_layer_us", "attn_share", "status", "steps_each_ms", "core_step_ms",
          "core_steps_each_ms", "core_decode_tokens_per_s", "core_median_step_ms",
          "core_step_quantiles_each_ms", "core_median_decode_tokens_per_s", "mtp",
          "sm_mhz", "power_w", "power_capped", "gpu_mem_mib"]


def prompt_lens(batch: int, lo: int, hi: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed * 1000 + batch)
    return [rng.randint(lo, hi) for _ in range(batch)]


def attention_lens(args: argparse.Namespace, batch: int) -> list[int]:
    """The request lengths the attention share is timed on: the batch's prompts
    (``prompt_lens``) each grown by half the output, the middle of the timed decode."""
    lens = prompt_lens(batch, args.min_prompt, args.max_prompt, args.seed)
    return [n + args.output_len // 2 for n in lens]


def layer_decoder(heads: int, kv: str, lens: list[int], route: str | None = None,
                  block: int = 64, eager: bool = False, q_len: int = 1,
                  query_parts: bool = False) -> tuple:
    """The plugin's decoder for one layer of ``heads`` heads over requests of ``lens``
    tokens (random cache and query, pages in random order), planned as vLLM's builder plans
    it (exact host lengths; ``eager``: routes ranked with them, else as under CUDA graphs by
    batch size only, unless ``route`` forces one) and run once. FP8 query where vLLM would
    hand one over; ``query_parts``: a 16-bit query in the two parts vLLM's MLA layer hands
    over (``decode_kernels.engine_query_parts``), so a route that needs them concatenated
    pays for it. ``q_len`` query tokens a request (speculative decoding: 1 + draft tokens).
    Returns ``(decoder, query, cache)``."""
    from dataclasses import replace

    import torch

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, MLADecoder, engine_query_dtype
    from trtllm_mla_plugin.ops.platform import platform_of

    device = torch.device("cuda")
    fp8 = kv == "fp8"
    spec = DecodeSpec(heads, 512, 64, block, torch.bfloat16,
                      torch.float8_e4m3fn if fp8 else torch.bfloat16, 1 / 192**0.5,
                      max_q_len=q_len)
    spec = replace(spec, q_dtype=engine_query_dtype(spec, platform_of(device), route))
    b = len(lens)
    need = [-(-n // block) for n in lens]
    table = torch.zeros(b, max(need), dtype=torch.int32)
    perm = torch.randperm(sum(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    cache = torch.randn(sum(need), block, 576, device=device).to(spec.kv_dtype)
    query = torch.randn(b * q_len, heads, 576, device=device).to(spec.q_dtype)
    join = None
    if query_parts and query.element_size() == 2:
        from decode_kernels import engine_query_join, engine_query_parts

        query = engine_query_parts(query, spec.kv_lora_rank)
        join = engine_query_join(spec)
    dec = MLADecoder(spec, device, b, route=route, cuda_graph=not eager, query_join=join)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu_q = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
    several = q_len > 1
    dec.plan(DecodeBatch(table.to(device), seq_lens.to(device), max(lens),
                         cu_seqlens_q=cu_q.to(device) if several else None, max_q_len=q_len,
                         num_tokens=b * q_len, kv_tokens=sum(lens), seq_lens_host=seq_lens,
                         cu_seqlens_q_host=cu_q if several else None))
    dec.run(query, cache)
    torch.cuda.synchronize()
    return dec, query, cache


def attention_layer_us(heads: int, kv: str, lens: list[int], route: str | None = None,
                       block: int = 64, eager: bool = False,
                       q_len: int = 1) -> tuple[str, float]:
    """The plugin's decode of one layer for ``lens`` (``layer_decoder`` with the query as
    the engine hands it over: a 16-bit one in vLLM's two parts, so a route that reads it
    whole pays the join), kernels only (no ``plan``): graph-timed as under CUDA graphs;
    ``eager``: timed launch by launch, as an ``enforce_eager`` engine runs it."""
    import torch
    import triton.testing

    dec, query, cache = layer_decoder(heads, kv, lens, route, block, eager, q_len,
                                      query_parts=True)
    if eager:  # launched one by one, as the engine does
        ms = triton.testing.do_bench(lambda: dec.run(query, cache), warmup=10, rep=60,
                                     return_mode="median")
        return dec.route.name, ms * 1000.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            dec.run(query, cache)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    return dec.route.name, ms * 100.0  # us per call


@dataclass
class CoreTiming:
    """What one engine's core timed in its timed ``generate(1 + N)`` repeats: per repeat,
    the decode step by the requests' first and last token (``core_decode_step_s``; ``None``
    with stats off) and the 10th/50th/90th percentile of its steps one by one
    (``step_quantiles_s`` of what ``intervals``, ``run_engine.record_step_intervals``'
    list, holds after the repeat; ``None`` without it)."""

    intervals: list | None = None
    steps: list[float | None] = field(default_factory=list)
    quantiles: list[tuple[float, float, float] | None] = field(default_factory=list)

    def start(self) -> None:
        if self.intervals is not None:
            self.intervals.clear()

    def add(self, outputs: list) -> None:
        self.steps.append(core_decode_step_s(outputs))
        self.quantiles.append(step_quantiles_s(self.intervals or []))


def timed_generate(llm, prompts: list, n: int, core: CoreTiming | None = None) -> float:
    """Seconds for ``generate`` of exactly ``1 + n`` greedy tokens per prompt; with
    ``core``, also what the engine core timed of it."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1 + n, min_tokens=1 + n, ignore_eos=True,
                            temperature=0.0)
    if core is not None:
        core.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == 1 + n for o in outs)
    if core is not None:
        core.add(outs)
    return dt


def step_quantiles_s(steps: list[list[float]]) -> tuple[float, float, float] | None:
    """10th, 50th and 90th percentile (inclusive, linear) of the decode steps' seconds, each
    step its median interval (``[median, total, count]`` rows of
    ``run_engine.record_step_intervals``); ``None`` for fewer than two steps."""
    if len(steps) < 2:
        return None
    times = [median for median, _, _ in steps]
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return deciles[0], statistics.median(times), deciles[-1]


def core_decode_step_s(outputs: list) -> float | None:
    """Seconds per decode step by vLLM's engine-core timestamps (``RequestOutput.metrics``,
    a ``RequestStateStats``, kept only when the engine logs stats): per request, from its
    first token (the prefill or recompute step) to its last, over the decode steps between
    them (``num_generation_tokens - 1``); the median over requests. ``None`` where the
    engine kept no timestamps."""
    steps = []
    for out in outputs:
        m = getattr(out, "metrics", None)
        n = getattr(m, "num_generation_tokens", 0)
        if n > 1 and m.last_token_ts > m.first_token_ts:
            steps.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return statistics.median(steps) if steps else None


#: vLLM's ``gpu_memory_utilization`` of an engine alone in its process, and of each of two
#: (``--paired``), unless ``--gpu-memory`` says otherwise.
GPU_MEMORY_ALONE, GPU_MEMORY_PAIRED = 0.6, 0.45


def draft_tokens(args: argparse.Namespace) -> int:
    """``--mtp K``'s K (0 without speculation; also for callers' namespaces that predate
    the option)."""
    return getattr(args, "mtp", 0)


def speculative_config(args: argparse.Namespace, backend: str) -> dict | None:
    """vLLM's ``speculative_config`` for ``--mtp K`` (the model's MTP layer drafting K
    tokens; its drafter on ``backend`` too, which vLLM would otherwise pick on its own), or
    ``None``."""
    mtp = draft_tokens(args)
    if not mtp:
        return None
    return {"method": "mtp", "num_speculative_tokens": mtp, "attention_backend": backend}


def engine_mode_args(args: argparse.Namespace, backend: str, capture: list[int]) -> dict:
    """``LLM`` arguments for CUDA graphs over decode batches of the request counts in
    ``capture`` (``--eager``: none, vLLM's ``enforce_eager``) and, with ``--mtp K``,
    speculative decoding: each decode batch then has ``1 + K`` query tokens a request, and
    vLLM's capture sizes count tokens."""
    q_len = 1 + draft_tokens(args)
    mode: dict = ({"enforce_eager": True} if args.eager else {"compilation_config": {
        "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": sorted({b * q_len for b in capture})}})
    spec = speculative_config(args, backend)
    if spec is not None:
        mode["speculative_config"] = spec
    return mode


def make_llm(args: argparse.Namespace, backend: str, max_num_seqs: int, capture: list[int],
             gpu_memory: float = GPU_MEMORY_ALONE):
    """The engine every run of this file times (``engine_mode_args``), no torch.compile,
    block 64, prefix caching."""
    from vllm import LLM

    return LLM(
        model=args.model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
        attention_backend=backend, kv_cache_dtype=args.kv, block_size=64,
        max_model_len=args.max_prompt + args.output_len + 8, max_num_seqs=max_num_seqs,
        enable_prefix_caching=True, gpu_memory_utilization=gpu_memory,
        disable_log_stats=not getattr(args, "core_steps", False),
        **engine_mode_args(args, backend, capture),
    )


def make_prompts(args: argparse.Namespace, batch: int) -> list:
    """``batch`` token prompts, lengths from ``prompt_lens`` (the same for every backend)."""
    from vllm.inputs import TokensPrompt

    lens = prompt_lens(batch, args.min_prompt, args.max_prompt, args.seed)
    return [TokensPrompt(prompt_token_ids=[(31 * j + 7 * i) % 997 + 1 for j in range(n)])
            for i, n in enumerate(lens)]


def split_backend(name: str) -> tuple[str, str]:
    """A ``--backends`` name: ``TRTLLM_MLA@ROUTE`` -> (``TRTLLM_MLA``, ``ROUTE``), a plain
    backend -> (it, ``""``)."""
    backend, _, route = name.partition("@")
    return backend, route


def set_route(backend_arg: str) -> tuple[str, str]:
    """``TRTLLM_MLA@ROUTE`` -> (``TRTLLM_MLA``, ``ROUTE``), forcing the route by env var."""
    backend, route = split_backend(backend_arg)
    if route:
        from trtllm_mla_plugin.vllm_backend.decode_spec import ROUTE_ENV_VAR

        os.environ[ROUTE_ENV_VAR] = route
    return backend, route


def step_row(args: argparse.Namespace, backend: str, batch: int, short_s: float,
             dt: float, core: CoreTiming | None = None) -> dict:
    """One (backend, batch) row from the fastest ``1 + S`` and ``1 + N`` generate times,
    and from what the engine core timed of each ``1 + N`` repeat where it timed them."""
    step = (dt - short_s) / (args.output_len - args.short_len)
    row = dict(heads=args.heads, kv=args.kv, backend=backend, batch=batch,
               output_len=args.output_len, decode_s=f"{dt:.4f}",
               tokens_per_s=f"{batch * args.output_len / dt:.0f}",
               tpot_ms=f"{dt / args.output_len * 1e3:.3f}", short_len=args.short_len,
               short_s=f"{short_s:.4f}", step_ms=f"{step * 1e3:.3f}",
               decode_tokens_per_s=f"{batch / step:.0f}", status="ok",
               mtp=draft_tokens(args))
    core = core or CoreTiming()
    timed = [s for s in core.steps if s is not None]
    if timed:
        row.update(core_step_ms=f"{min(timed) * 1e3:.3f}",
                   core_steps_each_ms=";".join(f"{s * 1e3:.3f}" for s in timed),
                   core_decode_tokens_per_s=f"{batch / min(timed):.0f}")
    quantiles = [q for q in core.quantiles if q is not None]
    if quantiles:
        fastest = min(median for _, median, _ in quantiles)
        row.update(core_median_step_ms=f"{fastest * 1e3:.3f}",
                   core_step_quantiles_each_ms=";".join(
                       "/".join(f"{t * 1e3:.3f}" for t in q) for q in quantiles),
                   core_median_decode_tokens_per_s=f"{batch / fastest:.0f}")
    return row


def alternating(names: list[str], repeats: int) -> list[list[str]]:
    """Timing order per repeat for engines timed side by side: A B, B A, A B, ..."""
    return [names if r % 2 == 0 else names[::-1] for r in range(repeats)]


def worker(args: argparse.Namespace) -> None:
    """One engine: every batch size for one (heads, kv, backend); with ``--paired``, two
    engines in this process (``--backend A,B``) timed alternately."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from gpu_clocks import ClockSampler
    from gpu_clocks import summarize as summarize_clocks
    from vllm import SamplingParams

    from trtllm_mla_plugin.testing.run_engine import record_step_intervals
    from trtllm_mla_plugin.vllm_backend.decode_spec import ROUTE_ENV_VAR

    names = args.backend.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    outside_route = os.environ.get(ROUTE_ENV_VAR)
    share = args.gpu_memory or (GPU_MEMORY_PAIRED if len(names) > 1 else GPU_MEMORY_ALONE)
    llms = {}
    for name in names:
        # Each engine process inherits the environment at its start: one engine's forced
        # route must not reach the next.
        if outside_route is None:
            os.environ.pop(ROUTE_ENV_VAR, None)
        else:
            os.environ[ROUTE_ENV_VAR] = outside_route
        backend, _ = set_route(name)
        llms[name] = make_llm(args, backend, max(batches), batches, gpu_memory=share)
    clocks = {name: record_step_intervals(llm) for name, llm in llms.items()}
    rows = []
    for b in batches:
        prompts = make_prompts(args, b)
        for llm in llms.values():
            llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
        # Fastest of --repeats runs each: the difference below amplifies one-off stalls.
        short = {n: [] for n in names}
        full = {n: [] for n in names}
        core = {n: CoreTiming(clocks[n]) for n in names}
        gpu = {n: [] for n in names}
        for order in alternating(names, args.repeats):
            for n in order:
                short[n].append(timed_generate(llms[n], prompts, args.short_len))
                with ClockSampler() as sampler:
                    full[n].append(timed_generate(llms[n], prompts, args.output_len, core[n]))
                gpu[n] += sampler.samples
        rows += [step_row(args, n, b, min(short[n]), min(full[n]), core[n]) for n in names]
        # The GPU's clock over the timed 1 + N runs: a slower clock, not a slower kernel, is
        # what a power-capped board shows (gpu_clocks).
        for row, n in zip(rows[-len(names):], names, strict=True):
            clock_summary = summarize_clocks(gpu[n])
            if clock_summary is not None:
                row.update(clock_summary.columns())
        used = gpu_memory_used_mib()
        for row in rows[-len(names):]:
            row["gpu_mem_mib"] = "" if not used else str(max(used))
        # Every repeat's own step estimate too: how much one engine instance varies between
        # its repeats, against how much instances vary between rounds.
        span = args.output_len - args.short_len
        for row, n in zip(rows[-len(names):], names, strict=True):
            row["steps_each_ms"] = ";".join(f"{(f - s) / span * 1e3:.3f}"
                                            for s, f in zip(short[n], full[n], strict=True))
    del llms
    import torch

    torch.cuda.empty_cache()
    q_len = 1 + draft_tokens(args)
    for row in rows:
        backend, route = split_backend(row["backend"])
        if backend == "TRTLLM_MLA":
            lens = attention_lens(args, int(row["batch"]))
            try:
                served_by, us = attention_layer_us(args.heads, args.kv, lens, route or None,
                                                   eager=args.eager, q_len=q_len)
            except Exception as e:  # the engine's timings stand without it
                row.update(route=f"not timed: {type(e).__name__}: {e}"[:200])
                continue
            share = us * args.layers / (float(row["step_ms"]) * 1e3)
            row.update(route=served_by, attn_layer_us=f"{us:.1f}", attn_share=f"{share:.2f}")
    Path(args.result).write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)  # engine teardown can hang after the results are out


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def engine_rows(args: argparse.Namespace, model: Path, heads: int, kv: str, backend: str,
                rnd: int) -> list[dict]:
    """Start one engine in its own process; its rows, or one row saying why it failed."""
    tag = f"{heads}-{kv}-{backend.replace('@', '-').replace(',', '+')}-r{rnd}"
    result = args.out / f"r-{tag}.json"
    cmd = [sys.executable, __file__, "--worker", "--model", str(model),
           "--heads", str(heads), "--kv", kv, "--backend", backend,
           "--batches", args.batches, "--output-len", str(args.output_len),
           "--short-len", str(args.short_len), "--repeats", str(args.repeats),
           "--min-prompt", str(args.min_prompt), "--max-prompt",
           str(args.max_prompt), "--seed", str(args.seed), "--layers",
           str(args.layers), "--result", str(result), *(["--eager"] if args.eager else []),
           *(["--core-steps"] if args.core_steps else []),
           *(["--mtp", str(args.mtp)] if draft_tokens(args) else []),
           *(["--gpu-memory", str(args.gpu_memory)] if args.gpu_memory else [])]
    log = args.out / f"log-{tag}.txt"
    with open(log, "w") as f:
        # Its own session, so that the engine processes it leaves behind (its worker exits
        # without tearing the engines down, which can hang) are killed with it: left alone
        # they kept their GPU memory for minutes (run 38).
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not wait_for_free_gpu():
        print(f"GPU memory still in use 120 s after {tag}; the next engine may not start",
              flush=True)
    if rc == 0 and result.exists():
        return [dict(r, round=rnd) for r in json.loads(result.read_text())]
    tail = log.read_text()[-300:].replace("\n", " | ")
    return [dict(round=rnd, heads=heads, kv=kv, backend=backend,
                 status=f"failed ({rc}): {tail}")]


def stop_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a scheduler) unwind through ``engine_rows``' ``finally``,
    which kills the running engine's process group: left behind, a stopped bench's two
    engines kept 130 GB of GPU memory and the next GPU job ran out of it (run 52)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def gpu_memory_used_mib() -> list[int] | None:
    """MiB in use on each GPU this process may use (``nvidia-smi``); ``None`` without it."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        cmd.append(f"--id={visible}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) for x in out.stdout.split()]


def wait_for_free_gpu(read=gpu_memory_used_mib, limit_mib: int = 4096,
                      timeout_s: float = 120.0, sleep=time.sleep) -> bool:
    """Wait until every GPU holds at most ``limit_mib`` MiB. Why: an engine's worker
    processes let go of their GPU memory seconds after the engine's process has exited,
    and the next engine then refuses to start (run 37: the second round of a paired bench
    found 8.8 of 139.8 GiB free). False on timeout; True at once without ``nvidia-smi``."""
    waited = 0.0
    while True:
        used = read()
        if used is None or max(used, default=0) <= limit_mib:
            return True
        if waited >= timeout_s:
            return False
        sleep(2.0)
        waited += 2.0


def add_shared_args(ap: argparse.ArgumentParser) -> None:
    """Prompt arguments and the worker-only ones, shared with ``profile_engine_step.py``."""
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eager", action="store_true",
                    help="engines with enforce_eager (no CUDA graphs): the plugin's decoder "
                         "then sees each step's lengths and ranks routes per batch")
    ap.add_argument("--gpu-memory", type=float, default=None,
                    help="vLLM's gpu_memory_utilization per engine (default 0.6, or 0.45 "
                         "each for two engines in one process, --paired). Two 128-head "
                         "engines with an FP8 cache ran out of memory in one process at 0.45 "
                         "and at 0.4 (runs 166, 168: after its prefills over cached FP8 "
                         "context, vLLM's own path, the first engine held 72-75 GiB), and "
                         "two bf16 ones on an H100 80 GB at 0.45 (run 319: vLLM's chunked-"
                         "context prefill asked 4 GiB past the profiled budget; 0.35 ran)")
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="speculative decoding: the model gets one DeepSeek MTP layer that "
                         "drafts K tokens a step (vLLM's method 'mtp'), so every decode batch "
                         "has 1 + K query tokens a request; the step time is then per "
                         "output token and depends on how many drafts are accepted "
                         "(--core-steps: per engine step too)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)


def build_model(out: Path, heads: int, layers: int, max_len: int, mtp: bool = False) -> Path:
    """The random-weight DeepSeek-V3-style model of these benchmarks, in ``out`` (``mtp``:
    with one multi-token-prediction layer for speculative decoding)."""
    from trtllm_mla_plugin.testing.tiny_model import build_tiny_deepseek_v3

    return build_tiny_deepseek_v3(
        out / f"model-h{heads}{'-mtp' if mtp else ''}", num_layers=layers, num_heads=heads,
        hidden_size=1024, vocab_size=1024, dtype="bfloat16",
        max_position_embeddings=max_len + 64, mtp_layers=1 if mtp else 0)


def round_engines(backends: list[str], rnd: int, paired: bool) -> list[str]:
    """The engine processes of round ``rnd``, in start order: one per backend, or with
    ``paired`` one holding all backends (``"A,B"``, creation order rotated)."""
    order = rotated(backends, rnd)
    return [",".join(order)] if paired else order


def rotated(backends: list[str], rnd: int) -> list[str]:
    """The backend order of round ``rnd``: shifted by one per round, so that no backend is
    always started first (runs 24, 26-28: the first engine after a machine's previous work
    ran its host code up to 1.9x slower, the same kernels on the GPU)."""
    k = rnd % len(backends)
    return backends[k:] + backends[:k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("engine-out"))
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batches", default="32,128,256")
    ap.add_argument("--kv", default="auto,fp8")
    ap.add_argument("--backends", default="TRTLLM_MLA,FLASH_ATTN_MLA,FLASHMLA,TRITON_MLA")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per length (fastest kept)")
    ap.add_argument("--short-len", type=int, default=8,
                    help="decode steps of the shorter run the step time is differenced against")
    add_shared_args(ap)
    ap.add_argument("--core-steps", action="store_true",
                    help="engines log stats; rows add the decode step by vLLM's engine-core "
                         "token timestamps (recompute step left out, not differenced) and "
                         "percentiles of the steps one by one")
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds per engine process (with --paired: two engines)")
    ap.add_argument("--warmup-engine", action=argparse.BooleanOptionalAction, default=True,
                    help="start one engine (the first backend) before the measured ones and "
                         "discard it (default on)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="start every engine this many times, backends interleaved per round; "
                         "the table reports each point's median over rounds")
    ap.add_argument("--paired", action="store_true",
                    help="two backends: both engines in one process per round, timed "
                         "alternately")
    args = ap.parse_args()
    backends = args.backends.split(",")
    if args.paired and len(backends) != 2:
        ap.error("--paired times exactly two backends side by side")
    if args.worker:
        args.heads = int(args.heads)
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    stop_on_sigterm()
    rows = []
    for heads in (int(h) for h in args.heads.split(",")):
        model = build_model(args.out, heads, args.layers, args.max_prompt + args.output_len,
                            mtp=args.mtp > 0)
        if args.warmup_engine:
            first = backends[0]
            t0 = time.time()
            smallest = argparse.Namespace(**vars(args))
            smallest.batches = str(min(int(b) for b in args.batches.split(",")))
            warm = engine_rows(smallest, model, heads, args.kv.split(",")[0], first, -1)
            print(f"[{time.time() - t0:.0f}s] h{heads} warm-up engine ({first}, discarded): "
                  f"{warm[-1].get('status', '')[:100]}", flush=True)
        order = [(kv, r, backend) for kv in args.kv.split(",") for r in range(args.rounds)
                 for backend in round_engines(backends, r, args.paired)]
        for kv, rnd, backend in order:
            t0 = time.time()
            rows += engine_rows(args, model, heads, kv, backend, rnd)
            print(f"[{time.time() - t0:.0f}s] h{heads} {kv} {backend} round {rnd}: "
                  f"{rows[-1].get('status', '')[:100]}", flush=True)
            # After every engine, so that a run stopped part-way keeps what it measured.
            write_csv(args.out / "engine.csv", rows)
    print_medians(rows)
    if args.paired:
        import summarize_engine

        tables = [("", "decode_tokens_per_s")]
        if args.core_steps:
            tables += [("By the engine core's timestamps (--core-steps):",
                        "core_decode_tokens_per_s"),
                       ("By the median decode step of the engine core (--core-steps):",
                        "core_median_decode_tokens_per_s")]
        for title, column in tables:
            print(f"\n{title}" if title else "")
            summarize_engine.print_table(
                summarize_engine.paired_points([rows], column, backends[0]))


def print_medians(rows: list[dict]) -> None:
    """Per (heads, kv, backend, batch): the median decode step over rounds, its range, and
    the most GPU memory in use after a round's timed runs (``gpu_mem_mib``, in GiB)."""
    steps: dict[tuple, list[float]] = {}
    memory: dict[tuple, list[int]] = {}
    for r in rows:
        if r.get("status") == "ok":
            key = (r["heads"], r["kv"], r["backend"], int(r["batch"]))
            steps.setdefault(key, []).append(float(r["step_ms"]))
            if r.get("gpu_mem_mib"):
                memory.setdefault(key, []).append(int(r["gpu_mem_mib"]))
    print(f"\n{'heads':>5} {'kv':>4} {'backend':>26} {'batch':>5} {'decode tok/s':>12} "
          f"{'step ms (median)':>16} {'min-max':>13} {'rounds':>6} {'GiB in use':>10}")
    for key, ms in steps.items():
        heads, kv, backend, batch = key
        mid = statistics.median(ms)
        used = f"{max(memory[key]) / 1024:.1f}" if key in memory else "-"
        print(f"{heads:>5} {kv:>4} {backend:>26} {batch:>5} {batch / mid * 1e3:>12.0f} "
              f"{mid:>16.3f} {min(ms):>6.2f}-{max(ms):<6.2f} {len(ms):>6} {used:>10}")


if __name__ == "__main__":
    main()
