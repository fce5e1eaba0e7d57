"""The pure-torch reference against a naive per-request, per-row float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from trtllm_mla_plugin.ops import UNIT_SCALES, KVScales, mla_decode_reference
from trtllm_mla_plugin.ops import reference as reference_module

DC, DR = 32, 16  # small latent dims keep the loop fast; the reference is dim-agnostic


def naive(query, kv, table, lens, q_lens, scale, dc, scales=UNIT_SCALES):
    """Row t of a request with L keys and n rows sees keys [0, L - n + t]."""
    out = torch.zeros(query.shape[0], query.shape[1], dc, dtype=torch.float64)
    block = kv.shape[1]
    row = 0
    for r, (L, n) in enumerate(zip(lens, q_lens, strict=True)):
        keys = torch.stack([kv[table[r][i // block], i % block] for i in range(L)]).double()
        for t in range(n):
            visible = L - n + t + 1
            for h in range(query.shape[1]):
                q = query[row, h].double() * scales.q_scale
                s = [float(q @ (keys[j] * scales.k_scale)) * scale for j in range(visible)]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                z = sum(w)
                for j in range(visible):
                    out[row, h] += w[j] / z * keys[j, :dc] * scales.v_scale
            row += 1
    return out


def case(lens, q_lens, block, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-L // block) for L in lens]
    nblocks = sum(need) + 3
    perm = torch.randperm(nblocks, generator=g)
    table = torch.full((len(lens), max(need) + 1), int(perm[-1]), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    kv = torch.randn(nblocks, block, DC + DR, generator=g, dtype=torch.float64)
    query = torch.randn(sum(q_lens), heads, DC + DR, generator=g, dtype=torch.float64)
    return query, kv, table


@pytest.mark.parametrize(
    "lens,q_lens",
    [
        ([1], [1]),
        ([7, 8, 9], [1, 1, 1]),  # block - 1, block, block + 1
        ([16, 1, 23], [1, 1, 1]),
        ([9, 17], [3, 2]),  # causal, ragged
        ([4, 8], [4, 4]),  # every key masked for the first row but one
        ([8, 30, 2], [2, 1, 2]),
    ],
)
@pytest.mark.parametrize("chunk_rows", [None, 1, 2])
def test_matches_naive_loop(lens, q_lens, chunk_rows, monkeypatch):
    """Whole, and in chunks of one or two query rows (``CHUNK_ELEMENTS``, which bounds
    the reference's memory on long batches)."""
    block, scale = 8, 0.3
    if chunk_rows is not None:
        span = max(lens)  # the gather's width with max_seq_len
        monkeypatch.setattr(reference_module, "CHUNK_ELEMENTS", chunk_rows * span * (DC + DR))
    query, kv, table = case(lens, q_lens, block)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    uniform = len(set(q_lens)) == 1
    got = mla_decode_reference(
        query, kv, table, torch.tensor(lens, dtype=torch.int32), scale, DC,
        cu_seqlens_q=None if uniform else cu, max_seq_len=max(lens),
    )
    want = naive(query, kv, table, lens, q_lens, scale, DC)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if uniform:  # the explicit offsets give the same answer
        again = mla_decode_reference(
            query, kv, table, torch.tensor(lens, dtype=torch.int32), scale, DC,
            cu_seqlens_q=cu, max_seq_len=max(lens),
        )
        torch.testing.assert_close(again, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunked", [False, True])
def test_scales_and_fp8_cache(chunked, monkeypatch):
    if chunked:  # one query row at a time
        monkeypatch.setattr(reference_module, "CHUNK_ELEMENTS", 1)
    lens, q_lens, block = [13, 5], [1, 2], 4
    query, kv, table = case(lens, q_lens, block, seed=3)
    kv8 = kv.to(torch.float8_e4m3fn)
    scales = KVScales(q_scale=1.5, k_scale=0.5, v_scale=0.25)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    got = mla_decode_reference(
        query, kv8, table, torch.tensor(lens, dtype=torch.int32), 0.2, DC, cu_seqlens_q=cu,
        scales=scales,
    )
    want = naive(query, kv8.double(), table, lens, q_lens, 0.2, DC, scales)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_out_buffer_and_dtype():
    lens, q_lens, block = [10], [1], 4
    query, kv, table = case(lens, q_lens, block)
    out = torch.full((1, 3, DC), float("nan"), dtype=torch.bfloat16)
    res = mla_decode_reference(
        query.bfloat16(), kv.bfloat16(), table, torch.tensor(lens), 0.3, DC, out=out
    )
    assert res is out and torch.isfinite(out).all()
    want = naive(query.bfloat16(), kv.bfloat16(), table, lens, q_lens, 0.3, DC)
    assert ((out.double() - want).norm() / want.norm()).item() < 1e-2
