"""The TRTLLM-gen / CuTe DSL routes' call, checked on CPU against FlashInfer's own signature
and input validation (no Blackwell GPU is needed, none runs the kernel here)."""

from __future__ import annotations

import inspect

import pytest
import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, KVScales, Platform
from trtllm_mla_plugin.ops.routes import trtllm_gen
from trtllm_mla_plugin.ops.routes.trtllm_gen import (
    CuteDslRoute,
    TrtllmGenRoute,
    trtllm_gen_call_kwargs,
    trtllm_gen_supports_num_heads,
)

flashinfer = pytest.importorskip("flashinfer")
if flashinfer.__version__ != "0.7.2.post1":
    pytest.skip(
        f"contract read from flashinfer 0.7.2.post1 (private _check_trtllm_gen_mla_shape); "
        f"installed {flashinfer.__version__}",
        allow_module_level=True,
    )
from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla  # noqa: E402
from flashinfer.mla._core import _check_trtllm_gen_mla_shape  # noqa: E402

B200 = Platform("cuda", (10, 0), "NVIDIA B200")
SCALE = 1.0 / 192**0.5


def spec(heads=16, block=64, q=torch.bfloat16, kv=torch.bfloat16, dims=(512, 64), max_q_len=1):
    return DecodeSpec(heads, dims[0], dims[1], block, q, kv, SCALE, max_q_len)


def problem(s: DecodeSpec, lens: list[int], q_lens: list[int] | None, width: int):
    b = len(lens)
    tokens = sum(q_lens) if q_lens else b * s.max_q_len
    cu = None
    if q_lens:
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    batch = DecodeBatch(
        block_table=torch.randint(0, 50, (b, width), dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        max_seq_len=max(lens),
        cu_seqlens_q=cu,
        max_q_len=max(q_lens) if q_lens else s.max_q_len,
        num_tokens=tokens if q_lens else None,
    )
    query = torch.randn(tokens, s.num_heads, s.head_dim).to(s.q_dtype)
    kv = torch.randn(50, s.block_size, s.head_dim).to(s.kv_dtype)
    return batch, query, kv


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["out"]


def run_route(monkeypatch, route_cls, s, batch, query, kv, scales):
    """Run the route on CPU with FlashInfer's launch replaced by a recorder."""
    recorder = _Recorder()
    monkeypatch.setattr(flashinfer.decode, "trtllm_batch_decode_with_kv_cache_mla", recorder)
    if route_cls is TrtllmGenRoute:  # sizing the real one asks CUDA for the SM count
        monkeypatch.setattr(
            route_cls, "_make_counter", lambda self: torch.zeros(64, dtype=torch.uint8)
        )
    monkeypatch.setattr(trtllm_gen, "_workspaces", {})
    monkeypatch.setattr(trtllm_gen, "WORKSPACE_BYTES", 1024)
    route = route_cls(s, torch.device("cpu"), max_batch_size=8)
    route.plan(batch)
    out = torch.empty(query.shape[0], s.num_heads, s.kv_lora_rank, dtype=torch.bfloat16)
    assert route.run(query, kv, out, scales) is out
    (kwargs,) = recorder.calls
    return route, kwargs


def check_with_flashinfer(kwargs: dict) -> None:
    inspect.signature(trtllm_batch_decode_with_kv_cache_mla).bind(**kwargs)
    q = kwargs["query"]
    ragged = "cum_seq_lens_q" in kwargs
    _check_trtllm_gen_mla_shape(
        q,
        kwargs["kv_cache"],
        kwargs["kv_lora_rank"],
        kwargs["qk_rope_head_dim"],
        0,
        kwargs["block_tables"],
        kwargs["kv_cache"].shape[-2],
        batch_size=kwargs["seq_lens"].shape[0] if ragged else None,
        max_q_len=kwargs["max_q_len"] if ragged else None,
        require_aligned_block_table=True,
    )


@pytest.mark.parametrize("route_cls", [TrtllmGenRoute, CuteDslRoute])
@pytest.mark.parametrize("block,width", [(64, 3), (32, 5), (64, 2), (32, 4)])
def test_uniform_call_binds_and_passes_shape_check(monkeypatch, route_cls, block, width):
    s = spec(block=block, max_q_len=2)
    batch, query, kv = problem(s, [100, 7, 2 * block], None, width)
    route, kw = run_route(monkeypatch, route_cls, s, batch, query, kv, KVScales())
    check_with_flashinfer(kw)
    assert kw["query"].shape == (3, 2, 16, 576) and kw["out"].shape == (3, 2, 16, 512)
    assert kw["kv_cache"].shape == (50, 1, block, 576)
    assert kw["backend"] == route_cls.backend
    assert "cum_seq_lens_q" not in kw and "max_q_len" not in kw
    # Block table padded to a multiple of 128 / block, data copied, padding zero.
    table = kw["block_tables"]
    assert table.dtype == torch.int32 and table.shape[0] == 3
    assert table.shape[1] % (128 // block) == 0 and table.shape[1] >= width
    assert torch.equal(table[:, :width], batch.block_table)
    assert not table[:, width:].any()
    assert torch.equal(kw["seq_lens"], batch.seq_lens)
    assert kw["max_seq_len"] == max(100, 2 * block)
    assert kw["qk_nope_head_dim"] == 128
    assert ("multi_ctas_kv_counter_buffer" in kw) == (route_cls is TrtllmGenRoute)
    # The tensors are the route's persistent buffers, not the caller's.
    assert table.data_ptr() == route._block_table.data_ptr()
    assert kw["seq_lens"].data_ptr() == route._seq_lens.data_ptr()


def test_ragged_query_uses_cum_seq_lens(monkeypatch):
    s = spec(max_q_len=4)
    batch, query, kv = problem(s, [64, 500, 129, 4], [1, 3, 4, 2], 9)
    _, kw = run_route(monkeypatch, TrtllmGenRoute, s, batch, query, kv, KVScales())
    check_with_flashinfer(kw)
    assert kw["query"].shape == (10, 16, 576) and kw["out"].shape == (10, 16, 512)
    assert kw["max_q_len"] == 4
    assert kw["cum_seq_lens_q"].tolist() == [0, 1, 4, 8, 10]
    assert kw["cum_seq_lens_q"].dtype == torch.int32


def test_fp8_cache_quantizes_query_and_fuses_scales(monkeypatch):
    s = spec(kv=torch.float8_e4m3fn)
    batch, query, kv = problem(s, [300, 65], None, 5)
    query[0, 0, 0] = 1000.0  # beyond e4m3's range: must saturate, not become NaN
    scales = KVScales(q_scale=2.0, k_scale=0.25, v_scale=0.125)
    _, kw = run_route(monkeypatch, TrtllmGenRoute, s, batch, query, kv, scales)
    check_with_flashinfer(kw)
    q8 = kw["query"]
    assert q8.dtype == torch.float8_e4m3fn and kw["kv_cache"].dtype == torch.float8_e4m3fn
    assert q8.float()[0, 0, 0, 0].item() == 448.0
    expected = query.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(q8.float().view_as(expected), expected)
    assert kw["bmm1_scale"] == pytest.approx(SCALE * 2.0 * 0.25)
    assert kw["bmm2_scale"] == pytest.approx(0.125)


def test_unit_scales_are_softmax_scale_only():
    s = spec()
    kw = trtllm_gen_call_kwargs(
        spec=s, backend="trtllm-gen", query=torch.zeros(2, 16, 576, dtype=torch.bfloat16),
        kv_cache=torch.zeros(4, 64, 576, dtype=torch.bfloat16),
        out=torch.zeros(2, 16, 512, dtype=torch.bfloat16), workspace=torch.zeros(8),
        block_tables=torch.zeros(2, 2, dtype=torch.int32),
        seq_lens=torch.ones(2, dtype=torch.int32), max_seq_len=1, batch_size=2, max_q_len=1,
        cum_seq_lens_q=None, scales=KVScales(), counter=None,
    )
    assert kw["bmm1_scale"] == SCALE and kw["bmm2_scale"] == 1.0
    assert "multi_ctas_kv_counter_buffer" not in kw
    check_with_flashinfer(kw)


def test_flashinfer_rejects_unpadded_table():
    """The padding matters: FlashInfer's check refuses a width of 3 with 64-token pages."""
    with pytest.raises(ValueError, match="block_num"):
        _check_trtllm_gen_mla_shape(
            torch.zeros(2, 1, 16, 576), torch.zeros(4, 64, 576), 512, 64, 0,
            torch.zeros(2, 3, dtype=torch.int32), 64,
        )


def test_eligibility_reasons():
    assert TrtllmGenRoute.unsupported_reason(spec(), B200) is None
    assert TrtllmGenRoute.unsupported_reason(spec(), Platform("cuda", (10, 3), "B300")) is None
    assert "--block-size 64" in TrtllmGenRoute.unsupported_reason(spec(block=16), B200)
    assert "--block-size 64" in CuteDslRoute.unsupported_reason(spec(block=16), B200)
    assert "(512, 64)" in TrtllmGenRoute.unsupported_reason(spec(dims=(384, 64)), B200)
    assert "sparse" in TrtllmGenRoute.unsupported_reason(spec(dims=(512, 0)), B200)
    assert TrtllmGenRoute.unsupported_reason(spec(dims=(256, 64)), B200) is None
    assert "SM100" in TrtllmGenRoute.unsupported_reason(spec(), Platform("cuda", (9, 0), "H200"))
    assert "SM100" in CuteDslRoute.unsupported_reason(spec(), Platform("cuda", (12, 0), "5090"))
    assert "bfloat16" in TrtllmGenRoute.unsupported_reason(spec(q=torch.float16,
                                                                 kv=torch.float16), B200)
    fp8 = torch.float8_e4m3fn
    assert TrtllmGenRoute.unsupported_reason(spec(kv=fp8), B200) is None
    assert TrtllmGenRoute.unsupported_reason(spec(q=fp8, kv=fp8), B200) is None
    assert "FP8" in TrtllmGenRoute.unsupported_reason(spec(q=fp8), B200)


@pytest.mark.parametrize("heads", [24, 20, 96, 72])
def test_odd_heads_go_to_cute_dsl(heads):
    assert "cute-dsl" in TrtllmGenRoute.unsupported_reason(spec(heads=heads), B200)
    assert CuteDslRoute.unsupported_reason(spec(heads=heads), B200) is None


def test_head_tiling_rule():
    """vLLM 0.33's rule: heads % min(heads, tile) == 0 with tile 8/16/64, plus FlashInfer's
    refusal of 64 < heads < 128."""
    supported = (1, 2, 4, 8, 12, 16, 32, 40, 48, 64, 128, 192, 256)
    assert [h for h in supported if not trtllm_gen_supports_num_heads(h)] == []
    refused = (20, 24, 72, 96, 100, 160)
    assert [h for h in refused if trtllm_gen_supports_num_heads(h)] == []
