"""Every executable decode route against the float64 reference on the GPU.

Routes that cannot serve a case on this GPU are skipped with the route's own reason
(e.g. TRTLLM-gen on anything but SM100/SM103). Output is poisoned with NaN before each call.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_mla_plugin.ops import KVScales, MLADecoder
from trtllm_mla_plugin.ops.routes.base import module_available

from mla_cases import (
    FP8,
    GPU_TEST_MARKS,
    KERNEL_ROUTES,
    bounds,
    errors,
    make_problem,
    reference,
    route_skip_reason,
    with_host_lengths,
)

pytestmark = GPU_TEST_MARKS

ROUTES = KERNEL_ROUTES
BF16, FP16 = torch.bfloat16, torch.float16

# (id, heads, block, seq_lens, q_lens (int: uniform, list: ragged), q dtype, kv dtype, scales)
CASES = [
    ("h16-b64-edges", 16, 64, [1, 63, 64, 65, 128, 1000], 1, BF16, BF16, None),
    ("h128-b64-32k", 128, 64, [32768, 5], 1, BF16, BF16, None),
    ("h32-b32-edges", 32, 32, [1, 31, 32, 33, 4096], 1, BF16, BF16, None),
    ("h64-b64-fp16-ragged-len", 64, 64, [100, 7999, 2048, 513, 64, 3001, 1, 640], 1, FP16,
     FP16, None),
    ("h24-b64-odd-heads", 24, 64, [777, 64, 2000], 1, BF16, BF16, None),
    ("h20-b32-odd-heads-fp16", 20, 32, [96, 1500], 1, FP16, FP16, None),
    ("h16-q2-uniform", 16, 64, [100, 64, 3000, 65], 2, BF16, BF16, None),
    ("h16-q-ragged", 16, 64, [64, 500, 129, 4], [1, 3, 4, 2], BF16, BF16, None),
    ("h128-b32-q4-uniform", 128, 32, [1000, 2048], 4, BF16, BF16, None),
    ("h20-q-ragged-fp16", 20, 64, [300, 1024], [3, 1], FP16, FP16, None),
    ("h64-b64-q3-fp16", 64, 64, [129, 4097], 3, FP16, FP16, None),
    ("fp8-h16-unit", 16, 64, [1, 64, 65, 3000], 1, BF16, FP8, KVScales()),
    ("fp8-h16-kv-scaled", 16, 64, [1, 64, 65, 3000], 1, BF16, FP8, KVScales(1.0, 0.5, 0.5)),
    ("fp8-h128-k-ne-v", 128, 64, [2000, 63], 1, BF16, FP8, KVScales(1.0, 0.25, 0.125)),
    ("fp8-h16-q-ragged", 16, 32, [500, 70], [2, 4], BF16, FP8, KVScales(2.0, 0.5, 0.5)),
    ("fp8-h16-q-ragged-p64", 16, 64, [500, 70, 64, 1000], [2, 4, 1, 3], BF16, FP8,
     KVScales(2.0, 0.5, 0.5)),
    ("fp8-h128-q4-uniform", 128, 64, [4, 1000, 4096], 4, BF16, FP8, KVScales(1.0, 0.5, 0.5)),
    # FP8 queries (as vLLM hands them over, quantised with q_scale)
    ("fp8-query-h16", 16, 64, [1, 64, 65, 3000], 1, FP8, FP8, KVScales(0.5, 0.25, 0.25)),
    ("fp8-query-h64-q2-k-ne-v", 64, 64, [100, 2000, 2], 2, FP8, FP8, KVScales(1.0, 0.5, 0.25)),
]


@pytest.mark.parametrize("lengths", ["device", "host"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_route_matches_reference(route: str, case: tuple, lengths: str) -> None:
    """``lengths="host"``: the batch also carries exact host copies of its lengths, as
    vLLM's builder passes them (FlashInfer routes then plan without a device sync)."""
    _, heads, block, lens, q_lens, dtype, kv_dtype, scales = case
    device = torch.device("cuda")
    torch.manual_seed(hash((route, case[0])) % 2**31)
    p = make_problem(heads=heads, block=block, lens=lens, q_lens=q_lens, dtype=dtype,
                     kv_dtype=kv_dtype, scales=scales or KVScales(), device=device)
    if (reason := route_skip_reason(route, p.spec, device)) is not None:
        pytest.skip(reason)
    if lengths == "host":
        p.batch = with_host_lengths(p.batch)
    decoder = MLADecoder(p.spec, device, max_batch_size=len(lens), route=route)
    decoder.plan(p.batch)
    out = torch.full((p.query.shape[0], heads, 512), float("nan"), dtype=decoder.output_dtype,
                     device=device)
    result = decoder.run(p.query, p.kv_cache, out=out, scales=p.scales)
    torch.cuda.synchronize()
    assert result.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "some output elements were not written (NaN poison left)"
    rel, worst = errors(out, reference(p, route))
    rel_bound, max_bound = bounds(p)
    print(f"[{route} {case[0]}] rel={rel:.2e} max={worst:.2e}")
    assert rel < rel_bound and worst < max_bound, (rel, worst)


def test_second_step_replans() -> None:
    """Plan/run twice on one decoder with different batches: no state leaks between steps."""
    device = torch.device("cuda")
    p1 = make_problem(heads=16, block=64, lens=[1000, 70, 3], q_lens=1, dtype=BF16,
                      kv_dtype=BF16, device=device)
    p2 = make_problem(heads=16, block=64, lens=[5, 4000], q_lens=1, dtype=BF16, kv_dtype=BF16,
                      device=device)
    decoder = MLADecoder(p1.spec, device, max_batch_size=3)
    for p in (p1, p2, p1):
        decoder.plan(p.batch)
        out = decoder.run(p.query, p.kv_cache)
        rel, _ = errors(out, reference(p))
        assert rel < 1e-2, (decoder.route_name, rel)


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("route", ["flashinfer-fa3", "flashinfer-fa2", "vllm-fa3-mla"])
def test_host_lengths_plan_without_device_sync(route: str, cuda_graph: bool) -> None:
    """With exact host lengths FlashInfer's planner must not wait for the GPU (torch's sync
    debug mode raises on any synchronising call), also with the length sort on."""
    device = torch.device("cuda")
    p = make_problem(heads=16, block=64, lens=[3000, 5, 700, 64, 1, 2500], q_lens=1,
                     dtype=BF16, kv_dtype=BF16, device=device)
    if (reason := route_skip_reason(route, p.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(p.spec, device, max_batch_size=6, route=route, cuda_graph=cuda_graph)
    batch = with_host_lengths(p.batch)
    decoder.plan(batch)  # first plan: JIT load and wrapper set-up may synchronise
    for sort in (False, True):
        decoder.sort_override = sort
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            decoder.plan(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out = decoder.run(p.query, p.kv_cache)
        rel, _ = errors(out, reference(p, route))
        assert rel < 1e-2, (sort, rel)


@pytest.mark.parametrize("split", [False, True], ids=["concatenated", "parts"])
@pytest.mark.parametrize("heads", [16, 128])
def test_short_prefills_on_their_decode_route(heads: int, split: bool) -> None:
    """Steps whose decode part carries short prefills (``ops.small_prefill_choice``, up to
    512 new tokens per request over cached context or none, mixed with one-token decodes):
    the route, planned as the engine's builder plans it, against float64; the query whole
    or as vLLM's (latent, rope) parts."""
    from trtllm_mla_plugin.ops import platform_of, small_prefill_choice, small_prefill_spec

    device = torch.device("cuda")
    torch.manual_seed(heads + split)
    lens = [700, 512, 37, 2100, 1, 4096, 64]
    q_lens = [200, 512, 37, 1, 1, 63, 64]
    p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_lens, dtype=BF16,
                     kv_dtype=BF16, device=device)
    choice = small_prefill_choice(p.spec, platform_of(device))
    if choice is None:
        pytest.skip("no short-prefill route on this GPU (SM90 with vLLM's FA3 MLA only)")
    decoder = MLADecoder(small_prefill_spec(p.spec), device, max_batch_size=8,
                         route=choice.name)
    decoder.plan(with_host_lengths(p.batch))
    query = (p.query[..., :512], p.query[..., 512:]) if split else p.query
    out = torch.full((p.query.shape[0], heads, 512), float("nan"), dtype=BF16, device=device)
    decoder.run(query, p.kv_cache, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    rel, worst = errors(out, reference(p, choice.name))
    rel_bound, max_bound = bounds(p)
    print(f"[{choice.name} short prefills h{heads} split={split}] rel={rel:.2e} max={worst:.2e}")
    assert rel < rel_bound and worst < max_bound, (rel, worst)


def _vllm_join():
    """vLLM's fused join where vLLM (a CUDA build) is importable here, else ``None``."""
    if not module_available("vllm"):
        return None
    from trtllm_mla_plugin.vllm_backend.query_join import vllm_query_join
    return vllm_query_join


PARTS_CASES = [c for c in CASES if c[0] in ("h16-b64-edges", "h16-q-ragged",
                                               "h128-b32-q4-uniform", "h64-b64-q3-fp16")]


@pytest.mark.parametrize("sort", [False, True], ids=["caller-order", "sorted"])
@pytest.mark.parametrize("join", ["decoder", "vllm"])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", PARTS_CASES, ids=[c[0] for c in PARTS_CASES])
def test_route_matches_reference_on_vllms_query_parts(route: str, case: tuple,
                                                      join: str, sort: bool) -> None:
    """The query as vLLM's MLA layer hands it over (the latent part contiguous, the rope
    part a strided view of the projection's 128 + 64 columns a head): read apart by the
    routes that take the parts (``takes_split_query``: vLLM's FA3, FlashInfer's FA2/FA3,
    also length-sorted), joined for the others by the decoder's own copies or by vLLM's
    ``concat_mla_q``."""
    _, heads, block, lens, q_lens, dtype, kv_dtype, _ = case
    device = torch.device("cuda")
    torch.manual_seed(hash((route, case[0], join)) % 2**31)
    p = make_problem(heads=heads, block=block, lens=lens, q_lens=q_lens, dtype=dtype,
                     kv_dtype=kv_dtype, device=device)
    if (reason := route_skip_reason(route, p.spec, device)) is not None:
        pytest.skip(reason)
    query_join = None
    if join == "vllm":
        make = _vllm_join()
        query_join = make(p.spec) if make is not None else None
        if query_join is None:
            pytest.skip("vLLM's concat_mla_q is not importable here")
    projected = torch.randn(p.query.shape[0], heads, 128 + 64, dtype=dtype, device=device)
    projected[..., 128:] = p.query[..., 512:]
    parts = (p.query[..., :512].contiguous(), projected[..., 128:])
    decoder = MLADecoder(p.spec, device, max_batch_size=len(lens), route=route,
                         query_join=query_join)
    if sort and not decoder.route.supports_length_sort:
        pytest.skip(f"{route} does not sort by length")
    decoder.sort_override = sort
    decoder.plan(with_host_lengths(p.batch))
    out = torch.full((p.query.shape[0], heads, 512), float("nan"), dtype=decoder.output_dtype,
                     device=device)
    decoder.run(parts, p.kv_cache, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "some output elements were not written (NaN poison left)"
    rel, worst = errors(out, reference(p, route))
    rel_bound, max_bound = bounds(p)
    print(f"[{route} {case[0]} parts, {join} join, sort={sort}] rel={rel:.2e} "
          f"max={worst:.2e}")
    assert rel < rel_bound and worst < max_bound, (rel, worst)
