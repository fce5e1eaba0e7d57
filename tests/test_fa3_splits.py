"""``ops.fa3_splits``: FA3's split formula and the balanced plan, against an independent
simulation of FA3's persistent grid (CPU)."""

from __future__ import annotations

import heapq
import math
import random

import numpy as np
import pytest

from trtllm_mla_plugin.ops import fa3_splits

SMS = 132


def grid_span(kv_tiles: list[int], splits: list[int], query_tiles: int,
              split_cost: float) -> float:
    """The busiest of ``SMS`` CTAs when each takes the next (request, query tile, split)
    work tile in batch order as it frees up, a tile costing its KV tiles plus
    ``split_cost``."""
    free = [0.0] * SMS
    for n, s in zip(kv_tiles, splits, strict=True):
        per = -(-n // s)
        for _ in range(query_tiles):
            for j in range(s):
                size = min(per, n - j * per)
                heapq.heappush(free, heapq.heappop(free) + size + split_cost)
    return max(free)


def test_fa3_formula_by_hand():
    # 28 requests of 276 KV tiles, one query tile: ceil(7728 x 1.1 / 132) = 65 tiles a
    # split, so ceil(276 / 65) = 5 splits each: 140 work tiles on 132 SMs.
    assert fa3_splits.fa3_splits(np.full(28, 276), 1, 32, SMS).tolist() == [5] * 28
    # The cap binds: one request of 700 tiles, ceil(770 / 132) = 6 a split -> 117, capped.
    assert fa3_splits.fa3_splits(np.array([700]), 1, 32, SMS).tolist() == [32]


def test_balanced_plan_fills_the_grid_where_fa3_spills_a_second_wave():
    kv_tiles = np.full(28, 276)
    cost = fa3_splits.split_cost_tiles(32)
    own = fa3_splits.fa3_splits(kv_tiles, 1, 32, SMS)
    balanced = fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 32)
    assert balanced is not None
    own_span = grid_span(kv_tiles.tolist(), own.tolist(), 1, cost)
    balanced_span = grid_span(kv_tiles.tolist(), balanced.tolist(), 1, cost)
    assert balanced_span < 0.7 * own_span


def test_no_replan_outside_the_spill_band():
    # One wave (28 x 4 = 112 tiles) and three waves (400 one-split requests).
    assert fa3_splits.fa3_splits(np.full(28, 200), 1, 4, SMS).sum() == 112
    assert fa3_splits.balanced_splits(np.full(28, 200), 1, 64, SMS, 32, fa3_cap=4) is None
    assert fa3_splits.fa3_splits(np.full(400, 30), 1, 32, SMS).sum() == 400
    assert fa3_splits.balanced_splits(np.full(400, 30), 1, 32, SMS, 16) is None


def test_a_wider_band_replans_past_spill_but_never_past_fa3s_dynamic_split_batch():
    # 187 one-split requests of 200 KV tiles at 64-row tiles: 1.42 waves, past SPILL (1.35);
    # cut in two, 374 tiles run in 3 waves of half the work.
    kv_tiles = np.full(187, 200)
    assert fa3_splits.fa3_splits(kv_tiles, 1, 32, SMS).sum() == 187
    assert fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 64) is None
    wider = fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 64, spill=math.inf)
    assert wider is not None
    cost = fa3_splits.split_cost_tiles(64)
    assert (grid_span(kv_tiles.tolist(), wider.tolist(), 1, cost)
            < 0.8 * grid_span(kv_tiles.tolist(), [1] * 187, 1, cost))
    # FA3 reads no per-request splits beyond 992 requests, whatever the band.
    assert fa3_splits.balanced_splits(np.full(993, 20), 1, 32, SMS, 8, spill=math.inf) is None


def test_narrow_tiles_over_long_requests_take_the_wider_band():
    cost = fa3_splits.split_cost_tiles(32)
    # The same 1.42 waves at 32-row tiles over requests of 200 KV tiles: NARROW_SPILL.
    kv_tiles = np.full(187, 200)
    planned = fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 32)
    assert planned is not None
    assert (grid_span(kv_tiles.tolist(), planned.tolist(), 1, cost)
            < 0.8 * grid_span(kv_tiles.tolist(), [1] * 187, 1, cost))
    # Requests averaging fewer than NARROW_MIN_MEAN_TILES: SPILL's band, FA3's plan kept.
    short = np.full(187, fa3_splits.NARROW_MIN_MEAN_TILES - 1)
    assert fa3_splits.fa3_splits(short, 1, 32, SMS).sum() == 187
    assert fa3_splits.balanced_splits(short, 1, 32, SMS, 32) is None
    # 48 rows a request still narrow, 64 not, nor two tiles of 48 on average (96 rows).
    assert fa3_splits.spill_band(48, kv_tiles) == fa3_splits.NARROW_SPILL
    assert fa3_splits.spill_band(64, kv_tiles) == fa3_splits.SPILL
    assert fa3_splits.balanced_splits(np.full(94, 200), 2, 32, SMS, 48) is None
    assert fa3_splits.fa3_splits(np.full(94, 200), 2, 32, SMS).sum() * 2 == 188
    # Past NARROW_SPILL (210 requests: 1.59 waves): FA3's plan kept.
    assert fa3_splits.balanced_splits(np.full(210, 200), 1, 32, SMS, 32) is None


def test_near_equal_batches_past_the_band_are_replanned_into_one_wave():
    # 52 requests of 12 KV tiles at two 64-row query tiles (h64 q2 at 757 tokens, run 177):
    # ceil(1248 x 1.1 / 132) = 11 KV tiles a split cuts each request in two, 208 work tiles,
    # 1.58 waves: past SPILL. Unsplit, the 104 tiles run in one wave.
    kv_tiles = np.full(52, 12)
    own = fa3_splits.fa3_splits(kv_tiles, 2, 32, SMS)
    assert 2 * own.sum() == 208
    plan = fa3_splits.balanced_splits(kv_tiles, 2, 32, SMS, 64)
    assert plan is not None and 2 * plan.sum() <= SMS
    cost = fa3_splits.split_cost_tiles(64)
    assert (grid_span(kv_tiles.tolist(), plan.tolist(), 2, cost)
            < 0.8 * grid_span(kv_tiles.tolist(), own.tolist(), 2, cost))
    # A padded batch's empty slots count neither toward the spread nor as pieces to cut.
    padded = np.concatenate([kv_tiles, np.zeros(8, dtype=np.int64)])
    assert fa3_splits.one_wave_past_band(padded, 2, SMS)
    padded_plan = fa3_splits.balanced_splits(padded, 2, 32, SMS, 64)
    assert padded_plan is not None and 2 * padded_plan.sum() <= SMS


def test_ragged_batches_past_the_band_keep_fa3s_plan():
    # Lengths of 6-63 KV tiles, longest 1.82x the mean (the grid's h128 b64 4k r, 1.7-2.0,
    # ran 0.92-0.95x FA3's plan unsplit): FA3 spills 1.5 waves, and the plan is kept (the
    # longest past ONE_WAVE_SHORT_MAX_TILES).
    kv_tiles = np.tile(np.arange(6, 64, 2), 3)[:64]
    assert kv_tiles.max() * kv_tiles.size > fa3_splits.ONE_WAVE_MAX_SPREAD * kv_tiles.sum()
    own_tiles = 2 * fa3_splits.fa3_splits(kv_tiles, 2, 32, SMS).sum()
    assert own_tiles > fa3_splits.SPILL * SMS
    assert not fa3_splits.one_wave_past_band(kv_tiles, 2, SMS)
    assert fa3_splits.balanced_splits(kv_tiles, 2, 32, SMS, 64) is None
    # Near-equal lengths, but more query tiles than SMs: no plan fits one wave.
    assert not fa3_splits.one_wave_past_band(np.full(67, 12), 2, SMS)


def assert_unsplit_in_one_wave(kv_tiles: np.ndarray, fa3_work_tiles: int) -> None:
    """At two 64-row query tiles a request, FA3's plan holds ``fa3_work_tiles`` and the
    route replaces it with every request unsplit, in one wave."""
    assert 2 * fa3_splits.fa3_splits(kv_tiles, 2, 32, SMS).sum() == fa3_work_tiles
    plan = fa3_splits.balanced_splits(kv_tiles, 2, 32, SMS, 64)
    assert plan is not None and (plan == 1).all()


def assert_fa3_plan_kept_past_the_band(kv_tiles: np.ndarray) -> None:
    """At two 64-row query tiles a request, FA3's plan spills past SPILL and is kept."""
    assert 2 * fa3_splits.fa3_splits(kv_tiles, 2, 32, SMS).sum() > fa3_splits.SPILL * SMS
    assert fa3_splits.balanced_splits(kv_tiles, 2, 32, SMS, 64) is None


def test_ragged_batches_of_short_requests_past_the_band_are_replanned_into_one_wave():
    # 26 requests of 40 KV tiles (2560 tokens) and 40 of 10 at two 64-row query tiles: the
    # longest 1.83x the mean, past ONE_WAVE_MAX_SPREAD, but at ONE_WAVE_SHORT_MAX_TILES.
    # FA3 cuts the long ones in two (splits of 25 tiles): 184 work tiles, 1.39 waves.
    kv_tiles = np.array([40] * 26 + [10] * 40)
    assert kv_tiles.max() > fa3_splits.ONE_WAVE_MAX_SPREAD * kv_tiles.mean()
    assert kv_tiles.max() == fa3_splits.ONE_WAVE_SHORT_MAX_TILES
    assert_unsplit_in_one_wave(kv_tiles, 184)
    # The same spread over longer requests (70 and 18 tiles): FA3's plan kept.
    longer = np.array([70] * 26 + [18] * 40)
    assert longer.max() > fa3_splits.ONE_WAVE_MAX_SPREAD * longer.mean()
    assert_fa3_plan_kept_past_the_band(longer)
    # Past ONE_WAVE_SHORT_MAX_SPREAD (the longest 2.06x the mean): kept too.
    wider = np.array([40] * 26 + [6] * 40)
    assert wider.max() > fa3_splits.ONE_WAVE_SHORT_MAX_SPREAD * wider.mean()
    assert not fa3_splits.one_wave_past_band(wider, 2, SMS)


def test_longer_requests_past_the_band_take_one_wave_up_to_a_spread_of_1_65():
    # 26 requests of 60 KV tiles (3840 tokens) and 40 of 22 at two 64-row query tiles: the
    # longest 1.62x the mean, past ONE_WAVE_SHORT_MAX_TILES, under ONE_WAVE_MAX_SPREAD. FA3
    # cuts the long ones in two (splits of 41 tiles): 184 work tiles, 1.39 waves, past
    # SPILL. Unsplit, the 132 tiles run in one wave.
    kv_tiles = np.array([60] * 26 + [22] * 40)
    assert kv_tiles.max() > fa3_splits.ONE_WAVE_SHORT_MAX_TILES
    assert 1.6 * kv_tiles.mean() < kv_tiles.max() < fa3_splits.ONE_WAVE_MAX_SPREAD * kv_tiles.mean()
    assert_unsplit_in_one_wave(kv_tiles, 184)
    # Two more short requests in place of long ones: the longest 1.67x the mean, kept.
    wider = np.array([60] * 24 + [22] * 42)
    assert wider.max() > fa3_splits.ONE_WAVE_MAX_SPREAD * wider.mean()
    assert_fa3_plan_kept_past_the_band(wider)


def test_short_requests_at_wide_query_tiles_are_not_cut_finer():
    # 172 requests of 11 KV tiles at 48 rows a tile: FA3 gives each one split (172 work
    # tiles, in the band), and a finer cut would leave pieces under MIN_SPLIT_TILES.
    kv_tiles = np.full(172, 11)
    assert fa3_splits.fa3_splits(kv_tiles, 1, 32, SMS).sum() == 172
    assert fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 48) is None
    # The same batch at 16 rows a tile: pieces are cheap, the step is replanned.
    assert fa3_splits.balanced_splits(kv_tiles, 1, 32, SMS, 16) is not None


@pytest.mark.parametrize("seed", [3, 4])
def test_may_spill_rules_out_only_batches_fa3_keeps_off_the_band(seed):
    rng = random.Random(seed)
    ruled_out = 0
    for _ in range(2000):
        kv_tiles, query_tiles, _, _ = random_batch(rng)
        tiles = query_tiles * int(fa3_splits.fa3_splits(kv_tiles, query_tiles, 32, SMS).sum())
        if not fa3_splits.may_spill(query_tiles * len(kv_tiles), SMS):
            ruled_out += 1
            assert not SMS < tiles <= fa3_splits.SPILL * SMS
    assert ruled_out > 500


def random_batch(rng: random.Random) -> tuple[np.ndarray, int, int, float]:
    heads, q_len = rng.choice((8, 16, 32, 64, 128)), rng.randint(1, 4)
    batch = max(1, round(2 ** rng.uniform(0, 9)))
    longest = round(2 ** rng.uniform(8, 16))
    low = rng.choice((1.0, rng.uniform(0, 0.9)))
    lens = [rng.randint(int(low * longest), longest) for _ in range(batch)]
    kv_tiles = np.array([max(1, -(-n // 64)) for n in lens], dtype=np.int64)
    query_tiles = -(-heads * q_len // 64)
    reserve = 64 if heads * q_len * batch <= 1024 else 32
    return kv_tiles, query_tiles, reserve, heads * q_len / query_tiles


@pytest.mark.parametrize("seed", [1, 2])
def test_balanced_plan_on_random_batches(seed):
    rng = random.Random(seed)
    gains, changed = [], 0
    for _ in range(300):
        kv_tiles, query_tiles, reserve, rows = random_batch(rng)
        cost = fa3_splits.split_cost_tiles(rows)
        own = fa3_splits.fa3_splits(kv_tiles, query_tiles, 32, SMS)
        plan = fa3_splits.balanced_splits(kv_tiles, query_tiles, reserve, SMS, rows)
        if plan is None:
            continue
        changed += 1
        assert plan.dtype == np.int32 and plan.shape == kv_tiles.shape
        assert plan.min() >= 1 and plan.max() <= reserve and (plan <= kv_tiles).all()
        # No empty split: the last split of a request starts before its end.
        per = -(-kv_tiles // plan)
        assert ((plan - 1) * per < kv_tiles).all()
        gains.append(grid_span(kv_tiles.tolist(), own.tolist(), query_tiles, cost)
                     / grid_span(kv_tiles.tolist(), plan.tolist(), query_tiles, cost))
    geomean = math.exp(sum(map(math.log, gains)) / len(gains))
    print(f"{changed} replanned, geomean {geomean:.3f}, worst {min(gains):.3f}")
    assert changed >= 40
    assert geomean > 1.1
    assert min(gains) > 0.85


@pytest.mark.parametrize("seed", range(4))
def test_estimated_span_matches_integer_arithmetic(seed):
    """``estimated_span`` computes in float64 (numpy vectorises it; the host runs it every
    step): on random plans its spans equal the two bounds worked out with Python integers
    (ceil divisions exact) and the same float split cost."""
    rng = random.Random(seed)
    b = rng.randint(1, 300)
    kv_tiles = [rng.randint(0, 4000) for _ in range(b)]
    plans = [[rng.randint(1, 128) for _ in range(b)] for _ in range(rng.randint(1, 40))]
    query_tiles, cost = rng.randint(1, 4), rng.choice([1.0, 1.875, 4.5])
    spans = fa3_splits.estimated_span(
        np.array(kv_tiles, dtype=np.int64), np.array(plans, dtype=np.float64).T,
        query_tiles, SMS, cost)
    for plan, span in zip(plans, spans, strict=True):
        largest = max(-(-n // s) for n, s in zip(kv_tiles, plan, strict=True)) + cost
        pieces = sum(plan)
        waves = -(-(query_tiles * pieces) // SMS)
        share = query_tiles * (sum(kv_tiles) + cost * pieces) / SMS
        assert span == pytest.approx(min(waves * largest, share + largest), rel=1e-12)

