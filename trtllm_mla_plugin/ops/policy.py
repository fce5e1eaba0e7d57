"""Which eligible route is preferred, per GPU generation: one ranking, built from measurements.

Eligibility (what a route *can* serve) lives with each route; this module only orders names.
The evidence for each order and threshold is in docs/benchmarks.md ("Route policy").

On SM90 FP8 caches go to FlashMLA's dense FP8 kernel (2.6-5x faster than any route that
reads FP8 with a bf16 query; the others stay behind it for installs without that kernel).
For bf16 caches the order may depend on the step's batch (``BatchShape``): FlashMLA
overtakes FlashInfer FA3 on large batches that FA3's planner cannot spread evenly over the
SMs (with the lengths known, a model of that planner says which).
Everything else ranks per ``DecodeSpec`` alone.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TypeVar

from .platform import Platform
from .spec import DecodeSpec

T = TypeVar("T")

REFERENCE = "torch-reference"
FA3, FLASHMLA, FA2 = "flashinfer-fa3", "flashmla", "flashinfer-fa2"
FLASHMLA_FP8 = "flashmla-fp8"
VLLM_FA3 = "vllm-fa3-mla"
TRITON = "triton-balanced"
SPLITK = "cuda-splitk"

# SM100/SM103: TRTLLM-gen is the kernel the plugin exists for; FlashInfer's CuTe DSL MLA
# kernel takes head counts TRTLLM-gen cannot tile.
BLACKWELL = ("trtllm-gen", "flashinfer-cute-dsl", FA2, REFERENCE)
# SM90: FlashInfer FA3 (with length-sorted requests) by default; FlashMLA first for the
# batches of ``hopper_prefers_flashmla`` (under CUDA graphs: every batch but those of
# ``hopper_prefers_vllm_fa3``, which go to vLLM's FA3 MLA kernel). With lengths known
# (enforce_eager), vLLM's FA3 kernel also takes the small one-token batches of
# ``hopper_prefers_vllm_fa3`` (its plan: 0.5 ms of host time against FlashInfer FA3's
# 2.3 ms, profiled).
HOPPER = (FA3, FLASHMLA, VLLM_FA3, FA2, REFERENCE)
HOPPER_FLASHMLA_FIRST = (FLASHMLA, FA3, VLLM_FA3, FA2, REFERENCE)
HOPPER_VLLM_FA3_FIRST = (VLLM_FA3, FLASHMLA, FA3, FA2, REFERENCE)
# SM90, 16-bit cache, 8-16 query rows per request, large batches: the plugin's CUDA split-KV
# kernel (``hopper_prefers_splitk``) ahead of whichever ranking the batch has without it
# (what runs where nvcc is missing).
# SM90, FP8 cache: FlashMLA's dense FP8 kernel (FP8 query) first for every batch. Behind it,
# for installs without that kernel, the bf16-query routes: FlashInfer FA3 reads FP8 at 9-15%
# of the copy ceiling; the plugin's page-balanced Triton kernel is 1.3-2x faster than FA3
# for few heads, one query token and batches of TRITON_FP8_MIN_BATCH or more.
HOPPER_FP8 = (FLASHMLA_FP8, FA3, FA2, REFERENCE)
HOPPER_FP8_FEW_HEADS = (FLASHMLA_FP8, TRITON, FA3, FA2, REFERENCE)
AMPERE_ADA = (FA2, REFERENCE)
OTHER = (REFERENCE,)

# Thresholds of the SM90 rule, from the H200 runs of docs/benchmarks-history.md (2026-11-30 on):
#: FP8 caches up to this many heads take the Triton kernel (16: 1.3-2.1x faster than FA3;
#: 32: +7% at b64 but -13% against length-sorted FA3 at b128; 64 and 128: FA3 faster) ...
TRITON_FP8_MAX_HEADS = 16
#: ... from this batch size on (b1: FA3 48 us, the Triton kernel far slower) ...
TRITON_FP8_MIN_BATCH = 32
#: ... with one query token per request (q_len 2: FA3 188 us vs 207 us).
TRITON_FP8_MAX_Q_LEN = 1
#: With the step's lengths on the host (eager decoders, exact lengths), FlashMLA goes first
#: when FlashInfer FA3's planner would leave its busiest SM with at least this many times an
#: even share of the batch's work (``fa3_plan_imbalance``; FlashMLA's scheduler splits the
#: work evenly). Fitted with FLASHMLA_REQUEST_COST on seeds 1-8 (runs 23, 46-48: 234 bf16
#: shapes; 1.2-1.3 with a request cost of 64-256 score alike), checked on seed 9 and the bf16
#: grid (runs 46, 52), replayed against the best peer: geomean 0.979 -> 0.992 (shapes under
#: 0.95: 38 -> 19), 0.955 -> 0.961, 0.996 -> 1.010 (grid shapes under 0.95: 1 -> 0), against
#: the rule of max length, spread and head count below (``evaluate_policy.py``).
FA3_PLAN_IMBALANCE_FOR_FLASHMLA = 1.3
#: ... and only for batches whose requests average at least this many KV tokens: FlashMLA's
#: fixed cost per request outweighs FA3's imbalance on short ones (h128 b286 mean 339 q3:
#: FA3 1.55x faster at imbalance 1.34; h128 b52 mean 1217 q4: 1.20x at 1.33). Replayed
#: (``evaluate_policy.py``, best of the plugin's routes): seeds 1-12 geomean 0.9758 ->
#: 0.9776 (1536-2048 alike), seeds 13-19 0.9680 -> 0.9727.
FLASHMLA_MIN_MEAN_LEN = 2048
#: SMs of the H100 SXM and H200 (FlashInfer's MLA planner spreads work over one cluster per
#: SM, or per SM pair when a request's query rows take two-CTA clusters): the count where
#: the platform does not say (``Platform.sm_count``), as in replays of the H200's timings.
#: Other Hopper parts (H100 PCIe 114, H20 78) are modelled with their own count, unmeasured.
HOPPER_SMS = 132
#: What a request costs FlashMLA beyond its KV tokens, in token-equivalents (its scheduler
#: splits tokens evenly, but each request it touches adds a fixed cost).
FLASHMLA_REQUEST_COST = 128
#: Without the lengths (an upper bound only), the rule of these thresholds decides:
#: with at least this many heads FlashMLA goes first for every batch whose longest request
#: reaches FLASHMLA_LONG_SEQ tokens (h128 b64 16k/32k uniform) and for every ragged batch.
FLASHMLA_MANY_HEADS = 64
FLASHMLA_LONG_SEQ = 16 * 1024
#: With fewer heads FlashMLA takes ragged batches from this longest request on (16k ragged:
#: 172 vs 199 us; 12k ragged b128: tie with sorted FA3; 8k: FA3 ahead) ...
FLASHMLA_RAGGED_LONG_SEQ = 12 * 1024
#: ... and uniform ones only from this one (16k uniform: FA3 292 us vs FlashMLA 303 us;
#: 32k uniform: FlashMLA 609 us vs FA3 640 us in run 5).
FLASHMLA_UNIFORM_LONG_SEQ = 32 * 1024
#: ... and in every case (lengths known or not) only for batches with at least this much
#: work: KV tokens x 64-row query tiles (ceil(heads * q_len / 64)). Fitted on 390 random
#: shapes (run 12): below it FA3's lower fixed cost wins (h128 b1 62k: FA3 54 us, FlashMLA
#: 69; h8 b10 46k: 87 vs 102).
FLASHMLA_MIN_WORK = 200_000
# Under CUDA graphs (lengths unknown when ranking; the engine's default) FlashMLA goes first
# for every batch size: its schedule is one kernel launch (plan: 30-115 us of host time),
# while FlashInfer FA3's plan is 1.1-2.3 ms of Python on the host per step even with exact
# host lengths (run 17, ``bench_plan_host.py``), and 5 ms more when it has to copy lengths
# back from a busy GPU. In the engine (runs 13-15, h16 bf16, CUDA graphs) TRTLLM_MLA on FA3
# was slower than vLLM's FLASHMLA at b128/b256 and in 3 of 4 samples at b32; FA3's kernel
# lead over FlashMLA is a few us per layer where it has one.
#: Under CUDA graphs, batches of at most this many requests go to vLLM's FA3 MLA kernel
#: (the kernel of vLLM's default SM90 backend, FLASH_ATTN_MLA): without lengths, small
#: batches are where FlashMLA's fixed cost shows. In the engine (run 42, h16, 24 layers,
#: prompts 1k-8k, five paired rounds) TRTLLM_MLA on FlashMLA decoded 0.93x FLASH_ATTN_MLA's
#: tokens/s at b32 (0.89-0.99 in every round; run 27: 0.84) and 1.15x at b256. Of the kernel
#: benchmark's random shapes with 17-32 requests under the rows bound, 6 of 7 ran faster on
#: FA3 (the exception: h32 b23 at 65k tokens, 1.48x faster on FlashMLA); replayed, 32
#: instead of 16 scores the same on seeds 1-4 (geomean against vLLM's kernel 1.063 -> 1.061)
#: and better on seeds 7-8 (1.012 -> 1.027). Above it the faster kernel depends on the
#: context length, which this rule cannot see (FlashMLA 1.1-1.5x faster from ~2.5k tokens,
#: FA3 1.3-1.5x at 0.3-2k) ...
VLLM_FA3_GRAPH_MAX_BATCH = 32
#: ... and at most this many query rows (requests x heads x query tokens): past it FA3 gains
#: nothing (run 23: FlashMLA 1.4x faster at h128 b9 q4, 611 vs 868 us; runs 155-180, the 30
#: shapes of 3073-4096 rows: FA3 1.005x FlashMLA on geomean, 0.71x at h128 b14 319 q2).
#: 2048 until the thirty-sixth session; 3072 refitted on the graph-timed runs 155-177 (the
#: 20 shapes of 2049-3072 rows: FA3 1.050x FlashMLA on geomean, worst 0.930 at h64 b17 63k
#: q2; against the faster of vLLM's two calls 0.984 -> 1.029) and checked on run 180 (4
#: shapes, 1.094x) and run 184 (47 fresh shapes drawn at 2049-3072 rows, seeds 305-308:
#: 1.053x, worst 0.785 at h32 b28 321 q3, 0.88-1.02x from 12k tokens on; 0.984 -> 1.026 of
#: the faster of vLLM's calls, shapes under 0.95 13 -> 4). On an H100 (run 313, addendum 16:
#: 84 fresh shapes of 3073-16384 rows at <= 32 requests) no bound of 4096-16384 passed the
#: declared reading: FA3 was faster at <= 2k tokens (27 of 28), FlashMLA from 10k (24 of 32).
#: 4096 since the sixty-fifth session, read as addendum 17 of
#: docs/bench-2026-12-05/run228-criteria.txt declared, on 73 fresh shapes of 3073-4096 rows
#: at <= 32 requests per card, "FA3 up to X rows, FlashMLA past it" against the faster of
#: vLLM's calls: H100 (run 314, seeds 728-735) 1.080 on geomean at 4096 (worst 0.889, 7
#: under 0.95) against 0.959 at 3072 (0.681, 26); H200 (run 329, the same seeds) 1.080
#: (0.912, 5) against 0.977 (0.707, 21). In the engine (addendum 18, h128 b32, 24 layers)
#: the H100 decoded 1.119x the same engine with FlashMLA forced (run 321); the H200's engine
#: pair is declared (addendum 20).
VLLM_FA3_GRAPH_MAX_ROWS = 4096
#: Each GPU's own rows bound in place of ``VLLM_FA3_GRAPH_MAX_ROWS``, for GPUs whose name
#: contains a key (``gpu_entry``): none, since both Hopper cards read 4096 (the H100's entry
#: of 4096, 0278810, became the default when the H200 read the same).
VLLM_FA3_GRAPH_MAX_ROWS_BY_GPU: dict[str, int] = {}
#: Whatever the batch size, vLLM's FA3 MLA kernel also takes batches with at most this many
#: query rows per request (heads x query tokens: Kimi-K2's 64 heads at TP8, DeepSeek-V3's
#: 128 at TP16, one token each): the same kernel as vLLM's default, and the faster one on 14
#: of 15 such shapes with 8 heads and one query token (1.02-1.81x, b1-b452, 0.4k-56k tokens;
#: run 23 seeds 1-4, runs 36-37 seeds 7-8); the exception, h8 b213 at 6-9.6k tokens (seed 8,
#: after the fit), ran 12% faster on FlashMLA. Fitted on seeds 1-4 (geomean against vLLM's
#: kernel 1.053 -> 1.063), checked on seed 7 (0.960 -> 0.983).
VLLM_FA3_GRAPH_MAX_REQUEST_ROWS = 8
#: With lengths known (eager decoders), vLLM's FA3 MLA kernel goes ahead of FlashInfer FA3
#: for batches of at most this many requests with one query token each ...
VLLM_FA3_EAGER_MAX_BATCH = 32
#: ... and at least this many KV tokens in all (below it FlashInfer's kernel kept pace:
#: h32 b1 276 tokens 0.91x, h16 b2 503 tokens 0.93x). Where FA3's planner leaves too much
#: imbalance FlashMLA stays first (``hopper_prefers_flashmla``). Fitted on seeds 1-4 and
#: 9-12 (runs 23, 52, 73, 76; bf16 batches the ranking gave FlashInfer FA3, searched over
#: batch, rows per request, query length and KV-token bounds): 45 shapes switched, 34
#: faster (h8 b2 9.6k ragged 1.13x, h16 b2 16k 1.25x, h128 b9 0.7k 1.26x). Checked on
#: seeds 13-19 (runs 77-79), not fitted on: 66 switched, 41 faster, geomean 1.027 over
#: them; worst 0.855 (seed 15), two seeds of seven 0.992 / 0.999 over their switched shapes.
VLLM_FA3_EAGER_MIN_KV_TOKENS = 4096
#: Under CUDA graphs vLLM caps FA3's KV splits at 32 (``GRAPH_MAX_SPLITS`` of the
#: ``vllm-fa3-mla`` route; FA3 sizes its partial outputs by the cap when the graph is
#: captured). Where the route reserved room for more (small batches: ``GRAPH_WIDE_SPLITS``
#: there), steps whose longest request holds at least this many tokens plan up to that
#: many: by FA3's split formula the cap of 32 binds only for a request holding more than
#: about a quarter of the batch's KV, and then long requests gain while short ones, cut
#: into one-page splits, lose (run 97, seeds 41-42, 58 shapes of at most 8 query tiles: cap
#: 64 for all ran 1.02-1.43x faster from 13k tokens on, but 0.76x at h16 b2 3.6k q3 and
#: 0.95x at h32 b1 5.5k q3; from 8k on no shape lost more than 2%). Checked on seeds 43-44
#: (run 99, 64 shapes): geomean 1.025-1.035 over cap 32, worst 0.983 (h128 b1 32k).
VLLM_FA3_WIDE_SPLITS_MIN_SEQ = 8192
#: ... and only for query tiles of at most this many rows (heads x query tokens per 64-row
#: tile): each split writes ``rows x 512`` float32 partial outputs, and at 48-64 rows more
#: splits gained nothing (runs 97, 99: 8 shapes, 0.981-1.066, geomean 1.00) or lost (fresh
#: seeds 63-70, run 107-108: h16 b2 14k q4 0.90, h64 b2 19.5k 0.93, h64 b2 48k q2 0.955),
#: while at 8-32 rows they gained 1.04-1.11 on geomean, up to 1.43x.
VLLM_FA3_WIDE_SPLITS_MAX_TILE_ROWS = 32
#: FA3's KV tile for MLA on SM90 (kBlockN of ``tile_size_fwd_sm90`` at headdim_v 512), tokens.
FA3_KV_TILE = 64
#: FA3's split formula (``prepare_varlen_num_blocks`` in ``flash_prepare_scheduler.cu``) puts
#: ``ceil(1.1 x work / SMs)`` KV tiles in a split, where work is query tiles x KV tiles summed
#: over the batch: while ``1.1 x work`` fits the SMs, every request is cut into one-KV-tile
#: splits. Each split writes ``rows x 512`` float32 partial outputs (128 KiB for a full
#: 64-row query tile, 1.7x the 74 KiB of KV it read) that the combine reads back. Under CUDA
#: graphs the ``vllm-fa3-mla`` route plans two-KV-tile splits instead (a cap of half the
#: longest request's KV tiles) from this much work per 132 SMs at full query tiles, scaled by
#: ``(64 / rows per tile) ** 0.25`` for fewer rows per tile (run 102: 291 batches of 8-128
#: heads, 1-4 query tokens, 0.3-2k tokens and 16-160 work tiles: 56 switched, geomean 1.022
#: over the grid, up to 1.37x (h128 b2 1920), none slower). Checked on shapes not fitted on
#: (runs 103, 105): 120 seeded draws in the grid's region, 33 switched, 1.089 on geomean
#: over them (0.979-1.380); 125 random-set shapes of seeds 45-60 in that range, 13 switched,
#: 1.000-1.235. Below it one-tile splits ran up to 9% faster (fewer rows per tile, fewer
#: requests); so they did at 8 rows per tile (8 heads, one token) at every work tested
#: (0.89-1.00x), and where the longest request held 5 KV tiles (320 tokens, cut 2 + 2 + 1:
#: 0.95-0.99x; the grid had 5, 11, 19 and 30).
VLLM_FA3_HALVED_SPLITS_MIN_WORK = 72
VLLM_FA3_HALVED_SPLITS_MIN_TILE_ROWS = 16
VLLM_FA3_HALVED_SPLITS_MIN_KV_TILES = 8
FA3_SPLIT_MARGIN = 1.1
#: Under CUDA graphs the ``vllm-fa3-mla`` route writes its own per-request KV splits over
#: FA3's (``ops.fa3_splits.balanced_splits``) where FA3's formula, whose 10% margin leaves
#: many batches a few work tiles past one wave of SMs, spills a second wave.
VLLM_FA3_BALANCED_SPLITS = True
#: The route's per-step plan computed on the GPU: its balanced splits
#: (``kernels.fa3_split_plan``: the host's search, one small program a step, launched after
#: a batch-size check) and its length order (``kernels.length_order``: the ordered tables
#: and block-table rows in one launch) instead of on the host, where they were the two
#: largest parts of the route's plan (runs 233b, 249) and the engine waits for that plan
#: every step (runs 228, 231). The same plans (H100, runs 258, 261) and 0.54-0.67x the host
#: plan's time at b48-b128 (run 260), but off: the two launches took 16.0-16.9 us of GPU
#: time a step (12.6-13.1 + 1.6-2.2 at the planner's best launch, runs 262-263), over the
#: 15 us criteria addendum 11 set before the runs.
VLLM_FA3_DEVICE_PLAN = False
#: Batches of at least this many requests reach FA3 longest first: the ``vllm-fa3-mla``
#: route hands FA3 the requests in length order (through ``cu_seqlens_q`` and
#: ``seqused_q``, no data moved), so the kernel's in-order persistent grid takes the long
#: requests first and the short ones fill its last wave. Run 157 (seeds 110-125, the 155
#: bf16 shapes of 33-1024 requests, CUDA graphs): 1.032x FA3 in the caller's order on
#: geomean, worst 0.945, up to 1.19x on ragged grid batches (h128 b64 32k).
VLLM_FA3_LENGTH_ORDER_MIN_BATCH = 33
#: Under CUDA graphs vLLM's FA3 kernel, its requests longest first, also takes batches of
#: VLLM_FA3_LENGTH_ORDER_MIN_BATCH to this many requests at any query rows, ahead of
#: FlashMLA, for specs outside ``splitk_candidate`` (its 8-16-row batches keep it, and
#: FlashMLA behind it: run 157 timed the two about equal there). Run 157 (fit, seeds
#: 110-125, the 155 shapes of >= 33 requests): 0.989 -> 1.029 of the faster of vLLM's two calls on
#: geomean, worst 0.666 -> 0.811, shapes under 0.95 34 -> 26; the bf16 grid's 32 such
#: shapes 1.011 -> 1.034 (replayed from the forced rows; bounds of 48-1024 requests and
#: 2k-16k rows or none tried: 256 and none scored best, 512 and 1024 within 0.003).
#: 1024 since the forty-third session: those timings handed every kernel one 576-wide
#: query, while the engine hands vLLM's two parts, which FA3 reads apart and FlashMLA needs
#: joined (run 220: 40 us a layer at 480 x 128 with vLLM's fused join, torch.cat 152; in
#: the engine the cat was what FlashMLA lost at b160 MTP 2, run 217). Replayed with the
#: fused join's measured cost added to FlashMLA (``evaluate_policy.py --query-join
#: fused``), the shapes of 257-1024 requests and more than 32 rows a request that 256 left
#: on FlashMLA score, against vLLM's FA3 call, 0.962 -> 1.008 on geomean on FA3 longest
#: first (50 shapes of runs 155-184, worst 0.743 -> 0.936, under 0.95 18 -> 1) and 0.950
#: -> 1.000 on shapes not used to pick the bound (37 of runs 145-156 and 205-214, worst
#: 0.705 -> 0.898, 17 -> 1). A model of measured parts, then timed as the decoder on 192
#: fresh such shapes with vLLM's query parts (run 222): 1.014 of the faster of vLLM's calls,
#: 1.084 over FlashMLA forced; the engine has not run such a batch (docs/benchmarks-history.md,
#: "The query join", "The decoder in alternation"). Requests of at most 32 query rows (one
#: query tile, at most half filled) had gone there up to 1024 requests since the
#: thirty-fifth session: fit on runs 155, 156, 158, 164 (12 such shapes of 257-1024
#: requests, replayed from the route's forced rows: 8 faster, the four worst 0.84-0.94 ->
#: 1.00-1.03 of the faster of vLLM's two calls; 4 slower, h32 b457 382 tokens 1.022 ->
#: 0.890, h32 b309 5.3k 1.004 -> 0.925), checked on runs 169 and 177 (4 such shapes, all
#: faster: h8 b435 643 tokens q4 0.685 -> 1.001). FA3 reads per-request splits up to 992
#: requests (``fa3_splits.DYNAMIC_SPLIT_MAX_BATCH``); past that it keeps its own plan.
VLLM_FA3_GRAPH_ORDERED_MAX_BATCH = 1024
#: ... except where a request's query rows fill its 64-row tiles unevenly
#: (``uneven_query_tiles``: more than one tile, the last partly filled; of 8-128 heads at
#: 1-4 query tokens only 32 heads x 3 tokens = 96 rows; head counts that are no power of
#: two, none measured, follow the same test), which keep FlashMLA: at 96 rows
#: and 33-256 requests FlashMLA ran faster than FA3 longest first on 6 of the 7 shapes
#: runs 157-158 timed (1.165x on geomean; h32 b45 397 tokens: 27.7 against 46.6 us) and
#: than FA3 in the caller's order in 24 of 29 earlier timings (1.12x; runs 52-156). Batches
#: of at most 32 such requests stay on FA3 (faster in 41 of 44 timings, 1.13x). Replayed on
#: run 158's fresh seeds 134-141: 1.014 -> 1.018 of the faster of vLLM's two calls, worst
#: 0.609 -> 0.615 (docs/benchmarks-history.md, "96 query rows per request back on FlashMLA").
VLLM_FA3_GRAPH_ORDERED_UNEVEN_TILES = False
# Tall requests (384 query rows: 128 heads x 3 tokens) stay on FA3. FlashMLA above 132 such
# requests ran 1.037x FA3 kernel for kernel (run 211, one 576-wide query for both),
# but in the engine the plugin on FlashMLA decoded at 0.909x FLASH_ATTN_MLA (h128 24 layers,
# b160, MTP 2, two paired rounds 0.913 and 0.905; run 217) and on FA3 forced at 1.000x (run
# 218). The gap was the join of vLLM's two query parts, which FA3 reads apart and FlashMLA
# needs whole: torch.cat took 152 us a layer (run 220), the fused join the decoder now uses
# 40 us, which leaves FlashMLA at FA3's speed there: 1.000 and 0.994 (run 221; the
# criterion for moving back was >= 1.02 in every round; docs/benchmarks-history.md, "The
# query join").
#: The plugin's CUDA split-KV kernel (route cuda-splitk) goes first for 16-bit caches with
#: at least SPLITK_MIN_REQUEST_ROWS and at most this many query rows per request (heads x
#: query tokens: one 16-row mma tile, no padding; 32 rows run two row groups and lost to
#: every peer, 0.64x at h32 b64 4k ragged) ...
SPLITK_MAX_REQUEST_ROWS = 16
#: ... on pages FlashMLA also reads (64 tokens: where it was measured against FlashMLA) ...
SPLITK_PAGE_MULTIPLE = 64
#: ... in batches of at least this many requests when the lengths are known: below it the
#: kernel's fixed cost (15 us at b1; one request cut over all 264 CTAs: 136 us against FA3's
#: 39 us at h8 b1 52k) loses ...
SPLITK_MIN_BATCH = 48
#: ... and, under CUDA graphs (lengths unknown), every batch vLLM's FA3 kernel does not
#: take (more than VLLM_FA3_GRAPH_MAX_BATCH requests), ahead of FlashMLA. Run 131 (H200, 9-16
#: rows, 111 random shapes of 33-127 requests, seeds 83-88) fitted the bound: against the
#: faster of vLLM's two calls, geomean 1.022 from 33 requests, 0.982 from 96 (the bound runs
#: 46-47 had set against FlashMLA alone); run 132 checked it, timed in alternation on 148
#: fresh shapes (seeds 89-96 and the grid): 0.999 against 0.958, better in every range of
#: batch sizes (33-40: 0.966 against FlashMLA's 0.926, 81-95: 1.053 against 0.979) and at
#: the worst shape (0.655 against 0.609). Short contexts lose either way (0.65-0.8; vLLM's
#: FA3 kernel is faster there), which a graph cannot see. Against vLLM's FA3 kernel longest
#: first with the engine's query parts (run 225, 50 fresh 16-row shapes) the kernel lost on
#: geomean (1.004 against 1.026), but in the engine (run 226, h16 b128, prompts of 1-8k)
#: the plugin with FA3 forced decoded at 0.820 of the plugin on this kernel: it stays. At
#: 33-96 requests (run 231, 43 fresh shapes) FA3 would score 1.059 (worst 0.937) against
#: this kernel's 0.961 (0.670), but the engine pair at b48 came out even (1.008), the FA3
#: route's host plan costing 0.17 ms a step beyond its kernels; at 61 layers (H100) FA3
#: won at b48 (1.040, run 247) and lost at b80 (0.990, run 251): it stays there too.
#: Batches of the band below this bound and from VLLM_FA3_LENGTH_ORDER_MIN_BATCH on go to
#: vLLM's FA3 kernel longest first, planned on the GPU (``vllm_fa3_device_plan``): none
#: while the two bounds are equal. A GPU can have its own (``SPLITK_GRAPH_BANDS_BY_GPU``:
#: the H100's is 49, the H200's 65).
SPLITK_GRAPH_MIN_BATCH = VLLM_FA3_GRAPH_MAX_BATCH + 1
#: The kernel also takes (under CUDA graphs from SPLITK_GRAPH_MIN_BATCH requests on) batches
#: of this many query rows per request (8 heads at one token: Kimi-K2 at TP8, DeepSeek-V3 at
#: TP16; half a 16-row tile), ahead of vLLM's FA3 kernel, which the rule of
#: VLLM_FA3_GRAPH_MAX_REQUEST_ROWS gave them at any batch size. Run 141 (seeds 97-98, 43
#: random 8-row shapes of 33-1024 requests, each kernel's graph timed in three rotated
#: rounds) against the faster of vLLM's two calls: 1.079 on geomean (worst 0.822) against
#: vLLM's FA3 kernel's 0.879 (0.677), every lower bound of 40-96 scoring less; checked on
#: fresh seeds 99-100 (run 142, 38 shapes): 1.027 (0.755) against 0.903 (0.696). Against
#: FLASHMLA's call alone it was faster on every shape (1.03-1.7x); against FLASH_ATTN_MLA's
#: it loses short contexts (0.76-0.83 at 0.3-1.1k tokens), as at 16 rows. With lengths
#: known (eager) 8-row batches follow the rule of 9-16 rows below, unchanged: run 147
#: (seeds 112-116, 65 random 8-row shapes of 33-1024 requests, every route timed) replays
#: 1.006 -> 1.029 on geomean against the best peer, worst 0.920 -> 0.987, all 22 shapes
#: that switch faster (1.04-1.13 after, 0.92-1.09 before); on fresh seeds 117-122 (run 148,
#: 93 shapes) 1.020 -> 1.032, worst 0.936 -> 0.921 (33 switch: 1.048 -> 1.083).
SPLITK_MIN_REQUEST_ROWS = VLLM_FA3_GRAPH_MAX_REQUEST_ROWS
#: ... and at most this many (the kernel keeps a step's lengths in shared memory).
SPLITK_MAX_BATCH = 1024
#: ... and, when the lengths are known (no CUDA graph: FlashInfer FA3 is the alternative),
#: only with at least this many KV tokens (FA3's lower fixed cost wins short batches: h16
#: b94 332 tokens 0.70x, h8 b340 359 0.87x) ...
SPLITK_MIN_KV_TOKENS = 128 * 1024
#: ... and uniform lengths only from this mean length on (FA3 keeps uniform mid-size
#: batches: h16 b64 4k 0.86x, b256 4k 0.96x, b128 8k 0.98x; 9.8k-32k uniform: 1.04-1.05x).
SPLITK_UNIFORM_MIN_MEAN_LEN = 8 * 1024 + 1
#: ... and only while no request holds more than this share of the batch's KV tokens: the
#: kernel cuts a long request over many CTAs and four combine CTAs then merge all its
#: partials (run 52, one request of 32-64k among 95-127 of 2k: the longest holding 12% of
#: the tokens tied the best peer, 21% ran 0.95x, 26% 0.75x against FA3; every shape the
#: rule won in runs 46-48 had its longest request at <= 3.5%).
SPLITK_MAX_REQUEST_SHARE = 0.1
#: max / mean of the lengths from which a batch counts as ragged.
RAGGED_SPREAD = 1.25
#: FA3 plans requests longest first from this batch size on (ragged batches, or any batch
#: when lengths are unknown, as under CUDA graphs); below it the sort costs more than it saves.
FA_SORT_MIN_BATCH = 128
#: ... and, when lengths are known, only from this mean length on: the sort's gather and
#: scatter of the query and output rows outweigh its gain on short requests (run 12:
#: h32 b196 mean 240 q4 sorted 2.1x slower).
FA_SORT_MIN_MEAN_LEN = 1024
#: kv_tokens matters only to batches of at least this many (possible) KV tokens.
KV_TOKENS_WORTH_COUNTING = 64 * 1024
#: Short prefills (requests with up to this many new tokens, over any cached context) may
#: run on a decode kernel instead of vLLM's MLA prefill path, which first up-projects the
#: request's whole cached context through ``kv_b_proj``: vLLM's own SM90 default,
#: FLASH_ATTN_MLA, does so for up to 512 tokens (its builder's ``reorder_batch_threshold``),
#: and in the engine (run 56, h16, prompts 1k-8k re-sent with their prefix cached) its
#: step that recomputes each prompt's last, partial page took 0.5-0.6x the time it took
#: through the prefill path (the plugin and FLASHMLA then).
SMALL_PREFILL_MAX_Q_LEN = 512
#: Routes for those batches, most preferred first: on SM90 with a 16-bit cache, the kernel
#: FLASH_ATTN_MLA runs them on (so they cost what they cost without the plugin).
HOPPER_SMALL_PREFILL = (VLLM_FA3,)


@dataclass(frozen=True)
class BandBound:
    """Where one GPU's CUDA-graph rule starts the split-KV band (``splitk_graph_min_batch``).

    Attributes:
        min_batch: batches of fewer requests (from ``VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` on)
            go to vLLM's FA3 kernel longest first, planned on the GPU; from it on to
            ``cuda-splitk``.
        fewest_request_rows: only specs of at least this many query rows a request move
            with ``min_batch``; the band's others keep ``SPLITK_GRAPH_MIN_BATCH`` (9 keeps
            the 8-row batches on ``cuda-splitk``, as addenda 13-14 read runs 291 and 328,
            until a card's runs of addendum 23 move them).
    """

    min_batch: int
    fewest_request_rows: int = SPLITK_MIN_REQUEST_ROWS


#: Each GPU's own band bound, for GPUs whose name contains a key, where the engine measured
#: the band's crossing apart (readings declared before the runs, addenda 13-14 of
#: docs/bench-2026-12-05/run228-criteria.txt; every run and the 8-row readings since, addenda
#: 23-25, in docs/benchmarks.md's route section). In the engine pairs (h16, 61 layers, FA3
#: planned on the GPU over ``cuda-splitk``) the H100 won at b40 and b48 (balanced 1.014-1.029,
#: runs 292, 284, 288) and lost from b56 on (0.996 at b56), so 49; the H200 won at b48 (1.023,
#: run 326) and lost at b80 (0.957, run 327), so 65 (a pair at b64 is declared, addendum 20).
#: The H100's 8-row batches move with its bound: on fresh 8-row shapes of 33-48 requests FA3
#: scored 1.023 (worst 0.976) against the decoder's 1.007 (worst 0.839, run 337), and in the
#: engine pair at h8 b48 1.021 of ``cuda-splitk`` (no round under 0.97, run 338; addenda
#: 23-25). The H200 keeps its 8-row batches on ``cuda-splitk`` (fewest_request_rows=9) until
#: its own runs of those two phases are in. Each measured on the SXM card alone; a key also
#: names that chip's other boards (the PCIe and NVL H100s, the H200 NVL and the GH200), as
#: ``ONE_CTA_GPUS`` does.
SPLITK_GRAPH_BANDS_BY_GPU: dict[str, BandBound] = {
    "H100": BandBound(49),
    "H200": BandBound(65, fewest_request_rows=9),
}


@dataclass(frozen=True)
class BatchShape:
    """Host-side facts about one step's batch that the ranking may use (no device data).

    Attributes:
        batch_size: requests in the step.
        max_q_len: largest query length of a request.
        max_seq_len: host-side bound on ``seq_lens``; ``None`` when unknown (CUDA-graph
            decoders rank without lengths so a captured batch size keeps its route).
        kv_tokens: ``sum(seq_lens)`` when the host knows it, else ``None``.
        lengths: every request's KV length in the batch's order, when the host has them
            exactly and they can change the choice (``wants_lengths``), else ``None``.
    """

    batch_size: int
    max_q_len: int = 1
    max_seq_len: int | None = None
    kv_tokens: int | None = None
    lengths: tuple[int, ...] | None = None

    @property
    def spread(self) -> float | None:
        """``max / mean`` of the lengths (1.0 for uniform batches), ``None`` if unknown."""
        if self.max_seq_len is None or not self.kv_tokens:
            return None
        return self.max_seq_len * self.batch_size / self.kv_tokens


def wants_kv_tokens(spec: DecodeSpec, shape: BatchShape) -> bool:
    """Whether ``kv_tokens`` could change the SM90 choice for ``shape`` (so a caller without
    it should count it): when the lengths are known but not their sum, and the batch is
    large enough for the FlashMLA and sort rules to apply, or a small one-token batch whose
    sum alone decides vLLM's FA3 rule (``hopper_prefers_vllm_fa3``)."""
    del spec
    if shape.max_seq_len is None or shape.kv_tokens is not None:
        return False
    bound = shape.batch_size * shape.max_seq_len
    if bound >= KV_TOKENS_WORTH_COUNTING:
        return True
    # vLLM's FA3 rule for small one-token batches: only the sum can tell.
    return (shape.batch_size <= VLLM_FA3_EAGER_MAX_BATCH and shape.max_q_len == 1
            and shape.max_seq_len < VLLM_FA3_EAGER_MIN_KV_TOKENS <= bound)


def wants_lengths(spec: DecodeSpec, shape: BatchShape) -> bool:
    """Whether the SM90 rule would read each request's length for ``shape`` (a caller with
    exact host lengths then passes them as ``BatchShape.lengths``): 16-bit caches, lengths
    known, and enough work for FlashMLA to be a candidate."""
    if spec.fp8_kv or shape.max_seq_len is None or shape.lengths is not None:
        return False
    return _enough_work_for_flashmla(spec, shape)


def _enough_work_for_flashmla(spec: DecodeSpec, shape: BatchShape) -> bool:
    """``FLASHMLA_MIN_WORK``: KV tokens (their bound where unsummed) x 64-row query tiles."""
    kv_tokens = shape.kv_tokens or shape.batch_size * shape.max_seq_len
    return kv_tokens * query_tiles(spec, shape.max_q_len) >= FLASHMLA_MIN_WORK


def _fa3_chunk_limit(share: int) -> int:
    """The most KV tokens FlashInfer's MLA planner gives one work item, for an even share of
    ``share`` tokens per cluster (its ``MLAPlan``: small shares round to 32-192, larger ones
    up to a multiple of 256)."""
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if share <= bound:
            return limit
    return -(-share // 256) * 256


def fa3_plan_imbalance(spec: DecodeSpec, shape: BatchShape, sms: int = HOPPER_SMS) -> float:
    """The busiest cluster's cost over an even share of the work, for the plan FlashInfer's
    FA3 MLA planner (``MLAPlan`` in ``attention/scheduler.cuh``, flashinfer 0.7) makes of
    ``shape.lengths``: query rows packed ``heads x q_len`` into tiles of 64 rows (128, as
    two-CTA clusters on half the SMs, when a request has more than 64), each tile's KV cut
    into chunks of at most a limit near the even share, the chunks of the requests in order
    (longest first where the route sorts them, ``fa_sort_by_length``) handed to the
    cluster with the least cost so far, a chunk costing its tokens plus two tile heights.
    FlashMLA's own scheduler splits the work evenly, so this ratio is what FA3 loses to
    load imbalance (1.71 for 78 requests of 9.8k tokens at 16 heads, where FlashMLA ran
    1.35x faster; 1.03 for 128 of 8k, where FA3 ran 1.03x faster: runs 46, 52). The even
    share counts ``FLASHMLA_REQUEST_COST`` per request and query tile."""
    if shape.lengths is None:
        raise ValueError("fa3_plan_imbalance needs the batch's lengths (BatchShape.lengths)")
    rows = spec.num_heads * shape.max_q_len
    cluster = 2 if rows > 64 else 1
    clusters, tile = sms // cluster, 64 * cluster
    tiles = -(-rows // tile)
    lengths = shape.lengths
    if fa_sort_by_length(spec, shape):
        lengths = sorted(lengths, reverse=True)
    total = sum(lengths) * tiles
    if total <= 0:
        return 1.0
    limit = _fa3_chunk_limit(-(-total // clusters))
    even = (total + len(lengths) * tiles * FLASHMLA_REQUEST_COST) / clusters
    loads = [0] * clusters
    for length in lengths:
        for _ in range(tiles):
            remaining = length
            while True:
                part = min(remaining, limit)
                heapq.heapreplace(loads, loads[0] + 2 * tile + part)
                remaining -= part
                if remaining <= 0:
                    break
    return max(loads) / even


def _kv_tokens_at_least(shape: BatchShape, tokens: int) -> bool:
    """Whether the batch holds at least ``tokens`` KV tokens: from ``kv_tokens`` or the
    lengths where known, else from the longest request (a lower bound)."""
    if shape.kv_tokens is not None:
        return shape.kv_tokens >= tokens
    if shape.lengths is not None:
        return sum(shape.lengths) >= tokens
    return (shape.max_seq_len or 0) >= tokens


def _ragged(shape: BatchShape) -> bool:
    spread = shape.spread
    return spread is not None and spread >= RAGGED_SPREAD


def query_tiles(spec: DecodeSpec, max_q_len: int) -> int:
    """64-row query tiles per request (FA3 and FlashMLA both tile heads x q_len by 64)."""
    return -(-spec.num_heads * max_q_len // 64)


def hopper_prefers_flashmla(spec: DecodeSpec, shape: BatchShape | None,
                            sms: int = HOPPER_SMS) -> bool:
    """The SM90 rule: FlashMLA ahead of FA3 for this batch (see docs/benchmarks.md): under
    CUDA graphs always; with lengths, by FA3's plan imbalance over the GPU's ``sms``
    (``shape.lengths``) or else by the thresholds above."""
    if shape is None:
        return False
    if shape.max_seq_len is None:  # CUDA graphs: FlashMLA always ("Under CUDA graphs" above)
        return True
    if not _enough_work_for_flashmla(spec, shape):
        return False
    if shape.lengths is not None:
        if not _kv_tokens_at_least(shape, FLASHMLA_MIN_MEAN_LEN * shape.batch_size):
            return False
        return fa3_plan_imbalance(spec, shape, sms) >= FA3_PLAN_IMBALANCE_FOR_FLASHMLA
    if spec.num_heads >= FLASHMLA_MANY_HEADS:
        return shape.max_seq_len >= FLASHMLA_LONG_SEQ or _ragged(shape)
    if shape.max_seq_len >= FLASHMLA_UNIFORM_LONG_SEQ:
        return True
    return shape.max_seq_len >= FLASHMLA_RAGGED_LONG_SEQ and _ragged(shape)


def gpu_entry(entries: dict[str, T], gpu_name: str) -> T | None:
    """The first of ``entries`` whose key the GPU name ``gpu_name``
    (``torch.cuda.get_device_properties().name``) contains, as
    ``splitk_mla_decode.ONE_CTA_GPUS`` matches (a key ``"H200"`` also names the GH200), or
    ``None``."""
    return next((entry for key, entry in entries.items() if key in gpu_name), None)


def band_bound(gpu_name: str) -> BandBound | None:
    """The band bound of the GPU named ``gpu_name``: its entry in
    ``SPLITK_GRAPH_BANDS_BY_GPU``, or ``None``."""
    return gpu_entry(SPLITK_GRAPH_BANDS_BY_GPU, gpu_name)


def vllm_fa3_graph_max_rows(gpu_name: str) -> int:
    """The most query rows of a batch of at most ``VLLM_FA3_GRAPH_MAX_BATCH`` requests that
    the CUDA-graph rule gives vLLM's FA3 kernel on the GPU named ``gpu_name``: its entry in
    ``VLLM_FA3_GRAPH_MAX_ROWS_BY_GPU``, else ``VLLM_FA3_GRAPH_MAX_ROWS``."""
    rows = gpu_entry(VLLM_FA3_GRAPH_MAX_ROWS_BY_GPU, gpu_name)
    return VLLM_FA3_GRAPH_MAX_ROWS if rows is None else rows


def splitk_graph_min_batch(spec: DecodeSpec, gpu_name: str = "") -> int:
    """The fewest requests of a batch of ``spec`` that the CUDA-graph rule gives
    ``cuda-splitk`` on the GPU named ``gpu_name``: its ``band_bound``'s ``min_batch`` if
    ``spec``'s query rows a request reach that bound's ``fewest_request_rows``, else
    ``SPLITK_GRAPH_MIN_BATCH``."""
    band = band_bound(gpu_name)
    if band is not None and spec.num_heads * spec.max_q_len >= band.fewest_request_rows:
        return band.min_batch
    return SPLITK_GRAPH_MIN_BATCH


def hopper_prefers_vllm_fa3(spec: DecodeSpec, shape: BatchShape | None,
                            gpu_name: str = "") -> bool:
    """The SM90 rule for vLLM's FA3 MLA kernel. Under CUDA graphs (no lengths): ahead of
    FlashMLA for batches of at most ``VLLM_FA3_GRAPH_MAX_BATCH`` requests and the rows bound
    of the GPU named ``gpu_name`` (``vllm_fa3_graph_max_rows``), for batches of
    ``VLLM_FA3_LENGTH_ORDER_MIN_BATCH`` to ``VLLM_FA3_GRAPH_ORDERED_MAX_BATCH`` requests
    (launched longest first) whose query tiles are even (``uneven_query_tiles``), but for
    those of ``splitk_candidate`` specs from the band's bound of that GPU on
    (``splitk_graph_min_batch``), and for every batch of at most
    ``VLLM_FA3_GRAPH_MAX_REQUEST_ROWS`` rows per request.
    With lengths:
    ahead of FlashInfer FA3 for one-token batches of at most ``VLLM_FA3_EAGER_MAX_BATCH``
    requests and at least ``VLLM_FA3_EAGER_MIN_KV_TOKENS`` KV tokens (``rank`` puts
    FlashMLA first where its rule, which then decides first, takes the batch)."""
    if shape is None:
        return False
    if shape.max_seq_len is not None:
        return (shape.batch_size <= VLLM_FA3_EAGER_MAX_BATCH and shape.max_q_len == 1
                and _kv_tokens_at_least(shape, VLLM_FA3_EAGER_MIN_KV_TOKENS))
    request_rows = spec.num_heads * shape.max_q_len
    if request_rows <= VLLM_FA3_GRAPH_MAX_REQUEST_ROWS:
        return True
    if (VLLM_FA3_LENGTH_ORDER_MIN_BATCH <= shape.batch_size <= VLLM_FA3_GRAPH_ORDERED_MAX_BATCH
            and not (splitk_candidate(spec)
                     and shape.batch_size >= splitk_graph_min_batch(spec, gpu_name))
            and (VLLM_FA3_GRAPH_ORDERED_UNEVEN_TILES
                 or not uneven_query_tiles(spec, shape.max_q_len))):
        return True
    rows = shape.batch_size * request_rows
    return (shape.batch_size <= VLLM_FA3_GRAPH_MAX_BATCH
            and rows <= vllm_fa3_graph_max_rows(gpu_name))


def vllm_fa3_device_plan(spec: DecodeSpec, batch_size: int, gpu_name: str = "") -> bool:
    """Whether the ``vllm-fa3-mla`` route computes the plan of a step of ``batch_size``
    requests (its length order and balanced splits) on the GPU named ``gpu_name``: every
    step where ``VLLM_FA3_DEVICE_PLAN``, else the steps of ``splitk_candidate`` specs that
    the graph rule gives vLLM's FA3 kernel longest first below that GPU's
    ``splitk_graph_min_batch`` (none while that bound is the length order's own; addenda
    13-14 of docs/bench-2026-12-05/run228-criteria.txt say what moves it)."""
    if VLLM_FA3_DEVICE_PLAN:
        return True
    return (splitk_candidate(spec) and vllm_fa3_length_order(batch_size)
            and batch_size < splitk_graph_min_batch(spec, gpu_name))


def vllm_fa3_length_order(batch_size: int) -> bool:
    """Whether the ``vllm-fa3-mla`` route launches a batch of ``batch_size`` requests
    longest first (``VLLM_FA3_LENGTH_ORDER_MIN_BATCH``); batch size alone, so a captured
    launch and its replays agree."""
    return batch_size >= VLLM_FA3_LENGTH_ORDER_MIN_BATCH


def uneven_query_tiles(spec: DecodeSpec, max_q_len: int) -> bool:
    """Whether a request's ``heads x max_q_len`` query rows span more than one 64-row tile
    and fill the last one partly (96 rows: two tiles, the second half full)."""
    tiles = query_tiles(spec, max_q_len)
    return tiles > 1 and tiles * 64 != spec.num_heads * max_q_len


def query_tile_rows(spec: DecodeSpec, max_q_len: int) -> float:
    """Query rows (heads x query tokens) per 64-row query tile, on average over a request's
    tiles."""
    return spec.num_heads * max_q_len / query_tiles(spec, max_q_len)


def vllm_fa3_wide_splits(spec: DecodeSpec, max_q_len: int, max_seq_len: int) -> bool:
    """Whether the ``vllm-fa3-mla`` route, under CUDA graphs, plans more KV splits than
    vLLM's 32 for a step whose longest request holds ``max_seq_len`` tokens (as many as
    its captured launch reserved room for)."""
    return (max_seq_len >= VLLM_FA3_WIDE_SPLITS_MIN_SEQ
            and query_tile_rows(spec, max_q_len) <= VLLM_FA3_WIDE_SPLITS_MAX_TILE_ROWS)


def vllm_fa3_halved_splits(spec: DecodeSpec, max_q_len: int, max_seq_len: int,
                           work_tiles: int, sms: int = HOPPER_SMS) -> bool:
    """Whether the ``vllm-fa3-mla`` route, under CUDA graphs, plans splits of two KV tiles
    for a step of ``work_tiles`` FA3 work tiles (query tiles x 64-token KV tiles, summed over
    the requests) where FA3's own formula would cut every request into one-tile splits."""
    if work_tiles * FA3_SPLIT_MARGIN > sms:
        return False
    if -(-max_seq_len // FA3_KV_TILE) < VLLM_FA3_HALVED_SPLITS_MIN_KV_TILES:
        return False
    rows_per_tile = query_tile_rows(spec, max_q_len)
    if rows_per_tile < VLLM_FA3_HALVED_SPLITS_MIN_TILE_ROWS:
        return False
    least = VLLM_FA3_HALVED_SPLITS_MIN_WORK * sms / HOPPER_SMS * (64 / rows_per_tile) ** 0.25
    return work_tiles >= least


def splitk_candidate(spec: DecodeSpec) -> bool:
    """Whether the SM90 rule can pick the CUDA split-KV kernel for some batch of ``spec``:
    a 16-bit cache on pages of ``SPLITK_PAGE_MULTIPLE`` tokens and 8-16 query rows per
    request at ``spec.max_q_len`` (the kernel's row groups are built for that length, so a
    step with fewer query tokens runs the same kernel)."""
    rows = spec.num_heads * spec.max_q_len
    return (not spec.fp8_kv and spec.block_size % SPLITK_PAGE_MULTIPLE == 0
            and SPLITK_MIN_REQUEST_ROWS <= rows <= SPLITK_MAX_REQUEST_ROWS)


def hopper_prefers_splitk(spec: DecodeSpec, shape: BatchShape | None,
                          gpu_name: str = "") -> bool:
    """The SM90 rule for the plugin's CUDA split-KV kernel (``splitk_candidate`` specs):
    under CUDA graphs batches of ``splitk_graph_min_batch`` requests or more (the bound of
    the GPU named ``gpu_name``); with lengths known,
    ``SPLITK_MIN_BATCH`` or more with enough KV tokens, no request holding too large a share
    of them, and ragged (or long uniform) lengths (see the constants)."""
    if shape is None or shape.batch_size > SPLITK_MAX_BATCH:
        return False
    if shape.max_seq_len is None:  # CUDA graphs: batch size alone
        return (splitk_candidate(spec)
                and shape.batch_size >= splitk_graph_min_batch(spec, gpu_name))
    if not splitk_candidate(spec):
        return False
    if shape.batch_size < SPLITK_MIN_BATCH:
        return False
    kv_tokens = shape.kv_tokens or shape.batch_size * shape.max_seq_len
    if kv_tokens < SPLITK_MIN_KV_TOKENS or (
            shape.max_seq_len > SPLITK_MAX_REQUEST_SHARE * kv_tokens):
        return False
    return _ragged(shape) or kv_tokens / shape.batch_size >= SPLITK_UNIFORM_MIN_MEAN_LEN


def triton_fp8_candidate(spec: DecodeSpec) -> bool:
    """Whether the SM90 FP8 rule can pick the Triton kernel for some batch of ``spec``."""
    return (spec.fp8_kv and spec.num_heads <= TRITON_FP8_MAX_HEADS
            and spec.max_q_len <= TRITON_FP8_MAX_Q_LEN)


def hopper_prefers_triton(spec: DecodeSpec, shape: BatchShape | None) -> bool:
    """The SM90 FP8 rule: the Triton kernel first for FP8 caches with few heads and batches
    of at least ``TRITON_FP8_MIN_BATCH`` (batch size only, so CUDA-graph decoders, which rank
    without lengths, follow it too)."""
    return (triton_fp8_candidate(spec) and shape is not None
            and shape.batch_size >= TRITON_FP8_MIN_BATCH)


def fa_sort_by_length(spec: DecodeSpec, shape: BatchShape | None) -> bool:
    """Whether FlashInfer FA routes plan this batch's requests longest first (lever (a) in
    docs/benchmarks-history.md, "Aims not met"): large batches only, and only ragged ones
    of long enough requests when lengths are known."""
    del spec
    if shape is None or shape.batch_size < FA_SORT_MIN_BATCH:
        return False
    if shape.max_seq_len is None:
        return True
    mean_len = (shape.kv_tokens or 0) / shape.batch_size
    return _ragged(shape) and mean_len >= FA_SORT_MIN_MEAN_LEN


def rank(
    spec: DecodeSpec, platform: Platform, shape: BatchShape | None = None
) -> tuple[str, ...]:
    """Route names for ``spec`` on ``platform``, most preferred first (eligibility ignored).

    ``shape`` is the step's batch; ``None`` gives the per-spec default (used to build a
    decoder and whenever lengths are unknown).
    """
    if platform.kind != "cuda" or platform.capability is None:
        return OTHER
    major = platform.capability[0]
    if platform.capability in ((10, 0), (10, 3)):
        return BLACKWELL
    if major == 9:
        if spec.fp8_kv:
            return HOPPER_FP8_FEW_HEADS if hopper_prefers_triton(spec, shape) else HOPPER_FP8
        flashmla = hopper_prefers_flashmla(spec, shape, platform.sm_count or HOPPER_SMS)
        # Without lengths (CUDA graphs) vLLM's FA3 rule decides before FlashMLA's, which
        # takes every other batch there; with lengths FlashMLA's rule decides first.
        lengths_known = shape is not None and shape.max_seq_len is not None
        if (hopper_prefers_vllm_fa3(spec, shape, platform.name)
                and not (lengths_known and flashmla)):
            ranking = HOPPER_VLLM_FA3_FIRST
        else:
            ranking = HOPPER_FLASHMLA_FIRST if flashmla else HOPPER
        return (SPLITK, *ranking) if hopper_prefers_splitk(spec, shape, platform.name) else ranking
    if platform.capability >= (8, 0):
        return AMPERE_ADA
    return OTHER


def small_prefill_rank(spec: DecodeSpec, platform: Platform) -> tuple[str, ...]:
    """Routes for decode batches carrying short prefills (up to ``SMALL_PREFILL_MAX_Q_LEN``
    query tokens per request, causal, lengths known), most preferred first; empty where the
    plugin leaves them to vLLM's prefill path (every GPU but SM90, and FP8 caches, whose
    short prefills vLLM's FLASHMLA also sends through that path)."""
    if (platform.kind == "cuda" and platform.capability is not None
            and platform.capability[0] == 9 and not spec.fp8_kv):
        return HOPPER_SMALL_PREFILL
    return ()


def rankings(
    spec: DecodeSpec, platform: Platform, cuda_graph: bool = False,
    max_batch_size: int | None = None,
) -> tuple[tuple[str, ...], ...]:
    """Every ranking ``rank`` can return for ``spec`` on ``platform`` over all batches
    (a decoder builds the first eligible route of each).

    ``cuda_graph``: only those of batches ranked without lengths (as a CUDA-graph decoder
    ranks), of up to ``max_batch_size`` requests and up to ``spec.max_q_len`` query
    tokens, in order of the first batch size that reaches each; a graph decoder then
    allocates no route it can never run (FlashInfer FA3's workspace and sort buffers).
    """
    if cuda_graph and max_batch_size is not None:
        found: dict[tuple[str, ...], None] = {}
        for batch in range(1, max_batch_size + 1):
            for q_len in range(1, spec.max_q_len + 1):
                found.setdefault(rank(spec, platform, BatchShape(batch, q_len)), None)
        return tuple(found)
    if platform.kind == "cuda" and platform.capability and platform.capability[0] == 9:
        if spec.fp8_kv:
            few_heads = (HOPPER_FP8_FEW_HEADS,) if triton_fp8_candidate(spec) else ()
            return (HOPPER_FP8, *few_heads)
        splitk: tuple[tuple[str, ...], ...] = ()
        if splitk_candidate(spec):
            splitk = ((SPLITK, *HOPPER), (SPLITK, *HOPPER_FLASHMLA_FIRST))
            if cuda_graph:  # 8-row batches that vLLM's FA3 rule gives the rest
                splitk += ((SPLITK, *HOPPER_VLLM_FA3_FIRST),)
        return (HOPPER, HOPPER_FLASHMLA_FIRST, HOPPER_VLLM_FA3_FIRST, *splitk)
    return (rank(spec, platform),)
