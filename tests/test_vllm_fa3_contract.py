"""The ``vllm-fa3-mla`` route's calls, checked on CPU against the parameter names of vLLM's
own ``vllm_flash_attn`` interface (read from the installed vllm's source, not imported: the
CPU build cannot load FA3) and against what vLLM's FLASH_ATTN_MLA backend passes. The
kernel itself runs in tests/gpu."""

from __future__ import annotations

import ast
import importlib.util
import math
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, Platform, fa3_splits, policy
from trtllm_mla_plugin.ops.routes import vllm_fa3_mla
from trtllm_mla_plugin.ops.routes.base import round_up
from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import (
    FA3_MODULE,
    GRAPH_MAX_SPLITS,
    GRAPH_WIDE_MAX_ROWS,
    GRAPH_WIDE_SPLITS,
    VllmFA3MLARoute,
    fa3_scheduler_metadata_size,
)
from trtllm_mla_plugin.ops.spec import UNIT_SCALES, KVScales

H200 = Platform("cuda", (9, 0), "NVIDIA H200")
B200 = Platform("cuda", (10, 0), "NVIDIA B200")
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SCALE = 1.0 / 192**0.5


def spec(heads=16, block=64, q=BF16, kv=BF16, dims=(512, 64), max_q_len=1) -> DecodeSpec:
    return DecodeSpec(heads, dims[0], dims[1], block, q, kv, SCALE, max_q_len)


def interface_params() -> dict[str, list[str]]:
    """Parameter names of the public functions in vllm's flash_attn_interface.py."""
    found = importlib.util.find_spec("vllm")
    if found is None or found.origin is None:
        pytest.skip("vllm is not installed")
    path = Path(found.origin).parent / "vllm_flash_attn" / "flash_attn_interface.py"
    if not path.exists():
        pytest.skip(f"{path} is not in this vllm build")
    tree = ast.parse(path.read_text())
    params = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            params[node.name] = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return params


class FakeFA3(types.ModuleType):
    """Records the route's calls; the scheduler returns ``metadata_len`` ones."""

    def __init__(self, metadata_len: int = 9) -> None:
        super().__init__(FA3_MODULE)
        self.metadata_len = metadata_len
        self.schedules: list[dict] = []
        self.calls: list[dict] = []

    def get_scheduler_metadata(self, **kwargs):
        self.schedules.append(kwargs)
        return torch.ones(self.metadata_len, dtype=torch.int32)

    def flash_attn_varlen_func(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["out"]

    def fwd(self, *args):
        """``torch.ops._vllm_fa3_C.fwd`` (the length-order launch): the positional
        arguments, with the ones the tests read by name."""
        self.calls.append({"positional": args, "num_splits": args[30], "out": args[6]})
        return args[6], None, None, None


@pytest.fixture
def fake(monkeypatch) -> FakeFA3:
    module = FakeFA3()
    monkeypatch.setitem(sys.modules, FA3_MODULE, module)
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    monkeypatch.setattr(vllm_fa3_mla, "fa3_forward_op", lambda: module.fwd)
    return module


def interface_fwd_call() -> list[str]:
    """The arguments (source text) of ``flash_attn_varlen_func``'s own call of
    ``torch.ops._vllm_fa3_C.fwd`` in the installed vLLM."""
    spec_ = importlib.util.find_spec("vllm")
    if spec_ is None or spec_.origin is None:
        pytest.skip("vllm is not installed")
    path = Path(spec_.origin).parent / "vllm_flash_attn" / "flash_attn_interface.py"
    if not path.exists():
        pytest.skip("this vllm build has no vllm_flash_attn interface")
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "fwd" and "_vllm_fa3_C" in ast.unparse(node.func)):
            return [ast.unparse(a) for a in node.args]
    raise AssertionError("no _vllm_fa3_C.fwd call in vLLM's FA3 interface")


def test_length_order_launch_matches_the_wrappers_op_call(fake):
    """Batches of >= ``policy.VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` requests launch FA3's op
    directly (to pass ``seqused_q``): every argument where vLLM's own wrapper puts it, the
    wrapper's ``None`` for ``seqused_q`` replaced by the route's, the tables those of the
    requests longest first."""
    names = interface_fwd_call()
    b = policy.VLLM_FA3_LENGTH_ORDER_MIN_BATCH
    lens = [100 + 37 * ((i * 7) % b) for i in range(b)]
    route = VllmFA3MLARoute(spec(heads=16, max_q_len=2), torch.device("cpu"),
                            max_batch_size=b, cuda_graph=True)
    batch = batch_of(lens, uniform_q=2, width=max(lens) // 64 + 1)
    route.plan(replace(batch, seq_lens_host=batch.seq_lens.clone()))
    query = torch.randn(2 * b, 16, 576).to(BF16)
    out = torch.empty(2 * b, 16, 512, dtype=BF16)
    assert route.run(query, torch.randn(4, 64, 576).to(BF16), out, UNIT_SCALES) is out
    args = fake.calls[-1]["positional"]
    assert len(args) == len(names)
    order = route._order
    want = {"q": query[..., 512:], "q_v": query[..., :512], "out": out,
            "cu_seqlens_q": order.cu_seqlens_q, "seqused_k": order.seq_lens,
            "block_table": order.block_table, "scheduler_metadata": route._metadata,
            "max_seqlen_q": 2, "max_seqlen_k": max(lens), "softmax_scale": SCALE,
            "causal": True, "num_splits": route._reserved_splits, "softcap": 0.0,
            "real_window_size[0]": -1, "real_window_size[1]": -1, "True": True, "0": 0,
            "cp_world_size": 1, "cp_rank": 0}
    seqused_q_at = names.index("seqused_k") - 1
    for i, (name, got) in enumerate(zip(names, args, strict=True)):
        if i == seqused_q_at:
            assert name == "None" and got is order.seqused_q
        elif name in ("None", "cu_seqlens_k", "q_descale", "k_descale", "v_descale",
                      "s_aux", "cp_tot_seqused_k"):
            assert got is None, (i, name)
        elif name == "out":
            assert got is out
        elif name in ("k", "v"):
            assert got.shape[-1] == (64 if name == "k" else 512), name
        elif isinstance(want[name], torch.Tensor):
            assert torch.equal(got, want[name]), name
        else:
            assert got == want[name], name
    assert order.seq_lens.tolist() == sorted(lens, reverse=True)
    assert order.seqused_q.tolist() == [2] * b


def test_eligibility_names_the_fix(monkeypatch):
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    assert VllmFA3MLARoute.unsupported_reason(spec(), H200) is None
    assert VllmFA3MLARoute.unsupported_reason(spec(block=32, max_q_len=4), H200) is None
    assert "SM90 only" in VllmFA3MLARoute.unsupported_reason(spec(), B200)
    assert "flashmla-fp8" in VllmFA3MLARoute.unsupported_reason(spec(kv=FP8), H200)
    assert "512 and rope_dim 64" in VllmFA3MLARoute.unsupported_reason(
        spec(dims=(256, 64)), H200)
    assert "--block-size 64" in VllmFA3MLARoute.unsupported_reason(spec(block=8), H200)
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: False)
    assert "CUDA build of vllm" in VllmFA3MLARoute.unsupported_reason(spec(), H200)


def batch_of(lens, q_lens=None, width=8, uniform_q: int = 1) -> DecodeBatch:
    """``q_lens`` given: ragged query rows with offsets; else ``uniform_q`` rows per request
    and no offsets (``DecodeBatch``'s uniform form)."""
    cu = None
    if q_lens is not None:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return DecodeBatch(
        block_table=torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_seq_len=max(lens),
        cu_seqlens_q=cu,
        max_q_len=max(q_lens) if q_lens else uniform_q,
        num_tokens=sum(q_lens) if q_lens else None,
    )


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_calls_match_vllm_interface_and_backend(fake, cuda_graph):
    params = interface_params()
    s = spec(heads=16, max_q_len=3)
    route = VllmFA3MLARoute(s, torch.device("cpu"), max_batch_size=6, cuda_graph=cuda_graph)
    cache = torch.randn(48, 64, 576).to(BF16)
    for lens, q_lens, uniform_q in (([300, 5, 64], [1, 3, 2], 1), ([7, 900], None, 1),
                                    ([40, 50, 9], None, 3), ([8, 60], None, 1)):
        b = batch_of(lens, q_lens, uniform_q=uniform_q)
        route.plan(b)
        tokens = b.num_tokens
        query = torch.randn(tokens, 16, 576).to(BF16)
        out = torch.empty(tokens, 16, 512, dtype=BF16)
        assert route.run(query, cache, out, UNIT_SCALES) is out

        sched, call = fake.schedules[-1], fake.calls[-1]
        assert set(sched) <= set(params["get_scheduler_metadata"])
        assert set(call) <= set(params["flash_attn_varlen_func"])
        # Short requests under CUDA graphs: vLLM's cap in the plan; the launch reserves
        # room for the wide cap (16 heads x at most 6 tokens is under GRAPH_WIDE_MAX_ROWS).
        splits = GRAPH_MAX_SPLITS if cuda_graph else 0
        reserved = GRAPH_WIDE_SPLITS if cuda_graph else 0
        expect_cu = torch.tensor([0, *torch.tensor(q_lens or [uniform_q] * len(lens)).cumsum(0)])
        # What vLLM's FlashAttnMLAMetadataBuilder._schedule_decode passes.
        assert sched["batch_size"] == len(lens) and sched["max_seqlen_q"] == b.max_q_len
        assert sched["max_seqlen_k"] == max(lens) and sched["num_heads_q"] == 16
        assert (sched["num_heads_kv"], sched["headdim"], sched["headdim_v"]) == (1, 64, 512)
        assert sched["page_size"] == 64 and sched["causal"] is True
        assert sched["qkv_dtype"] == BF16 and sched["num_splits"] == splits
        assert torch.equal(sched["cu_seqlens_q"].long(), expect_cu)
        assert torch.equal(sched["cache_seqlens"], b.seq_lens)
        # What FlashAttnMLAImpl.forward_mqa passes.
        assert torch.equal(call["q"], query[..., 512:])
        assert torch.equal(call["q_v"], query[..., :512])
        assert torch.equal(call["k"], cache.unsqueeze(-2)[..., 512:])
        assert torch.equal(call["v"], cache.unsqueeze(-2)[..., :512])
        assert call["k"].shape == (48, 64, 1, 64) and call["v"].shape == (48, 64, 1, 512)
        assert torch.equal(call["cu_seqlens_q"].long(), expect_cu)
        assert torch.equal(call["seqused_k"], b.seq_lens)
        assert torch.equal(call["block_table"], b.block_table)
        assert call["max_seqlen_q"] == b.max_q_len and call["max_seqlen_k"] == max(lens)
        assert call["causal"] is True and call["fa_version"] == 3
        assert call["softmax_scale"] == SCALE and call["num_splits"] == reserved
        assert call["out"] is out
        meta = call["scheduler_metadata"]
        assert meta.shape == (fake.metadata_len,) and bool((meta == 1).all())
        # The persistent buffer's tail is zeroed (stale entries would misdirect thread blocks).
        assert bool((route._scheduler[fake.metadata_len:] == 0).all())
        assert route._scheduler.numel() == 1 + round_up(6, 4) * 4


def planned_and_launched(route, fake, lens, uniform_q=1) -> tuple[int, int]:
    """(``num_splits`` of the plan, of the launch) for a batch of ``lens``."""
    b = batch_of(lens, uniform_q=uniform_q, width=max(lens) // 64 + 1)
    route.plan(b)
    heads = route.spec.num_heads
    route.run(torch.randn(b.num_tokens, heads, 576).to(BF16), torch.randn(4, 64, 576).to(BF16),
              torch.empty(b.num_tokens, heads, 512, dtype=BF16), UNIT_SCALES)
    return fake.schedules[-1]["num_splits"], fake.calls[-1]["num_splits"]


@pytest.mark.parametrize("heads,q_len,batch", [(16, 1, 1), (16, 1, 64), (128, 4, 2),
                                               (16, 1, 65), (128, 1, 9), (64, 4, 8)])
def test_graph_launch_reserves_splits_by_rows_alone(fake, heads, q_len, batch):
    """Under CUDA graphs the launch's ``num_splits`` (the size of FA3's partial outputs in
    the captured graph) depends on the batch's query rows only, so replays of any lengths
    match the capture; the plan never asks for more splits than that, and more than vLLM's
    32 only for long requests on batches of at most ``GRAPH_WIDE_MAX_ROWS`` rows whose query
    tiles hold at most 32 rows (16 heads here; 64 and 128 heads fill whole 64-row tiles)."""
    route = VllmFA3MLARoute(spec(heads=heads, max_q_len=q_len), torch.device("cpu"),
                            max_batch_size=128, cuda_graph=True)
    small = heads * q_len * batch <= GRAPH_WIDE_MAX_ROWS
    reserved = GRAPH_WIDE_SPLITS if small else GRAPH_MAX_SPLITS
    seen = set()
    for longest in (70, 8191, 8192, 50_000, 900):
        lens = [longest] + [64] * (batch - 1)
        planned, launched = planned_and_launched(route, fake, lens, q_len)
        seen.add(launched)
        wide = longest >= 8192 and small and heads * q_len <= 32
        assert planned == (GRAPH_WIDE_SPLITS if wide else GRAPH_MAX_SPLITS), longest
        assert planned <= launched
    assert seen == {reserved}


def host_lens_batch(lens, uniform_q=1, kv_tokens=False, host=True) -> DecodeBatch:
    """``batch_of`` with the host's exact lengths (vLLM's builder under CUDA graphs), or only
    their sum (``kv_tokens``), or neither."""
    from dataclasses import replace

    b = batch_of(lens, uniform_q=uniform_q, width=max(lens) // 64 + 1)
    return replace(b, seq_lens_host=b.seq_lens.clone() if host else None,
                   kv_tokens=sum(lens) if kv_tokens else None)


@pytest.mark.parametrize("heads,q_len,lens,planned", [
    # 2 query tiles x 2 requests x 30 KV tiles = 120 work tiles: FA3 would cut each request
    # into 30 one-tile splits; at full 64-row tiles from 72 work tiles the plan halves that.
    (64, 2, [1920] * 2, 15),
    (64, 2, [1920] * 3, 32),  # 180 tiles: FA3's own formula already puts 2 tiles a split
    (16, 1, [1920] * 4, 15),  # 16-row tiles: 120 >= 72 x 4 ** 0.25 = 101.8
    (16, 1, [1920] * 3, 32),  # 90 < 101.8
    (8, 1, [1920] * 4, 32),  # 8-row tiles never
    (64, 2, [320] * 10, 32),  # 100 tiles, but 5 KV tiles a request (cut 2 + 2 + 1)
    (64, 1, [512] * 8, 32),  # 64 < 72
    (64, 1, [512] * 9, 4),  # 72: half of 8 KV tiles
    (64, 1, [1920] + [128] * 40, 15),  # ragged: 30 + 40 x 2 = 110 tiles
])
def test_graph_plan_halves_one_tile_splits_of_busy_short_batches(fake, heads, q_len, lens,
                                                                 planned):
    route = VllmFA3MLARoute(spec(heads=heads, max_q_len=q_len), torch.device("cpu"),
                            max_batch_size=64, cuda_graph=True)
    route.plan(host_lens_batch(lens, q_len))
    reserved = GRAPH_WIDE_SPLITS if heads * q_len * len(lens) <= GRAPH_WIDE_MAX_ROWS else 32
    assert (route._planned_splits, route._reserved_splits) == (planned, reserved)
    assert fake.schedules[-1]["num_splits"] == planned


def test_halving_counts_work_from_what_the_host_knows(fake):
    """Exact host lengths first; else ``kv_tokens`` with each request's last KV tile half
    full; without either, no halving (even where every request could be the longest)."""
    route = VllmFA3MLARoute(spec(heads=64), torch.device("cpu"), 64, cuda_graph=True)
    lens = [1920] + [128] * 40  # exact: 110 work tiles
    route.plan(host_lens_batch(lens))
    assert route._planned_splits == 15
    route.plan(host_lens_batch(lens, kv_tokens=True, host=False))  # 7040 / 64 + 20.5: 130
    assert route._planned_splits == 32
    route.plan(host_lens_batch([1920] * 4, host=False))  # 120 tiles, unknown to the host
    assert route._planned_splits == 32
    route.plan(host_lens_batch([1216] * 2 + [64], kv_tokens=True, host=False))  # 39 + 1.5: 40
    assert route._planned_splits == 32
    route.plan(host_lens_batch([1216] * 4, kv_tokens=True, host=False))  # 76 + 2: 78
    assert route._planned_splits == 10


def test_halving_scales_with_the_gpus_sms(fake):
    """FA3 spreads work over the GPU's SMs (78 on an H20): both bounds of the rule scale."""
    route = VllmFA3MLARoute(spec(heads=64, max_q_len=2), torch.device("cpu"), 8,
                            cuda_graph=True)
    route._sms = 78
    route.plan(host_lens_batch([1920] * 2, 2))  # 120 x 1.1 > 78: FA3 splits by 2 itself
    assert route._planned_splits == 32
    route = VllmFA3MLARoute(spec(heads=64), torch.device("cpu"), 8, cuda_graph=True)
    route._sms = 78
    route.plan(host_lens_batch([1216] * 2))  # 38 < 72 x 78 / 132 = 42.5
    assert route._planned_splits == 32
    route.plan(host_lens_batch([1216] * 3))  # 57, and 57 x 1.1 <= 78
    assert route._planned_splits == 10


def test_eager_steps_and_overrides_leave_the_splits_to_one_value(fake):
    eager = VllmFA3MLARoute(spec(), torch.device("cpu"), 4, cuda_graph=False)
    assert planned_and_launched(eager, fake, [50_000]) == (0, 0)
    graph = VllmFA3MLARoute(spec(), torch.device("cpu"), 4, cuda_graph=True)
    graph.max_splits_override = 128
    assert planned_and_launched(graph, fake, [100, 50_000]) == (128, 128)


def test_decoder_switch_sets_where_the_route_plans(fake):
    """``MLADecoder.set_device_plan`` (the engine's TRTLLM_MLA_FA3_DEVICE_PLAN) overrides
    ``policy.vllm_fa3_device_plan`` on the decoder's ``vllm-fa3-mla`` route, both ways."""
    from trtllm_mla_plugin.ops import MLADecoder

    decoder = MLADecoder(spec(), "cpu", 4)
    route = VllmFA3MLARoute(spec(), torch.device("cpu"), 4, cuda_graph=True)
    decoder.routes[policy.VLLM_FA3] = route
    default = policy.vllm_fa3_device_plan(spec(), 48)
    assert route._device_plan(48) is default
    decoder.set_device_plan(not default)
    assert route._device_plan(48) is not default
    decoder.set_device_plan(default)
    assert route._device_plan(48) is default


def test_band_below_the_splitk_bound_plans_on_the_gpu(monkeypatch):
    """Where ``SPLITK_GRAPH_MIN_BATCH`` rises past the length order's bound, the 8-16-row
    batches between the two are planned on the GPU (and only those, while
    ``VLLM_FA3_DEVICE_PLAN`` is off); at today's bounds none are."""
    monkeypatch.setattr(policy, "VLLM_FA3_DEVICE_PLAN", False)
    assert not any(policy.vllm_fa3_device_plan(spec(h), b) for h in (8, 16, 32, 128)
                   for b in range(1, 1025))
    monkeypatch.setattr(policy, "SPLITK_GRAPH_MIN_BATCH", 97)
    for h in (8, 16):
        assert [b for b in range(1, 1025) if policy.vllm_fa3_device_plan(spec(h), b)] == list(
            range(33, 97))
    assert not policy.vllm_fa3_device_plan(spec(16, max_q_len=2), 48)  # 32 rows
    assert not policy.vllm_fa3_device_plan(spec(16, block=32), 48)  # pages cuda-splitk skips
    assert not policy.vllm_fa3_device_plan(spec(32), 48)
    monkeypatch.setattr(policy, "VLLM_FA3_DEVICE_PLAN", True)
    assert policy.vllm_fa3_device_plan(spec(32), 48) and policy.vllm_fa3_device_plan(spec(), 8)


def test_graph_buffers_keep_their_addresses(fake):
    route = VllmFA3MLARoute(spec(max_q_len=2), torch.device("cpu"), 4, cuda_graph=True)
    cache = torch.randn(40, 64, 576).to(BF16)
    seen = set()
    for lens in ([10, 20], [700, 3], [64, 64]):
        route.plan(batch_of(lens, [2, 2]))
        route.run(torch.randn(4, 16, 576).to(BF16), cache,
                  torch.empty(4, 16, 512, dtype=BF16), UNIT_SCALES)
        call = fake.calls[-1]
        seen.add(tuple(t.data_ptr() for t in (
            call["cu_seqlens_q"], call["seqused_k"], call["block_table"],
            call["scheduler_metadata"])))
    assert len(seen) == 1


def test_scheduler_buffer_matches_vllm_bound():
    assert fa3_scheduler_metadata_size(1) == 1 + 4 * 4
    assert fa3_scheduler_metadata_size(256) == 1 + 256 * 4


def test_scheduler_tail_holds_zeros_after_a_shorter_metadata(fake):
    """Each step's metadata is followed by zeros in the persistent buffer, also when it is
    shorter than an earlier step's (a step zeroes only what a longer one left)."""
    route = VllmFA3MLARoute(spec(), torch.device("cpu"), max_batch_size=6, cuda_graph=True)
    route._scheduler.fill_(0)
    for length in (9, 5, 7, 7, 2):
        fake.metadata_len = length
        route.plan(batch_of([100, 700, 64]))
        written = route._scheduler.tolist()
        assert written[:length] == [1] * length, length
        assert not any(written[length:]), (length, written)


def test_ordered_graph_plan_issues_four_device_operations(fake):
    """The host cost of a step's plan (run 228: the route's plan held the engine's step on
    the host): a 128-request uniform batch with host lengths under CUDA graphs, launched
    longest first with the route's own splits, takes four operations that touch memory
    besides FA3's scheduler call (the packed length order, the block table's row gather,
    the scheduler copy, the splits), counted with a dispatch-mode counter; views are
    free."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    views = {"slice", "alias", "detach", "lift_fresh", "view", "select"}
    fake.metadata_len = 1 + 128 * 4
    route = VllmFA3MLARoute(spec(), torch.device("cpu"), max_batch_size=128, cuda_graph=True)
    lens = torch.tensor(np.random.default_rng(0).integers(1024, 8600, 128), dtype=torch.int32)
    batch = DecodeBatch(torch.zeros(128, 140, dtype=torch.int32), lens, int(lens.max()),
                        kv_tokens=int(lens.sum()), seq_lens_host=lens.clone(),
                        persistent=True)
    route.plan(batch)
    with Count() as count:
        route.plan(batch)
    assert route._ordered and vllm_fa3_mla.graph_replan(
        route.spec, 1, route._order.lens_host, route._reserved_splits, route._planned_splits,
        route._sms) is not None
    ops = [op for op in count.ops if op not in views and op != "ones"]  # "ones": the fake's
    assert ops == ["copy_", "index_select", "copy_", "copy_"], count.ops


def test_fp8_scales_are_refused(fake):
    route = VllmFA3MLARoute(spec(), torch.device("cpu"), 2)
    route.plan(batch_of([5, 6]))
    with pytest.raises(ValueError, match="FP8 caches only"):
        route.run(torch.randn(2, 16, 576).to(BF16), torch.randn(4, 64, 576).to(BF16),
                  torch.empty(2, 16, 512, dtype=BF16), KVScales(k_scale=0.5))


def test_persistent_batch_tensors_reach_the_kernel_without_copies(fake):
    """With the engine's own fixed-address tensors (``DecodeBatch.persistent``, as vLLM's
    FLASH_ATTN_MLA passes them), the kernel reads the caller's block table and lengths, as
    vLLM's backend does: no staging copy per step, also under CUDA graphs."""
    from dataclasses import replace

    route = VllmFA3MLARoute(spec(), torch.device("cpu"), 4, cuda_graph=True)
    cache = torch.randn(40, 64, 576).to(BF16)
    b = replace(batch_of([10, 700, 64]), persistent=True)
    route.plan(b)
    route.run(torch.randn(3, 16, 576).to(BF16), cache, torch.empty(3, 16, 512, dtype=BF16),
              UNIT_SCALES)
    sched, call = fake.schedules[-1], fake.calls[-1]
    assert call["block_table"] is b.block_table and call["seqused_k"] is b.seq_lens
    assert sched["cache_seqlens"] is b.seq_lens
    assert call["cu_seqlens_q"].tolist() == [0, 1, 2, 3]


def test_graph_plan_writes_balanced_splits_over_fa3s(monkeypatch):
    """A step FA3's formula spills past one wave (28 x 5 splits = 140 work tiles on 132
    SMs) gets ``fa3_splits.balanced_splits``' plan at FA3's split vector (after the padded
    query-row vector), the rest of FA3's metadata kept; eager steps, steps without host
    lengths and the override off keep FA3's."""
    fake = FakeFA3(metadata_len=1 + 3 * 28)
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake)
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    lens = [17_658] * 28
    with_host = replace(batch_of(lens), seq_lens_host=torch.tensor(lens, dtype=torch.int32))
    want = fa3_splits.balanced_splits(np.full(28, 276), 1, GRAPH_WIDE_SPLITS,
                                      policy.HOPPER_SMS, 32, GRAPH_MAX_SPLITS)
    assert want is not None and want.tolist() != [5] * 28
    for cuda_graph, batch, override, balanced in (
            (True, with_host, None, True), (False, with_host, None, False),
            (True, batch_of(lens), None, False), (True, with_host, False, False)):
        route = VllmFA3MLARoute(spec(heads=32), torch.device("cpu"), max_batch_size=28,
                                cuda_graph=cuda_graph)
        route.balanced_splits_override = override
        route.plan(batch)
        metadata = route._scheduler[: fake.metadata_len].tolist()
        at = vllm_fa3_mla.fa3_splits_offset(28)
        assert at == 28
        expect = want.tolist() if balanced else [1] * 28
        assert metadata[at: at + 28] == expect
        assert metadata[:at] == [1] * at and metadata[at + 28:] == [1] * (1 + 28)


def test_graph_plan_takes_the_narrow_tile_band_longest_first(monkeypatch):
    """32-row tiles over requests of 2.4-4.8k tokens, 128 of them: FA3's formula plans 192
    work tiles (1.45 waves on 132 SMs), past ``SPILL`` but inside ``NARROW_SPILL``. The
    route writes ``balanced_splits``' plan of the lengths longest first (the order it
    launches FA3 in); with the band held at ``SPILL`` it keeps FA3's."""
    fake = FakeFA3(metadata_len=1 + 3 * 128)
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake)
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    lens = [4800, 2400] * 64
    batch = replace(batch_of(lens), seq_lens_host=torch.tensor(lens, dtype=torch.int32))
    tiles = -(-np.sort(np.array(lens))[::-1] // 64)
    want = fa3_splits.balanced_splits(tiles, 1, GRAPH_MAX_SPLITS, policy.HOPPER_SMS, 32,
                                      GRAPH_MAX_SPLITS)
    assert fa3_splits.fa3_splits(tiles, 1, GRAPH_MAX_SPLITS, policy.HOPPER_SMS).sum() == 192
    assert want is not None
    at = vllm_fa3_mla.fa3_splits_offset(128)
    for spill, expect in ((None, want.tolist()), (fa3_splits.SPILL, [1] * 128)):
        route = VllmFA3MLARoute(spec(heads=32), torch.device("cpu"), max_batch_size=128,
                                cuda_graph=True)
        route.spill_override = spill
        route.plan(batch)
        assert route._reserved_splits == GRAPH_MAX_SPLITS
        assert route._scheduler[at: at + 128].tolist() == expect


def test_the_balanced_benchmark_variant_replans_past_every_band(monkeypatch):
    """``bench_decode --extra-routes vllm-fa3-mla:balanced`` sets ``ROUTE_VARIANTS``' settings
    on the route: a 64-row batch FA3 plans at 1.42 waves (past ``SPILL``, and no narrow
    tile) then gets ``balanced_splits``' plan, where the route's own rule keeps FA3's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import decode_kernels

    fake = FakeFA3(metadata_len=1 + 3 * 188)
    monkeypatch.setitem(sys.modules, FA3_MODULE, fake)
    monkeypatch.setattr(vllm_fa3_mla, "module_available", lambda name: True)
    lens = [6400] * 188
    batch = replace(batch_of(lens), seq_lens_host=torch.tensor(lens, dtype=torch.int32))
    tiles = np.full(188, 100)
    assert fa3_splits.fa3_splits(tiles, 1, GRAPH_MAX_SPLITS, policy.HOPPER_SMS).sum() == 188
    want = fa3_splits.balanced_splits(tiles, 1, GRAPH_MAX_SPLITS, policy.HOPPER_SMS, 64,
                                      GRAPH_MAX_SPLITS, spill=math.inf)
    assert want is not None
    at = vllm_fa3_mla.fa3_splits_offset(188)
    settings = decode_kernels.ROUTE_VARIANTS["vllm-fa3-mla", "balanced"]
    for variant, expect in ((False, [1] * 188), (True, want.tolist())):
        route = VllmFA3MLARoute(spec(heads=64), torch.device("cpu"), max_batch_size=188,
                                cuda_graph=True)
        for name, value in (settings.items() if variant else ()):
            setattr(route, name, value)
        route.plan(batch)
        assert route._scheduler[at: at + 188].tolist() == expect
