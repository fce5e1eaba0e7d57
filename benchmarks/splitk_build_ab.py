"""Builds of the CUDA split-KV kernel's source timed against each other: per shape every
variant's call (decode + combine) is captured once and timed in rotated rounds
(``bench_decode.time_alternating``, CUDA-graph medians over rotating cache copies), the
outputs compared bit for bit with the first variant's, and the ratio of each variant's median
to the first's printed (> 1: the variant faster).

Variants (``--variants``, ``;``-separated, each ``,``-separated tokens): ``default`` (the
build every route runs), ``helped=N`` (``SplitKConfig.helped_requests``: the combine's helper
CTAs for heavy requests; 0 is the build without them) and any other token as a preprocessor
define of the source (a variant kept behind an ``#ifdef`` while it is measured: run 136
timed a pipeline prologue that way, docs/benchmarks-history.md).

Usage (GPU machine, ``nvcc`` on the path)::

    PYTHONPATH=$PWD python benchmarks/splitk_build_ab.py --variants "helped=0;default" \\
        --shapes heavy     # as runs 126 and 130 (splitk_helpers_ab.py then, folded in here)
    PYTHONPATH=$PWD python benchmarks/splitk_build_ab.py --variants "SOME_DEFINE;default" \\
        --shapes short,heavy --seeds 97 --out ab.csv    # run 136's form

``--out``: one row per shape and variant (us per round, median, bit-equal to the first).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode
from bench_decode import BF, F8, K, bytes_flops, ceilings, int_range, make_case, random_set
from decode_kernels import splitk_call

from trtllm_mla_plugin.ops.kernels.cuda_driver import CubinModule
from trtllm_mla_plugin.ops.kernels.nvcc_build import build_cubin
from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import (
    SOURCE,
    SplitKConfig,
    build_defines,
)

#: bench_decode's shape tuples (heads, batch, ctx, lengths, q_len, cache, page).
SHAPE_SETS = {
    # one long request among short ones ("oFRAC"), then batches without a heavy request
    "heavy": [
        (16, 96, 64 * K, "o0.03", 1, BF, 64), (16, 128, 32 * K, "o0.06", 1, BF, 64),
        (8, 128, 64 * K, "o0.03", 2, BF, 64), (16, 160, 16 * K, "o0.1", 1, BF, 64),
        (16, 512, 32 * K, "o0.01", 1, BF, 64), (16, 1024, 64 * K, "o0.005", 1, BF, 64),
        (32, 128, 64 * K, "o0.03", 1, BF, 64), (16, 256, 128 * K, "o0.01", 1, BF, 64),
        (16, 128, 8 * K, "u", 1, BF, 64), (16, 128, 8 * K, "r", 1, BF, 64),
        (16, 256, 4 * K, "u", 1, BF, 64), (16, 256, 4 * K, "r", 1, BF, 64),
        (16, 256, 1 * K, "r", 1, BF, 64), (16, 96, 2 * K, "r", 1, BF, 64),
        (16, 512, 2 * K, "r", 1, BF, 64), (16, 1024, 1 * K, "r", 1, BF, 64),
        (8, 256, 4 * K, "r", 2, BF, 64), (16, 128, 8 * K, "r", 1, F8, 64),
    ],
    # short contexts at 33-64 requests, where vLLM's FA3 kernel ran 1.3-1.5x faster (run
    # 132), and the grid's 16-row batches of 64
    "short": [
        (16, 33, 981, "u", 1, BF, 64), (16, 46, 390, "r0.51", 1, BF, 64),
        (16, 55, 338, "u", 1, BF, 64), (16, 34, 2023, "r0.15", 1, BF, 64),
        (8, 46, 592, "r0.68", 2, BF, 64), (16, 1, 256, "u", 1, BF, 64),
        (16, 64, 4 * K, "u", 1, BF, 64), (16, 64, 4 * K, "r", 1, BF, 64),
        (16, 64, 32 * K, "u", 1, BF, 64), (16, 64, 4 * K, "r", 1, F8, 64),
    ],
}


@dataclass(frozen=True)
class Variant:
    """One build: the launch ``config`` (its own defines) plus ``defines`` of the source."""

    name: str
    config: SplitKConfig = field(default_factory=SplitKConfig)
    defines: tuple[str, ...] = ()


def parse_variants(text: str) -> list[Variant]:
    """``--variants``: ``;``-separated variants of ``,``-separated tokens (see the module)."""
    variants = []
    for item in (v.strip() for v in text.split(";")):
        if not item:
            continue
        config, defines = SplitKConfig(), []
        for token in (t.strip() for t in item.split(",")):
            if token == "default":
                continue
            if token.startswith("helped="):
                config = SplitKConfig(helped_requests=int(token.partition("=")[2]))
            else:
                defines.append(token)
        variants.append(Variant(item, config, tuple(defines)))
    if len(variants) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least two variants to compare")
    return variants


def shapes_for(sets: str, seeds: str, count: int, request_rows: tuple[int, int],
               batches: tuple[int, int]) -> list[tuple[int, tuple]]:
    """``(case seed, shape)``: the named sets (case seed 1) then the random draws' bf16
    shapes within the filters (their own case seeds, ``bench_decode.random_set``)."""
    shapes = [(1, shape) for name in sets.split(",") if name for shape in SHAPE_SETS[name]]
    for seed in (int(s) for s in seeds.split(",") if s):
        shapes += random_set(seed, count, keep=BF, request_rows=request_rows, batches=batches)
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", type=parse_variants, required=True)
    ap.add_argument("--shapes", default="heavy", help=f"sets of {sorted(SHAPE_SETS)}")
    ap.add_argument("--seeds", default="", help="random-set seeds (bf16 shapes)")
    ap.add_argument("--count", type=int, default=1000, help="shapes drawn per seed")
    ap.add_argument("--request-rows", type=int_range, default=(9, 16), metavar="LO-HI")
    ap.add_argument("--batches", type=int_range, default=(17, 1024), metavar="LO-HI")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    variants: list[Variant] = args.variants
    modules = {v.name: CubinModule(build_cubin(SOURCE, cap, build_defines(v.config) + v.defines),
                                   device) for v in variants}
    copy_gbps = ceilings(device)["copy_GBps"]
    shapes = shapes_for(args.shapes, args.seeds, args.count, args.request_rows, args.batches)
    print(f"copy ceiling {copy_gbps:.0f} GB/s; {len(shapes)} shapes; variants "
          + " | ".join(v.name for v in variants), flush=True)
    ratios: dict[str, list[float]] = {v.name: [] for v in variants[1:]}
    writer = None
    if args.out:
        out_file = open(args.out, "w", newline="")  # noqa: SIM115 (kept open for the run)
        writer = csv.writer(out_file)
        writer.writerow(["shape", "batch", "copy_us", "variant", "rounds_us", "median_us",
                         "bit_equal"])
    for case_seed, shape in shapes:
        case = make_case(shape, case_seed, device)
        calls, outs = [], []
        for v in variants:
            kernel, call, out = splitk_call(case, v.config)
            kernel.use_module(modules[v.name])
            calls.append(call)
            outs.append(out)
        results = []
        for call, out in zip(calls, outs, strict=True):
            call(case.caches[0])
            torch.cuda.synchronize()
            results.append(out.clone())
        times = bench_decode.time_alternating(calls, case, args.rounds)
        medians = [statistics.median(t) for t in times]
        copy_us = bytes_flops(case)[0] / (copy_gbps * 1e3)
        cells = []
        for v, t, med, res in zip(variants, times, medians, results, strict=True):
            equal = torch.equal(res, results[0])
            if writer:
                writer.writerow([case.name, shape[1], f"{copy_us:.1f}", v.name,
                                 " ".join(f"{x:.2f}" for x in t), f"{med:.2f}", equal])
            if v is not variants[0]:
                ratios[v.name].append(medians[0] / med)
                cells.append(f"{v.name} {medians[0] / med:.3f}{'' if equal else ' (differs)'}")
        print(f"{case.name}: copy {copy_us:.1f} us, {variants[0].name} {medians[0]:.1f} us; "
              + ", ".join(cells), flush=True)
        if writer:
            out_file.flush()
        del case, calls, outs, results
        torch.cuda.empty_cache()
    for name, values in ratios.items():
        print(f"{name} / {variants[0].name} (> 1: {name} faster): geomean "
              f"{statistics.geometric_mean(values):.3f}, worst {min(values):.3f}, best "
              f"{max(values):.3f}, n {len(values)}")


if __name__ == "__main__":
    main()
