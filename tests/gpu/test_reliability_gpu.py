"""Reliability of the executable GPU decode routes: randomized sweeps, caches of more than
2**32 elements, CUDA graphs captured at several batch sizes and replayed over padded batches.

Everything is checked against the float64 ``mla_decode_reference`` (``mla_cases.reference``)
on fresh random inputs, with NaN-poisoned outputs. Routes this GPU cannot run are skipped
with the route's own eligibility reason. A failing sweep configuration names its route and
seed; rerun some with ``MLA_GPU_SWEEP_SEEDS=3,17 pytest tests/gpu/test_reliability_gpu.py``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, KVScales, MLADecoder

from mla_cases import (
    FP8,
    GPU_TEST_MARKS,
    HEAD_DIM,
    KERNEL_ROUTES,
    KV_LORA_RANK,
    Problem,
    bounds,
    capture_decode,
    errors,
    make_problem,
    reference,
    route_skip_reason,
    with_host_lengths,
)

pytestmark = GPU_TEST_MARKS

ALL_ROUTES = KERNEL_ROUTES
#: Routes that serve FP8 caches only: their graph tests run FP8 (query and cache, as vLLM
#: hands them over) where the others run bf16.
FP8_ONLY = {"flashmla-fp8"}
BF16, FP16 = torch.bfloat16, torch.float16
SOFTMAX_SCALE = 1.0 / (192**0.5)
SWEEP_CONFIGS = 520
SPEC_GROUP = 4  # consecutive seeds share a DecodeSpec, hence one decoder that is re-planned
# The Triton route compiles one kernel variant per tile shape and dtype (seconds each):
# fewer configurations, more of them per layer spec.
SWEEP_CONFIGS_BY_ROUTE = {"triton-balanced": 200}
SPEC_GROUP_BY_ROUTE = {"triton-balanced": 8}
SWEEP_MAX_BATCH = 32


def _spec(heads: int = 16, block: int = 64, dtype: torch.dtype = BF16,
          kv_dtype: torch.dtype = BF16, max_q_len: int = 1) -> DecodeSpec:
    return DecodeSpec(num_heads=heads, kv_lora_rank=KV_LORA_RANK, rope_dim=HEAD_DIM - 512,
                      block_size=block, q_dtype=dtype, kv_dtype=kv_dtype,
                      softmax_scale=SOFTMAX_SCALE, max_q_len=max_q_len)


def _skip_unless_eligible(route: str, spec: DecodeSpec) -> None:
    if (reason := route_skip_reason(route, spec, torch.device("cuda"))) is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def _prebuild_flashinfer_modules() -> None:
    """Compile the six FA2/FA3 MLA modules the tests use in one parallel ninja run (JIT
    would build them one after another, ~20 s each). Best effort: on any failure the
    routes JIT-compile on first use as usual."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return
    try:
        from flashinfer.jit import build_jit_specs, gen_batch_mla_module

        specs = [
            gen_batch_mla_module(backend, q, kv, q, torch.int32, 512, 64, False)
            for backend in ("fa3", "fa2")
            for q, kv in ((BF16, BF16), (FP16, FP16), (BF16, FP8))
        ]
        build_jit_specs(specs)
    except Exception as exc:  # only a speed-up
        print(f"FlashInfer prebuild skipped: {type(exc).__name__}: {exc}")


def _poisoned(tokens: int, heads: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((tokens, heads, KV_LORA_RANK), float("nan"), dtype=dtype, device="cuda")


# ---- randomized sweep ----------------------------------------------------------------------


def _sweep_problem(route: str, seed: int) -> tuple[Problem, str]:
    """One random configuration for ``route``: the layer (heads, block, dtypes, spec's
    max_q_len) from ``random.Random`` of ``seed // SPEC_GROUP``, the batch from that of
    ``seed``, the data from a CUDA generator seeded with ``seed``."""
    group = SPEC_GROUP_BY_ROUTE.get(route, SPEC_GROUP)
    spec_rng = random.Random(f"{route}/spec/{seed // group}")
    rng = random.Random(f"{route}/{seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    paged_fp8 = route.startswith("flashinfer") or route in ("triton-balanced", "cuda-splitk")
    blocks = {"flashmla": [64], "flashmla-fp8": [64], "triton-balanced": [16, 32, 64, 64, 64],
              "cuda-splitk": [32, 64, 64, 64]}
    block = spec_rng.choice(blocks.get(route, [1, 16, 32, 64, 64, 64]))
    heads = spec_rng.choice([1, 2, 3, 4, 7, 8, 13, 16, 16, 20, 24, 32, 33, 64, 100, 127, 128])
    kinds = ["bf16", "bf16", "fp16", "fp8"] if paged_fp8 else ["bf16", "bf16", "fp16"]
    if route in FP8_ONLY:
        kinds = ["fp8", "fp8-query"]  # bf16 query quantised by the route, or an FP8 query
    kind = spec_rng.choice(kinds)
    spec_q = spec_rng.choice([1, 1, 2, 3, 4, 5])
    dtype = FP16 if kind == "fp16" else FP8 if kind == "fp8-query" else BF16
    kv_dtype = FP8 if kind.startswith("fp8") else dtype
    scales = KVScales()
    if kind.startswith("fp8"):
        scales = KVScales(q_scale=rng.choice([1.0, 0.5, 2.0]), k_scale=2.0 ** rng.uniform(-3, 1),
                          v_scale=2.0 ** rng.uniform(-3, 1))
    batch = rng.choice([1, 1, 2, 3, 4, 5, 8, 8, 16, SWEEP_MAX_BATCH])
    q_mode = rng.choice(["1", "1", "uniform", "ragged"]) if spec_q > 1 else "1"
    q_lens: int | list[int]
    if q_mode == "ragged":
        q_lens = [rng.randint(1, spec_q) for _ in range(batch)]
    else:
        q_lens = 1 if q_mode == "1" else rng.randint(2, spec_q)
    per_req = q_lens if isinstance(q_lens, list) else [q_lens] * batch
    kinds_len = ["one", "edge", "edge", "rand", "rand", "rand", "long"]
    lens = []
    for n in per_req:
        kind_len = rng.choice(kinds_len)
        length = {
            "one": 1,
            "edge": rng.choice([block - 1, block, block + 1, 2 * block]),
            "rand": rng.randint(1, 1500),
            "long": rng.randint(2000, 8192),
        }[kind_len]
        lens.append(max(length, n, 1))
    # Bound the float64 reference's gather (tokens x max_len x 576 doubles) to ~1.2 GB.
    cap = max(2 * block + 1, 250_000 // sum(per_req))
    lens = [max(min(L, cap), n) for L, n in zip(lens, per_req, strict=True)]
    need = max(-(-L // block) for L in lens)
    width = need + rng.choice([0, 0, 1, 7])
    p = make_problem(heads=heads, block=block, lens=lens, q_lens=q_lens, dtype=dtype,
                     kv_dtype=kv_dtype, scales=scales, device=torch.device("cuda"),
                     width=width, spec_q_len=spec_q, generator=gen)
    table_mode = rng.choice(["scattered", "shared-prefix", "random-reuse"])
    table = p.batch.block_table
    blocks_of = [-(-L // block) for L in lens]
    if table_mode == "shared-prefix":
        # Prefix caching: request i starts with k blocks of an earlier request j.
        for i in range(1, batch):
            j = rng.randrange(i)
            k = rng.randint(0, min(blocks_of[i], blocks_of[j]))
            table[i, :k] = table[j, :k]
    elif table_mode == "random-reuse":
        few = max(1, sum(blocks_of) // 3)
        table.copy_(torch.randint(0, few, table.shape, generator=gen, device="cuda"))
    desc = (f"{route} seed={seed} heads={heads} block={block} {kind} scales={scales} "
            f"lens={lens} q_lens={q_lens} spec_q={spec_q} width={width} table={table_mode}")
    return p, desc


def _sweep_seeds() -> list[int]:
    """Seeds 0, 1, ... until SWEEP_CONFIGS configurations ran (configurations the route
    refuses do not count), or the seeds named in MLA_GPU_SWEEP_SEEDS."""
    forced = os.environ.get("MLA_GPU_SWEEP_SEEDS")
    return [int(s) for s in forced.split(",")] if forced else list(range(4 * SWEEP_CONFIGS))


@pytest.mark.parametrize("route", ["flashinfer-fa3", "flashinfer-fa2", "flashmla",
                                   "flashmla-fp8", "vllm-fa3-mla", "triton-balanced",
                                   "cuda-splitk"])
def test_randomized_sweep(route: str) -> None:
    device = torch.device("cuda")
    _skip_unless_eligible(route, _spec(kv_dtype=FP8 if route in FP8_ONLY else BF16))
    seeds = _sweep_seeds()
    configs = SWEEP_CONFIGS_BY_ROUTE.get(route, SWEEP_CONFIGS)
    ran, refused, failures = 0, 0, []
    worst: dict[str, tuple[float, float]] = {}
    decoders: dict[DecodeSpec, MLADecoder] = {}  # one per layer config, re-planned per batch
    for seed in seeds:
        if ran >= configs and "MLA_GPU_SWEEP_SEEDS" not in os.environ:
            break
        p, desc = _sweep_problem(route, seed)
        if route_skip_reason(route, p.spec, device) is not None:
            refused += 1  # e.g. FA's causal-tile hazard: the route refuses, as it should
            continue
        try:
            decoder = decoders.get(p.spec)
            if decoder is None:
                decoder = MLADecoder(p.spec, device, max_batch_size=SWEEP_MAX_BATCH, route=route)
                decoders[p.spec] = decoder
            # Odd seeds carry exact host lengths (FlashInfer's sync-free planning path).
            decoder.plan(with_host_lengths(p.batch) if seed % 2 else p.batch)
            out = _poisoned(p.query.shape[0], p.spec.num_heads, decoder.output_dtype)
            decoder.run(p.query, p.kv_cache, out=out, scales=p.scales)
            torch.cuda.synchronize()
            ran += 1
            if not torch.isfinite(out).all():
                failures.append(f"{desc}: NaN/inf left in the output")
                continue
            rel, mx = errors(out, reference(p, route))
        except Exception as exc:  # report the seed; stop on a dead context
            failures.append(f"{desc}: {type(exc).__name__}: {exc}")
            if "CUDA" in str(exc) or "cuda" in type(exc).__name__.lower():
                break
            continue
        key = str(p.spec.q_dtype).replace("torch.", "") + ("/fp8" if p.spec.fp8_kv else "")
        old = worst.get(key, (0.0, 0.0))
        worst[key] = (max(old[0], rel), max(old[1], mx))
        rel_bound, max_bound = bounds(p)
        if not (rel < rel_bound and mx < max_bound):
            failures.append(f"{desc}: rel={rel:.2e} max={mx:.2e} over {rel_bound}/{max_bound}")
    summary = ", ".join(f"{k} rel<={r:.1e} max<={m:.1e}" for k, (r, m) in sorted(worst.items()))
    print(f"[sweep {route}] {ran} configurations run ({len(decoders)} layer specs), "
          f"{refused} refused by eligibility, {len(failures)} failed; {summary}")
    assert not failures, f"{len(failures)} failures of {route}:\n" + "\n".join(failures[:25])
    if "MLA_GPU_SWEEP_SEEDS" not in os.environ:
        assert ran >= min(500, configs), f"only {ran} configurations ran ({refused} refused)"


# ---- caches of more than 2**31 and 2**32 elements --------------------------------------------

BIG_BLOCKS = 120_000  # x 64 x 576 = 4.42e9 elements > 2**32; bf16: 8.8 GB, FP8: 4.4 GB
ELEMS_PER_BLOCK = 64 * HEAD_DIM


def _big_table(gen: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Requests whose blocks sit near the start, across the 2**31- and 2**32-element
    offsets, and at the very end of the cache, shuffled."""
    marks = [2**31 // ELEMS_PER_BLOCK, 2**32 // ELEMS_PER_BLOCK]
    pool = list(range(0, 12)) + [b for m in marks for b in range(m - 6, m + 7)]
    pool += list(range(BIG_BLOCKS - 12, BIG_BLOCKS))
    pool_t = torch.tensor(pool)[torch.randperm(len(pool), generator=gen)]
    lens = [64 * 14 + 5, 64 * 12, 64 * 9 + 63, 64 * 6 + 1, 65, 1]  # 48 blocks of 49 in pool
    table = torch.zeros(len(lens), 16, dtype=torch.int32)
    start = 0
    for i, L in enumerate(lens):
        n = -(-L // 64)
        table[i, :n] = pool_t[start : start + n]
        table[i, n:] = BIG_BLOCKS - 1
        start += n
    return lens, table


@pytest.fixture(scope="module")
def big_bf16_cache() -> torch.Tensor:
    return torch.empty(BIG_BLOCKS, 64, HEAD_DIM, dtype=BF16, device="cuda").normal_()


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("route", ALL_ROUTES)
def test_big_cache(route: str, kv_kind: str, request: pytest.FixtureRequest) -> None:
    kv_dtype = FP8 if kv_kind == "fp8" else BF16
    spec = _spec(kv_dtype=kv_dtype)
    _skip_unless_eligible(route, spec)
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(4242)
    lens, table = _big_table(gen)
    if kv_kind == "fp8":
        cache = torch.empty(BIG_BLOCKS, 64, HEAD_DIM, dtype=BF16, device=device)
        cache = cache.normal_().to(FP8)
        scales = KVScales(1.0, 0.5, 0.25)
    else:
        cache, scales = request.getfixturevalue("big_bf16_cache"), KVScales()
    assert cache.numel() > 2**32
    table = table.to(device)
    batch = DecodeBatch(block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32,
                        device=device), max_seq_len=max(lens))
    query = torch.randn(len(lens), 16, HEAD_DIM, device=device).to(BF16)
    decoder = MLADecoder(spec, device, max_batch_size=len(lens), route=route)
    decoder.plan(batch)
    out = _poisoned(len(lens), 16, decoder.output_dtype)
    decoder.run(query, cache, out=out, scales=scales)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "NaN poison left in the output"
    # Reference over the addressed blocks only: gather them, remap the table.
    used = torch.unique(table)
    assert int(used.max()) == BIG_BLOCKS - 1 and int(used.min()) < 12
    picked = cache.view(torch.uint8)[used].view(kv_dtype)  # byte gather: FP8 too
    small = Problem(spec, DecodeBatch(
        block_table=torch.searchsorted(used, table).to(torch.int32), seq_lens=batch.seq_lens,
        max_seq_len=batch.max_seq_len), query, picked, scales)
    rel, mx = errors(out, reference(small, route))
    rel_bound, max_bound = bounds(small)
    print(f"[big cache {route} {kv_kind}] {cache.numel()} elements, rel={rel:.2e} max={mx:.2e}")
    assert rel < rel_bound and mx < max_bound, (rel, mx)


# ---- CUDA graphs: several batch sizes, padded batches, replays -------------------------------

GRAPH_SIZES = (1, 8, 32)
GRAPH_WIDTH = 128  # blocks per block-table row (8192 tokens), fixed as in vLLM
GRAPH_CACHE_BLOCKS = 4096


def _graph_step(rng: random.Random, gen: torch.Generator, graph_b: int, q_len: int,
                pad_len: int, pad: bool) -> tuple[int, list[int], torch.Tensor]:
    """A step for a graph of ``graph_b`` rows: ``real`` requests with random lengths on
    distinct random blocks, then (``pad`` and ``graph_b > 1``) padding rows of length
    ``pad_len`` on block 0, as vLLM pads a batch up to the captured size."""
    real = rng.randint(1, graph_b - 1) if pad and graph_b > 1 else graph_b
    lens = [rng.choice([q_len, 63, 64, 65, rng.randint(q_len, 3000), rng.randint(q_len, 8192)])
            for _ in range(real)]
    lens = [max(L, q_len) for L in lens]
    while sum(-(-L // 64) for L in lens) > GRAPH_CACHE_BLOCKS - 1:
        lens = [max(L // 2, q_len) for L in lens]
    perm = torch.randperm(GRAPH_CACHE_BLOCKS - 1, generator=gen) + 1  # block 0: padding's
    table = torch.zeros(graph_b, GRAPH_WIDTH, dtype=torch.int32)
    start = 0
    for i, L in enumerate(lens):
        n = -(-L // 64)
        table[i, :n] = perm[start : start + n]
        start += n
    return real, lens + [pad_len] * (graph_b - real), table


def _graph_replays(route: str, q_len: int, pad_len: int, sizes: tuple[int, ...],
                   steps: int, always_pad: bool = False) -> None:
    device = torch.device("cuda")
    dtype = FP8 if route in FP8_ONLY else BF16
    spec = _spec(dtype=dtype, kv_dtype=dtype, max_q_len=q_len)
    _skip_unless_eligible(route, spec)
    rng = random.Random(f"graph/{route}/{q_len}/{pad_len}")
    gen = torch.Generator().manual_seed(len(route) * 100 + q_len * 10 + pad_len)
    decoder = MLADecoder(spec, device, max_batch_size=max(sizes), route=route, cuda_graph=True)
    staging = torch.empty(GRAPH_CACHE_BLOCKS, 64, HEAD_DIM, dtype=BF16, device=device)
    cache = staging.normal_().to(dtype)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def batch_of(lens: list[int], table: torch.Tensor, host: bool = False) -> DecodeBatch:
        lens_t = torch.tensor(lens, dtype=torch.int32)
        return DecodeBatch(block_table=table.to(device), seq_lens=lens_t.to(device),
                           max_seq_len=GRAPH_WIDTH * 64, max_q_len=q_len,
                           seq_lens_host=lens_t if host else None)

    for b in sizes:  # capture every size first, as vLLM does at start-up
        _, lens, table = _graph_step(rng, gen, b, q_len, pad_len, pad=False)
        query = torch.randn(b * q_len, 16, HEAD_DIM, device=device).to(dtype)
        out = _poisoned(b * q_len, 16, BF16)
        decoder.plan(batch_of(lens, table))
        graph = capture_decode(decoder, query, cache, out)
        graphs[b] = (graph, query, out)

    order = [sizes[i % len(sizes)] for i in range(steps)]
    rng.shuffle(order)
    padded_steps = 0
    for step, b in enumerate(order):
        graph, query, out = graphs[b]
        pad = always_pad or step % 2 == 0
        real, lens, table = _graph_step(rng, gen, b, q_len, pad_len, pad)
        padded_steps += real < b
        cache.copy_(staging.normal_())  # fresh data every step: stale reads cannot match
        batch = batch_of(lens, table, host=step % 3 == 1)  # padded and unpadded steps
        decoder.plan(batch)
        query.copy_(torch.randn(query.shape, device=device))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = real * q_len
        tag = f"[graph {route} q{q_len} pad{pad_len} step {step}: b={b} real={real}]"
        assert torch.isfinite(out[:rows]).all(), f"{tag} NaN poison left in real rows"
        replayed = out[:rows].clone()
        eager = decoder.run(query, cache)
        torch.cuda.synchronize()
        rel_eager, _ = errors(replayed, eager[:rows].to(torch.float64))
        real_problem = Problem(spec, DecodeBatch(
            block_table=batch.block_table[:real], seq_lens=batch.seq_lens[:real],
            max_seq_len=max(lens[:real]), max_q_len=q_len), query[:rows], cache, KVScales())
        rel, mx = errors(replayed, reference(real_problem, route))
        print(f"{tag} rel={rel:.2e} max={mx:.2e} vs-eager={rel_eager:.1e}")
        assert rel_eager < 1e-3, f"{tag} replay differs from eager: {rel_eager:.2e}"
        rel_bound, max_bound = bounds(real_problem)
        assert rel < rel_bound and mx < max_bound, (tag, rel, mx)
        if pad_len > 0:  # padding rows with a key are well defined too
            pad_ref = reference(Problem(spec, batch, query, cache, KVScales()), route)
            rel_all, _ = errors(out, pad_ref)
            assert rel_all < rel_bound, (tag, "padded rows", rel_all)
    assert padded_steps > 0, "no step exercised a padded batch"


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("route", ALL_ROUTES)
def test_graphs_several_sizes_padded_replays(route: str, q_len: int) -> None:
    _graph_replays(route, q_len, pad_len=q_len, sizes=GRAPH_SIZES, steps=12)


# Last in the file on purpose: a kernel that faults on an empty request would take the
# CUDA context (and every later test) with it.
@pytest.mark.parametrize("route", ALL_ROUTES)
def test_graph_padding_rows_with_zero_length(route: str) -> None:
    """vLLM pads graph batches with seq_len 0 rows (block table row 0): real rows must still
    be right. The padding rows' output is undefined."""
    _graph_replays(route, 1, pad_len=0, sizes=(8,), steps=4, always_pad=True)
