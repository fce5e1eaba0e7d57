"""MLA decode benchmark on one GPU: the plugin's dispatch and routes against every peer.

Usage (one process, on the GPU machine)::

    python benchmarks/bench_decode.py --out DIR [--quick] [--noise] [--host]
        [--random 1,2 [--random-count 40]] [--shape-list FILE] [--train 100] [--no-grid]
        [--extra-routes cuda-splitk] [--splitk-configs "4,1,4;2,2,4"] [--rounds 5]
    python benchmarks/bench_decode.py --out DIR --paired 5 [--shapes ...] [--random 1,2]

Writes ``DIR/decode.csv`` (the grid: one row per shape x kernel x pass), ``random-S.csv``
per random seed S, ``list-NAME.csv`` per ``--shape-list NAME.txt``, ``train.csv`` (the
policy-fit sweep), ``shapes.jsonl`` (every shape's lengths), ``DIR/ceilings.csv`` and
``DIR/host.csv``, then prints summary tables. With ``--paired`` only FP8 shapes are timed,
the plugin against FLASHMLA FP8 alternately (``DIR/paired.csv``, one row per alternation).
Shapes:
DeepSeek-V3/Kimi-K2 absorbed MLA (latent 512 + rope 64, softmax scale 1/sqrt(192));
lengths all = ctx ("u"), uniform-random in [1, ctx] ("r") or in [lo * ctx, ctx]
("r0.37"), with a fixed seed per shape.

Per kernel: median time of ``REPS_PER_GRAPH`` calls captured in one CUDA graph (so launch
gaps do not count; ``triton.testing.do_bench`` median of graph replays, L2 flushed before each
replay, and the calls inside a replay rotate over cache copies that together exceed L2);
with ``--rounds N`` each kernel's median over N rounds of the shape's kernels, the order
rotated each round;
``%copy`` = (KV bytes read once + q + out) / time / copy ceiling; TFLOP/s =
2 * heads * (576 + 512) * sum over query rows of visible keys / time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_kernels
from decode_kernels import (
    Case,
    Kernel,
    decoder_kernel,
    extra_route_kernel,
    flashmla_fp8_peer,
    flashmla_peer,
    plugin_kernels,
    splitk_kernel,
    splitk_label,
    triton_peer,
    vllm_fa3_mla_peer,
)

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, mla_decode_reference

DC, DR = 512, 64
D = DC + DR
SCALE = 1.0 / 192**0.5
FP8 = torch.float8_e4m3fn
L2_BYTES = 50 * 2**20
REPS_PER_GRAPH = 10
K = 1024

# (heads, batch, ctx, lens "u"/"r"/"rLO"/"oFRAC" (see case_lengths), q_len, kv dtype, block)
BF, F8 = "bf16", "fp8"
FULL = [
    (16, 1, 8 * K, "u", 1, BF, 64), (16, 32, 4 * K, "u", 1, BF, 64),
    (16, 32, 4 * K, "r", 1, BF, 64), (16, 64, 4 * K, "u", 1, BF, 64),
    (16, 64, 4 * K, "r", 1, BF, 64), (16, 128, 8 * K, "u", 1, BF, 64),
    (16, 128, 8 * K, "r", 1, BF, 64), (16, 256, 4 * K, "u", 1, BF, 64),
    (16, 256, 4 * K, "r", 1, BF, 64), (16, 64, 32 * K, "u", 1, BF, 64),
    (16, 64, 32 * K, "r", 1, BF, 64), (16, 256, 1 * K, "r", 1, BF, 64),
    (32, 64, 4 * K, "u", 1, BF, 64), (32, 64, 4 * K, "r", 1, BF, 64),
    (32, 128, 8 * K, "r", 1, BF, 64), (64, 64, 8 * K, "u", 1, BF, 64),
    (64, 64, 8 * K, "r", 1, BF, 64),
    (128, 1, 8 * K, "u", 1, BF, 64), (128, 32, 4 * K, "u", 1, BF, 64),
    (128, 64, 4 * K, "r", 1, BF, 64), (128, 128, 8 * K, "u", 1, BF, 64),
    (128, 128, 8 * K, "r", 1, BF, 64), (128, 64, 32 * K, "u", 1, BF, 64),
    (128, 64, 32 * K, "r", 1, BF, 64), (128, 256, 4 * K, "r", 1, BF, 64),
    # block 32
    (16, 64, 4 * K, "u", 1, BF, 32), (16, 64, 4 * K, "r", 1, BF, 32),
    (128, 64, 4 * K, "r", 1, BF, 32),
    # FP8 cache
    (16, 64, 4 * K, "u", 1, F8, 64), (16, 64, 4 * K, "r", 1, F8, 64),
    (16, 128, 8 * K, "r", 1, F8, 64), (128, 64, 4 * K, "u", 1, F8, 64),
    # speculative decode
    (16, 64, 4 * K, "r", 2, BF, 64), (16, 64, 4 * K, "r", 4, BF, 64),
    (16, 128, 8 * K, "u", 4, BF, 64), (128, 64, 4 * K, "u", 2, BF, 64),
    # FP8 cache, more head counts and speculative decode (added with the Triton route)
    (32, 64, 4 * K, "r", 1, F8, 64), (64, 64, 8 * K, "r", 1, F8, 64),
    (16, 64, 4 * K, "r", 2, F8, 64), (16, 1, 8 * K, "u", 1, F8, 64),
    (32, 128, 8 * K, "r", 1, F8, 64), (16, 8, 8 * K, "u", 1, F8, 64),
    (16, 16, 4 * K, "r", 1, F8, 64), (16, 32, 4 * K, "r", 1, F8, 64),
    # one long request among many short ones ("o": the first request at ctx, the rest at
    # that fraction of it): the split-KV kernel cuts the long one over many CTAs
    (16, 96, 64 * K, "o0.03", 1, BF, 64), (16, 128, 32 * K, "o0.06", 1, BF, 64),
    (8, 128, 64 * K, "o0.03", 2, BF, 64),
]
QUICK = [FULL[i] for i in (1, 4, 6, 8, 10, 19, 21, 23)]
#: The SM90 policy's FlashMLA threshold (16k) sits between measured 8k and 32k shapes;
#: these check it (`--threshold`; seeds 100 + index).
THRESHOLD = [(16, 64, 16 * K, "r", 1, BF, 64), (16, 64, 16 * K, "u", 1, BF, 64),
             (16, 128, 12 * K, "r", 1, BF, 64), (128, 64, 16 * K, "u", 1, BF, 64)]
FA2_SHAPES = {FULL[i] for i in (3, 4, 21)}
#: `--sweep`: launch configurations of the plugin's Triton kernel (route "triton-balanced")
#: timed on these shapes; (block_n, num_warps, num_stages) x ctas_per_sm.
SWEEP = [FULL[i] for i in (1, 4, 29, 30, 31, 36)]
SWEEP_TILES = [(32, 4, 3), (32, 4, 4), (64, 8, 2), (32, 8, 3), (64, 4, 2), (16, 4, 4)]
SWEEP_CTAS_PER_SM = (1, 2)
CHECK_MAX_TOKENS = 300 * K  # float32 reference on shapes up to this many KV tokens
#: Random shapes: heads per rank (DeepSeek-V3 128 / Kimi-K2 64 heads at TP 1-16), batch
#: log-uniform in [1, 512], longest request log-uniform in [256, 64k], q_len 1-4, bf16 or
#: FP8 cache, lengths uniform (30%) or uniform in [lo * ctx, ctx] with lo in [0, 0.9].
RANDOM_HEADS = (8, 16, 32, 64, 128)
#: KV tokens of one random shape at most (batch halved until it fits): a layer's decode
#: over 2M tokens is ~2.3 GB of bf16 cache, more than a rank holds per layer in practice.
RANDOM_MAX_KV_TOKENS = 2 * 1024 * 1024


def random_shapes(seed: int, count: int, kv_kinds: tuple[str, ...] = (BF, F8)) -> list[tuple]:
    """``count`` seeded random shapes (see ``RANDOM_HEADS``); a shape's lengths are drawn in
    ``make_case`` from its own seed."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        heads = rng.choice(RANDOM_HEADS)
        b = max(1, round(2 ** rng.uniform(0, 9)))
        ctx = round(2 ** rng.uniform(8, 16))
        m = rng.choice((1, 1, 1, 2, 3, 4))
        kvd = rng.choice(kv_kinds)
        lo = None if rng.random() < 0.3 else rng.uniform(0.0, 0.9)
        kind = "u" if lo is None else f"r{lo:.2f}"
        mean = ctx if lo is None else ctx * (1 + lo) / 2
        while b > 1 and b * mean > RANDOM_MAX_KV_TOKENS:
            b //= 2
        shapes.append((heads, b, ctx, kind, m, kvd, 64))
    return shapes


def random_set(seed: int, count: int, kv_kinds: tuple[str, ...] = (BF, F8),
               keep: str = "both", request_rows: tuple[int, int] | None = None,
               batches: tuple[int, int] | None = None,
               rows: tuple[int, int] | None = None) -> list[tuple[int, tuple]]:
    """``(case seed, shape)`` of random set ``seed`` whose cache dtype ``keep`` admits
    (``"both"``, ``BF`` or ``F8``) and, if given, with query rows per request (heads x q_len),
    batch size and the batch's query rows each within an inclusive ``(lo, hi)`` range. The
    case seed (lengths and values of ``make_case``) is ``1000 * seed`` + the shape's place in
    the draw, the same in every run and mode, so a filtered set's shapes are those of the
    whole draw (draw at most 1000 shapes a seed, or case seeds repeat across seeds)."""
    def within(value: int, bounds: tuple[int, int] | None) -> bool:
        return bounds is None or bounds[0] <= value <= bounds[1]

    return [(1000 * seed + i, shape)
            for i, shape in enumerate(random_shapes(seed, count, kv_kinds))
            if keep in ("both", shape[5]) and within(shape[0] * shape[4], request_rows)
            and within(shape[1], batches) and within(batch_query_rows(shape), rows)]


def batch_query_rows(shape: tuple) -> int:
    """A shape's query rows for the whole batch: heads x requests x query tokens."""
    heads, batch, _ctx, _kind, q_len, *_ = shape
    return heads * batch * q_len


def int_range(text: str) -> tuple[int, int]:
    """``"LO-HI"`` (or one number) as an inclusive ``(lo, hi)``, for the filter options."""
    lo, _, hi = text.partition("-")
    bounds = (int(lo), int(hi or lo))
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"empty range {text!r}")
    return bounds


def add_shape_options(ap: argparse.ArgumentParser, count: int,
                      request_rows: tuple[int, int], batches: tuple[int, int]) -> None:
    """The shape options of the graph benchmarks (``graph_routes_ab``,
    ``graph_switch_probe``): grid indices, and random draws filtered by query rows per
    request, batch size and the batch's query rows (``chosen_shapes`` reads them)."""
    ap.add_argument("--grid", default="", help="comma-separated indices into bench_decode's "
                    "grid (bf16 shapes)")
    ap.add_argument("--seeds", default="", help="comma-separated random-set seeds")
    ap.add_argument("--count", type=int, default=count, help="shapes drawn per seed")
    ap.add_argument("--request-rows", type=int_range, default=request_rows, metavar="LO-HI")
    ap.add_argument("--batches", type=int_range, default=batches, metavar="LO-HI")
    ap.add_argument("--rows", type=int_range, default=None, metavar="LO-HI",
                    help="keep the draws whose batch has LO to HI query rows (requests x "
                         "heads x query tokens)")


def chosen_shapes(args: argparse.Namespace,
                  keep: Callable[[tuple], bool] = lambda shape: True) -> list[tuple[int, tuple]]:
    """``(case seed, shape)`` of ``add_shape_options``' options: the grid shapes (the case
    seed their index), then each seed's bf16 draws within the filters and ``keep``."""
    shapes = [(int(i), FULL[int(i)]) for i in args.grid.split(",") if i]
    for seed in (int(x) for x in args.seeds.split(",") if x):
        shapes += [(case_seed, shape) for case_seed, shape in random_set(
            seed, args.count, keep=BF, request_rows=args.request_rows, batches=args.batches,
            rows=args.rows)
            if keep(shape)]
    return shapes


def case_lengths(kind: str, ctx: int, b: int, q_len: int, g: torch.Generator) -> list[int]:
    """KV lengths of a shape's ``b`` requests: ``u`` all ``ctx``; ``r`` / ``rLO`` uniform in
    ``[LO * ctx, ctx]`` (LO 0 when absent); ``oFRAC`` the first request ``ctx`` and the rest
    ``FRAC * ctx`` (one long request among short ones). Never below ``q_len``."""
    if kind == "u":
        return [ctx] * b
    if kind.startswith("o"):
        short = max(q_len, 1, int(float(kind[1:]) * ctx))
        return [ctx] + [short] * (b - 1)
    low = max(q_len, 1, int(float(kind[1:] or 0) * ctx))
    return torch.randint(low, ctx + 1, (b,), generator=g).tolist()


def shape_name(shape: tuple) -> str:
    """The ``shape`` column of a shape's rows, e.g. ``h16 b64 4k r q1 bf16 p64``."""
    heads, b, ctx, kind, m, kvd, block = shape
    size = f"{ctx // K}k" if ctx % K == 0 else str(ctx)
    return f"h{heads} b{b} {size} {kind} q{m} {kvd} p{block}"


def parse_shape_name(name: str) -> tuple:
    """The shape ``shape_name`` writes as ``name`` (``h16 b64 4k r q1 bf16 p64``)."""
    heads, b, size, kind, m, kvd, block = name.split()
    ctx = int(size[:-1]) * K if size.endswith("k") else int(size)
    return (int(heads[1:]), int(b[1:]), ctx, kind, int(m[1:]), kvd, int(block[1:]))


def read_shape_list(path: Path) -> list[tuple[int, tuple]]:
    """``(case seed, shape)`` from a file of ``CASE_SEED SHAPE_NAME`` lines
    (``one_wave_shapes.py`` writes them)."""
    cases = []
    for line in path.read_text().splitlines():
        if line.strip():
            seed, name = line.split(maxsplit=1)
            cases.append((int(seed), parse_shape_name(name)))
    return cases


def make_case(shape: tuple, seed: int, device: torch.device) -> Case:
    heads, b, ctx, kind, m, kvd, block = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = case_lengths(kind, ctx, b, m, g)
    need = [-(-n // block) for n in lens]
    width = -(-ctx // block)
    nblocks = sum(need) + 1
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    table = torch.full((b, width), int(perm[-1]), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    kv_dtype = FP8 if kvd == F8 else torch.bfloat16
    cache_bytes = nblocks * block * D * (1 if kvd == F8 else 2)
    copies = max(1, min(8, math.ceil(3 * L2_BYTES / cache_bytes)))
    caches = []
    for _ in range(copies):
        c = torch.randn(nblocks, block, D, device=device, dtype=torch.bfloat16)
        caches.append(c.to(kv_dtype) if kvd == F8 else c)
    query = torch.randn(b * m, heads, D, device=device, dtype=torch.bfloat16)
    spec = DecodeSpec(heads, DC, DR, block, torch.bfloat16, kv_dtype, SCALE, max_q_len=m)
    lens_host = torch.tensor(lens, dtype=torch.int32)
    batch = DecodeBatch(table.to(device), lens_host.to(device), max_seq_len=max(lens),
                        max_q_len=m, kv_tokens=sum(lens), seq_lens_host=lens_host)
    case = Case(shape_name(shape), spec, batch, query, caches, lens, m)
    case.info["with_fa2"] = shape in FA2_SHAPES
    return case


def bytes_flops(case: Case) -> tuple[int, float]:
    spec, m = case.spec, case.q_len
    esize = 1 if spec.fp8_kv else 2
    kv_tokens = sum(case.lens_host)
    rows = case.query.shape[0]
    nbytes = kv_tokens * D * esize + rows * spec.num_heads * (D + DC) * 2
    visible = sum(m * n - m * (m - 1) // 2 for n in case.lens_host)
    return nbytes, 2.0 * spec.num_heads * (D + DC) * visible


def capture_calls(call, reps: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``call(0)``, ..., ``call(reps - 1)``, captured on a side stream."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(reps):
            call(i)
    torch.cuda.synchronize()
    return graph


def capture_graph(fn, case: Case, reps: int = REPS_PER_GRAPH) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``reps`` calls of ``fn``, rotating over the case's cache copies."""
    for c in case.caches[:2]:
        fn(c)  # warm-up (JIT, lazy state) outside capture
    return capture_calls(lambda i: fn(case.caches[i % len(case.caches)]), reps)


#: ``--sustain S``: every timing first replays its graph for S seconds, so that it is taken
#: at the clock seconds of such work leave the GPU at, as in an engine (docs/benchmarks.md,
#: "Method", sustained load); 0: timed right after set-up, as runs 1-218.
SUSTAIN_S = 0.0
#: ``--rounds N``: a shape's kernels are captured, then timed in N rounds, each round
#: starting at the next kernel (``alternate_graphs``), and each one's median round kept;
#: 1: each kernel timed once, one after another, in ``kernels_for``'s order (runs 1-220).
ROUNDS = 1


def keep_busy(replay: Callable[[], object], seconds: float) -> None:
    """``replay`` launched back to back for ``seconds`` (host time), the host waiting for
    the GPU every four launches so that the time is the GPU's."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(4):
            replay()
        torch.cuda.synchronize()


def time_replays(graph: torch.cuda.CUDAGraph, reps: int = REPS_PER_GRAPH) -> float:
    """Median microseconds of one call, from replays of a graph of ``reps`` calls (after
    ``SUSTAIN_S`` seconds of them)."""
    import triton.testing

    if SUSTAIN_S > 0:
        keep_busy(graph.replay, SUSTAIN_S)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")
    return ms * 1e3 / reps


def time_alternating(calls: list[Callable], case: Case, rounds: int) -> list[list[float]]:
    """Microseconds per call of each of ``calls`` (each captured into one graph), one value
    per round (``alternate_graphs``)."""
    return alternate_graphs([capture_graph(call, case) for call in calls], rounds)


def alternate_graphs(graphs: list, rounds: int) -> list[list[float]]:
    """Microseconds per call of each of ``graphs``, one value per round; round ``r`` starts
    at graph ``r`` (mod the count), so no graph always runs first or last (A B, B A, ... for
    two). Why: a clock or thermal drift between timings taken one after the other reads as a
    gap between kernels (the kernel timed first for each shape ran more than 1 us slower
    than its twin timed later on 38 of 879 shapes under 40 us, faster on none: runs
    150-220, ``evaluate_policy.py --twin``); alternating, each one's median keeps only
    their own difference."""
    times: list[list[float]] = [[] for _ in graphs]
    for r in range(rounds):
        first = r % len(graphs)
        for i in [*range(first, len(graphs)), *range(first)]:
            times[i].append(time_replays(graphs[i]))
    return times


def time_kernels(kernels: dict[str, Kernel], case: Case) -> dict[str, float]:
    """Graph-timed microseconds of each of ``kernels`` that can run (``call`` not ``None``)."""
    return {name: time_graph(k.call, case) for name, k in kernels.items() if k.call is not None}


def route_variants(kernel: Kernel, case: Case, values: list, set_value: Callable
                   ) -> Iterator[tuple[object, float, float]]:
    """The route of ``kernel`` (a ``decoder_kernel``) under each of ``values``: per value,
    ``set_value(route, value)``, the route re-planned on the case's batch, then ``(value,
    graph-timed us, its output's relative difference to the first value's)``; the route
    keeps each value's plan until the caller resumes."""
    route, first = kernel.obj.route, None
    for value in values:
        set_value(route, value)
        route.plan(case.batch)
        result = kernel.call(case.caches[0]).float()
        first = result if first is None else first
        diff = ((result - first).norm() / first.norm()).item()
        yield value, time_graph(kernel.call, case), diff


def write_peer_rows(writer: csv.DictWriter, name: str, peers: list[str],
                    times: dict[str, float], **columns: object) -> None:
    """CSV rows (``shape``, ``kernel``, ``us`` and ``columns``) for the peers of ``peers``
    that ``times`` holds, then one line of every time of shape ``name`` on stdout."""
    for peer in peers:
        if peer in times:
            writer.writerow(dict(shape=name, kernel=peer, us=f"{times[peer]:.2f}", **columns))
    print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()), flush=True)


def ratio_summary(ratios: list[float]) -> str:
    """``over N shapes: geomean G, worst W, best B`` of per-shape time ratios."""
    return (f"over {len(ratios)} shapes: geomean {statistics.geometric_mean(ratios):.3f}, "
            f"worst {min(ratios):.3f}, best {max(ratios):.3f}")


def time_graph(fn, case: Case, reps: int = REPS_PER_GRAPH) -> float:
    """Median microseconds of one call, from graph replays of ``reps`` calls."""
    return time_replays(capture_graph(fn, case, reps), reps)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("nan")
    diff = out.float() - ref
    return (diff.norm() / ref.norm()).item()


def reference(case: Case) -> torch.Tensor:
    return mla_decode_reference(
        case.query.float(), case.caches[0].float(), case.batch.block_table,
        case.batch.seq_lens, SCALE, DC, max_seq_len=case.batch.max_seq_len,
    )


#: ``--extra-routes``: plugin routes no policy ranks yet (e.g. ``cuda-splitk``), timed forced
#: on every shape as ``route:NAME`` rows beside the peers.
EXTRA_ROUTES: tuple[str, ...] = ()
#: ``--splitk-configs``: launch configurations (stages, CTAs per SM, min tiles per CTA and
#: optionally the fused merge's ``fuse_max_splits``) of the CUDA split-KV kernel, each timed
#: as ``splitk[...]`` rows.
SPLITK_CONFIGS: tuple[tuple[int, ...], ...] = ()


def kernels_for(case: Case, mode: str = "grid") -> list[Kernel]:
    """Kernels timed per shape. ``grid``: everything, levers included; ``random``: the
    plugin and every peer but vLLM's Triton MLA (2-10x slower than the best peer on every
    grid shape; its per-shape JIT would not fit the device budget); ``train``: the routes
    the bf16 policy picks between; ``graph`` (bf16): the CUDA-graph decoder, the two routes
    its rule picks between and vLLM's own calls of those two kernels."""
    ks = plugin_kernels(case, mode)
    ks += [extra_route_kernel(r, case) for r in EXTRA_ROUTES]
    ks += [splitk_kernel(case, *config) for config in SPLITK_CONFIGS]
    if mode == "train":
        return ks
    if mode == "graph":
        return [*ks, flashmla_peer(case), vllm_fa3_mla_peer(case)]
    if case.spec.fp8_kv:
        ks.append(flashmla_fp8_peer(case))
    else:
        ks.append(flashmla_peer(case))
        ks.append(vllm_fa3_mla_peer(case))
        ragged = case.batch.max_seq_len != min(case.lens_host)
        if mode == "grid" and ragged and case.q_len == 1:
            ks.append(flashmla_peer(case, sort=True))
    if mode == "grid":
        ks.append(triton_peer(case))
    return ks


def bench_shape(shape: tuple, idx: int, device, writer, pass_no: int, summary: list,
                mode: str = "grid", shapes_log=None) -> None:
    case = make_case(shape, seed=idx, device=device)
    if shapes_log is not None:
        shapes_log.write(json.dumps({"shape": case.name, "seed": idx, "mode": mode,
                                     "lens": case.lens_host}) + "\n")
    nbytes, flops = bytes_flops(case)
    check = sum(case.lens_host) * case.q_len <= CHECK_MAX_TOKENS
    ref = reference(case) if check else None
    heads, b, ctx, kind, m, kvd, block = shape
    row0 = dict(pass_no=pass_no, shape=case.name, heads=heads, batch=b, ctx=ctx, lens=kind,
                q_len=m, kv=kvd, block=block, kv_tokens=sum(case.lens_host),
                max_len=max(case.lens_host), bytes=nbytes, flops=flops,
                spread=round(max(case.lens_host) * b / sum(case.lens_host), 3))
    times = {}

    def timed(row: dict, name: str, us: float) -> dict:
        times[name] = us
        return dict(row, us=f"{us:.2f}", pct_copy=f"{100 * nbytes / (us * 1e-6) / COPY_BPS:.1f}",
                    tflops=f"{flops / (us * 1e-6) / 1e12:.1f}")

    captured = []  # (kernel, row, graph) to time in rotated rounds (``ROUNDS`` > 1)
    for k in kernels_for(case, mode):
        row = dict(row0, kernel=k.name, status="ok", us="", pct_copy="", tflops="", rel_err="")
        if k.absent:
            row["status"] = "absent: " + k.absent
        else:
            try:
                if ref is not None:
                    k.out.fill_(float("nan"))
                    row["rel_err"] = f"{rel_error(k.call(case.caches[0]), ref):.2e}"
                if ROUNDS > 1:
                    captured.append((k, row, capture_graph(k.call, case)))
                    continue
                row = timed(row, k.name, time_graph(k.call, case))
            except Exception as exc:
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        writer.writerow(row)
    if captured:
        rounds = alternate_graphs([graph for *_, graph in captured], ROUNDS)
        for (k, row, _), values in zip(captured, rounds, strict=True):
            writer.writerow(timed(row, k.name, statistics.median(values)))
    plugin = next((t for n, t in times.items() if n.startswith("plugin")), None)
    peers = {n: t for n, t in times.items() if n.startswith("peer:") and "sorted" not in n}
    best = min(peers.items(), key=lambda kv: kv[1]) if peers else (None, None)
    summary.append((pass_no, case.name, times, plugin, best, nbytes))
    del case
    torch.cuda.empty_cache()


PAIRED_FIELDS = ["set", "shape", "heads", "batch", "ctx", "lens", "q_len", "round",
                 "plugin_route", "plugin_us", "peer_us", "identical_output"]


def bench_paired(shape: tuple, idx: int, device, writer, rounds: int, label: str,
                 summary: list) -> None:
    """The plugin's dispatch (as vLLM calls it) and vLLM's FLASHMLA FP8 call on one FP8
    shape, each captured once and then timed alternately ``rounds`` times (A B A B ...).

    Why: both run FlashMLA's dense FP8 kernel; timed one after the other, a 2-4% clock or
    thermal drift between the two timings reads as a gap on small shapes
    (``time_alternating``). ``identical_output``: the two outputs compared bit for bit (the
    same kernel on the same inputs)."""
    case = make_case(shape, seed=idx, device=device)
    plugin = decoder_kernel("plugin", case, None, engine_query=True)
    peer = flashmla_fp8_peer(case)
    if plugin.absent or peer.absent:
        raise RuntimeError(f"{case.name}: {plugin.absent or peer.absent}")
    identical = torch.equal(plugin.call(case.caches[0]), peer.call(case.caches[0]))
    times = time_alternating([plugin.call, peer.call], case, rounds)
    heads, b, ctx, kind, m, _kvd, _block = shape
    for rnd, (ours, theirs) in enumerate(zip(*times, strict=True)):
        writer.writerow(dict(set=label, shape=case.name, heads=heads, batch=b, ctx=ctx,
                             lens=kind, q_len=m, round=rnd, plugin_route=plugin.obj.route.name,
                             plugin_us=f"{ours:.3f}", peer_us=f"{theirs:.3f}",
                             identical_output=identical))
    med = [sorted(t)[len(t) // 2] for t in times]
    summary.append((label, case.name, med[0], med[1], identical))
    del case
    torch.cuda.empty_cache()


COPY_BPS = 4.2e12  # replaced by the measured ceiling in main()


def sweep_triton(device, writer) -> None:
    """Time the Triton route under each launch configuration of ``SWEEP_TILES`` x
    ``SWEEP_CTAS_PER_SM`` (same plan, same inputs) and check each against the reference."""
    from dataclasses import replace

    from trtllm_mla_plugin.ops.kernels import balanced_mla_decode as kernel_module

    for shape in SWEEP:
        case = make_case(shape, seed=FULL.index(shape), device=device)
        nbytes, _ = bytes_flops(case)
        check = sum(case.lens_host) * case.q_len <= CHECK_MAX_TOKENS
        ref = reference(case) if check else None
        k = decoder_kernel("triton-balanced", case, "triton-balanced")
        route = k.obj.route
        base = route.config
        for bn, nw, ns in SWEEP_TILES:
            for cps in SWEEP_CTAS_PER_SM:
                route.config = replace(base, block_n=bn, num_warps=nw, num_stages=ns,
                                       ctas_per_sm=cps)
                k.obj.plan(case.batch)  # the route reads its config when planning
                row = dict(shape=case.name, block_n=bn, num_warps=nw, num_stages=ns,
                           ctas_per_sm=cps, us="", pct_copy="", rel_err="", status="ok")
                try:
                    if ref is not None:
                        k.out.fill_(float("nan"))
                        row["rel_err"] = f"{rel_error(k.call(case.caches[0]), ref):.2e}"
                    us = time_graph(k.call, case)
                    compiled = kernel_module.last_compiled
                    ptx = compiled.asm.get("ptx", "")
                    copies = ptx.count("cp.async.ca") + ptx.count("cp.async.cg")
                    row["status"] = (f"ok regs={compiled.n_regs} spills={compiled.n_spills} "
                                     f"cp.async={copies} "
                                     f"wait_group={ptx.count('cp.async.wait_group')}")
                    pct = 100 * nbytes / (us * 1e-6) / COPY_BPS
                    row.update(us=f"{us:.2f}", pct_copy=f"{pct:.1f}")
                except Exception as exc:
                    row["status"] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
                writer.writerow(row)
                print(f"sweep {case.name} bn{bn} w{nw} s{ns} cps{cps}: {row['us']} us "
                      f"{row['pct_copy']}% err {row['rel_err']} {row['status'][:90]}", flush=True)
        route.config = base
        del case, k
        torch.cuda.empty_cache()


def ceilings(device) -> dict:
    import triton.testing

    n = 2 * 2**30 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    copy_bps = 2 * src.numel() * 4 / (ms * 1e-3)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    bm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms2 = triton.testing.do_bench(lambda: a @ bm, warmup=25, rep=200, return_mode="median")
    return {"copy_GBps": copy_bps / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / (ms2 * 1e-3) / 1e12}


#: Host-cost shapes: a tiny one whose kernel takes a few microseconds, so a loop of eager
#: calls is bound by host launch cost (what the <= 15 us target is about), one request of
#: 4k and b32 4k ragged (the engine's small batches, on vLLM's FA3 kernel under CUDA
#: graphs), and the memory-bound h16 b64 4k of the tables (there the loop is GPU-bound).
HOST_SHAPES = ((16, 1, 4 * K, "u", 1, BF, 64), (16, 4, 256, "u", 1, BF, 64),
               (16, 32, 4 * K, "r", 1, BF, 64), (16, 64, 4 * K, "u", 1, BF, 64),
               (16, 64, 4 * K, "r", 1, BF, 64))


def host_overhead(device, writer) -> None:
    """Eager per-call cost of ``MLADecoder.run`` against the bare kernel call on the same
    plan, and CUDA-graph replay of each (one and ten calls per graph). The decoder is the
    default dispatch for FA3 (route forced only to fix which kernel is compared; no sort at
    these batch sizes), the FlashMLA route, and the ``vllm-fa3-mla`` route against vLLM's
    own FA3 MLA call (``peer:vllm-fa3-mla``, as FLASH_ATTN_MLA makes it per layer)."""
    import triton.testing

    for shape in HOST_SHAPES:
        case = make_case(shape, seed=99, device=device)
        cache = case.caches[0]
        kernels = {k.name: k for k in plugin_kernels(case)}
        for route, label in (("flashinfer-fa3", "peer:flashinfer-fa3"),
                             ("flashmla", "flashmla"), ("vllm-fa3-mla", "vllm-fa3-mla")):
            k = kernels[label]
            if k.call is None:
                continue
            dec, out = k.obj, k.out
            r = dec.route
            assert r.name == route and not getattr(r, "_sorted", False)
            if route == "vllm-fa3-mla":
                peer = vllm_fa3_mla_peer(case)
                if peer.call is None:
                    continue
                bare = peer.call
            elif route == "flashinfer-fa3":
                def bare(c, r=r, out=out, q=case.query):
                    r._wrapper.run(query=q, kv_cache=c, out=out)
            else:
                q4 = case.query.view(case.batch.batch_size, 1, -1, D)
                out4 = out.view(case.batch.batch_size, 1, -1, DC)

                # FlashMLA's op on the route's schedule (the decoder's warm-up fills it).
                def bare(c, q4=q4, out4=out4, r=r):
                    r._decode(q4, c.unsqueeze(-2), DC, r._seq_lens, r._block_table, SCALE,
                              False, *r._schedule.buffers, out4)
            res = {}
            for name, fn in (("decoder", lambda c, k=k: k.call(c)), ("bare", bare)):
                for _ in range(50):
                    fn(cache)
                torch.cuda.synchronize()
                n = 1000
                t0 = time.perf_counter()
                for _ in range(n):
                    fn(cache)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                res[f"{name}_host_us"] = (t1 - t0) / n * 1e6
                for reps in (1, 10):
                    g = torch.cuda.CUDAGraph()
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
                        for _ in range(reps):
                            fn(cache)
                    torch.cuda.synchronize()
                    ms = triton.testing.do_bench(g.replay, warmup=10, rep=60,
                                                 return_mode="median")
                    res[f"{name}_graph{reps}_us"] = ms * 1e3 / reps
            writer.writerow(dict(shape=case.name, route=route,
                                 **{k2: f"{v:.2f}" for k2, v in res.items()}))
            print(f"host {case.name} {route}: " + ", ".join(f"{k2} {v:.2f}"
                                                            for k2, v in res.items()))
        del case
        torch.cuda.empty_cache()


def prewarm_jit() -> None:
    """Compile FlashInfer's MLA modules in parallel processes (about 20 s each)."""
    code = ("import torch,sys;from flashinfer.mla._batch_mla._backends._fa_common import "
            "get_batch_mla_module as g;b,kv=sys.argv[1],getattr(torch,sys.argv[2]);"
            "q=torch.float16 if sys.argv[2]=='float16' else torch.bfloat16;"
            "g(b,q,kv,q,torch.int32,512,64,False)")
    procs = [subprocess.Popen([sys.executable, "-c", code, be, dt])
             for be in ("fa3", "fa2") for dt in ("bfloat16", "float8_e4m3fn", "float16")]
    for p in procs:
        p.wait()


def main() -> None:
    global COPY_BPS, EXTRA_ROUTES, ROUNDS, SPLITK_CONFIGS, SUSTAIN_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    ap.add_argument("--quick", action="store_true", help="8 representative shapes only")
    ap.add_argument("--noise", action="store_true", help="time the quick shapes a second time")
    ap.add_argument("--host", action="store_true", help="measure host-side dispatch cost")
    ap.add_argument("--threshold", action="store_true",
                    help="only the shapes around the SM90 policy's 16k threshold")
    ap.add_argument("--sweep", action="store_true",
                    help="only time launch configurations of the plugin's Triton kernel")
    ap.add_argument("--shapes", type=str, default=None,
                    help="comma-separated indices into FULL (instead of the full grid)")
    ap.add_argument("--no-prewarm", action="store_true")
    ap.add_argument("--no-grid", action="store_true", help="skip the fixed grid")
    ap.add_argument("--random", type=str, default=None,
                    help="comma-separated seeds of random shape sets (random-SEED.csv)")
    ap.add_argument("--random-count", type=int, default=40)
    ap.add_argument("--shape-list", type=Path, action="append", default=[],
                    help="a file of 'CASE_SEED SHAPE' lines, timed as a random set "
                         "(list-NAME.csv); may be given more than once")
    ap.add_argument("--random-request-rows", type=int_range, default=None, metavar="LO-HI",
                    help="keep the random shapes with LO to HI query rows per request "
                         "(heads x q_len) out of the --random-count drawn")
    ap.add_argument("--random-batches", type=int_range, default=None, metavar="LO-HI",
                    help="keep the random shapes of LO to HI requests out of those drawn")
    ap.add_argument("--random-rows", type=int_range, default=None, metavar="LO-HI",
                    help="keep the random shapes of LO to HI query rows in all (requests x "
                         "heads x q_len) out of those drawn")
    ap.add_argument("--train", type=int, default=0,
                    help="bf16 random shapes timed on the policy's routes only (train.csv)")
    ap.add_argument("--train-seed", type=int, default=101)
    ap.add_argument("--kv", choices=("both", BF, F8), default="both",
                    help="cache dtypes of the random sets")
    ap.add_argument("--graph-only", action="store_true",
                    help="bf16 shapes (of the grid unless --no-grid, and of the random sets): "
                         "only the CUDA-graph decoder, the two routes its rule picks between "
                         "and vLLM's calls of those kernels")
    ap.add_argument("--extra-routes", default="",
                    help="comma-separated plugin routes to time forced on every shape "
                         "(route:NAME rows; a summary of each against the best peer)")
    ap.add_argument("--splitk-configs", default="",
                    help="semicolon-separated STAGES,CTAS_PER_SM,MIN_TILES[,FUSE_MAX_SPLITS] "
                         "launch configurations of the CUDA split-KV kernel to time on every "
                         "shape")
    ap.add_argument("--query-parts", action="store_true",
                    help="hand the plugin's decoder 16-bit queries in vLLM's two parts "
                         "(latent, rope) and let vLLM's FLASHMLA peer concatenate them, as "
                         "in the engine (decode_kernels.QUERY_PARTS); default: one "
                         "576-wide query for every kernel, as runs 1-218")
    ap.add_argument("--sustain", type=float, default=0.0, metavar="S",
                    help="replay each graph for S seconds before timing it (the clock an "
                         "engine's seconds of work leave; bench_decode.SUSTAIN_S)")
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="time each shape's kernels in N rounds, the order rotated each "
                         "round, and keep each kernel's median (bench_decode.ROUNDS); 1: "
                         "once each, one after another, as runs 1-220")
    ap.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                    help="FP8 shapes of the grid (--shapes) and random sets only: the plugin "
                         "against vLLM's FLASHMLA FP8, timed alternately ROUNDS times each "
                         "(paired.csv)")
    args = ap.parse_args()
    EXTRA_ROUTES = tuple(r for r in args.extra_routes.split(",") if r)
    decode_kernels.QUERY_PARTS = args.query_parts
    SUSTAIN_S = args.sustain
    ROUNDS = max(1, args.rounds)
    if SUSTAIN_S:
        print(f"every graph replayed for {SUSTAIN_S:g} s before it is timed (--sustain)",
              flush=True)
    if args.query_parts:
        print("queries in vLLM's two parts (--query-parts)", flush=True)
    SPLITK_CONFIGS = tuple(tuple(int(v) for v in c.split(","))
                           for c in args.splitk_configs.split(";") if c)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    t_start = time.time()
    if not args.no_prewarm:
        prewarm_jit()
        print(f"prewarm done in {time.time() - t_start:.0f} s", flush=True)
    ceil = ceilings(device)
    COPY_BPS = ceil["copy_GBps"] * 1e9
    with open(args.out / "ceilings.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gpu", "torch", "copy_GBps", "bf16_matmul_TFLOPs"])
        w.writerow([torch.cuda.get_device_name(), torch.__version__,
                    f"{ceil['copy_GBps']:.0f}", f"{ceil['bf16_matmul_TFLOPs']:.0f}"])
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul "
          f"{ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    if args.sweep:
        with open(args.out / "sweep.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["shape", "block_n", "num_warps",
                                                   "num_stages", "ctas_per_sm", "us",
                                                   "pct_copy", "rel_err", "status"])
            writer.writeheader()
            sweep_triton(device, writer)
        print(f"sweep total {time.time() - t_start:.0f} s")
        return
    if args.paired:
        paired_fp8(args, device, t_start)
        return
    fields = ["pass_no", "shape", "heads", "batch", "ctx", "lens", "q_len", "kv", "block",
              "kv_tokens", "max_len", "spread", "bytes", "flops", "kernel", "status", "us",
              "pct_copy", "tflops", "rel_err"]
    summary: list = []
    shapes = THRESHOLD if args.threshold else QUICK if args.quick else FULL
    if args.shapes:
        shapes = [FULL[int(i)] for i in args.shapes.split(",")]
    grid_mode = "graph" if args.graph_only else "grid"
    if args.graph_only:
        shapes = [shape for shape in shapes if shape[5] == BF]
    shapes_log = open(args.out / "shapes.jsonl", "w")  # noqa: SIM115
    if not args.no_grid:
        with open(args.out / "decode.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for shape in shapes:
                idx = FULL.index(shape) if shape in FULL else 100 + THRESHOLD.index(shape)
                bench_shape(shape, idx, device, writer, 1, summary, grid_mode, shapes_log)
                f.flush()
                print(f"[{time.time() - t_start:.0f}s] {summary[-1][1]} done", flush=True)
            if args.noise:
                for shape in QUICK:
                    bench_shape(shape, FULL.index(shape), device, writer, 2, summary)
                    f.flush()
    if args.graph_only:
        args.kv = BF
    sets = [(f"random-{s}", random_set(int(s), args.random_count, keep=args.kv,
                                       request_rows=args.random_request_rows,
                                       batches=args.random_batches,
                                       rows=args.random_rows),
             "graph" if args.graph_only else "random")
            for s in (args.random.split(",") if args.random else [])]
    sets += [(f"list-{path.stem}", read_shape_list(path),
              "graph" if args.graph_only else "random") for path in args.shape_list]
    if args.train:
        sets.append((f"train-{args.train_seed}",
                     random_set(args.train_seed, args.train, (BF,)), "train"))
    for label, seeded_shapes, mode in sets:
        with open(args.out / f"{label}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for case_seed, shape in seeded_shapes:
                bench_shape(shape, case_seed, device, writer, 1,
                            summary if mode != "train" else [], mode, shapes_log)
                f.flush()
                shapes_log.flush()
            print(f"[{time.time() - t_start:.0f}s] {label}: {len(seeded_shapes)} shapes done",
                  flush=True)
    shapes_log.close()
    if args.host:
        with open(args.out / "host.csv", "w", newline="") as f:
            cols = ["shape", "route"] + [f"{a}_{b}" for a in ("decoder", "bare")
                                         for b in ("host_us", "graph1_us", "graph10_us")]
            writer = csv.DictWriter(f, fieldnames=cols)
            writer.writeheader()
            host_overhead(device, writer)
    print(f"\n{'pass':4} {'shape':32} {'plugin us':>9} {'%copy':>6} {'best peer':>24} "
          f"{'us':>8} {'ratio':>6}")
    for pass_no, name, _times, plugin, (peer, peer_us), nbytes in summary:
        pct = 100 * nbytes / (plugin * 1e-6) / COPY_BPS if plugin else float("nan")
        ratio = peer_us / plugin if plugin and peer_us else float("nan")
        print(f"{pass_no:4} {name:32} {plugin or float('nan'):9.1f} {pct:6.1f} "
              f"{peer!s:>24} {peer_us or float('nan'):8.1f} {ratio:6.2f}")
    for name in [f"route:{r}" for r in EXTRA_ROUTES] + [
            splitk_label(*c) for c in SPLITK_CONFIGS]:
        print_route_summary(name, summary)
    print(f"total {time.time() - t_start:.0f} s; pid {os.getpid()}")


def print_route_summary(name: str, summary: list) -> None:
    """Per shape: ``name``'s time, % of the copy ceiling and best-peer time / its time
    (> 1: faster than every peer); then the worst and the geometric mean."""
    print(f"\n{name}: {'shape':32} {'us':>8} {'%copy':>6} {'best peer':>24} {'us':>8} "
          f"{'peer/this':>9}")
    ratios = []
    for _pass_no, shape, times, _plugin, (peer, peer_us), nbytes in summary:
        us = times.get(name)
        if us is None or not peer_us:
            continue
        ratios.append(peer_us / us)
        pct = 100 * nbytes / (us * 1e-6) / COPY_BPS
        print(f"{shape:32} {us:8.1f} {pct:6.1f} {peer!s:>24} {peer_us:8.1f} "
              f"{ratios[-1]:9.3f}")
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"{name}: {len(ratios)} shapes, worst {min(ratios):.3f}, best "
              f"{max(ratios):.3f}, geomean {geo:.3f} (best peer / this)")


def paired_fp8(args, device, t_start: float) -> None:
    """``--paired``: FP8 grid shapes (``--shapes``) and FP8 random shapes, plugin against
    FLASHMLA FP8 timed alternately; prints each set's worst and geometric-mean ratio."""
    sets = []
    if args.shapes:
        grid = [FULL[int(i)] for i in args.shapes.split(",")]
        sets.append(("grid", [(FULL.index(x), x) for x in grid if x[5] == F8]))
    sets += [(f"random-{s}", random_set(int(s), args.random_count, keep=F8))
             for s in (args.random.split(",") if args.random else [])]
    summary: list = []
    with open(args.out / "paired.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=PAIRED_FIELDS)
        writer.writeheader()
        for label, shapes in sets:
            for idx, shape in shapes:
                bench_paired(shape, idx, device, writer, args.paired, label, summary)
                f.flush()
            print(f"[{time.time() - t_start:.0f}s] {label}: {len(shapes)} shapes done",
                  flush=True)
    print(f"\n{'set':10} {'shape':32} {'plugin us':>9} {'peer us':>8} {'peer/plugin':>11} "
          "identical")
    for label, name, ours, theirs, identical in summary:
        print(f"{label:10} {name:32} {ours:9.2f} {theirs:8.2f} {theirs / ours:11.3f} "
              f"{identical}")
    for label in dict.fromkeys(r[0] for r in summary):
        ratios = [r[3] / r[2] for r in summary if r[0] == label]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        print(f"{label}: {len(ratios)} shapes, peer/plugin worst {min(ratios):.3f}, "
              f"geomean {geo:.3f}, outputs identical "
              f"{sum(r[4] for r in summary if r[0] == label)}/{len(ratios)}")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
