"""Route choice on fake platforms, the decoder's validation errors, and the CPU path."""

from __future__ import annotations

import pytest
import torch

from trtllm_mla_plugin.ops import (
    DecodeBatch,
    DecodeSpec,
    MLADecoder,
    Platform,
    choose_route,
    engine_query_dtype,
    join_query_parts,
    mla_decode,
    mla_decode_reference,
)
from trtllm_mla_plugin.ops.platform import CPU
from trtllm_mla_plugin.ops.policy import BatchShape
from trtllm_mla_plugin.ops.routes import ROUTES
from trtllm_mla_plugin.ops.routes.flashinfer_mla import fa_causal_tiles_safe

B200 = Platform("cuda", (10, 0), "NVIDIA B200")
H200 = Platform("cuda", (9, 0), "NVIDIA H200")
A100 = Platform("cuda", (8, 0), "NVIDIA A100")
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def spec(heads=16, block=64, q=BF16, kv=BF16, max_q_len=1, dims=(512, 64)):
    return DecodeSpec(heads, dims[0], dims[1], block, q, kv, 0.1, max_q_len)


ROUTE_MODULES = ("trtllm_gen", "flashinfer_mla", "flashmla", "flashmla_fp8", "triton_balanced",
                 "vllm_fa3_mla")


@pytest.fixture
def flashinfer_present(monkeypatch):
    """Pretend flashinfer (and nothing else optional) is importable."""
    for mod in ROUTE_MODULES:
        monkeypatch.setattr(f"trtllm_mla_plugin.ops.routes.{mod}.module_available",
                            lambda name: name == "flashinfer")


@pytest.fixture
def nothing_installed(monkeypatch):
    for mod in ROUTE_MODULES:
        monkeypatch.setattr(f"trtllm_mla_plugin.ops.routes.{mod}.module_available",
                            lambda name: False)


def test_blackwell_prefers_trtllm_gen(flashinfer_present):
    assert choose_route(spec(), B200).name == "trtllm-gen"
    assert choose_route(spec(), Platform("cuda", (10, 3), "B300")).name == "trtllm-gen"


@pytest.mark.parametrize("heads", [20, 24, 96])
def test_blackwell_odd_heads_take_cute_dsl(flashinfer_present, heads):
    choice = choose_route(spec(heads=heads), B200)
    assert choice.name == "flashinfer-cute-dsl"
    assert choice.skipped[0][0] == "trtllm-gen" and "cute-dsl" in choice.skipped[0][1]


def test_blackwell_block16_falls_to_fa2(flashinfer_present):
    choice = choose_route(spec(block=16), B200)
    assert choice.name == "flashinfer-fa2"
    assert "--block-size 64" in choice.explain()


def test_hopper_takes_fa3(flashinfer_present):
    assert choose_route(spec(), H200).name == "flashinfer-fa3"
    # FP8: FlashMLA's FP8 kernel first, then (few heads, large batches) the Triton kernel;
    # with neither installed, FA3
    choice = choose_route(spec(kv=FP8), H200, shape=BatchShape(64, 1))
    assert choice.name == "flashinfer-fa3"
    assert [name for name, _ in choice.skipped] == ["flashmla-fp8", "triton-balanced"]
    assert "vllm._flashmla_extension_C is not importable" in choice.skipped[0][1]
    assert "triton" in choice.skipped[1][1]
    assert choose_route(spec(heads=128, kv=FP8), H200).name == "flashinfer-fa3"


def test_hopper_fp8_few_heads_takes_triton(monkeypatch):
    for mod in ROUTE_MODULES:
        monkeypatch.setattr(f"trtllm_mla_plugin.ops.routes.{mod}.module_available",
                            lambda name: name in ("flashinfer", "triton"))
    # no CUDA toolkit: the bf16 batch below would otherwise go to the plugin's split-KV kernel
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.find_nvcc", lambda: None)
    monkeypatch.setattr("trtllm_mla_plugin.ops.routes.cuda_splitk.cached_cubin",
                        lambda *a, **k: None)
    big = BatchShape(64, 1, 4096, 64 * 2048)
    assert choose_route(spec(kv=FP8), H200, shape=big).name == "triton-balanced"
    assert choose_route(spec(kv=FP8), H200).name == "flashinfer-fa3"  # default: no batch yet
    assert choose_route(spec(), H200, shape=big).name == "flashinfer-fa3"


@pytest.fixture
def flashmla_fp8_present(monkeypatch):
    for mod in ROUTE_MODULES:
        monkeypatch.setattr(f"trtllm_mla_plugin.ops.routes.{mod}.module_available",
                            lambda name: name in ("flashinfer", "vllm._flashmla_extension_C"))


@pytest.mark.parametrize("heads", [16, 20, 128])
@pytest.mark.parametrize("q", [BF16, FP8])
@pytest.mark.parametrize("max_q_len", [1, 4])
def test_hopper_fp8_takes_flashmla_fp8(flashmla_fp8_present, heads, q, max_q_len):
    s = spec(heads=heads, q=q, kv=FP8, max_q_len=max_q_len)
    for shape in (None, BatchShape(1, 1), BatchShape(64, max_q_len, 4096, 64 * 2048)):
        assert choose_route(s, H200, shape=shape).name == "flashmla-fp8"


def test_flashmla_fp8_reasons(flashmla_fp8_present):
    reason = ROUTES["flashmla-fp8"].unsupported_reason
    assert "--block-size 64" in reason(spec(block=32, kv=FP8), H200)
    assert "FP8 (e4m3) caches only" in reason(spec(), H200)
    assert "bfloat16" in reason(spec(q=torch.float16, kv=FP8), H200)
    assert "kv_lora_rank 512" in reason(spec(kv=FP8, dims=(256, 64)), H200)
    for platform in (B200, A100, CPU, Platform("cuda", (9, 1), "SM91")):
        assert "SM90 only" in reason(spec(kv=FP8), platform)
    # block 32: FP8 caches fall back to a bf16-query route with the reason kept
    choice = choose_route(spec(block=32, kv=FP8), H200)
    assert choice.name == "flashinfer-fa3" and "--block-size 64" in choice.explain()


def test_engine_query_dtype(flashmla_fp8_present):
    """FP8 queries are asked of the engine only where every route would read FP8 anyway."""
    assert engine_query_dtype(spec(kv=FP8), H200) == FP8
    assert engine_query_dtype(spec(kv=FP8, heads=128, max_q_len=4), H200) == FP8
    assert engine_query_dtype(spec(), H200) == BF16  # bf16 cache
    assert engine_query_dtype(spec(kv=FP8, block=32), H200) == BF16  # FA3 reads bf16 queries
    assert engine_query_dtype(spec(kv=FP8), H200, forced="flashinfer-fa3") == BF16
    assert engine_query_dtype(spec(kv=FP8), H200, forced="flashmla-fp8") == FP8
    assert engine_query_dtype(spec(kv=FP8), B200) == FP8  # TRTLLM-gen reads FP8 queries
    assert engine_query_dtype(spec(kv=FP8), CPU) == BF16  # the reference takes any query
    with pytest.raises(ValueError, match="cannot serve"):
        engine_query_dtype(spec(kv=FP8), CPU, forced="flashmla-fp8")


def test_engine_query_dtype_without_flashmla_fp8(flashinfer_present):
    assert engine_query_dtype(spec(kv=FP8), H200) == BF16


def test_hopper_causal_tile_hazard_skips_fa(flashinfer_present):
    choice = choose_route(spec(heads=24, max_q_len=4), H200)
    assert choice.name == "torch-reference"  # flashmla and vLLM's FA3 not importable here
    assert [name for name, _ in choice.skipped] == ["flashinfer-fa3", "flashmla",
                                                    "vllm-fa3-mla", "flashinfer-fa2"]


def test_ampere_takes_fa2_but_not_fp8(flashinfer_present):
    assert choose_route(spec(), A100).name == "flashinfer-fa2"
    choice = choose_route(spec(kv=FP8), A100)
    assert choice.name == "torch-reference" and "SM90" in choice.explain()


def test_without_flashinfer_everything_falls_back(nothing_installed):
    for platform in (B200, H200, A100):
        choice = choose_route(spec(), platform)
        assert choice.name == "torch-reference"
        assert all("pip install" in r or "not importable" in r for _, r in choice.skipped)


def test_cpu_takes_reference():
    assert choose_route(spec(), CPU).name == "torch-reference"
    assert choose_route(spec(heads=7, block=5, dims=(100, 3)), CPU).name == "torch-reference"


def test_forced_route_errors(flashinfer_present):
    with pytest.raises(ValueError, match="unknown decode route 'nope'; known: trtllm-gen"):
        choose_route(spec(), H200, forced="nope")
    with pytest.raises(ValueError, match=r"cannot serve.*SM100/SM103"):
        choose_route(spec(), H200, forced="trtllm-gen")
    assert choose_route(spec(), H200, forced="flashinfer-fa2").name == "flashinfer-fa2"


def test_fa_causal_tile_rule():
    assert fa_causal_tiles_safe(16, 4) and fa_causal_tiles_safe(128, 4)
    assert fa_causal_tiles_safe(24, 2)  # 48 rows fit one 64-row tile
    assert not fa_causal_tiles_safe(24, 3) and not fa_causal_tiles_safe(96, 2)
    assert all(fa_causal_tiles_safe(h, 1) for h in (20, 24, 96, 100))


# ---- validation and the CPU decoder ---------------------------------------------------


def cpu_problem(lens=(5, 9), block=4, heads=2, q_len=1):
    s = DecodeSpec(heads, 8, 4, block, torch.float32, torch.float32, 0.5, q_len)
    width = max(-(-L // block) for L in lens)
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    batch = DecodeBatch(table, torch.tensor(lens, dtype=torch.int32), max(lens), max_q_len=q_len)
    query = torch.randn(len(lens) * q_len, heads, 12)
    kv = torch.randn(table.numel(), block, 12)
    return s, batch, query, kv


def test_cpu_decoder_matches_reference():
    s, batch, query, kv = cpu_problem(q_len=2)
    decoder = MLADecoder(s, "cpu", max_batch_size=4)
    assert decoder.route_name == "torch-reference"
    decoder.plan(batch)
    got = decoder.run(query, kv)
    want = mla_decode_reference(query.double(), kv.double(), batch.block_table,
                                batch.seq_lens, 0.5, 8)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    one_shot = mla_decode(query, kv, batch.block_table, batch.seq_lens, 0.5, 8,
                          max_seq_len=batch.max_seq_len, max_q_len=2)
    torch.testing.assert_close(one_shot, got)


def test_query_in_two_parts_matches_the_concatenated_query():
    """vLLM hands a 16-bit query over as (latent, rope) parts; a route that reads one
    tensor gets them concatenated by the decoder, with the same result."""
    s, batch, query, kv = cpu_problem(q_len=2)
    decoder = MLADecoder(s, "cpu", max_batch_size=4)
    decoder.plan(batch)
    latent, rope = query[..., :8].contiguous(), query[..., 8:].contiguous()
    want = mla_decode_reference(query.double(), kv.double(), batch.block_table,
                                batch.seq_lens, 0.5, 8)
    torch.testing.assert_close(decoder.run((latent, rope), kv).double(), want,
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"query parts must be \[num_tokens, 2, 4\]"):
        decoder.run((latent, rope[..., :3]), kv)
    with pytest.raises(ValueError, match="rows but the planned batch"):
        decoder.run((latent, rope[:1]), kv)
    with pytest.raises(ValueError, match="dtype mismatch"):
        decoder.run((latent, rope.double()), kv)


def test_query_parts_are_joined_by_the_decoders_query_join():
    """A route that reads one query tensor gets the parts through ``query_join`` (an
    engine's fused kernel): what it writes is what is decoded; the default, two copies,
    joins a strided rope part as ``torch.cat`` does."""
    s, batch, query, kv = cpu_problem(q_len=2)
    latent = query[..., :8].contiguous()
    projected = torch.zeros(*query.shape[:2], 3 + 4)
    projected[..., 3:] = query[..., 8:]
    rope = projected[..., 3:]  # strided, as vLLM's q_pe view of the projection
    out = torch.empty_like(query)
    join_query_parts(latent, rope, out)
    assert torch.equal(out, torch.cat((latent, rope), dim=-1))

    calls = []

    def zero_rope_join(a, b, joined):
        calls.append((a.shape, b.shape, joined.shape))
        joined[..., :8].copy_(a)
        joined[..., 8:].zero_()

    decoder = MLADecoder(s, "cpu", max_batch_size=4, query_join=zero_rope_join)
    decoder.plan(batch)
    got = decoder.run((latent, rope), kv)
    assert calls == [(latent.shape, rope.shape, query.shape)]
    no_rope = torch.cat((latent, torch.zeros_like(rope)), dim=-1)
    want = mla_decode_reference(no_rope.double(), kv.double(), batch.block_table,
                                batch.seq_lens, 0.5, 8)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    full = mla_decode_reference(query.double(), kv.double(), batch.block_table,
                                batch.seq_lens, 0.5, 8)
    assert not torch.allclose(got.double(), full, rtol=1e-3, atol=1e-4)
    decoder.run(query, kv)  # a whole query is never joined
    assert len(calls) == 1


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: setattr(b, "seq_lens", b.seq_lens.float()), r"\.to\(torch\.int32\)"),
        (lambda b: setattr(b, "max_seq_len", 10_000), "block table is too narrow"),
        (lambda b: setattr(b, "block_table", b.block_table[:1]), r"\[batch, max_blocks\]"),
        (lambda b: setattr(b, "max_q_len", 3), "raise DecodeSpec.max_q_len"),
    ],
)
def test_plan_errors_name_the_fix(mutate, match):
    s, batch, _, _ = cpu_problem()
    mutate(batch)
    with pytest.raises(ValueError, match=match):
        MLADecoder(s, "cpu", max_batch_size=4).plan(batch)


def test_batch_too_large():
    s, batch, _, _ = cpu_problem()
    with pytest.raises(ValueError, match="build it with a larger max_batch_size"):
        MLADecoder(s, "cpu", max_batch_size=1).plan(batch)


def test_run_errors_name_the_fix():
    s, batch, query, kv = cpu_problem()
    decoder = MLADecoder(s, "cpu", max_batch_size=4)
    decoder.plan(batch)
    with pytest.raises(ValueError, match=r"query must be \[num_tokens, 2, 12\]"):
        decoder.run(query[:, :1], kv)
    with pytest.raises(ValueError, match="kv_cache must be"):
        decoder.run(query, kv[:, :2])
    with pytest.raises(ValueError, match="dtype mismatch"):
        decoder.run(query.double(), kv)
    with pytest.raises(ValueError, match="contiguous"):
        decoder.run(query, torch.randn(kv.shape[0], 4, 24)[..., ::2])
    with pytest.raises(ValueError, match="out must be"):
        decoder.run(query, kv, out=torch.empty(2, 2, 7))


def test_spec_errors():
    with pytest.raises(ValueError, match="use bfloat16 or float16"):
        MLADecoder(DecodeSpec(2, 8, 4, 4, torch.int8, torch.int8, 0.5), "cpu", 1)
    with pytest.raises(ValueError, match="num_tokens is required"):
        DecodeBatch(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1,
                    cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_q_len=1)


def test_staged_tables_keep_addresses_and_zero_the_padding():
    """Routes copy each step's block table and lengths into these buffers, so a captured
    CUDA graph replays after re-planning; the table grows only for a wider table."""
    from trtllm_mla_plugin.ops.routes.base import StagedTables

    def batch(table, lens):
        t = torch.tensor(table, dtype=torch.int32)
        return DecodeBatch(t, torch.tensor(lens, dtype=torch.int32), max(lens))

    staged = StagedTables(4, torch.device("cpu"), width_multiple=4)
    table, lens = staged.stage(batch([[5, 6, 7], [8, 9, 10]], [40, 3]))
    assert table.shape == (2, 4) and table.tolist() == [[5, 6, 7, 0], [8, 9, 10, 0]]
    assert lens.tolist() == [40, 3]
    ptrs = (staged.block_table.data_ptr(), staged.seq_lens.data_ptr())
    table, lens = staged.stage(batch([[1, 2], [3, 4], [5, 6]], [7, 8, 9]))
    assert (staged.block_table.data_ptr(), staged.seq_lens.data_ptr()) == ptrs
    assert table.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0]]
    assert lens.tolist() == [7, 8, 9]
    staged.stage(batch([[1] * 5], [70]))  # wider: a new, larger table
    assert staged.block_table.shape == (4, 8)


def test_staged_tables_take_persistent_tensors_as_they_are():
    """An engine's inputs at fixed addresses (``DecodeBatch.persistent``, vLLM's model
    runner) go to the kernels as they are: no copy per step. Tensors a kernel could not
    read as they are (int64, a width that is not a multiple) are still staged."""
    from dataclasses import replace

    from trtllm_mla_plugin.ops.routes.base import StagedTables

    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([200, 30], dtype=torch.int32)
    owned = DecodeBatch(table, lens, 200, persistent=True)
    staged = StagedTables(4, torch.device("cpu"), width_multiple=4)
    got_table, got_lens = staged.stage(owned)
    assert got_table is table and got_lens is lens and staged.block_table is None
    not_marked = staged.stage(replace(owned, persistent=False))
    assert not_marked[0].data_ptr() == staged.block_table.data_ptr() != table.data_ptr()
    for unreadable in (replace(owned, block_table=table.long()),
                       replace(owned, seq_lens=lens.long()),
                       replace(owned, block_table=table[:, :3])):
        got_table, got_lens = staged.stage(unreadable)
        assert got_table.data_ptr() == staged.block_table.data_ptr()
        assert got_lens.data_ptr() == staged.seq_lens.data_ptr()
        width = unreadable.block_table.shape[1]
        assert torch.equal(got_table[:, :width], unreadable.block_table.int())
        assert not got_table[:, width:].any()
        assert got_lens.tolist() == [200, 30]


def test_staged_query_offsets_write_uniform_offsets_once(monkeypatch):
    """Uniform offsets (``arange * q_len``) are computed only when the buffer does not hold
    them yet; a ragged step's copy invalidates them. Every step reads one address."""
    from trtllm_mla_plugin.ops.routes.base import StagedQueryOffsets

    muls = []
    real_mul = torch.mul
    monkeypatch.setattr(torch, "mul", lambda *a, **k: muls.append(1) or real_mul(*a, **k))
    staged = StagedQueryOffsets(8, torch.device("cpu"))
    table = torch.zeros(8, 2, dtype=torch.int32)

    def uniform(b, q):
        return DecodeBatch(table[:b], torch.ones(b, dtype=torch.int32), 1, max_q_len=q)

    def ragged(q_lens):
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return DecodeBatch(table[: len(q_lens)], torch.ones(len(q_lens), dtype=torch.int32),
                           1, cu_seqlens_q=cu, max_q_len=max(q_lens), num_tokens=sum(q_lens))

    steps = [(uniform(4, 2), [0, 2, 4, 6, 8], 1), (uniform(2, 2), [0, 2, 4], 0),
             (uniform(4, 2), [0, 2, 4, 6, 8], 0), (uniform(6, 2), list(range(0, 13, 2)), 1),
             (ragged([1, 3]), [0, 1, 4], 0), (uniform(2, 2), [0, 2, 4], 1),
             (uniform(2, 3), [0, 3, 6], 1), (uniform(2, 3), [0, 3, 6], 0)]
    ptrs = set()
    for batch, expected, computed in steps:
        before = len(muls)
        cu = staged.stage(batch)
        assert cu.tolist() == expected
        assert len(muls) - before == computed
        ptrs.add(cu.data_ptr())
    assert len(ptrs) == 1


def test_length_order_reaches_the_gpu_in_one_host_copy(monkeypatch):
    """The FA3 route's length order of a uniform batch with host lengths: one
    ``copy_from_host`` a step (offsets, lengths, query rows and order in one array, each at
    its fixed offset), written in the destination's dtype."""
    import numpy as np

    from trtllm_mla_plugin.ops.routes import vllm_fa3_mla
    from trtllm_mla_plugin.ops.routes.base import copy_from_host

    dst = torch.zeros(5, dtype=torch.int32)
    copy_from_host(dst[1:4], np.array([7, 8, 9], dtype=np.int64))
    assert dst.tolist() == [0, 7, 8, 9, 0]

    calls = []

    def recording(d, s):
        calls.append(s.tolist())
        copy_from_host(d, s)

    monkeypatch.setattr(vllm_fa3_mla, "copy_from_host", recording)
    order = vllm_fa3_mla.LengthOrder(4, torch.device("cpu"))
    lens = torch.tensor([30, 500, 7], dtype=torch.int32)
    batch = DecodeBatch(torch.arange(6, dtype=torch.int32).view(3, 2), lens, 500,
                        max_q_len=2)
    cu = torch.arange(4, dtype=torch.int32) * 2
    order.stage(batch, batch.block_table, lens, cu, lens.numpy())
    # max batch 4: offsets [0:5], lengths [5:9], query rows [9:13], order [13:16]
    assert calls == [[2, 0, 4, 6, 0, 500, 30, 7, 0, 2, 2, 2, 0, 1, 0, 2]]
    assert order.seq_lens.tolist() == [500, 30, 7]
    assert order.cu_seqlens_q.tolist() == [2, 0, 4, 6]
    assert order.seqused_q.tolist() == [2, 2, 2]
    assert order.block_table.tolist() == [[2, 3], [0, 1], [4, 5]]


def test_flashinfer_csr_reaches_the_gpu_through_to_device(monkeypatch):
    """FlashInfer routes' page list takes its host sizes to the device with ``to_device``
    (an asynchronous copy), so an eager plan does not wait for the previous step's
    kernels."""
    from trtllm_mla_plugin.ops.routes import base, flashinfer_mla

    moved = []

    def recording(host, device):
        moved.append(host.tolist())
        return base.to_device(host, device)

    monkeypatch.setattr(flashinfer_mla, "to_device", recording)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    kv_indptr, kv_indices = flashinfer_mla.paged_csr(
        table, torch.tensor([65, 1, 130], dtype=torch.int32), 64)
    assert moved == [[2, 1, 3], [0, 2, 3]]
    assert kv_indptr.tolist() == [0, 2, 3, 6] and kv_indices.tolist() == [0, 1, 4, 8, 9, 10]
