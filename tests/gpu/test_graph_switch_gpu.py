"""CUDA graph if-nodes (``ops.graph_switch``): a replay runs a captured block only while its
flag is set, and two decode routes captured in one graph, each behind its flag, replay the
flagged one on its own fresh plan (checked against float64) while the other leaves its
output untouched."""

from __future__ import annotations

import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder
from trtllm_mla_plugin.ops.graph_switch import (
    if_node,
    if_node_support,
    prepare_if_nodes,
    torch_has_if_nodes,
)
from trtllm_mla_plugin.ops.kernels.graph_if_node import driver_if_node, prepare

from mla_cases import (
    GPU_TEST_MARKS,
    bounds,
    errors,
    make_problem,
    reference,
    route_skip_reason,
)

pytestmark = [*GPU_TEST_MARKS,
              pytest.mark.skipif(if_node_support() is not None,
                                 reason=f"no if-node capture: {if_node_support()}")]

#: ``if_node`` (torch's capture where torch has it) and the driver-API way on its own.
BLOCKS = {"if_node": if_node, "driver_if_node": driver_if_node}


def _ready(name: str, device: torch.device) -> None:
    if name == "driver_if_node":
        prepare(device)
    else:
        prepare_if_nodes(device)


@pytest.mark.parametrize("name", BLOCKS)
def test_replay_runs_the_block_only_while_its_flag_is_set(name: str) -> None:
    device = torch.device("cuda")
    _ready(name, device)
    print(f"[if_node] torch {torch.__version__}: "
          f"{'its own capture' if torch_has_if_nodes() else 'the driver API'}")
    x = torch.randn(4096, device=device)
    out = torch.empty_like(x)
    after = torch.empty_like(x)
    flag = torch.zeros((), dtype=torch.bool, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with BLOCKS[name](flag):
            out.copy_(x * 2 + 1)  # a temporary allocated inside the body
        after.copy_(x - 1)  # after the node: runs either way
    for value in (True, False, True, False):
        x.normal_()
        out.fill_(float("nan"))
        flag.fill_(value)
        scribble = torch.full((1 << 22,), 7.0, device=device)  # memory handed out between
        graph.replay()
        torch.cuda.synchronize()
        del scribble
        assert torch.equal(after, x - 1)
        if value:
            assert torch.equal(out, x * 2 + 1)
        else:
            assert torch.isnan(out).all(), "the block ran with its flag clear"


#: Route pairs a CUDA-graph decoder may switch between on SM90 (the policy's per-batch-size
#: routes; each test skips a pair with a route that declines the case).
PAIRS = [("cuda-splitk", "vllm-fa3-mla"), ("flashmla", "vllm-fa3-mla"),
         ("triton-balanced", "flashinfer-fa3")]
#: Steps of one batch size (lengths; one query token each).
STEPS = [[300, 64, 2000, 1], [4000, 65, 1, 129], [64, 64, 64, 64], [1500, 9, 700, 3000]]


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_two_routes_in_one_graph_replay_the_flagged_one(pair: tuple[str, str],
                                                        name: str) -> None:
    device = torch.device("cuda")
    problems = [make_problem(heads=16, block=64, lens=lens, q_lens=1, dtype=torch.bfloat16,
                             kv_dtype=torch.bfloat16, device=device, width=64)
                for lens in STEPS]
    first = problems[0]
    for route in pair:
        if (reason := route_skip_reason(route, first.spec, device)) is not None:
            pytest.skip(reason)
    _ready(name, device)
    decoders = [MLADecoder(first.spec, device, max_batch_size=4, route=r, cuda_graph=True)
                for r in pair]
    cache = torch.zeros(max(p.kv_cache.shape[0] for p in problems), 64, 576,
                        dtype=torch.bfloat16, device=device)
    cache[: first.kv_cache.shape[0]].copy_(first.kv_cache)
    query = first.query.clone()
    outs = [torch.empty(4, 16, 512, dtype=torch.bfloat16, device=device) for _ in pair]
    flags = torch.zeros(len(pair), dtype=torch.bool, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for decoder, out in zip(decoders, outs, strict=True):
            decoder.plan(first.batch)
            decoder.run(query, cache, out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for flag, decoder, out in zip(flags, decoders, outs, strict=True):
            with BLOCKS[name](flag):
                decoder.run(query, cache, out=out)
    for step, p in enumerate(problems[1:] + problems[:1]):
        chosen = step % len(pair)
        cache[: p.kv_cache.shape[0]].copy_(p.kv_cache)
        p.kv_cache = cache
        query.copy_(p.query)
        p.query = query
        decoders[chosen].plan(p.batch)  # only the flagged route plans, as a switch would
        flags.zero_()
        flags[chosen] = True
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        other = outs[1 - chosen]
        assert torch.isnan(other).all(), f"{pair[1 - chosen]} ran with its flag clear"
        rel, worst = errors(outs[chosen], reference(p, pair[chosen]))
        print(f"[switch {name} {pair[chosen]} step {step}] rel={rel:.2e} max={worst:.2e}")
        rel_bound, max_bound = bounds(p)
        assert rel < rel_bound and worst < max_bound, (pair[chosen], step, rel, worst)

