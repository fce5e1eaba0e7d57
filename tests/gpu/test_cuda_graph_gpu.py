"""CUDA-graph capture of one decode layer per route, replayed after re-planning.

The graph is captured once with persistent query/output buffers; then the decoder is
re-planned with new lengths and block tables of the same batch size (and the same number
of query rows), the query buffer refilled, and the replay must equal an eager run and the
float64 reference. ``persistent``: the batches' block table and lengths live in two
buffers that each step rewrites in place (``DecodeBatch.persistent``, as vLLM's model runner
keeps them), which routes then read directly instead of staging copies.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder, fa3_splits, policy
from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import fa3_splits_offset

from mla_cases import (
    GPU_TEST_MARKS,
    KERNEL_ROUTES,
    bounds,
    capture_decode,
    errors,
    in_fixed_buffers,
    make_problem,
    reference,
    route_skip_reason,
    with_host_lengths,
)

pytestmark = GPU_TEST_MARKS

ROUTES = KERNEL_ROUTES
FP8 = torch.float8_e4m3fn
#: The KV (and query) dtype each route is captured with: FP8-only routes read FP8.
KV_DTYPE = {"flashmla-fp8": FP8}
WIDTH = 64  # blocks per block-table row, fixed as in vLLM

# (id, steps of (seq_lens, q_lens)); every step has the same batch and row count.
SCHEDULES = [
    ("q1", [([300, 64, 2000, 1], 1), ([4000, 65, 1, 129], 1), ([64, 64, 64, 64], 1)]),
    ("q-ragged", [([300, 64, 2000, 4], [1, 2, 2, 1]), ([4000, 65, 2, 129], [2, 1, 1, 2]),
                  ([70, 3000, 64, 2], [1, 1, 2, 2])]),
]


@pytest.mark.parametrize("persistent", [False, True], ids=["staged", "persistent"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_graph_replay_after_replan(route: str, schedule: tuple, persistent: bool) -> None:
    device = torch.device("cuda")
    dtype = KV_DTYPE.get(route, torch.bfloat16)
    steps = [
        make_problem(heads=16, block=64, lens=lens, q_lens=q, dtype=dtype, kv_dtype=dtype,
                     device=device, width=WIDTH, spec_q_len=2)
        for lens, q in schedule[1]
    ]
    first = steps[0]
    if (reason := route_skip_reason(route, first.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(first.spec, device, max_batch_size=4, route=route, cuda_graph=True)
    # One cache for all steps (as in an engine): each step writes its blocks into it.
    num_blocks = max(p.kv_cache.shape[0] for p in steps)
    cache = torch.randn(num_blocks, 64, 576, device=device).to(dtype)
    query = first.query.clone()
    out = torch.empty(query.shape[0], 16, 512, dtype=torch.bfloat16, device=device)

    step_batch = in_fixed_buffers(first.batch) if persistent else (lambda batch: batch)

    decoder.plan(step_batch(first.batch))
    graph = capture_decode(decoder, query, cache, out)

    # Re-planned steps alternate between device-only and host-carrying lengths.
    for i, p in enumerate(steps[1:] + steps[:1]):
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        decoder.plan(step_batch(with_host_lengths(p.batch) if i % 2 == 0 else p.batch))
        query.copy_(p.query)
        p.query = query
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all(), "replay left NaN poison in the output"
        eager = decoder.run(query, cache)
        rel_eager, _ = errors(out, eager.to(torch.float64))
        assert rel_eager < 1e-3, f"replay differs from eager run: {rel_eager:.2e}"
        rel, worst = errors(out, reference(p, route))
        print(f"[graph {route} {schedule[0]} persistent={persistent}] rel={rel:.2e} "
              f"max={worst:.2e} "
              f"vs-eager={rel_eager:.1e}")
        rel_bound, max_bound = bounds(p)
        assert rel < rel_bound and worst < max_bound, (rel, worst)


# (heads, batch, the route the SM90 CUDA-graph rule runs on an H100 and an H200 alike): 8
# heads at one token (Kimi-K2 at TP8, DeepSeek-V3 at TP16) take vLLM's FA3 MLA up to 32
# requests and the plugin's CUDA split-KV kernel for 33-1024 where nvcc builds it (on an
# H100 from its band bound 49, FA3 longest first below, hence b56 here); 16 heads
# vLLM's FA3 MLA up to the card's band bound (49 on the H100, 65 on the H200: longest
# first from 33) and the split-KV kernel from it; 32 heads vLLM's FA3 MLA, longest first
# from 33 on (docs/benchmarks.md; tests/test_policy.py checks this table against the
# H200's rule).
POLICY_CASES = [(8, 12, "vllm-fa3-mla"), (8, 56, "cuda-splitk"), (8, 160, "cuda-splitk"),
                (16, 12, "vllm-fa3-mla"), (16, 40, "vllm-fa3-mla"), (16, 80, "cuda-splitk"),
                (16, 128, "cuda-splitk"), (32, 40, "vllm-fa3-mla")]


@pytest.mark.parametrize("heads,batch,route", POLICY_CASES,
                         ids=[f"h{h}-b{b}" for h, b, _ in POLICY_CASES])
def test_policy_decoder_replays_its_batch_size_route(heads: int, batch: int,
                                                     route: str) -> None:
    """The decoder an engine builds (no forced route, ``cuda_graph=True``) on an H100/H200:
    the route its policy picks for the captured batch size, replayed after re-planning with
    new lengths, against the float64 reference. The block table and lengths live in fixed
    buffers rewritten each step (``DecodeBatch.persistent``), as the vLLM glue hands them."""
    replay_policy_decoder(heads, batch, route)


# (heads, batch): the band's batches below a raised ``SPLITK_GRAPH_MIN_BATCH`` (97, addendum
# 13's candidate): vLLM's FA3 kernel longest first, its plan on the GPU.
RAISED_BAND_CASES = [(8, 40), (16, 48), (16, 96)]


@pytest.mark.parametrize("heads,batch", RAISED_BAND_CASES,
                         ids=[f"h{h}-b{b}" for h, b in RAISED_BAND_CASES])
def test_band_below_a_raised_splitk_bound_replays_on_fa3_with_the_gpu_plan(
        monkeypatch, heads: int, batch: int) -> None:
    """The same decoder with the band moved below 97 requests: its batches run the
    ``vllm-fa3-mla`` route planned on the GPU (``policy.vllm_fa3_device_plan``), replayed
    after re-planning against float64."""
    monkeypatch.setattr(policy, "SPLITK_GRAPH_MIN_BATCH", 97)
    monkeypatch.setattr(policy, "SPLITK_GRAPH_BANDS_BY_GPU", {})
    monkeypatch.setattr(policy, "VLLM_FA3_DEVICE_PLAN", False)
    decoder = replay_policy_decoder(heads, batch, "vllm-fa3-mla")
    assert decoder.route._device_plan(batch)


def test_band_bound_raised_for_this_gpu_by_name_replays_on_fa3_with_the_gpu_plan(
        monkeypatch) -> None:
    """The bound raised for this GPU alone (``SPLITK_GRAPH_BANDS_BY_GPU`` keyed by its
    name, as a card's measured bound would be): the decoder and its route read the name
    from the device, so a 48-request band batch runs ``vllm-fa3-mla`` planned on the GPU,
    replayed after re-planning against float64."""
    name = torch.cuda.get_device_name()
    monkeypatch.setattr(policy, "SPLITK_GRAPH_BANDS_BY_GPU", {name: policy.BandBound(97)})
    monkeypatch.setattr(policy, "VLLM_FA3_DEVICE_PLAN", False)
    assert policy.SPLITK_GRAPH_MIN_BATCH < 48
    decoder = replay_policy_decoder(16, 48, "vllm-fa3-mla")
    assert decoder.route._device_plan(48)


def test_rows_bound_replays_on_each_side(monkeypatch) -> None:
    """The shipped rows bound (``VLLM_FA3_GRAPH_MAX_ROWS``, 4096 since both Hopper cards read
    it, runs 314 and 329): 128 heads at one token and 32 requests (4096 query rows) run
    ``vllm-fa3-mla``; with an entry of 3072 for this GPU alone
    (``VLLM_FA3_GRAPH_MAX_ROWS_BY_GPU`` keyed by its name) ``flashmla``; each replayed after
    re-planning against float64."""
    name = torch.cuda.get_device_name()
    assert policy.vllm_fa3_graph_max_rows(name) >= 128 * 32, "no 4096-row bound for this GPU"
    replay_policy_decoder(128, 32, "vllm-fa3-mla")
    monkeypatch.setattr(policy, "VLLM_FA3_GRAPH_MAX_ROWS_BY_GPU", {name: 3072})
    replay_policy_decoder(128, 32, "flashmla")


def test_this_gpus_own_band_bound_replays_on_each_side(monkeypatch) -> None:
    """This GPU's entry in ``SPLITK_GRAPH_BANDS_BY_GPU`` as shipped (the H100's 49 for 8-16
    rows, the H200's 65 for 9-16): a 16-row batch just below the bound runs
    ``vllm-fa3-mla`` planned on the GPU, one at the bound ``cuda-splitk``, and an 8-row
    batch below it ``cuda-splitk`` where the entry leaves 8 rows there (the H200), else
    ``vllm-fa3-mla`` planned on the GPU (the H100); each replayed after re-planning against
    float64."""
    monkeypatch.setattr(policy, "VLLM_FA3_DEVICE_PLAN", False)
    name = torch.cuda.get_device_name()
    band = policy.band_bound(name)
    if band is None:
        pytest.skip(f"no band bound of its own for {name}")
    below = band.min_batch - 1
    decoder = replay_policy_decoder(16, below, "vllm-fa3-mla")
    assert decoder.route._device_plan(below)
    replay_policy_decoder(16, band.min_batch, "cuda-splitk")
    if band.fewest_request_rows > 8:
        replay_policy_decoder(8, below, "cuda-splitk")
    else:
        assert replay_policy_decoder(8, below, "vllm-fa3-mla").route._device_plan(below)


def replay_policy_decoder(heads: int, batch: int, route: str) -> MLADecoder:
    """``test_policy_decoder_replays_its_batch_size_route``'s steps; returns the decoder."""
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip("the SM90 CUDA-graph rule")
    gen = torch.Generator(device="cpu").manual_seed(heads * 1000 + batch)
    steps = []
    for _ in range(3):
        lens = torch.randint(1, 3000, (batch,), generator=gen).tolist()
        steps.append(make_problem(heads=heads, block=64, lens=lens, q_lens=1,
                                  dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                  device=device, width=WIDTH))
    first = steps[0]
    if (reason := route_skip_reason(route, first.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(first.spec, device, max_batch_size=256, cuda_graph=True)
    num_blocks = max(p.kv_cache.shape[0] for p in steps)
    cache = torch.empty(num_blocks, 64, 576, dtype=torch.bfloat16, device=device)
    cache[: first.kv_cache.shape[0]].copy_(first.kv_cache)
    query = first.query.clone()
    out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device=device)
    engine_batch = in_fixed_buffers(first.batch)

    decoder.plan(engine_batch(first.batch))
    assert decoder.route.name == route, decoder.choice.explain()
    graph = capture_decode(decoder, query, cache, out)
    for p in steps[1:] + steps[:1]:
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        decoder.plan(engine_batch(p.batch))
        assert decoder.route.name == route
        query.copy_(p.query)
        p.query = query
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rel, worst = errors(out, reference(p, route))
        print(f"[policy graph h{heads} b{batch} {route}] rel={rel:.2e} max={worst:.2e}")
        rel_bound, max_bound = bounds(p)
        assert rel < rel_bound and worst < max_bound, (rel, worst)
    return decoder


# (heads, q_len, steps of seq_lens): the vllm-fa3-mla route's launch reserves room for 64 KV
# splits at up to 1024 query rows (32 above) and plans more than vLLM's 32 only for long
# requests with query tiles of at most 32 rows; captured on short requests, replays of long
# ones must still fit what the capture reserved. h64 q4 fills 64-row tiles: 64 reserved, 32
# planned. h128 b9 is 1152 rows: 32 reserved, long requests planned at 32.
WIDE_SPLIT_CASES = [
    (16, 1, [[300, 64], [43_000, 9000], [20_000, 20_000], [5000, 100], [64, 64]]),
    (64, 4, [[500, 40, 8], [30_000, 2000, 64], [12_000, 12_000, 12_000]]),
    (128, 1, [[300] * 9, [40_000] + [700] * 8, [300] * 9]),
]


def replay_vllm_fa3_split_steps(heads: int, q_len: int, schedule: list[list[int]],
                                label: str, host_lengths: bool,
                                balanced: bool | None = False,
                                length_order: bool = False,
                                device_plan: bool = False) -> list[int]:
    """Captures the ``vllm-fa3-mla`` route under CUDA graphs on ``schedule[0]``, replays the
    other steps (each checked against float64, the launch's reserve unchanged) and returns
    the cap each step planned; skips where the route cannot run. ``host_lengths``: the batch
    carries the host's exact lengths, as vLLM's builder passes them. ``balanced``: the
    route's balanced splits forced on or off (``None``: its rule); when on, each replayed
    step's split vector in FA3's metadata must be ``fa3_splits.balanced_splits``' plan (of
    the lengths longest first with ``length_order``: the route then launches FA3 on the
    requests in that order); ``device_plan``: the length order and the splits computed
    on the GPU (``kernels.length_order``, ``kernels.fa3_split_plan``), outside the captured
    graph as in the engine."""
    device = torch.device("cuda")
    width = max(max(lens) for lens in schedule) // 64 + 1
    steps = [make_problem(heads=heads, block=64, lens=lens, q_lens=q_len,
                          dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device=device,
                          width=width, spec_q_len=q_len)
             for lens in schedule]
    first = steps[0]
    if (reason := route_skip_reason("vllm-fa3-mla", first.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(first.spec, device, max_batch_size=max(16, len(schedule[0])),
                         route="vllm-fa3-mla", cuda_graph=True)
    decoder.route.balanced_splits_override = balanced
    decoder.route.length_order_override = length_order
    decoder.route.device_plan_override = device_plan
    num_blocks = max(p.kv_cache.shape[0] for p in steps)
    cache = torch.empty(num_blocks, 64, 576, dtype=torch.bfloat16, device=device)
    cache[: first.kv_cache.shape[0]].copy_(first.kv_cache)
    query = first.query.clone()
    out = torch.empty(query.shape[0], heads, 512, dtype=torch.bfloat16, device=device)
    fixed = in_fixed_buffers(first.batch)

    def engine_batch(batch):
        batch = fixed(batch)
        return replace(batch, seq_lens_host=batch.seq_lens.cpu()) if host_lengths else batch

    decoder.plan(engine_batch(first.batch))
    reserved = decoder.route._reserved_splits
    graph = capture_decode(decoder, query, cache, out)
    planned = []
    for p in steps[1:]:
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        decoder.plan(engine_batch(p.batch))
        assert decoder.route._reserved_splits == reserved
        planned.append(decoder.route._planned_splits)
        if balanced:
            lens = p.batch.seq_lens.cpu().numpy().astype("int64")
            if length_order:
                lens = -numpy.sort(-lens, kind="stable")
            want = fa3_splits.balanced_splits(
                -(-lens // 64), -(-heads * q_len // 64), reserved,
                torch.cuda.get_device_properties(device).multi_processor_count,
                heads * q_len / -(-heads * q_len // 64), decoder.route._planned_splits)
            assert want is not None, "a balanced-split case must change FA3's plan"
            b, at = len(lens), fa3_splits_offset(len(lens))
            written = decoder.route._scheduler[at: at + b].cpu().tolist()
            assert written == want.tolist()
            planned[-1] = max(written)
        query.copy_(p.query)
        p.query = query
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rel, worst = errors(out, reference(p, "vllm-fa3-mla"))
        print(f"[{label} h{heads} q{q_len} {p.batch.seq_lens.tolist()[:4]}] "
              f"reserved={reserved} planned={planned[-1]} rel={rel:.2e} max={worst:.2e}")
        rel_bound, max_bound = bounds(p)
        assert rel < rel_bound and worst < max_bound, (rel, worst)
    return planned


@pytest.mark.parametrize("heads,q_len,schedule", WIDE_SPLIT_CASES,
                         ids=[f"h{h}-q{q}-b{len(s[0])}" for h, q, s in WIDE_SPLIT_CASES])
def test_vllm_fa3_graph_replays_long_requests_with_wide_splits(heads, q_len, schedule):
    planned = replay_vllm_fa3_split_steps(heads, q_len, schedule, "wide splits",
                                          host_lengths=False)
    # 64 where the launch reserved it and the query tiles hold <= 32 rows (16 heads).
    assert max(planned) == (64 if heads * q_len * len(schedule[0]) <= 1024
                            and heads * q_len <= 32 else 32)


# (heads, q_len, steps of seq_lens, the cap each replayed step plans): for short requests
# that FA3 would cut into one-KV-tile splits, the route plans half the longest request's KV
# tiles from enough work (``policy.vllm_fa3_halved_splits``, on the host's exact lengths as
# vLLM's builder passes them under CUDA graphs); captured on other lengths, replays of
# halved and unhalved steps must both match float64.
HALVED_SPLIT_CASES = [
    (64, 2, [[300, 300], [1920, 1920], [1920, 100], [1216, 1216]], [15, 32, 10]),
    (16, 1, [[64] * 4, [1920] * 4, [1216, 1216, 1920, 1800], [1920, 1900, 1850, 1800]],
     [15, 32, 15]),
    (64, 1, [[100] * 9, [512] * 9, [1920] + [128] * 8], [4, 32]),
]


@pytest.mark.parametrize("heads,q_len,schedule,expected", HALVED_SPLIT_CASES,
                         ids=[f"h{h}-q{q}-b{len(s[0])}" for h, q, s, _ in HALVED_SPLIT_CASES])
def test_vllm_fa3_graph_replays_halved_splits(heads, q_len, schedule, expected):
    assert replay_vllm_fa3_split_steps(heads, q_len, schedule, "halved splits",
                                       host_lengths=True) == expected


# (heads, q_len, steps of seq_lens): batches whose work FA3's formula cuts into a few tiles
# more than one wave of SMs (``fa3_splits.SPILL``); the route's balanced splits (written
# over FA3's in its scheduler metadata) must replay to the float64 answer, uniform and
# ragged, one and several query tokens (FA3's causal metadata then holds one more vector).
# Steps a token longer within the same KV tiles (17_659, 19_001 / 12_001): the same splits
# again, written over FA3's fresh metadata.
BALANCED_SPLIT_CASES = [
    (32, 1, [[300] * 28, [17_658] * 28, [17_659] * 28, [19_000, 12_000] * 14,
             [19_001, 12_001] * 14]),
    (64, 3, [[500] * 21, [4374, 2000, 3000] * 7]),
    (64, 1, [[64] * 102, [387, 120, 300, 250] * 25 + [390, 390]]),
]


@pytest.mark.parametrize("device_plan", [False, True], ids=["host", "gpu-plan"])
@pytest.mark.parametrize("heads,q_len,schedule", BALANCED_SPLIT_CASES,
                         ids=[f"h{h}-q{q}-b{len(s[0])}" for h, q, s in BALANCED_SPLIT_CASES])
def test_vllm_fa3_graph_replays_balanced_splits(heads, q_len, schedule, device_plan):
    planned = replay_vllm_fa3_split_steps(heads, q_len, schedule, "balanced splits",
                                          host_lengths=True, balanced=True,
                                          device_plan=device_plan)
    assert all(p >= 1 for p in planned)


def test_split_planner_equals_host_plan_on_gpu():
    """The GPU planner of FA3's splits, compiled (float64 spans, no FMA contraction),
    against the host's ``fa3_splits.balanced_splits`` on 2000 random steps
    (tests/fa3_split_plan_cases.py; the CPU interpreter runs 400 in CI)."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fa3_split_plan_cases import check_steps

    outcomes = check_steps(2000, seed=21, device=torch.device("cuda"))
    print(f"[split planner] 2000 steps equal to the host's plan: {dict(outcomes)}")
    assert outcomes["replanned past the band"] >= 50 and outcomes["kept"] >= 200


def test_length_order_equals_stable_argsort_on_gpu():
    """``kernels.length_order`` compiled, against numpy's stable argsort longest first on
    300 random batches (the CPU interpreter runs 12 in CI)."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fa3_split_plan_cases import check_length_order

    ties = check_length_order(300, seed=22, device=torch.device("cuda"))
    print(f"[length order] 300 batches equal to numpy's, {ties} with ties")
    assert ties >= 100


# (heads, q_len, steps of seq_lens): the route launching FA3 on the requests longest first
# (``cu_seqlens_q`` permuted, ``seqused_q`` given) must replay to the float64 answer in the
# caller's row order: ragged and uniform, one and several query tokens, batches in
# ``balanced_splits``' bands (its plan then made on the sorted lengths) and a long one.
LENGTH_ORDER_CASES = [
    (16, 1, [[300] * 40, [9000, 200, 4000, 64, 12_000] * 8, [700] * 40], False),
    (64, 2, [[500] * 33, [100, 5000, 2500] * 11], False),
    (32, 1, [[300] * 28, [19_000, 12_000] * 14], True),
    (128, 1, [[1000] * 70, list(range(100, 7100, 100))], False),
    # 32-row tiles over requests of 2.4-4.8k tokens, 1.45 waves of FA3's own plan: past
    # SPILL, inside NARROW_SPILL (``fa3_splits.spill_band``).
    (32, 1, [[4800, 2400] * 64, [4000, 2600] * 64, [2400, 4800] * 64], True),
    # 257-1024 requests of <= 32 query rows, which the graph rule gives this route
    # (``policy.VLLM_FA3_GRAPH_ORDERED_MAX_BATCH``).
    (8, 4, [[700] * 300, [2500, 300, 900] * 100], False),
    # Near-equal lengths FA3 cuts in two, 1.58 waves at 64-row tiles: past the band, the
    # route runs every request unsplit in one wave (``fa3_splits.one_wave_past_band``).
    (64, 2, [[300] * 52, [757] * 52, [700, 757, 690] * 17 + [757]], True),
    # Past ONE_WAVE_MAX_SPREAD (the longest 1.8x the mean) over short requests (at most
    # ONE_WAVE_SHORT_MAX_TILES): one wave too.
    (64, 2, [[600] * 66, [2560] * 26 + [640] * 40, [2500, 600, 2450, 610, 620] * 13 + [2400]],
     True),
    # Longer requests (60 KV tiles) at spreads of 1.61-1.62, under ONE_WAVE_MAX_SPREAD: one wave.
    (128, 1, [[1400] * 66, [3840] * 26 + [1408] * 40, [3800, 1400, 1390, 3790, 1420] * 13
              + [1380]], True),
]


@pytest.mark.parametrize("device_plan", [False, True], ids=["host", "gpu-plan"])
@pytest.mark.parametrize("heads,q_len,schedule,balanced", LENGTH_ORDER_CASES,
                         ids=[f"h{h}-q{q}-b{len(s[0])}" for h, q, s, _ in LENGTH_ORDER_CASES])
def test_vllm_fa3_graph_replays_length_order(heads, q_len, schedule, balanced, device_plan):
    replay_vllm_fa3_split_steps(heads, q_len, schedule, "length order", host_lengths=True,
                                balanced=balanced, length_order=True,
                                device_plan=device_plan)


# (heads, q_len, seq_lens): FA3's own per-request splits, read where the route writes its
# balanced ones, must be FA3's formula (``fa3_splits.fa3_splits``): the check that the
# route's offset and the formula model the FA3 build vLLM ships.
FA3_LAYOUT_CASES = [
    (16, 1, [17_000, 3000, 9_500, 40_000, 777]),
    (32, 2, [12_345] * 12),
    (128, 1, [2_000, 61_000, 5_000]),
    (8, 4, [30_000, 250, 30_000, 9_999, 1_234, 45_678, 3_210]),
]


@pytest.mark.parametrize("heads,q_len,lens", FA3_LAYOUT_CASES,
                         ids=[f"h{h}-q{q}-b{len(lens)}" for h, q, lens in FA3_LAYOUT_CASES])
def test_vllm_fa3_metadata_holds_fa3_formula_splits(heads, q_len, lens):
    device = torch.device("cuda")
    p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16, device=device, width=max(lens) // 64 + 1,
                     spec_q_len=q_len)
    if (reason := route_skip_reason("vllm-fa3-mla", p.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(p.spec, device, max_batch_size=16, route="vllm-fa3-mla",
                         cuda_graph=True)
    route = decoder.route
    route.balanced_splits_override = False
    route.planned_splits_override = 32
    decoder.plan(with_host_lengths(p.batch))
    b, at = len(lens), fa3_splits_offset(len(lens))
    written = route._scheduler[at: at + b].cpu().tolist()
    kv_tiles = torch.tensor(lens, dtype=torch.int64).add(63).div(64, rounding_mode="floor")
    want = fa3_splits.fa3_splits(kv_tiles.numpy(), -(-heads * q_len // 64), 32,
                                 torch.cuda.get_device_properties(device).multi_processor_count)
    print(f"[fa3 layout h{heads} q{q_len}] metadata {route._metadata.shape[0]} entries, "
          f"splits {written}, formula {want.tolist()}")
    assert written == want.tolist()
