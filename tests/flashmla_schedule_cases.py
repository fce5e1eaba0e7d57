"""FlashMLA's dense-decode tile schedule, independently of the plugin's kernel: its own
scheduler (``get_mla_metadata_kernel``) transcribed as a sequential walk, and a checker of
what FlashMLA's decode and combine kernels need from any schedule. Imported by
tests/test_flashmla_schedule_cpu.py and tests/gpu/test_decode_routes_gpu.py; run as a
script (``TRITON_INTERPRET=1``) it checks the plugin's kernel under Triton's interpreter."""

from __future__ import annotations

import os
import random
import sys

PAGE, OVERHEAD = 64, 5
FIELDS = ("begin_req", "end_req", "begin_block", "end_block", "begin_split", "first_split",
          "last_split")


def blocks(lens: list[int]) -> list[int]:
    return [(max(n, 1) - 1) // PAGE + 1 for n in lens]


def _flashmla_walk(nb: list[int], parts: int, overhead: int = OVERHEAD):
    """FlashMLA's scheduler walk over ``parts`` SM parts for requests of ``nb`` blocks: per
    part its start (request, block, piece) and end (request, block), then ``num_splits``.
    ``overhead``: a request's cost beside its blocks (FlashMLA's 5)."""
    b = len(nb)
    payload = -(-sum(n + overhead for n in nb) // parts) + overhead
    req = block = split = cum = 0
    splits, walk = [0], []
    for _ in range(parts):
        begin = (req, block, split)
        remain = payload
        while req < b:
            left = nb[req] - block
            if remain >= left + overhead:
                cum += split + 1
                splits.append(cum)
                remain -= left + overhead
                req, block, split = req + 1, 0, 0
            else:
                if remain - overhead > 0:
                    block += remain - overhead
                    split += 1
                break
        walk.append((begin, (req, block)))
    return walk, splits


def flashmla_greedy(lens: list[int], parts: int, overhead: int = OVERHEAD
                    ) -> tuple[list[list[int]], list[int]]:
    """FlashMLA's own schedule (its metadata kernel's walk over parts), rows of
    ``DecodingSchedMeta`` without the padding int, and ``num_splits``; with another
    ``overhead``, the same walk at that cost per request."""
    nb = blocks(lens)
    walk, splits = _flashmla_walk(nb, parts, overhead)
    rows = []
    for (req0, block0, split0), (req, block) in walk:
        row = [req0, req if block > 0 else req - 1, block0, 0, split0, int(block0 != 0), 0]
        # A zero-length request (a padding slot) is scheduled as one block but written as
        # ending at block 0, and never as split.
        row[3] = block if block > 0 else 0 if lens[req - 1] == 0 else nb[req - 1]
        row[6] = int(row[3] != nb[row[1]] and lens[row[1]] != 0)
        if row[0] == row[1]:
            row[5] = row[6] = row[5] | row[6]
        rows.append(row)
    return rows, splits


def flashmla_fp8_greedy(lens: list[int], parts: int, overhead: int = OVERHEAD
                        ) -> tuple[list[list[int]], list[int]]:
    """FlashMLA's dense FP8 schedule (``get_mla_decoding_metadata_dense_fp8``, the older
    scheduler): the same walk, a zero-length request counted as no blocks, rows
    ``[begin_idx, begin_seqlen, end_idx, end_seqlen, begin_split]`` in tokens."""
    walk, splits = _flashmla_walk([-(-n // PAGE) for n in lens], parts, overhead)
    rows = [[req0, block0 * PAGE, req if block > 0 else req - 1,
             block * PAGE if block > 0 else lens[req - 1], split0]
            for (req0, block0, split0), (req, block) in walk]
    return rows, splits


def check_schedule(lens: list[int], rows: list[list[int]], splits: list[int],
                   overhead: int = OVERHEAD) -> int:
    """Assert that ``rows``/``splits`` are a schedule FlashMLA's kernels compute correctly
    with: every KV block of every request in exactly one part, non-empty ranges, a request's
    pieces numbered ``0..n-1`` with ``n = splits[r + 1] - splits[r]``, written unsplit
    exactly when ``n == 1``. Returns the largest part's cost in blocks (blocks plus
    ``overhead`` per request piece)."""
    nb = blocks(lens)
    b = len(nb)
    assert len(splits) == b + 1 and splits[0] == 0
    covered = [[0] * n for n in nb]
    pieces: list[list[tuple[int, bool]]] = [[] for _ in nb]
    worst = 0
    for row in rows:
        first_req, last_req, first_block, last_block, first_split, split_a, split_z = row[:7]
        if first_req >= b:
            continue
        assert first_req <= last_req < b, row
        cost = 0
        for r in range(first_req, last_req + 1):
            lo = first_block if r == first_req else 0
            hi = last_block if r == last_req else nb[r]
            if lens[r] == 0 and r == last_req and hi == 0:
                hi = 1  # a padding slot: its one scheduled block, written as ending at 0
            assert 0 <= lo < hi <= nb[r], (row, r)
            for k in range(lo, hi):
                covered[r][k] += 1
            unsplit = (not split_a if r == first_req
                       else not split_z if r == last_req else True)
            pieces[r].append((first_split if r == first_req else 0, unsplit))
            cost += hi - lo + overhead
        worst = max(worst, cost)
    # FlashMLA sizes its float32 partials for batch + parts pieces, and its combine kernel
    # takes at most as many pieces per request as there are parts.
    assert splits[-1] <= b + len(rows), (splits[-1], b, len(rows))
    for r in range(b):
        assert covered[r] == [1] * nb[r], f"request {r}: blocks covered {covered[r]}"
        assert splits[r + 1] - splits[r] <= len(rows), r
        n = splits[r + 1] - splits[r]
        assert n == len(pieces[r]), (r, n, pieces[r])
        if n == 1:
            assert pieces[r][0][1], f"request {r} has one piece but is written as split"
        else:
            assert not any(unsplit for _, unsplit in pieces[r]), r
            assert sorted(i for i, _ in pieces[r]) == list(range(n)), (r, pieces[r])
    return worst


def random_lens(rng: random.Random) -> tuple[list[int], int]:
    b = rng.choice([1, 2, 3, 7, 16, 33, 64, 129, 200, 257, 512])
    longest = rng.choice([1, 63, 64, 65, 300, 1000, 4096, 16000, 65536])
    # Length 0: a padding slot of a CUDA-graph batch (FlashMLA counts it as one block).
    lens = [0 if rng.random() < 0.03 else longest if rng.random() < 0.4
            else rng.randint(1, longest) for _ in range(b)]
    # 132 SMs over 1-16 query tiles per request (heads x q_len / 64), and a few others.
    parts = rng.choice([132, 66, 44, 33, 26, 22, 18, 16, 13, 12, 11, 10, 9, 8, 1])
    return lens, parts


def plugin_schedule(lens: list[int], parts: int, device: str = "cpu", **launch):
    """The plugin's kernel on ``lens``: its rows (all 8 ints) and ``num_splits``."""
    import torch

    from trtllm_mla_plugin.ops.kernels.flashmla_schedule import flashmla_schedule

    meta = torch.full((parts, 8), -7, dtype=torch.int32, device=device)
    splits = torch.full((len(lens) + 1,), -7, dtype=torch.int32, device=device)
    ends = torch.full((3, max(len(lens), 1)), -7, dtype=torch.int32, device=device)
    owners = torch.full((parts + 1,), -7, dtype=torch.int32, device=device)
    flashmla_schedule(torch.tensor(lens, dtype=torch.int32, device=device), meta, splits,
                      ends, owners, **launch)
    return meta.cpu().tolist(), splits.cpu().tolist()


def same_schedule(lens: list[int], rows, splits, want_rows, want_splits) -> bool:
    """``rows``/``splits`` equal to ``want_*`` in every field FlashMLA's kernels read: all of
    a part with work, ``begin_req >= batch`` of a part without (its other fields are left
    stale by FlashMLA's scheduler and never read)."""
    b = len(lens)
    return splits == want_splits and len(rows) == len(want_rows) and all(
        got[0] >= b if want[0] >= b else got[:7] == want[:7]
        for got, want in zip(rows, want_rows, strict=True))


def same_fp8_schedule(rows, splits, want_rows, want_splits) -> bool:
    """The plugin's FP8-layout rows equal FlashMLA's dense FP8 schedule in the five fields
    FlashMLA writes (every part, with or without work), the rest zero."""
    return splits == want_splits and [r[:5] for r in rows] == want_rows and all(
        r[5:] == [0, 0, 0] for r in rows)


def main(cases: int) -> int:
    rng = random.Random(11)
    for i in range(cases):
        lens, parts = random_lens(rng)
        if i % 4 == 3:  # uniform batches: the most boundaries snapping to request ends
            lens = [rng.choice([0, 1, 64, 65, 1315, 2048, 9000])] * rng.randint(1, 300)
        rows, splits = plugin_schedule(lens, parts)
        check_schedule(lens, rows, splits)
        assert all(row[7] == 0 for row in rows)
        want_rows, want_splits = flashmla_greedy(lens, parts)
        assert same_schedule(lens, rows, splits, want_rows, want_splits), (i, lens, parts)
        rows, splits = plugin_schedule(lens, parts, fp8_layout=True)
        assert same_fp8_schedule(rows, splits, *flashmla_fp8_greedy(lens, parts)), (i, lens)
        # Another cost per request: still FlashMLA's walk at that cost, still valid.
        overhead = rng.choice([1, 2, 13, 64, 1000])
        rows, splits = plugin_schedule(lens, parts, overhead_blocks=overhead)
        check_schedule(lens, rows, splits, overhead)
        want_rows, want_splits = flashmla_greedy(lens, parts, overhead)
        assert same_schedule(lens, rows, splits, want_rows, want_splits), (i, overhead)
        rows, splits = plugin_schedule(lens, parts, fp8_layout=True, overhead_blocks=overhead)
        assert same_fp8_schedule(rows, splits, *flashmla_fp8_greedy(lens, parts, overhead))
    print(f"schedule: {cases} cases valid and equal to FlashMLA's own (bf16 and FP8), "
          "and to its walk at other costs per request")
    return 0


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
