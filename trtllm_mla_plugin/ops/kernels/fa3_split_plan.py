"""FA3's per-request KV splits replanned on the GPU: ``ops.fa3_splits.balanced_splits`` as
one Triton program that reads the step's lengths where FA3 reads them and writes its plan
over FA3's in the scheduler metadata.

Why: under CUDA graphs the ``vllm-fa3-mla`` route replans FA3's splits every decode step,
and on the host that search (about 40 numpy calls, each at numpy's per-call floor) was the
largest part of the route's plan: ~125 of 272 us at 128 requests on the H200's host (run
233b), 36% of the plan at 48 requests on an H100's (run 249), where vLLM's own builder
plans in 50-100 us. The engine runs that plan on the host between steps, so it adds to
every step (runs 228, 231). Here the host only checks the batch size and launches; the
search costs the GPU one small program a step (not a layer): 14.4-14.8 us on an H100 at
4 warps, 12.6-13.1 at 16 (runs 261-263; it launches at 16), a chain of block reductions
in one CTA. Two rewrites were slower (run 265: the reductions over one axis merged, 13.5
us at best; every tensor in one 2-D layout, 14.9): fewer barriers did not shorten it.

The plan is the host's, operation for operation: integer ceilings where numpy divides whole
numbers in float64 (exact there, ``fa3_splits.estimated_span``), the spans in float64 in
numpy's order of operations with FMA contraction off, the float constants (FA3's margin,
the one-wave spreads) read as float64 from a buffer, and bands compared as whole numbers
(``tiles > spill x sms`` is ``tiles > floor(spill x sms)`` for whole ``tiles``). Ties go
to FA3's own plan, then to the smaller tile size, as ``numpy.argmin`` breaks them. A step
whose plan stays FA3's writes nothing.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import fa3_splits
from ..policy import FA3_KV_TILE, FA3_SPLIT_MARGIN

#: Candidate tile sizes per pass of the size loop.
SIZE_CHUNK = 16
#: Warps of the program: 16 took 12.6-13.1 us a launch on an H100 where 4 took 14.4-14.8
#: and 8 12.8-13.3 (runs 262-263 and 265, lengths of 1-8k tokens at 33-198 requests; the
#: plan equal to the host's at 16 on 500 compiled steps, runs 262-263).
NUM_WARPS = 16
#: Where the program reads its float64 constants (``FA3SplitPlanner.consts``).
MARGIN, SHORT_SPREAD, LONG_SPREAD = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _span(pieces, largest, total, cost, query_tiles, sms):
    """``fa3_splits.estimated_span`` of plans with ``pieces`` pieces (int) whose longest
    piece plus ``cost`` is ``largest`` (float64), over ``total`` KV tiles (float64)."""
    waves = ((query_tiles * pieces + sms - 1) // sms).to(tl.float64)
    share = query_tiles * (total + cost * pieces.to(tl.float64)) / sms
    return tl.minimum(waves * largest, share + largest)


# Scalars not specialised: one compiled variant serves every step (Triton would otherwise
# compile one per value that equals 1 or divides by 16).
@triton.jit(do_not_specialize=["batch", "query_tiles", "request_rows", "max_splits", "fa3_cap",
                               "sms", "num_sizes", "narrow_band", "wide_band"])
def _fa3_balanced_splits_kernel(
    seq_lens_ptr, sizes_ptr, consts_ptr, splits_ptr,
    batch, query_tiles, request_rows, max_splits, fa3_cap, sms, num_sizes,
    narrow_band, wide_band,
    BLOCK_B: tl.constexpr, SIZES_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    KV_TILE: tl.constexpr, NARROW_ROWS: tl.constexpr, NARROW_MIN_MEAN_TILES: tl.constexpr,
    CHEAP_ROWS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    SHORT_MAX_TILES: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_B)
    live = offs < batch
    lens = tl.load(seq_lens_ptr + offs, mask=live, other=0)
    kv_tiles = (lens + KV_TILE - 1) // KV_TILE  # 0 for an empty request
    n = tl.where(live, tl.maximum(kv_tiles, 1), 0)
    kv_total = tl.sum(kv_tiles.to(tl.int64), axis=0)
    n_total = tl.sum(n.to(tl.int64), axis=0)

    # spill_band and may_spill's upper bound (its lower bound is the host's).
    narrow = (request_rows <= NARROW_ROWS) & (kv_total >= NARROW_MIN_MEAN_TILES * batch)
    band = tl.where(narrow, narrow_band, wide_band)
    go = query_tiles * batch <= band

    # FA3's own plan (fa3_splits.fa3_splits), column 0 of the host's search.
    x = (n_total * query_tiles).to(tl.float64) * tl.load(consts_ptr + MARGIN) / sms
    per_split = x.to(tl.int64)
    per_split = tl.maximum(tl.where(per_split.to(tl.float64) < x, per_split + 1, per_split), 1)
    own = tl.minimum(tl.maximum((n + per_split - 1) // per_split, 1), fa3_cap)
    own = tl.where(live, own, 0)
    own_pieces = tl.sum(own, axis=0)
    own_tiles = query_tiles * own_pieces
    past_band = own_tiles > band

    # one_wave_past_band.
    filled = live & (kv_tiles > 0)
    count = tl.sum(filled.to(tl.int32), axis=0)
    longest = tl.max(tl.where(filled, kv_tiles, 0), axis=0)
    spread = tl.where(longest <= SHORT_MAX_TILES, tl.load(consts_ptr + SHORT_SPREAD),
                      tl.load(consts_ptr + LONG_SPREAD))
    near_equal = (longest.to(tl.int64) * count).to(tl.float64) < spread * kv_total.to(tl.float64)
    one_wave = (query_tiles * batch <= sms) & (count > 0) & near_equal
    go = go & (own_tiles > sms) & (one_wave | (own_tiles <= band))

    total = n_total.to(tl.float64)
    cost = 1.0 + 3.5 * (request_rows.to(tl.float64) / query_tiles) / 64
    own_longest = tl.max(tl.where(live, (n + own - 1) // tl.maximum(own, 1), 0), axis=0)
    best_span = _span(own_pieces, own_longest.to(tl.float64) + cost, total, cost,
                      query_tiles, sms)
    best_k = num_sizes * 0 - 1

    # Sizes up to the first that holds the longest request whole.
    top = tl.max(n, axis=0)
    k_all = tl.arange(0, SIZES_BLOCK)
    sizes_all = tl.load(sizes_ptr + k_all, mask=k_all < num_sizes, other=2**30)
    num_valid = tl.minimum(tl.sum((sizes_all < top).to(tl.int32), axis=0) + 1, num_sizes)
    cheap = request_rows <= CHEAP_ROWS * query_tiles
    for start in range(0, num_valid, CHUNK):
        ks = start + tl.arange(0, CHUNK)
        k_ok = ks < num_valid
        size = tl.load(sizes_ptr + ks, mask=k_ok, other=1)
        plan = tl.minimum((n[None, :] + size[:, None] - 1) // size[:, None], max_splits)
        plan = tl.where(live[None, :], plan, 0)
        pieces = tl.sum(plan, axis=1)
        piece = tl.where(live[None, :], (n[None, :] + plan - 1) // tl.maximum(plan, 1), 0)
        span = _span(pieces, tl.max(piece, axis=1).to(tl.float64) + cost, total, cost,
                     query_tiles, sms)
        # More pieces than FA3's only where each cut request's pieces keep enough KV.
        thin = tl.min(tl.where(live[None, :] & (plan > 1), piece, MIN_SPLIT_TILES),
                      axis=1) < MIN_SPLIT_TILES
        span = tl.where(~cheap & (pieces > own_pieces) & thin, float("inf"), span)
        # Past the band only plans that fit one wave.
        span = tl.where(past_band & (query_tiles * pieces > sms), float("inf"), span)
        span = tl.where(k_ok, span, float("inf"))
        low = tl.min(span, axis=0)
        better = low < best_span
        best_k = tl.where(better, start + tl.argmin(span, axis=0), best_k)
        best_span = tl.where(better, low, best_span)

    size = tl.load(sizes_ptr + tl.maximum(best_k, 0))
    plan = tl.maximum(tl.minimum((n + size - 1) // size, max_splits), 1)
    piece = (n + plan - 1) // plan
    # The mask as one comparison: Triton's interpreter rejects a block mask and-ed with a
    # scalar.
    write = (go & (best_k >= 0)).to(tl.int32)
    tl.store(splits_ptr + offs, (n + piece - 1) // tl.maximum(piece, 1),
             mask=offs < batch * write)


class FA3SplitPlanner:
    """``fa3_splits.balanced_splits`` on the GPU for one device: the candidate tile sizes
    and the float64 constants in persistent buffers (written once), then one launch per
    step (``write``) that is also capturable."""

    def __init__(self, device: torch.device) -> None:
        self.sizes = torch.tensor(fa3_splits.CANDIDATE_SIZES, dtype=torch.int32, device=device)
        # In the order of MARGIN, SHORT_SPREAD, LONG_SPREAD.
        self.consts = torch.tensor([FA3_SPLIT_MARGIN, fa3_splits.ONE_WAVE_SHORT_MAX_SPREAD,
                                    fa3_splits.ONE_WAVE_MAX_SPREAD],
                                   dtype=torch.float64, device=device)

    def write(self, seq_lens: torch.Tensor, splits: torch.Tensor, *, query_tiles: int,
              request_rows: int, max_splits: int, sms: int, fa3_cap: int | None = None,
              spill: float | None = None, num_warps: int = NUM_WARPS,
              size_chunk: int = SIZE_CHUNK) -> bool:
        """Write ``balanced_splits``' plan for the lengths ``seq_lens`` (``[batch]`` int32
        on the device, in the order FA3 is launched in) into ``splits`` (``[batch]`` int32,
        FA3's per-request splits in its scheduler metadata, already holding FA3's own
        plan), where that plan differs from FA3's; elsewhere ``splits`` is left as it is.
        The arguments are ``balanced_splits``' (``query_tiles`` per request of
        ``request_rows`` query rows, ``max_splits`` the launch reserved, ``sms``, FA3's
        cap ``fa3_cap``, a finite ``spill`` instead of ``spill_band``'s); ``num_warps`` and
        ``size_chunk`` (candidate sizes a pass) are the launch's, which benchmarks vary.
        Returns whether the program was launched: batch sizes for which no lengths could
        change FA3's plan launch nothing."""
        batch = seq_lens.shape[0]
        if spill is None:
            narrow, wide = fa3_splits.NARROW_SPILL, fa3_splits.SPILL
        else:
            narrow = wide = spill
        narrow_band, wide_band = math.floor(narrow * sms), math.floor(wide * sms)
        if (batch > fa3_splits.DYNAMIC_SPLIT_MAX_BATCH
                or not fa3_splits.may_spill(query_tiles * batch, sms, max(narrow, wide))):
            return False
        if splits.shape[0] != batch or seq_lens.dtype != torch.int32 or splits.dtype != torch.int32:
            raise ValueError(f"int32 [batch] lengths and splits expected, got {seq_lens.dtype} "
                             f"{tuple(seq_lens.shape)} and {splits.dtype} {tuple(splits.shape)}")
        _fa3_balanced_splits_kernel[(1,)](
            seq_lens, self.sizes, self.consts, splits,
            batch, query_tiles, request_rows, max_splits, fa3_cap or max_splits, sms,
            self.sizes.shape[0], narrow_band, wide_band,
            BLOCK_B=triton.next_power_of_2(
                min(max(narrow_band, wide_band), fa3_splits.DYNAMIC_SPLIT_MAX_BATCH)),
            SIZES_BLOCK=triton.next_power_of_2(self.sizes.shape[0]), CHUNK=size_chunk,
            KV_TILE=FA3_KV_TILE, NARROW_ROWS=fa3_splits.NARROW_REQUEST_ROWS,
            NARROW_MIN_MEAN_TILES=fa3_splits.NARROW_MIN_MEAN_TILES,
            CHEAP_ROWS=fa3_splits.CHEAP_SPLIT_ROWS, MIN_SPLIT_TILES=fa3_splits.MIN_SPLIT_TILES,
            SHORT_MAX_TILES=fa3_splits.ONE_WAVE_SHORT_MAX_TILES,
            num_warps=num_warps, enable_fp_fusion=False,
        )
        return True
