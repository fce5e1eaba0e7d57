"""Host time of one decode step's ``plan`` per route, with the GPU idle and with it busy.

In the engine ``plan`` runs on the host while the GPU still executes the previous step; a
plan that waits for the GPU (a device-to-host copy) ends that overlap. Here the GPU is
kept busy with ``torch.cuda._sleep`` (``--busy-us`` per plan, standing in for the previous
step) before each ``plan``; a route that synchronises then takes about that long per plan.

Usage (GPU machine, FlashInfer and vLLM's FlashMLA importable)::

    python benchmarks/bench_plan_host.py --out DIR [--batches 1,8,32,64,128,256]
        [--routes vllm-fa3-mla,peer:vllm-fa3-mla] [--reps 200] [--host-profile]

Each case plans a decode stream (``decode_stream``: every request a token longer each
plan, as the engine's steps come), so a plan that reuses what it worked out for an earlier
step does so as often as in decode. Writes ``DIR/plan_host.csv`` (route, lengths given,
batch, GPU state, median and mean host us per plan); with ``--host-profile`` also
``DIR/plan_profile.txt``, each plan's functions by host time (``host_profile``).

Row ``vllm-fa3-mla:gpu-plan``: the route with its length order and balanced splits
computed on the GPU (``policy.VLLM_FA3_DEVICE_PLAN``) instead of on the host. Row
``policy``: the decoder an engine builds (every route its CUDA-graph ranking can pick, the
route ranked per batch). Row
``peer:vllm-fa3-mla``: the per-step work of vLLM's own FLASH_ATTN_MLA builder under full
CUDA graphs (``FlashAttnMLAMetadataBuilder._build_decode``: the longest query from the host
offsets, FA3's scheduler metadata, its copy into a persistent buffer and the zeroed tail),
the baseline of the plugin's ``vllm-fa3-mla`` plan, which also stages the block table,
lengths and query offsets into graph-stable buffers.
Row ``peer:vllm-flashmla-fp8``: the per-step work of vLLM's FLASHMLA builder on an FP8 cache
under full CUDA graphs (``FlashMLAMetadataBuilder._build_decode``: the longest query from
the host offsets, FlashMLA's dense FP8 scheduler and the copy of its two outputs into
persistent buffers), the baseline of the plugin's ``flashmla-fp8`` plan, whose schedule
kernel writes those buffers itself.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import importlib
import io
import pstats
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from decode_kernels import (  # this folder is on sys.path when a file of it runs
    FLASHMLA_FP8_MODULE,
    FLASHMLA_MODULE,
    VLLM_FA3_MODULE,
    vllm_fa3_scheduler_metadata,
)

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, MLADecoder, engine_query_dtype, policy
from trtllm_mla_plugin.ops.platform import platform_of

#: (route, KV dtype, host lengths given)
CASES = [("flashinfer-fa3", "bf16", True), ("flashinfer-fa3", "bf16", False),
         ("flashmla", "bf16", True), ("flashmla-fp8", "fp8", True),
         ("vllm-fa3-mla", "bf16", True), ("vllm-fa3-mla:gpu-plan", "bf16", True),
         ("peer:vllm-fa3-mla", "bf16", True),
         ("peer:vllm-flashmla-fp8", "fp8", True), ("policy", "bf16", True)]
#: Requests the ``policy`` decoder is built for (as an engine's ``max_num_seqs``): it holds
#: every route its CUDA-graph ranking can pick and ranks each batch.
POLICY_MAX_BATCH = 256
#: Plans ``host_profile`` profiles per case.
PROFILE_CALLS = 200


def batch_for(b: int, heads: int, rng: random.Random, width: int, device) -> DecodeBatch:
    """``b`` requests of 1024-8192 tokens, their block table ``width`` blocks wide (wide
    enough for the longest after the steps a ``decode_stream`` adds: ``table_width``)."""
    lens = [rng.randint(1024, 8192) for _ in range(b)]
    table = torch.randint(0, 4096, (b, width), dtype=torch.int32, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    # As the vLLM glue passes them: the engine's fixed-address tensors, exact host lengths.
    return DecodeBatch(table, lens_t.to(device), max(lens), kv_tokens=sum(lens),
                       seq_lens_host=lens_t, persistent=True)


def table_width(steps: int, block_size: int = 64, longest: int = 8192) -> int:
    """Blocks per block-table row for ``batch_for``'s requests to grow ``steps`` tokens."""
    return -(-(longest + steps) // block_size)


def stream_steps(reps: int, host_profile: bool) -> int:
    """Steps ``main`` takes from one case's ``decode_stream``: a warm-up plan and ``reps``
    timed ones with the GPU idle and again busy, and ``host_profile``'s warm-up and calls."""
    return 2 * (reps + 1) + (PROFILE_CALLS + 1 if host_profile else 0)


def longest_query(cu_host: torch.Tensor, b: int) -> int:
    """The longest query of a batch of ``b`` requests from the host's query offsets
    (``(b + 1,)`` int32, CPU), as vLLM's MLA builders take it each step."""
    cu = cu_host[: b + 1]
    return int((cu[1:] - cu[:-1]).max().item())


class VllmFA3BuilderPlan:
    """What vLLM 0.33's FLASH_ATTN_MLA builder does per decode step under full CUDA graphs
    (``v1/attention/backends/mla/flashattn_mla.py``), as a ``plan`` to time beside the
    plugin's: it hands the engine's own block table and lengths to the kernel, which vLLM
    keeps at fixed addresses."""

    def __init__(self, spec: DecodeSpec, device: torch.device, max_batch: int) -> None:
        from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import fa3_scheduler_metadata_size

        self.fa = importlib.import_module(VLLM_FA3_MODULE)
        self.spec = spec
        self.buffer = torch.zeros(fa3_scheduler_metadata_size(max_batch), dtype=torch.int32,
                                  device=device)
        self.cu = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.cu_host = torch.arange(max_batch + 1, dtype=torch.int32)

    def plan(self, batch: DecodeBatch) -> None:
        b = batch.batch_size
        max_q = longest_query(self.cu_host, b)
        meta = vllm_fa3_scheduler_metadata(self.fa, self.spec, b, max_q, batch.max_seq_len,
                                           batch.seq_lens, self.cu[: b + 1])
        n = meta.shape[0]
        self.buffer[:n] = meta
        self.buffer[n:] = 0


class VllmFlashMLAFP8BuilderPlan:
    """What vLLM 0.33's FLASHMLA builder does per decode step on an FP8 cache under full
    CUDA graphs (``v1/attention/backends/mla/flashmla.py``), as a ``plan`` to time beside
    the plugin's ``flashmla-fp8``: FlashMLA's (empty) scheduler object, its dense FP8
    scheduler on the step's lengths, and the copy of the tile schedule (``(sm_parts, 8)``
    int32) and split offsets (``(batch + 1,)`` int32) into buffers at fixed addresses.
    ``ops`` / ``interface``: FlashMLA's FP8 extension ops and Python interface (imported
    where not given)."""

    def __init__(self, spec: DecodeSpec, device: torch.device, max_batch: int,
                 ops=None, interface=None) -> None:
        if ops is None:
            importlib.import_module(FLASHMLA_FP8_MODULE)
            ops = torch.ops._flashmla_extension_C
        self.ops = ops
        self.interface = interface or importlib.import_module(FLASHMLA_MODULE)
        self.spec = spec
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else policy.HOPPER_SMS)
        self.tiles = torch.zeros(sms, 8, dtype=torch.int32, device=device)
        self.splits = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
        self.cu_host = torch.arange(max_batch + 1, dtype=torch.int32)

    def plan(self, batch: DecodeBatch) -> None:
        max_q = longest_query(self.cu_host, batch.batch_size)
        self.interface.get_mla_metadata()
        tiles, splits = self.ops.get_mla_decoding_metadata_dense_fp8(
            batch.seq_lens, max_q * self.spec.num_heads, 1)
        self.tiles[: tiles.size(0)].copy_(tiles)
        self.splits[: splits.size(0)].copy_(splits)


def decode_stream(batch: DecodeBatch) -> Iterator[DecodeBatch]:
    """``batch``, then the same requests one decode step later, and so on: each request a
    token longer, written into the same fixed-address tensors (as vLLM's are), the host
    lengths too. Replanning one batch would hand a plan that reuses an earlier step's work
    (as ``e1b0ce5``'s FA3 splits did while no request crossed a KV tile, reverted since) a
    repeat on every call; in decode a 64-token tile is crossed every 64 steps per request."""
    while True:
        yield batch
        batch.seq_lens.add_(1)
        if batch.seq_lens_host is not None:
            batch.seq_lens_host.add_(1)
        batch = replace(batch, max_seq_len=batch.max_seq_len + 1,
                        kv_tokens=None if batch.kv_tokens is None
                        else batch.kv_tokens + batch.batch_size)


def host_us_per_plan(dec, steps: Iterator[DecodeBatch], busy_us: int,
                     reps: int) -> tuple[float, float]:
    """Median and mean host time of ``dec.plan`` over ``reps`` steps of ``steps``
    (``decode_stream``; ``dec``: an ``MLADecoder`` or a vLLM builder's stand-in), the GPU
    idle or kept busy ``busy_us`` before each. The median, because a few slow plans moved
    the means of runs 17 and 66-69 by tens of us; the mean, because it is what a stream
    pays where some plans reuse an earlier step's work."""
    cycles = int(busy_us * 1.98e3)  # H200 SM clock ~1.98 GHz
    dec.plan(next(steps))
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        batch = next(steps)
        if busy_us:
            torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        dec.plan(batch)
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6


def host_profile(dec, steps: Iterator, calls: int = PROFILE_CALLS, top: int = 15) -> str:
    """Where ``dec.plan``'s host time goes over ``calls`` steps of ``steps``
    (``decode_stream``; the GPU idle) under ``cProfile``: its table of the ``top``
    functions by their own time (torch operations appear as the builtin methods they are
    called through)."""
    dec.plan(next(steps))
    profile = cProfile.Profile()
    for _ in range(calls):
        batch = next(steps)  # the stream's own step (it writes the lengths in place)
        profile.enable()
        dec.plan(batch)
        profile.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def case_decoder(route: str, kv: str, host: bool, b: int, heads: int, width: int,
                 device: torch.device) -> tuple[object, Iterator[DecodeBatch]]:
    """The planner of one case (``CASES``) for ``b`` requests and its decode stream."""
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
    spec = DecodeSpec(heads, 512, 64, 64, torch.bfloat16, kv_dtype, 1 / 192**0.5)
    route, _, variant = (route, "", "") if route.startswith("peer:") else route.partition(":")
    forced = None if route == "policy" or route.startswith("peer:") else route
    spec = replace(spec, q_dtype=engine_query_dtype(spec, platform_of(device), forced))
    batch = batch_for(b, heads, random.Random(b), width, device)
    if not host:
        batch = replace(batch, seq_lens_host=None)
    if route == "peer:vllm-flashmla-fp8":
        dec = VllmFlashMLAFP8BuilderPlan(spec, device, b)
    elif route.startswith("peer:"):
        dec = VllmFA3BuilderPlan(spec, device, b)
    elif route == "policy":
        dec = MLADecoder(spec, device, max(b, POLICY_MAX_BATCH), cuda_graph=True)
    else:
        dec = MLADecoder(spec, device, b, route=forced, cuda_graph=True)
        if variant == "gpu-plan":
            dec.route.device_plan_override = True
    return dec, decode_stream(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("plan-out"))
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--busy-us", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--routes", default=",".join(dict.fromkeys(c[0] for c in CASES)),
                    help="comma-separated subset of the cases' routes")
    ap.add_argument("--host-profile", action="store_true",
                    help="also write each plan's cProfile table to DIR/plan_profile.txt")
    ap.add_argument("--rounds", type=int, default=1,
                    help="times through the cases, their order reversed every other round")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    rows, profiles = [], []
    routes = set(args.routes.split(","))
    width = table_width(stream_steps(args.reps, args.host_profile))
    cases = [c for c in CASES if c[0] in routes]
    for r in range(args.rounds):
        for route, kv, host in (cases if r % 2 == 0 else cases[::-1]):
            for b in (int(x) for x in args.batches.split(",")):
                dec, steps = case_decoder(route, kv, host, b, args.heads, width, device)
                for busy in (0, args.busy_us):
                    median, mean = host_us_per_plan(dec, steps, busy, args.reps)
                    rows.append(dict(round=r, route=route, kv=kv, host_lengths=host, batch=b,
                                     gpu_busy_us=busy, host_us_per_plan=f"{median:.1f}",
                                     host_us_mean=f"{mean:.1f}"))
                    print(f"r{r} {route:>26} {kv:>4} host_lengths={host!s:>5} b={b:>4} "
                          f"gpu_busy={busy:>5}us: plan {median:8.1f} us (mean {mean:8.1f})",
                          flush=True)
                if args.host_profile and r == 0:
                    profiles.append(f"== {route} {kv} host_lengths={host} b={b}\n"
                                    f"{host_profile(dec, steps)}")
    with open(args.out / "plan_host.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if profiles:
        (args.out / "plan_profile.txt").write_text("\n".join(profiles))


if __name__ == "__main__":
    main()
