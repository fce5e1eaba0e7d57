"""CUDA-graph capture of one decode layer per route, replayed after re-planning.

The graph is captured once with persistent query/output buffers; then the decoder is
re-planned with new lengths and block tables of the same batch size (and the same number
of query rows), the query buffer refilled, and the replay must equal an eager run and the
float64 reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder, platform_of, policy
from trtllm_mla_plugin.ops.graph_branches import GraphBranches, conditional_graphs_available

from mla_cases import (
    bounds,
    capture_decode,
    errors,
    make_problem,
    reference,
    route_skip_reason,
    with_host_lengths,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROUTES = ["flashinfer-fa3", "flashmla", "flashmla-fp8", "vllm-fa3-mla", "triton-balanced",
          "flashinfer-fa2",
          "trtllm-gen", "flashinfer-cute-dsl"]
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


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_graph_replay_after_replan(route: str, schedule: tuple) -> None:
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

    decoder.plan(first.batch)
    graph = capture_decode(decoder, query, cache, out)

    # Re-planned steps alternate between device-only and host-carrying lengths.
    for i, p in enumerate(steps[1:] + steps[:1]):
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        decoder.plan(with_host_lengths(p.batch) if i % 2 == 0 else p.batch)
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
        print(f"[graph {route} {schedule[0]}] rel={rel:.2e} max={worst:.2e} "
              f"vs-eager={rel_eager:.1e}")
        rel_bound, max_bound = bounds(p)
        assert rel < rel_bound and worst < max_bound, (rel, worst)


# (heads, q_len, batch, short lengths, long lengths): the graph-branch rule picks vLLM's
# FA3 MLA kernel for the short step and FlashMLA for the long one of the same batch size.
BRANCH_CASES = [
    (16, 1, 64, 1000, 16000),
    (128, 4, 8, 500, 10000),
]


@pytest.mark.parametrize(("heads", "q_len", "b", "short", "long"), BRANCH_CASES,
                         ids=[f"h{c[0]}-q{c[1]}-b{c[2]}" for c in BRANCH_CASES])
def test_graph_branches_switch_route_between_replays(heads, q_len, b, short, long) -> None:
    """One captured graph (two layers) holds vLLM's FA3 MLA and FlashMLA behind conditional
    nodes; re-planned steps alternate between lengths that select each, and every replay
    must equal the float64 reference and an eager run of the selected route."""
    device = torch.device("cuda")
    if not conditional_graphs_available():
        pytest.skip("this torch cannot capture CUDA graph conditional nodes")
    gen = torch.Generator(device=device).manual_seed(heads + b)
    steps = []
    for i, n in enumerate((short, long, short, long)):
        lens = (torch.randint(n // 2, n + 1, (b,), generator=gen, device=device)
                if i >= 2 else torch.full((b,), n, device=device)).tolist()
        lens = [max(x, q_len) for x in lens]
        p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=torch.bfloat16,
                         kv_dtype=torch.bfloat16, device=device, width=-(-long // 64),
                         generator=gen)
        p.batch = replace(with_host_lengths(p.batch), kv_tokens=sum(lens))
        steps.append(p)
    first = steps[0]
    for name in policy.graph_branches(first.spec, platform_of(device)):
        if (reason := route_skip_reason(name, first.spec, device)) is not None:
            pytest.skip(reason)
    decoder = MLADecoder(first.spec, device, max_batch_size=b, cuda_graph=True)
    assert decoder.branch_names == ("vllm-fa3-mla", "flashmla")
    num_blocks = max(p.kv_cache.shape[0] for p in steps)
    cache = torch.zeros(num_blocks, 64, 576, device=device, dtype=torch.bfloat16)
    query = first.query.clone()
    outs = [torch.empty(query.shape[0], heads, 512, dtype=torch.bfloat16, device=device)
            for _ in range(2)]
    decoder.plan(first.batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(query, cache, out=outs[0])  # eager warm-up: runs both branch routes
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:  # two layers, as an engine step has many
            decoder.run(query, cache, out=out)

    expected = ["vllm-fa3-mla", "flashmla", "vllm-fa3-mla", "flashmla"]
    for p, route in zip(steps, expected, strict=True):
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        decoder.plan(p.batch)
        assert decoder.route.name == route
        query.copy_(p.query)
        p.query = query
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(p)
        eager = decoder.run(query, cache).to(torch.float64)
        for out in outs:
            assert torch.isfinite(out).all(), f"{route}: replay left NaN poison"
            rel, worst = errors(out, ref)
            rel_eager, _ = errors(out, eager)
            print(f"[branches h{heads} q{q_len} b{b} {route}] rel={rel:.2e} max={worst:.2e} "
                  f"vs-eager={rel_eager:.1e}")
            assert rel_eager < 1e-3, f"{route}: replay differs from eager run"
            rel_bound, max_bound = bounds(p)
            assert rel < rel_bound and worst < max_bound, (route, rel, worst)


def test_graph_branches_run_the_selected_body_only() -> None:
    """Three bodies that allocate temporaries, 24 captured calls: each replay runs exactly
    the selected body (the others leave no trace), and the per-call cost of the selector
    and conditional node is printed beside a plain captured call."""
    device = torch.device("cuda")
    if not conditional_graphs_available(device):
        pytest.skip("CUDA graph conditional nodes unavailable here")
    x = torch.arange(4096, dtype=torch.float32, device=device)
    outs = [torch.zeros_like(x) for _ in range(24)]
    branches = GraphBranches(3, device)

    def body(k: int, out: torch.Tensor):
        return lambda: out.copy_(x * (k + 1) + k)  # x * (k + 1) is a temporary

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            branches.capture([body(k, out) for k in range(3)])
    plain = torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        for out in outs:
            body(0, out)()
    for k in (2, 0, 1, 1, 2):
        branches.select(k)
        for out in outs:
            out.fill_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        for out in outs:
            assert torch.equal(out, x * (k + 1) + k), k

    import triton.testing

    t_branch = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / 24
    t_plain = triton.testing.do_bench(plain.replay, return_mode="median") * 1e3 / 24
    print(f"[branches overhead] per call: conditional {t_branch:.2f} us, plain {t_plain:.2f} us")
