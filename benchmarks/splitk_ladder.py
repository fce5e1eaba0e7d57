"""First-run diagnosis of the CUDA split-KV kernel: a ladder of cases from one tile of one
request up to cut requests, several query tokens, row groups and head blocks, each against
float64, stopping at the first failure with where the error sits.

Usage (GPU machine)::

    python benchmarks/splitk_ladder.py [--all]      # --all: do not stop at a failure
    compute-sanitizer --tool memcheck python benchmarks/splitk_ladder.py --quick

Per case: relative error, the rows (query row = token * heads + head) and 128-column
quarters (one per warp) whose error exceeds 10x the bf16 bound, and whether the failing
rows are the ones cut across CTAs (partials through the combine kernel) or written whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from trtllm_mla_plugin.ops import KVScales
from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKConfig

from mla_cases import errors, make_problem, reference, splitk_decode

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SCALED = KVScales(q_scale=2.0, k_scale=0.5, v_scale=0.25)
#: (label, heads, lens, q_len, block, config[, scales]): each step adds one thing to the one
#: before; with scales the cache is FP8 e4m3 (read with the bf16 query).
LADDER = [
    ("one tile, one request, h16", 16, [32], 1, 64, SplitKConfig(min_tiles=1)),
    ("partial tile (len 5)", 16, [5], 1, 64, SplitKConfig(min_tiles=1)),
    ("one request, 2 tiles, one CTA", 16, [64], 1, 64, SplitKConfig(min_tiles=64)),
    ("one request, 8 pages, one CTA", 16, [500], 1, 64, SplitKConfig(min_tiles=64)),
    ("page 32", 16, [500], 1, 32, SplitKConfig(min_tiles=64)),
    ("two requests, one CTA", 16, [100, 300], 1, 64, SplitKConfig(min_tiles=64)),
    ("one request cut over 2 CTAs (combine)", 16, [64 * 32], 1, 64,
     SplitKConfig(min_tiles=32)),
    ("one request over every CTA", 16, [32 * 1024], 1, 64, SplitKConfig()),
    ("ragged batch, cuts and whole requests", 16, [1, 63, 64, 65, 700, 3000, 9000, 40], 1,
     64, SplitKConfig()),
    ("8 heads (rows 8-15 padding)", 8, [700, 3000], 1, 64, SplitKConfig()),
    ("q_len 2 at 8 heads (16 rows, causal)", 8, [700, 3000, 2], 2, 64, SplitKConfig()),
    ("32 heads (two row groups)", 32, [700, 3000, 1], 1, 64, SplitKConfig()),
    ("16 heads q_len 4 (64 rows: 2 head blocks)", 16, [700, 3000, 4], 4, 64, SplitKConfig()),
    ("128 heads (4 head blocks)", 128, [700, 3000], 1, 64, SplitKConfig()),
    ("2 stages, 2 CTAs per SM", 16, [700, 3000, 9000, 5], 1, 64,
     SplitKConfig(stages=2, ctas_per_sm=2)),
    ("3 stages", 16, [700, 3000, 9000, 5], 1, 64, SplitKConfig(stages=3)),
    ("FP8 cache: one tile, unit scales", 16, [32], 1, 64, SplitKConfig(min_tiles=1),
     KVScales()),
    ("FP8 cache: ragged, scaled", 16, [1, 63, 64, 65, 700, 3000, 9000, 40], 1, 64,
     SplitKConfig(), SCALED),
    ("FP8 cache: 32 heads, q_len 2, page 32", 32, [700, 3000, 2], 2, 32, SplitKConfig(),
     SCALED),
    ("FP8 cache: 4 stages", 16, [700, 3000, 9000, 5], 1, 64, SplitKConfig(stages=4), SCALED),
]
QUICK = {0, 1, 6, 8, 11, 16, 17}


def run_case(label, heads, lens, q_len, block, config, scales=None, *, device) -> bool:
    torch.manual_seed(0)
    kv_dtype = BF16 if scales is None else FP8
    p = make_problem(heads=heads, block=block, lens=lens, q_lens=q_len, dtype=BF16,
                     kv_dtype=kv_dtype, scales=scales or KVScales(), device=device)
    out = splitk_decode(p, config)
    ref = reference(p)
    unwritten = (~torch.isfinite(out)).any(-1)
    rel, worst = errors(torch.nan_to_num(out, nan=0.0), ref)
    # bf16 bounds of tests/gpu/mla_cases.py; FP8 caches read with the bf16 query are held
    # to them too (the reference reads the same stored values)
    ok = rel < 1e-2 and worst < 2e-2 and not unwritten.any()
    print(f"{'ok  ' if ok else 'FAIL'} {label:45} rel {rel:.2e} max {worst:.2e}", flush=True)
    if not ok:
        err = (out.double() - ref).abs() / ref.abs().max()
        bad = err > 0.2
        rows = bad.any(-1)  # [tokens, heads]
        print(f"     unwritten (token, head) rows: {unwritten.nonzero().tolist()[:16]}")
        print(f"     bad (token, head) rows: {rows.nonzero().tolist()[:16]} of "
              f"{rows.sum().item()}")
        quarters = bad.view(-1, 4, 128).any(-1).any(0).tolist()
        print(f"     bad column quarters (one per warp): {quarters}")
        print(f"     bad columns within a quarter: "
              f"{bad.view(-1, 4, 128).any(0).any(0).nonzero().flatten().tolist()[:32]}")
        print(f"     out[0,0,:8] {out[0, 0, :8].tolist()}\n     ref[0,0,:8] "
              f"{ref[0, 0, :8].tolist()}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="run every case, even after a failure")
    ap.add_argument("--quick", action="store_true", help="five cases (for compute-sanitizer)")
    args = ap.parse_args()
    device = torch.device("cuda")
    failed = 0
    for i, case in enumerate(LADDER):
        if args.quick and i not in QUICK:
            continue
        if not run_case(*case, device=device):
            failed += 1
            if not args.all:
                break
    print(f"{failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
