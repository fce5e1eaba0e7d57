"""CUDA graph conditional nodes (``ops.graph_switch``): a replay runs a captured block only
while its flag is set (an if-node, by torch's capture or the driver API, its flag read in
the stream's order or when the replay starts) or the branch its index names (a switch
node); two decode routes captured in one graph replay the chosen one on its own fresh plan
(checked against float64) while the other leaves its output untouched."""

from __future__ import annotations

import functools

import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder
from trtllm_mla_plugin.ops.graph_switch import (
    if_node,
    if_node_support,
    prepare_if_nodes,
    switch_node,
    switch_node_support,
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

#: ``if_node`` (torch's capture where torch has it) and the driver-API way on its own, its
#: flag read in the stream's order or by a root node.
BLOCKS = {"if_node": if_node, "driver_if_node": driver_if_node,
          "driver_if_node_root": functools.partial(driver_if_node, setter_at_root=True)}
NEEDS_SWITCH = pytest.mark.skipif(switch_node_support() is not None,
                                  reason=f"no switch node: {switch_node_support()}")


def _ready(name: str, device: torch.device) -> None:
    if name.startswith("driver"):
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
    _replay_two_routes(pair, name)


def _replay_two_routes(pair: tuple[str, str], name: str) -> None:
    """Captures both routes' decoders behind ``name`` (a ``BLOCKS`` key or
    ``"switch_node"``) and replays steps of new lengths, each planned on the chosen route
    only."""
    device = torch.device("cuda")
    problems = [make_problem(heads=16, block=64, lens=lens, q_lens=1, dtype=torch.bfloat16,
                             kv_dtype=torch.bfloat16, device=device, width=64)
                for lens in STEPS]
    first = problems[0]
    for route in pair:
        if (reason := route_skip_reason(route, first.spec, device)) is not None:
            pytest.skip(reason)
    if name == "switch_node":
        prepare_if_nodes(device, driver=True)
    else:
        _ready(name, device)
    decoders = [MLADecoder(first.spec, device, max_batch_size=4, route=r, cuda_graph=True)
                for r in pair]
    cache = torch.zeros(max(p.kv_cache.shape[0] for p in problems), 64, 576,
                        dtype=torch.bfloat16, device=device)
    cache[: first.kv_cache.shape[0]].copy_(first.kv_cache)
    query = first.query.clone()
    outs = [torch.empty(4, 16, 512, dtype=torch.bfloat16, device=device) for _ in pair]
    flags = torch.zeros(len(pair), dtype=torch.bool, device=device)
    index = torch.zeros((), dtype=torch.int32, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for decoder, out in zip(decoders, outs, strict=True):
            decoder.plan(first.batch)
            decoder.run(query, cache, out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if name == "switch_node":
            switch_node(index, [functools.partial(d.run, query, cache, out=o)
                                for d, o in zip(decoders, outs, strict=True)])
        else:
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
        index.fill_(chosen)
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


@NEEDS_SWITCH
def test_switch_node_replays_the_branch_its_index_names() -> None:
    device = torch.device("cuda")
    prepare_if_nodes(device, driver=True)
    x = torch.randn(4096, device=device)
    outs = [torch.empty_like(x) for _ in range(3)]
    index = torch.zeros((), dtype=torch.int32, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        switch_node(index, [lambda i=i: outs[i].copy_(x * (i + 2) + 1) for i in range(3)])
    for chosen in (2, 0, 1, 3, 0):  # 3: no branch
        x.normal_()
        for out in outs:
            out.fill_(float("nan"))
        index.fill_(chosen)
        graph.replay()
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            if i == chosen:
                assert torch.equal(out, x * (i + 2) + 1)
            else:
                assert torch.isnan(out).all(), f"branch {i} ran with index {chosen}"


@NEEDS_SWITCH
@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_two_routes_in_one_switch_node_replay_the_chosen_one(pair: tuple[str, str]) -> None:
    _replay_two_routes(pair, "switch_node")
