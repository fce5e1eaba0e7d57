"""The FlashMLA routes' own schedule kernel (``kernels.flashmla_schedule``) on the GPU: what
it writes against the schedules vLLM's FlashMLA extensions compute for themselves (bf16
dense decode, dense FP8) and against FlashMLA's schedulers transcribed, and the route on it
against the float64 reference and against FlashMLA on its own schedule (vLLM's FLASHMLA
call)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from trtllm_mla_plugin.ops import MLADecoder

from mla_cases import (
    GPU_TEST_MARKS,
    HEAD_DIM,
    bounds,
    errors,
    make_problem,
    reference,
    route_skip_reason,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashmla_schedule_cases import (
    check_schedule,
    flashmla_fp8_greedy,
    flashmla_greedy,
    plugin_schedule,
    random_lens,
    same_fp8_schedule,
    same_schedule,
)

pytestmark = GPU_TEST_MARKS
BF16 = torch.bfloat16


def _flashmla_ops():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's dense decode runs on SM90")
    try:
        import vllm.third_party.flashmla.flash_mla_interface  # noqa: F401  loads _flashmla_C
    except ImportError as exc:
        pytest.skip(f"vLLM's FlashMLA is not importable: {exc}")
    return torch.ops._flashmla_C


def _own_schedule(lens: list[int], heads: int, q_len: int):
    """FlashMLA's decode on a small random problem with no schedule given: the schedule its
    metadata kernel computed, as the extension returns it. A length of 0 (a CUDA-graph
    padding slot) is given to FlashMLA as 0 over a problem built with one token there."""
    ops = _flashmla_ops()
    p = make_problem(heads=heads, block=64, lens=[max(n, q_len) for n in lens],
                     q_lens=q_len, dtype=BF16, kv_dtype=BF16, device=torch.device("cuda"))
    b = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=p.batch.seq_lens.device)
    _, _, meta, splits = ops.dense_decode_fwd(
        p.query.view(b, q_len, heads, HEAD_DIM), p.kv_cache.unsqueeze(-2), 512,
        seq_lens, p.batch.block_table, 0.1, q_len > 1, None, None, None)
    return meta.cpu().tolist(), splits.cpu().tolist()


def test_kernel_writes_flashmla_own_schedule():
    """The extension's own schedule (its metadata kernel, no schedule given) equals, in
    every field its kernels read, what FlashMLA's scheduler as transcribed in
    flashmla_schedule_cases.py gives, and what the plugin's kernel writes on the GPU: the
    field order is the one the bundled kernels read, and the plugin's plan is FlashMLA's."""
    rng = random.Random(21)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i in range(40):
        b = rng.choice([1, 3, 16, 40, 129, 187])
        if i % 3 == 2:
            lens = [rng.choice([1, 64, 65, 1315, 2048])] * b
        else:
            lens = [rng.randint(1, rng.choice([100, 3000, 20000])) for _ in range(b)]
        heads, q_len = rng.choice([(16, 1), (64, 1), (128, 1), (16, 4), (64, 2), (128, 2)])
        lens = [max(n, q_len) for n in lens]
        meta, splits = _own_schedule(lens, heads, q_len)
        parts = max(sms // -(-heads * q_len // 64), 1)
        assert len(meta) == parts and len(meta[0]) == 8
        assert same_schedule(lens, meta, splits, *flashmla_greedy(lens, parts)), (i, lens)
        mine, mine_splits = plugin_schedule(lens, parts, device="cuda")
        assert same_schedule(lens, mine, mine_splits, meta, splits), (i, lens)


@pytest.mark.parametrize("chunk,num_warps", [(128, 4), (64, 2), (32, 1)])
def test_kernel_gives_flashmla_schedules(chunk: int, num_warps: int):
    """The default launch and the two the bench also times (requests per step, warps)."""
    _flashmla_ops()
    rng = random.Random(7)
    for _ in range(300):
        lens, parts = random_lens(rng)
        rows, splits = plugin_schedule(lens, parts, device="cuda", chunk=chunk,
                                       num_warps=num_warps)
        check_schedule(lens, rows, splits)
        assert same_schedule(lens, rows, splits, *flashmla_greedy(lens, parts)), lens


@pytest.mark.parametrize("seed", range(8))
def test_route_on_its_schedule_matches_reference(seed: int):
    """Random batches (up to 300 requests, lengths 1-40k, 16-128 heads, 1-4 query tokens)
    on the forced FlashMLA route, against float64 and against FlashMLA on its own
    schedule."""
    ops = _flashmla_ops()
    device = torch.device("cuda")
    rng = random.Random(seed)
    heads = rng.choice([16, 32, 64, 128])
    q_len = rng.choice([1, 1, 2, 4])
    b = rng.choice([1, 5, 33, 120, 300])
    longest = rng.choice([64, 700, 5000, 40000]) if b < 200 else rng.choice([64, 700, 3000])
    lens = [max(q_len, rng.randint(1, longest)) for _ in range(b)]
    gen = torch.Generator(device=device).manual_seed(seed)
    p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=BF16,
                     kv_dtype=BF16, device=device, generator=gen)
    if (reason := route_skip_reason("flashmla", p.spec, device)) is not None:
        pytest.skip(reason)
    decoder = MLADecoder(p.spec, device, max_batch_size=b, route="flashmla")
    decoder.plan(p.batch)
    out = decoder.run(p.query, p.kv_cache)
    torch.cuda.synchronize()
    rel, worst = errors(out, reference(p))
    rel_bound, max_bound = bounds(p)
    own, *_ = ops.dense_decode_fwd(
        p.query.view(b, q_len, heads, HEAD_DIM), p.kv_cache.unsqueeze(-2), 512,
        p.batch.seq_lens, p.batch.block_table, p.spec.softmax_scale, q_len > 1, None, None,
        None)
    rel_own, _ = errors(out, own.reshape(out.shape).to(torch.float64))
    print(f"[flashmla schedule h{heads} b{b} q{q_len} <= {longest}] rel={rel:.2e} "
          f"max={worst:.2e} vs-own-schedule={rel_own:.1e}")
    assert rel < rel_bound and worst < max_bound, (rel, worst)
    assert rel_own < 5e-3, rel_own


@pytest.mark.parametrize("overhead", [1, 32, 1000])
def test_route_on_other_costs_per_request_matches_reference(overhead: int):
    """FlashMLA's kernels on the walk at another cost per request (more split requests at 1,
    fewer at 32 and 1000; ``bench_flashmla_schedule.py --sections overhead`` times them)
    still compute the attention: against float64 on random batches."""
    _flashmla_ops()
    device = torch.device("cuda")
    rng = random.Random(overhead)
    for i in range(4):
        heads, q_len = rng.choice([(16, 1), (32, 1), (128, 1), (64, 2), (16, 4)])
        b = rng.choice([1, 3, 40, 140, 300])
        longest = rng.choice([64, 400, 3000, 30000]) if b < 200 else rng.choice([64, 1200])
        lens = [max(q_len, rng.randint(1, longest)) for _ in range(b)]
        gen = torch.Generator(device=device).manual_seed(i)
        p = make_problem(heads=heads, block=64, lens=lens, q_lens=q_len, dtype=BF16,
                         kv_dtype=BF16, device=device, generator=gen)
        decoder = MLADecoder(p.spec, device, max_batch_size=b, route="flashmla")
        decoder.route._schedule.overhead_blocks = overhead
        decoder.plan(p.batch)
        out = decoder.run(p.query, p.kv_cache)
        torch.cuda.synchronize()
        meta, splits = (t.cpu().tolist() for t in decoder.route._schedule.buffers)
        check_schedule(lens, meta, splits, overhead)
        assert same_schedule(lens, meta, splits,
                             *flashmla_greedy(lens, len(meta), overhead)), (i, lens)
        rel, worst = errors(out, reference(p))
        rel_bound, max_bound = bounds(p)
        print(f"[overhead {overhead} h{heads} b{b} q{q_len} <= {longest}] rel={rel:.2e}")
        assert rel < rel_bound and worst < max_bound, (rel, worst)


def test_fp8_layout_is_flashmla_fp8_own_schedule():
    """FlashMLA's dense FP8 scheduler (``get_mla_decoding_metadata_dense_fp8``, which vLLM's
    FLASHMLA runs for FP8 caches) equals its transcription and the plugin's kernel with
    ``fp8_layout``, every field it writes, zero-length padding slots included."""
    _flashmla_ops()
    try:
        import vllm._flashmla_extension_C  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"vLLM's FlashMLA FP8 extension is not importable: {exc}")
    ops = torch.ops._flashmla_extension_C
    rng = random.Random(31)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i in range(60):
        lens, _ = random_lens(rng)
        if i % 3 == 2:
            lens = [rng.choice([0, 1, 64, 65, 1315, 2048])] * rng.randint(1, 200)
        heads, q_len = rng.choice([(16, 1), (64, 1), (128, 1), (16, 4), (64, 2), (128, 2)])
        meta, splits = ops.get_mla_decoding_metadata_dense_fp8(
            torch.tensor(lens, dtype=torch.int32, device="cuda"), q_len * heads, 1)
        own = [row[:5] for row in meta.cpu().tolist()]
        parts = sms // -(-q_len * heads // 64)
        assert len(own) == parts
        want = flashmla_fp8_greedy(lens, parts)
        assert (own, splits.cpu().tolist()) == want, (i, lens)
        mine, mine_splits = plugin_schedule(lens, parts, device="cuda", fp8_layout=True)
        assert same_fp8_schedule(mine, mine_splits, *want), (i, lens)


def test_padding_slots_as_flashmla_schedules_them():
    """Zero-length requests (CUDA-graph padding slots) among real ones, one query token:
    the plugin's schedule equals the extension's own. Last in the file: FlashMLA's decode
    runs on the zero-length slots here."""
    rng = random.Random(5)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for _ in range(12):
        b = rng.choice([2, 16, 40, 129])
        lens = [0 if rng.random() < 0.3 else rng.randint(1, 5000) for _ in range(b)]
        heads = rng.choice([16, 64, 128])
        meta, splits = _own_schedule(lens, heads, 1)
        parts = max(sms // -(-heads // 64), 1)
        mine, mine_splits = plugin_schedule(lens, parts, device="cuda")
        assert same_schedule(lens, mine, mine_splits, meta, splits), lens
