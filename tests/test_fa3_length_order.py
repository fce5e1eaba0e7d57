"""``LengthOrder``: the per-request tables the ``vllm-fa3-mla`` route hands FA3 when it
launches the requests longest first (CPU tensors; the GPU launch itself is checked
against float64 in ``tests/gpu/test_cuda_graph_gpu.py``)."""

from __future__ import annotations

import numpy as np
import torch

from trtllm_mla_plugin.ops.routes.vllm_fa3_mla import LengthOrder
from trtllm_mla_plugin.ops.spec import DecodeBatch


def make_batch(lens: list[int], q_len: int, host: bool, ragged_q: list[int] | None = None):
    b = len(lens)
    table = torch.arange(b * 3, dtype=torch.int32).view(b, 3) + 100
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if ragged_q is None:
        cu = torch.arange(b + 1, dtype=torch.int32) * q_len
        batch = DecodeBatch(table, seq_lens, max(lens), max_q_len=q_len,
                            seq_lens_host=seq_lens.clone() if host else None)
    else:
        cu = torch.tensor(np.concatenate([[0], np.cumsum(ragged_q)]), dtype=torch.int32)
        batch = DecodeBatch(table, seq_lens, max(lens), cu_seqlens_q=cu,
                            max_q_len=max(ragged_q), num_tokens=int(cu[-1]),
                            seq_lens_host=seq_lens.clone() if host else None,
                            cu_seqlens_q_host=cu.clone() if host else None)
    return batch, table, seq_lens, cu


def stage(order: LengthOrder, batch, table, seq_lens, cu):
    host = None if batch.seq_lens_host is None else batch.seq_lens_host.numpy()
    order.stage(batch, table, seq_lens, cu, host)


def test_requests_longest_first_with_their_own_rows():
    lens = [300, 9000, 64, 9000, 4000]
    q_len = 2
    batch, table, seq_lens, cu = make_batch(lens, q_len, host=True)
    order = LengthOrder(8, torch.device("cpu"))
    stage(order, batch, table, seq_lens, cu)
    want = [1, 3, 4, 0, 2]  # longest first, ties in the caller's order
    assert order.seq_lens.tolist() == [lens[i] for i in want]
    assert order.lens_host.tolist() == [lens[i] for i in want]
    assert order.block_table.tolist() == [table[i].tolist() for i in want]
    # Each request keeps its query rows: the kernel reads (and writes) request i's rows at
    # cu_seqlens_q[i] for seqused_q[i] rows.
    assert order.cu_seqlens_q[:-1].tolist() == [i * q_len for i in want]
    assert order.seqused_q.tolist() == [q_len] * len(lens)
    rows = sorted((int(s), int(s) + int(n))
                  for s, n in zip(order.cu_seqlens_q[:-1], order.seqused_q, strict=True))
    assert rows == [(i * q_len, (i + 1) * q_len) for i in range(len(lens))]


def test_caller_order_without_host_lengths_or_with_ragged_queries():
    lens = [300, 9000, 64]
    order = LengthOrder(8, torch.device("cpu"))
    for batch, table, seq_lens, cu in (make_batch(lens, 1, host=False),
                                       make_batch(lens, 3, host=True, ragged_q=[1, 3, 2])):
        stage(order, batch, table, seq_lens, cu)
        assert order.seq_lens.tolist() == lens
        assert order.block_table.tolist() == table.tolist()
        assert order.cu_seqlens_q.tolist() == cu.tolist()
        assert order.seqused_q.tolist() == (cu[1:] - cu[:-1]).tolist()


def test_buffers_stay_put_across_steps():
    order = LengthOrder(8, torch.device("cpu"))
    first = make_batch([10, 20, 30, 40], 1, host=True)
    stage(order, *first)
    addresses = [t.data_ptr() for t in (order.block_table, order.seq_lens,
                                        order.cu_seqlens_q, order.seqused_q)]
    stage(order, *make_batch([40, 5, 700, 1], 1, host=True))
    assert [t.data_ptr() for t in (order.block_table, order.seq_lens,
                                   order.cu_seqlens_q, order.seqused_q)] == addresses
    assert order.seq_lens.tolist() == [700, 40, 5, 1]
