"""Where the CUDA split-KV kernel's time goes (issue 11): each shape timed whole and in
variants that leave one part out, against the time its bytes take at the copy ceiling.

Variants (builds of the same source with a diagnostic define, or launches left out):

- ``full``: decode + combine, as the route runs it;
- ``decode``: the decode launch alone (no combine);
- ``empty``: the decode launch exits once its schedule is known (launch, prefix-sum load,
  schedule): the fixed cost of a launch;
- ``no-math``: KV tiles loaded through the pipeline, no scores, softmax or output
  (``SPLITK_DIAG_SKIP_MATH``);
- ``no-kv``: scores, softmax and output over stale shared memory, no KV loads
  (``SPLITK_DIAG_SKIP_KV``; page ids still read).

Usage (GPU machine)::

    python benchmarks/splitk_profile.py [--configs "4,1,4;2,2,4;0,0,4,8;0,0,4,0,0"] [--shapes 0,1,2]
    python benchmarks/splitk_profile.py --eager SHAPE_INDEX   # 3 plain calls, for ncu

Times: median of CUDA-graph replays of ``REPS_PER_GRAPH`` calls over rotating cache copies
(``bench_decode.time_graph``); the output of a diagnostic variant is not checked (it is
not the attention).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BF, F8, K, bytes_flops, ceilings, make_case, time_graph
from decode_kernels import planned_splitk, splitk_call
from splitk_build_ab import SHAPE_SETS

from trtllm_mla_plugin.ops.kernels.cuda_driver import CubinModule
from trtllm_mla_plugin.ops.kernels.nvcc_build import build_cubin
from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import (
    SOURCE,
    SplitKConfig,
)

#: (heads, batch, ctx, lengths, q_len, cache, page): bench_decode's shape tuples.
SHAPES = [
    (16, 1, 256, "u", 1, BF, 64),  # one CTA, 8 tiles: nearly all fixed cost
    (16, 32, 4 * K, "r", 1, BF, 64),
    (16, 64, 4 * K, "r", 1, BF, 64),
    (16, 128, 8 * K, "r", 1, BF, 64),
    (16, 132, 4 * K, "u", 1, BF, 64),  # one whole request per CTA: no combine work
    (32, 64, 4 * K, "r", 1, BF, 64),
    (16, 64, 4 * K, "r", 2, BF, 64),
    (16, 64, 4 * K, "r", 1, F8, 64),
    (16, 128, 8 * K, "r", 1, F8, 64),
    # one long request among short ones: cut into ~70 pieces, merged by the combine
    (16, 96, 64 * K, "o0.03", 1, BF, 64),
    (16, 128, 32 * K, "o0.06", 1, BF, 64),
    (8, 128, 64 * K, "o0.03", 2, BF, 64),
    # short contexts at 33-64 requests, where vLLM's FA3 kernel ran 1.3-1.5x faster (run
    # 132), then h16 b64 4k uniform
    *SHAPE_SETS["short"][:5], SHAPE_SETS["short"][6],
]
COLUMNS = ("full", "decode", "empty", "no-math", "no-kv")
VARIANTS = {"empty": ("SPLITK_DIAG_EMPTY",), "no-math": ("SPLITK_DIAG_SKIP_MATH",),
            "no-kv": ("SPLITK_DIAG_SKIP_KV",)}


def time_variants(case, config: SplitKConfig,
                  modules: dict[str, CubinModule]) -> tuple[dict[str, float], tuple[int, int]]:
    """Microseconds per call of each of ``COLUMNS`` for ``case``, and the launch's
    ``(stages, ctas_per_sm)``."""
    k, call, _ = splitk_call(case, config)
    times = {"full": time_graph(call, case),
             "decode": time_graph(lambda c: call(c, combine=False), case)}
    for name, module in modules.items():
        k.use_module(module)
        times[name] = time_graph(lambda c: call(c, combine=False), case)
    return times, (k.stages, k.ctas_per_sm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="0,0,4;4,1,4",
                    help="stages,ctas_per_sm,min_tiles[,fuse_max_splits[,helped_requests]]; "
                         "... (0: the kernel's default; fuse_max_splits: the fused-merge build; "
                         "helped_requests: heavy requests given helper combine CTAs, default 4)")
    ap.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    ap.add_argument("--eager", type=int, default=None,
                    help="run shape INDEX three times without graphs (under ncu) and exit")
    args = ap.parse_args()
    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    if args.eager is not None:
        case = make_case(SHAPES[args.eager], 1, device)
        k, cu_q, out = planned_splitk(case)
        for i in range(3):
            k.run(case.query, case.caches[i % len(case.caches)], case.batch.block_table,
                  case.batch.seq_lens, cu_q, out, case.spec.softmax_scale)
        torch.cuda.synchronize()
        return
    modules = {name: CubinModule(build_cubin(SOURCE, cap, defines), device)
               for name, defines in VARIANTS.items()}
    copy_gbps = ceilings(device)["copy_GBps"]
    print(f"copy ceiling {copy_gbps:.0f} GB/s")
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    print(f"{'shape':34s} {'cfg':8s} {'copy us':>8s} " + " ".join(f"{c:>8s}" for c in COLUMNS))
    for i in (int(s) for s in args.shapes.split(",")):
        case = make_case(SHAPES[i], 1, device)
        nbytes, _ = bytes_flops(case)
        at_copy = nbytes / (copy_gbps * 1e3)
        for stages, ctas, min_tiles, *rest in configs:
            fused, helped = [*rest, 0, SplitKConfig.helped_requests][:2]
            config = SplitKConfig(stages=stages or None, ctas_per_sm=ctas or None,
                                  min_tiles=min_tiles, fuse_max_splits=fused,
                                  helped_requests=helped)
            try:
                times, (depth, ctas) = time_variants(case, config, modules)
            except ValueError as e:  # e.g. a depth not compiled for this cache dtype
                print(f"{case.name:34s} {config}: {e}")
                continue
            tag = (f"s{depth}c{ctas}m{min_tiles}" + (f"f{fused}" if fused else "")
                   + (f"h{helped}" if helped != SplitKConfig.helped_requests else ""))
            print(f"{case.name:34s} {tag:8s} {at_copy:8.1f} "
                  + " ".join(f"{times[c]:8.1f}" for c in COLUMNS), flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
