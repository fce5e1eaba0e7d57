"""KV splits per request for vLLM's FA3 MLA kernel on its persistent grid.

FA3 (``hopper/flash_prepare_scheduler.cu``, ``prepare_varlen_num_blocks``) gives request
``i`` of ``n_i`` 64-token KV tiles ``min(ceil(n_i / ceil(1.1 W / SMs)), cap)`` splits, ``W``
the batch's work (query tiles x KV tiles, summed), and its kernel runs one CTA per SM that
takes (request, query tile, split) work tiles in batch order. The 10% margin leaves the
tile count just above the SM count on many batches (133-178 tiles on 132 SMs): the last
few tiles then run as a second wave on a few SMs and the step takes up to twice its even
share (runs 145-146: FA3 at 0.62-0.75x FlashMLA on such batches).

``balanced_splits`` replans the batches FA3 spills: where FA3's own plan holds more work
tiles than SMs but at most ``SPILL`` times as many (``NARROW_SPILL`` for requests of few
query rows over long contexts: ``spill_band``), it picks one tile size for the whole batch, the one
whose tiles fill the grid best by ``estimated_span`` (a request of ``n`` KV tiles cut into
``ceil(n / size)`` equal splits). Outside that band more or fewer splits lost as often as
they gained (run 153, 44 shapes at 64-row query tiles that FA3 gives one wave or more than
1.35: 0.80-1.09x FA3's own; run 169, longest first: slower on 4 of 5 shapes of <= 48 query
rows past 1.5 waves and on 18 of 19 of 64-row tiles past 1.35), but for one kind of plan:
where every request fits the grid unsplit and the lengths are near-equal (the longest within
1.65x the mean; 2x for short requests), fewer pieces than FA3's in one wave save the second
wave's start and the combine (``one_wave_past_band``, runs 169-197). The route writes the
result over the ``num_splits_dynamic`` vector of FA3's scheduler metadata, which the kernel
and FA3's combine read per request.
"""

from __future__ import annotations

import math

import numpy as np

from .policy import FA3_SPLIT_MARGIN

#: FA3's query tile, rows (heads x query tokens, packed).
QUERY_TILE_ROWS = 64
#: FA3 plans this many times the SMs' work tiles at most for ``balanced_splits`` to replan:
#: run 153 (seeds 101-104, the 29 bf16 shapes in the band) gained 1.09-1.51x on every one.
SPILL = 1.35
#: For requests of at most ``NARROW_REQUEST_ROWS`` query rows (one query tile, partly
#: filled: each split's partial output costs less) in batches whose requests average at
#: least ``NARROW_MIN_MEAN_TILES`` KV tiles, the band reaches this far (every shape it was
#: fitted and checked on had one such tile; two tiles of 48 rows on average, 32 heads x 3
#: tokens, keep ``SPILL``). Run 169 (batches longest first, the route's splits
#: forced past the band): fitted on the grid and seeds 150-153, the 5 such shapes of
#: 1.42-1.50 waves gained 1.08-1.33x (h32 b109 21.6k: 781 -> 589 us), while past 1.5
#: (1.65-2.57 waves) four of five lost (0.76-0.92x, the fifth 1.02x) and every 64-row one
#: from 1.41 waves lost (0.85-0.98x). Checked on seeds 154-157 and on run 153's timings
#: (seeds 101-104, caller's order): the three such shapes of 7k+ tokens gained 1.08x,
#: 1.12x and 1.18x; one of short requests lost (h8 b182 578 tokens q2, 0.90x), which the
#: mean bound, set after that check, leaves out (the shapes that gained: 4.2-18.5k tokens).
NARROW_SPILL = 1.5
NARROW_REQUEST_ROWS = 48
NARROW_MIN_MEAN_TILES = 32
#: FA3 reads per-request splits only for batches of at most this many requests
#: (``use_dynamic_split`` in ``hopper/flash_api.cpp``); ``SPILL`` keeps far below it.
DYNAMIC_SPLIT_MAX_BATCH = 992
#: Above this many query rows per tile a plan with more pieces than FA3's keeps at least
#: ``MIN_SPLIT_TILES`` KV tiles in every piece of a cut request: runs 154-155 (seeds
#: 110-117) lost 0.76-0.93x on short requests (345-1579 tokens) cut into pieces of 3-13
#: tiles at 32-64 rows, and gained 1.09-1.17x at 8-16 rows on pieces of 6-12 tiles.
CHEAP_SPLIT_ROWS = 16
MIN_SPLIT_TILES = 16
#: Past the band, plans that put the whole batch in one wave with fewer pieces than FA3's
#: (requests unsplit or cut in fewer pieces) replace FA3's where the non-empty requests'
#: longest holds less than this many times their mean KV tiles. Fit: runs 169 and 177
#: (every bf16 shape's plan forced past the band, longest first: h64 b52 757 tokens q2 at
#: spread 1.00 1.71x, h128 b24 2.7k q2 at 1.07 1.28x; h128 b64 4k r at 1.72 and 1.98 0.95x
#: and 0.92x, where the estimate's even share misprices FA3's longest-first pieces) and run
#: 180 (seeds 301-302 of ``benchmarks/one_wave_shapes.py``: 96 shapes under 1.25 replanned,
#: 1.25x FA3's plan on geomean, worst 0.98; 32 controls of 1.25-1.6, the plan forced, 1.20x,
#: worst 1.03, the gain falling with the spread to 1.03x at 1.59). Checked on run 183 (80
#: fresh shapes, seeds 303-304: 1.20x, worst 0.952; 1.14x at spreads of 1.25-1.5, long
#: requests gaining least). Past 1.5 the plan forced still gained on run 183's 24 controls
#: (1.14x, up to 1.91), and on run 187's 64 fresh controls of 1.5-1.75 (1.17x on 64-token
#: pages, 1.13x on 32, worst 0.982 at h128 b65 3.5k), which the grid's two ragged losses
#: (and that shape, of their kind: a nearly full grid of long requests) keep out, but for
#: batches of short requests (``ONE_WAVE_SHORT_MAX_TILES``) and up to 1.65: the forced
#: plans of longer requests at spreads of 1.5-1.65 gained 1.087x over 30 timings (runs
#: 180-193, worst 1.010), at 1.65-1.75 1.025x (3 of 9 under 1.0). Checked on run 197 (64
#: fresh shapes of 1.50-1.65, longest 41-69 tiles, drawn before the change): 1.086x, worst
#: 0.993 (2 under 1.0), the gain falling with the spread (1.103x at 1.50-1.55, 1.071x at
#: 1.60-1.65).
ONE_WAVE_MAX_SPREAD = 1.65
#: Batches whose longest request holds at most this many KV tiles (2560 tokens) take the
#: one-wave plan up to ``ONE_WAVE_SHORT_MAX_SPREAD``. In one wave the busiest CTA runs the
#: longest request alone, where FA3's plan runs it in two pieces, so what the one wave loses
#: grows with the longest request's own length, while what it saves (the second wave's
#: start, the partial outputs and their combine) does not. Fit on the 93 forced timings
#: past a spread of 1.5 (runs 180, 183, 187: spreads 1.50-1.91, longest 7-66 tiles): the
#: 66 whose longest held at most 40 tiles gained 1.181x on geomean, worst 1.060; the 27
#: longer ones 1.074x, worst 0.982, as the grid's h128 b64 4k r (64 tiles) lost 0.92-0.96x.
#: Checked on run 193 (lists drawn after the fit): 40 fresh shapes taken at spreads of
#: 1.50-1.96, 1.133x, worst 0.968; 24 declined controls of longer requests 1.028x, and
#: 0.983x at spreads of 1.75-2 (0.90-0.93x with the longest at 47-48 tiles).
ONE_WAVE_SHORT_MAX_TILES = 40
ONE_WAVE_SHORT_MAX_SPREAD = 2.0
#: Tile sizes tried, in KV tiles: about 8% apart, so the best is within 8% of any size.
CANDIDATE_SIZES = np.unique(np.round(1.08 ** np.arange(0, 120)).astype(np.int64))


def split_cost_tiles(rows_per_tile: float) -> float:
    """What one more split costs, in KV tiles of work: its partial output (``rows x 512``
    float32, written, then read back by FA3's combine: 3.5 KV tiles' bytes at 64 rows) and
    about one tile of pipeline start."""
    return 1.0 + 3.5 * rows_per_tile / QUERY_TILE_ROWS


def fa3_splits(kv_tiles: np.ndarray, query_tiles: int, cap: int, sms: int) -> np.ndarray:
    """FA3's own splits per request (its formula above) for ``kv_tiles`` ``[batch]``."""
    per_split = max(1, math.ceil(int(kv_tiles.sum()) * query_tiles * FA3_SPLIT_MARGIN / sms))
    return np.minimum(np.maximum(-(-kv_tiles // per_split), 1), cap)


def widest_band(request_rows: int) -> float:
    """The band ``spill_band`` can give requests of ``request_rows`` query rows (heads x
    query tokens), whatever their lengths."""
    return NARROW_SPILL if request_rows <= NARROW_REQUEST_ROWS else SPILL


def spill_band(request_rows: int, kv_tiles: np.ndarray) -> float:
    """The band's upper bound, in waves of FA3's own plan, for a batch of ``kv_tiles``
    ``[batch]`` with ``request_rows`` query rows a request (``NARROW_SPILL`` or
    ``SPILL``)."""
    if (request_rows <= NARROW_REQUEST_ROWS
            and int(kv_tiles.sum()) >= NARROW_MIN_MEAN_TILES * kv_tiles.shape[0]):
        return NARROW_SPILL
    return SPILL


def may_spill(query_tiles_in_batch: int, sms: int, spill: float = SPILL) -> bool:
    """Whether FA3's plan of a batch with this many query tiles (requests x query tiles per
    request) can land in ``balanced_splits``' band of ``spill`` waves, before looking at
    any length. Every request has at least one split, so a batch of more than ``spill x
    sms`` query tiles starts past the band; and FA3's plan holds fewer than ``sms / 1.1``
    tiles plus one per query tile (``ceil(x) < x + 1`` over its splits of ``1.1 W / sms``
    KV tiles), so it stays within one wave unless the batch has more than ``sms / 11``
    query tiles."""
    return sms * (1 - 1 / FA3_SPLIT_MARGIN) < query_tiles_in_batch <= spill * sms


def estimated_span(kv_tiles: np.ndarray, splits: np.ndarray, query_tiles: int, sms: int,
                   split_cost: float) -> np.ndarray:
    """Estimated time of the busiest CTA, in KV tiles, for plans ``splits`` ``[batch, K]``
    (K plans at once): the smaller of two bounds of FA3's in-order grid, the wave count
    times the largest tile (exact when the tiles are equal) and the even share plus the
    largest tile (list scheduling). Float64 arithmetic on whole numbers below 2^26, where
    ``ceil`` of a quotient is exact and numpy vectorises it (integer division it does not:
    the host plans this every step)."""
    tiles = kv_tiles.astype(np.float64)
    largest = np.ceil(tiles[:, None] / splits).max(0) + split_cost
    pieces = splits.sum(0)
    waves = np.ceil(query_tiles * pieces / sms)
    share = query_tiles * (tiles.sum() + split_cost * pieces) / sms
    return np.minimum(waves * largest, share + largest)


def one_wave_max_spread(longest_tiles: int) -> float:
    """The spread (longest over mean KV tiles) below which ``one_wave_past_band`` takes a
    batch whose longest request holds ``longest_tiles`` KV tiles."""
    return (ONE_WAVE_SHORT_MAX_SPREAD if longest_tiles <= ONE_WAVE_SHORT_MAX_TILES
            else ONE_WAVE_MAX_SPREAD)


def one_wave_past_band(kv_tiles: np.ndarray, query_tiles: int, sms: int) -> bool:
    """Whether a batch FA3 spills past the band may still be replanned into one wave: every
    request fits the grid unsplit and the non-empty requests' lengths ``kv_tiles``
    ``[batch]`` (64-token KV tiles) are near-equal (``one_wave_max_spread``)."""
    if query_tiles * kv_tiles.shape[0] > sms:
        return False
    filled = kv_tiles[kv_tiles > 0]
    if filled.size == 0:
        return False
    longest = int(filled.max())
    return longest * filled.size < one_wave_max_spread(longest) * int(filled.sum())


def balanced_splits(kv_tiles: np.ndarray, query_tiles: int, max_splits: int, sms: int,
                    rows_per_tile: float, fa3_cap: int | None = None,
                    spill: float | None = None) -> np.ndarray | None:
    """Splits per request (int32 ``[batch]``, each in ``1..max_splits`` and at most the
    request's KV tiles) that fill FA3's grid of ``sms`` CTAs better than FA3's own plan,
    or ``None`` to keep FA3's (outside the band ``spill_band`` gives, except for the
    one-wave plans of ``one_wave_past_band``, or where no size is expected to be faster).

    Args:
        kv_tiles: ``[batch]`` int64, each request's 64-token KV tiles (0 for empty slots).
        query_tiles: query tiles per request (heads x query tokens over 64, rounded up).
        max_splits: splits the captured launch reserved partial outputs for.
        sms: FA3's grid (one CTA per SM).
        rows_per_tile: query rows per query tile (prices a split's partial output).
        fa3_cap: the cap FA3 plans its own splits with (default ``max_splits``).
        spill: the band's upper bound, in waves of FA3's own plan, instead of
            ``spill_band``'s (benchmarks time other bands).
    """
    if spill is None:
        spill = spill_band(round(query_tiles * rows_per_tile), kv_tiles)
    if (kv_tiles.shape[0] > DYNAMIC_SPLIT_MAX_BATCH
            or not may_spill(query_tiles * kv_tiles.shape[0], sms, spill)):
        return None
    n = np.maximum(kv_tiles, 1)
    own = fa3_splits(n, query_tiles, fa3_cap or max_splits, sms)
    own_tiles = query_tiles * int(own.sum())
    past_band = own_tiles > spill * sms
    if own_tiles <= sms or (past_band and not one_wave_past_band(kv_tiles, query_tiles, sms)):
        return None
    top = int(n.max())
    sizes = CANDIDATE_SIZES[: int(np.searchsorted(CANDIDATE_SIZES, top)) + 1]
    # Column 0: FA3's own plan; then one plan per tile size (whole numbers in float64, as
    # estimated_span says why).
    plans = np.empty((n.shape[0], sizes.shape[0] + 1), dtype=np.float64)
    plans[:, 0] = own
    np.minimum(np.ceil(n[:, None] / sizes), max_splits, out=plans[:, 1:])
    spans = estimated_span(n, plans, query_tiles, sms, split_cost_tiles(rows_per_tile))
    counts = plans[:, 1:].sum(0)  # pieces of each size's plan
    if rows_per_tile > CHEAP_SPLIT_ROWS:
        # More pieces than FA3's only where every cut request's pieces still hold enough KV
        # to pay for their partial outputs.
        more = counts > own.sum()
        pieces = np.where(plans[:, 1:] > 1, np.ceil(n[:, None] / plans[:, 1:]),
                          MIN_SPLIT_TILES)
        spans[1:][more & (pieces.min(0) < MIN_SPLIT_TILES)] = np.inf
    if past_band:  # only plans that fit one wave
        spans[1:][query_tiles * counts > sms] = np.inf
    best = int(np.argmin(spans))
    if best == 0 or spans[best] >= spans[0]:
        return None
    # A capped request may get more splits than its tiles fill: keep only non-empty ones.
    splits = plans[:, best].astype(np.int64)
    return (-(-n // (-(-n // splits)))).astype(np.int32)

