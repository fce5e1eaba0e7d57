"""The CUDA split-KV kernel (route ``cuda-splitk``) where its schedule is stressed: one long
request cut over every CTA, the largest batch it takes, query rows that do not fill a
16-row tile, every launch configuration, and seeded random batches of up to 512 requests
(the route sweep in test_reliability_gpu.py stops at 32); FP8 caches read with the bf16
query at bf16-query accuracy (issue 11's aim: <= 5e-3 relative); the fused-merge build
(``SplitKConfig.fuse_max_splits``, not the default), replayed in a CUDA graph; heavy
requests (one long request among short ones, cut into more than ``HEAVY_SPLITS`` pieces)
merged by the combine's helper CTAs. All against float64."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from trtllm_mla_plugin.ops import KVScales
from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import (
    HEAVY_SPLITS,
    SplitKConfig,
    SplitKMLADecode,
)

from mla_cases import (
    GPU_TEST_MARKS,
    bounds,
    errors,
    make_problem,
    reference,
    route_skip_reason,
    splitk_decode,
    vllm_query_parts,
)

pytestmark = GPU_TEST_MARKS
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
#: FP8 cache read with the 16-bit query: the error the bf16 routes have (issue 11's aim).
FP8_BF16_QUERY_REL = 5e-3
DEVICE = torch.device("cuda") if torch.cuda.is_available() else None


def _check(p, config: SplitKConfig | None = None, tag: str = "") -> tuple[float, float]:
    if (reason := route_skip_reason("cuda-splitk", p.spec, DEVICE)) is not None:
        pytest.skip(reason)
    out = splitk_decode(p, config)
    assert torch.isfinite(out).all(), f"{tag}: rows left unwritten (NaN poison)"
    rel, worst = errors(out, reference(p))
    rel_bound, max_bound = bounds(p)
    if p.spec.fp8_kv:
        rel_bound = FP8_BF16_QUERY_REL
    print(f"[splitk {tag}] rel={rel:.2e} max={worst:.2e}")
    assert rel < rel_bound and worst < max_bound, (tag, rel, worst)
    return rel, worst


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 4)])
def test_one_request_cut_over_every_cta(heads: int, q_len: int) -> None:
    p = make_problem(heads=heads, block=64, lens=[65536 if heads == 16 else 16384],
                     q_lens=q_len, dtype=BF16, kv_dtype=BF16, device=DEVICE)
    _check(p, tag=f"h{heads} q{q_len} one long request")


@pytest.mark.parametrize("heads,q_len,heavy", [(16, 1, 1), (16, 1, 6), (8, 2, 3), (32, 1, 2),
                                              (128, 2, 1)])
def test_heavy_requests_merged_by_helpers(heads: int, q_len: int, heavy: int) -> None:
    """``heavy`` long requests among 90 short ones, each cut into more than HEAVY_SPLITS
    pieces (the first four merged by helper CTAs, any more by their own items): float64,
    and bit-equal to the build without helpers (the same sums in the same order)."""
    rng = random.Random(heads * 10 + heavy)
    lens = [rng.randint(200, 2500) for _ in range(90)]
    for i in rng.sample(range(len(lens)), heavy):
        lens[i] = 32768
    p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=BF16,
                     kv_dtype=BF16, device=DEVICE)
    if (reason := route_skip_reason("cuda-splitk", p.spec, DEVICE)) is not None:
        pytest.skip(reason)
    # The cuts follow the grid: one row group on two CTAs per SM whatever this GPU's default
    # (the H100's one CTA per SM leaves the six-request case with none over HEAVY_SPLITS).
    config = SplitKConfig(stages=2, ctas_per_sm=2) if heads * q_len <= 16 else SplitKConfig()
    kernel = SplitKMLADecode(DEVICE, heads, q_len, 64, len(lens), BF16, config)
    kernel.plan(p.batch.seq_lens)
    prefix = kernel.tile_prefix[: len(lens) + 1].tolist()
    total = prefix[-1]
    active = min(kernel.num_ctas, -(-total // kernel.config.min_tiles))

    def cta_of(tile: int) -> int:  # the kernel's cta_of
        return ((tile + 1) * active - 1) // total

    cut = [cta_of(b - 1) - cta_of(a) + 1 for a, b in itertools.pairwise(prefix)]
    assert sum(c > HEAVY_SPLITS for c in cut) >= heavy, cut  # the case is what it says
    _check(p, config, tag=f"h{heads} q{q_len} {heavy} heavy")
    with_helpers = splitk_decode(p, config)
    without = splitk_decode(p, dataclasses.replace(config, helped_requests=0))
    assert torch.equal(with_helpers, without)


def test_largest_batch_it_takes() -> None:
    rng = random.Random(1024)
    lens = [rng.randint(1, 300) for _ in range(1024)]
    p = make_problem(heads=16, block=32, lens=lens, q_lens=1, dtype=BF16, kv_dtype=BF16,
                     device=DEVICE)
    _check(p, tag="b1024")


@pytest.mark.parametrize("heads,q_len", [(8, 1), (24, 1), (20, 3), (1, 1), (33, 2)])
def test_rows_that_do_not_fill_a_tile(heads: int, q_len: int) -> None:
    dtype = FP16 if q_len == 1 else BF16
    p = make_problem(heads=heads, block=64, lens=[q_len, 64, 65, 700, 3000], q_lens=q_len,
                     dtype=dtype, kv_dtype=dtype, device=DEVICE)
    _check(p, tag=f"h{heads} q{q_len}")


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("ctas_per_sm,min_tiles", [(1, 4), (2, 1), (1, 64)])
def test_every_launch_configuration(stages: int, ctas_per_sm: int, min_tiles: int) -> None:
    p = make_problem(heads=32, block=64, lens=[5, 4000, 129, 64, 1, 9000, 333], q_lens=1,
                     dtype=BF16, kv_dtype=BF16, device=DEVICE)
    _check(p, SplitKConfig(stages=stages, ctas_per_sm=ctas_per_sm, min_tiles=min_tiles),
           tag=f"s{stages} c{ctas_per_sm} m{min_tiles}")


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_one_row_group_launches(stages: int, ctas_per_sm: int) -> None:
    """16 rows a request (one row group) at each depth and CTAs per SM: the H100's default
    is three stages at one CTA per SM, the H200's two at two (``default_launch``)."""
    p = make_problem(heads=16, block=64, lens=[5, 4000, 129, 64, 1, 9000, 333, 467, 120],
                     q_lens=1, dtype=BF16, kv_dtype=BF16, device=DEVICE)
    _check(p, SplitKConfig(stages=stages, ctas_per_sm=ctas_per_sm),
           tag=f"h16 s{stages} c{ctas_per_sm}")


@pytest.mark.parametrize("latent_layout", ["token-major", "head-major"])
@pytest.mark.parametrize("heads,q_len,kv_dtype", [(16, 1, BF16), (8, 2, BF16), (32, 1, BF16),
                                                  (16, 1, FP8)])
def test_query_parts_read_where_they_lie(heads: int, q_len: int, kv_dtype, latent_layout):
    """vLLM's two query parts read where they lie (the rope part a strided view of the
    projection's 128 + 64 columns a head; the latent part token-major, or head-major as
    vLLM's bmm leaves it where it pads heads): against float64, and bit-equal to the joined
    query."""
    p = make_problem(heads=heads, block=64, lens=[q_len, 64, 700, 3000, 129], q_lens=q_len,
                     dtype=BF16, kv_dtype=kv_dtype, device=DEVICE)
    if (reason := route_skip_reason("cuda-splitk", p.spec, DEVICE)) is not None:
        pytest.skip(reason)
    (latent, _), (rope, _) = vllm_query_parts(p.query, latent_layout)
    out = splitk_decode(p, query=(latent, rope))
    rel, worst = errors(out, reference(p))
    rel_bound, max_bound = bounds(p)
    if p.spec.fp8_kv:
        rel_bound = FP8_BF16_QUERY_REL
    assert rel < rel_bound and worst < max_bound, (rel, worst)
    assert torch.equal(out, splitk_decode(p))


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("scales", [KVScales(), KVScales(2.0, 0.5, 0.25)])
def test_fp8_cache_with_the_bf16_query(stages: int, scales: KVScales) -> None:
    p = make_problem(heads=16, block=64, lens=[1, 63, 64, 65, 700, 3000, 9000, 40], q_lens=1,
                     dtype=BF16, kv_dtype=FP8, scales=scales, device=DEVICE)
    _check(p, SplitKConfig(stages=stages), tag=f"fp8 s{stages} {scales}")


@pytest.mark.parametrize("seed", range(24))
def test_seeded_random_batches(seed: int) -> None:
    rng = random.Random(f"splitk/{seed}")
    heads = rng.choice([8, 16, 16, 32, 64, 128])
    q_len = rng.choice([1, 1, 2, 4])
    b = rng.choice([1, 7, 64, 200, 512])
    ctx = rng.choice([256, 2048, 8192])
    # Bound the float64 reference (rows x max length x 576 doubles).
    ctx = min(ctx, max(64, 400_000 // (b * q_len)))
    lens = [max(q_len, rng.randint(1, ctx)) for _ in range(b)]
    dtype = rng.choice([BF16, BF16, FP16])
    kv_dtype = FP8 if seed % 3 == 2 else dtype
    scales = KVScales(rng.choice([1.0, 2.0]), 2 ** rng.uniform(-2, 1), 2 ** rng.uniform(-2, 1))
    p = make_problem(heads=heads, block=rng.choice([32, 64]), lens=lens, q_lens=q_len,
                     dtype=dtype, kv_dtype=kv_dtype,
                     scales=scales if kv_dtype == FP8 else KVScales(), device=DEVICE)
    _check(p, tag=f"seed {seed} h{heads} q{q_len} b{b} ctx{ctx} kv {kv_dtype}")


def test_requests_without_keys_get_zeros() -> None:
    """Engines pad CUDA-graph batches with requests of length 0: their rows come out zero
    (not stale memory), the real request between them exact."""
    p = make_problem(heads=16, block=64, lens=[5, 700, 9], q_lens=1, dtype=BF16,
                     kv_dtype=BF16, device=DEVICE)
    kernel = SplitKMLADecode(DEVICE, 16, 1, 64, 3, BF16)
    lens = p.batch.seq_lens.clone()
    lens[0] = lens[2] = 0
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    out = torch.full((3, 16, 512), float("nan"), dtype=BF16, device=DEVICE)
    kernel.plan(lens)
    kernel.run(p.query, p.kv_cache, p.batch.block_table, lens, cu, out, p.spec.softmax_scale)
    torch.cuda.synchronize()
    assert (out[0] == 0).all() and (out[2] == 0).all()
    real = make_problem(heads=16, block=64, lens=[700], q_lens=1, dtype=BF16, kv_dtype=BF16,
                        device=DEVICE)
    real.query, real.kv_cache = p.query[1:2], p.kv_cache
    real.batch.block_table = p.batch.block_table[1:2]
    rel, _ = errors(out[1:2], reference(real))
    assert rel < 1e-2, rel


def test_combine_is_launched_programmatically_and_captures() -> None:
    """On SM90 the driver takes the combine's programmatic dependent launch (else every
    launch falls back to a plain one, correct but slower), and a CUDA graph captures the
    pair and replays it with the next step's lengths."""
    p = make_problem(heads=16, block=64, lens=[3000, 5, 700], q_lens=1, dtype=BF16,
                     kv_dtype=BF16, device=DEVICE)
    kernel = SplitKMLADecode(DEVICE, 16, 1, 64, 3, BF16)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    lens = p.batch.seq_lens.clone()
    out = torch.empty(3, 16, 512, dtype=BF16, device=DEVICE)

    def step() -> None:
        kernel.run(p.query, p.kv_cache, p.batch.block_table, lens, cu, out,
                   p.spec.softmax_scale)

    kernel.plan(lens)
    step()
    torch.cuda.synchronize()
    assert kernel._module.programmatic is True
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lens.copy_(torch.tensor([40, 2900, 64], dtype=torch.int32))
    kernel.plan(lens)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    p.batch.seq_lens = lens
    rel, _ = errors(out, reference(p))
    assert rel < 1e-2, rel


#: The fused-merge build: requests cut into at most this many pieces merged in the decode
#: grid by the CTA that finishes last (checked in the CPU emulator; here on the GPU, where
#: the CTAs really race for the count).
FUSED = SplitKConfig(fuse_max_splits=8)


@pytest.mark.parametrize("seed", range(12))
def test_fused_merge_on_random_batches(seed: int) -> None:
    rng = random.Random(f"splitk-fused/{seed}")
    heads, q_len = rng.choice([(16, 1), (8, 2), (16, 2), (32, 1), (128, 1)])
    b = rng.choice([3, 32, 96, 300])
    if seed % 4 == 3:  # one 16k request among short ones: cut more than 8 ways
        b = min(b, 32)
    # Bound the float64 reference (requests x longest length x 576 doubles).
    ctx = min(rng.choice([512, 4096, 32768]), max(64, 400_000 // (b * q_len)))
    lens = [max(q_len, rng.randint(1, ctx)) for _ in range(b)]
    if seed % 4 == 3:
        lens[0] = 16384
    kv_dtype = FP8 if seed % 3 == 2 else BF16
    p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=BF16,
                     kv_dtype=kv_dtype, device=DEVICE)
    _check(p, FUSED, tag=f"fused seed {seed} h{heads} q{q_len} b{b} ctx{ctx} {kv_dtype}")


def test_fused_merge_replays_in_a_cuda_graph() -> None:
    """The counters are back at zero after every launch: a captured step replayed with new
    lengths (requests cut 2-8 ways in a different pattern each time) stays exact."""
    b = 64
    p = make_problem(heads=16, block=64, lens=[2048] * b, q_lens=1, dtype=BF16,
                     kv_dtype=BF16, device=DEVICE)
    kernel = SplitKMLADecode(DEVICE, 16, 1, 64, b, BF16, FUSED)
    cu = torch.arange(b + 1, dtype=torch.int32, device=DEVICE)
    lens = p.batch.seq_lens.clone()
    out = torch.empty(b, 16, 512, dtype=BF16, device=DEVICE)
    kernel.plan(lens)
    kernel.run(p.query, p.kv_cache, p.batch.block_table, lens, cu, out, p.spec.softmax_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(p.query, p.kv_cache, p.batch.block_table, lens, cu, out,
                   p.spec.softmax_scale)
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        lens.copy_(torch.randint(1, 2049, (b,), generator=gen, dtype=torch.int32))
        kernel.plan(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        p.batch.seq_lens = lens.clone()
        rel, worst = errors(out, reference(p))
        assert rel < 1e-2 and worst < 5e-2, (rel, worst)
    assert int(kernel.merge_count.abs().sum()) == 0
