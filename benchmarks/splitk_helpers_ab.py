"""The split-KV combine's helper CTAs for heavy requests (``SplitKConfig.helped_requests``,
docs/benchmarks.md "The combine's heavy requests"), timed against the same source built
without them: per shape the two alternate A B A B (CUDA-graph medians over rotating cache
copies, ``bench_decode.time_graph``), the decode launch alone beside them, and the two
outputs compared bit for bit (the helpers sum the same partials in the same order).

Usage (GPU machine, ``nvcc`` on the path)::

    PYTHONPATH=$PWD python benchmarks/splitk_helpers_ab.py > ab.csv

Columns: shape, time at the copy ceiling, decode alone, without / with helpers twice (us),
the ratio of the sums (> 1: helpers faster), bit-equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BF, F8, K, bytes_flops, ceilings, make_case, time_graph
from decode_kernels import splitk_call

from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKConfig

#: bench_decode's shape tuples: one long request among short ones ("oFRAC"), then batches
#: without a heavy request (what the helpers must not slow down).
SHAPES = [
    (16, 96, 64 * K, "o0.03", 1, BF, 64), (16, 128, 32 * K, "o0.06", 1, BF, 64),
    (8, 128, 64 * K, "o0.03", 2, BF, 64), (16, 160, 16 * K, "o0.1", 1, BF, 64),
    (16, 512, 32 * K, "o0.01", 1, BF, 64), (16, 1024, 64 * K, "o0.005", 1, BF, 64),
    (32, 128, 64 * K, "o0.03", 1, BF, 64), (16, 256, 128 * K, "o0.01", 1, BF, 64),
    (16, 128, 8 * K, "u", 1, BF, 64), (16, 128, 8 * K, "r", 1, BF, 64),
    (16, 256, 4 * K, "u", 1, BF, 64), (16, 256, 4 * K, "r", 1, BF, 64),
    (16, 256, 1 * K, "r", 1, BF, 64), (16, 96, 2 * K, "r", 1, BF, 64),
    (16, 512, 2 * K, "r", 1, BF, 64), (16, 1024, 1 * K, "r", 1, BF, 64),
    (8, 256, 4 * K, "r", 2, BF, 64), (16, 128, 8 * K, "r", 1, F8, 64),
]
HELPED = (0, SplitKConfig.helped_requests)


def compare(shape: tuple, device: torch.device, copy_gbps: float) -> str:
    """One CSV line for ``shape``."""
    case = make_case(shape, 1, device)
    nbytes, _ = bytes_flops(case)
    calls, outs = {}, {}
    for helped in HELPED:
        _, calls[helped], outs[helped] = splitk_call(case, SplitKConfig(helped_requests=helped))
    times = [time_graph(calls[h], case) for _ in range(2) for h in HELPED]
    decode_us = time_graph(lambda cache: calls[HELPED[0]](cache, combine=False), case)
    results = []
    for helped in HELPED:
        calls[helped](case.caches[0])
        torch.cuda.synchronize()
        results.append(outs[helped].clone())
    ratio = (times[0] + times[2]) / (times[1] + times[3])
    return (f"{case.name},{nbytes / (copy_gbps * 1e3):.1f},{decode_us:.1f},"
            + ",".join(f"{t:.1f}" for t in times)
            + f",{ratio:.3f},{torch.equal(results[0], results[1])}")


def main() -> None:
    device = torch.device("cuda")
    copy_gbps = ceilings(device)["copy_GBps"]
    print(f"copy ceiling {copy_gbps:.0f} GB/s", flush=True)
    print("shape,copy_us,decode_only,helped0_a,helped4_a,helped0_b,helped4_b,ratio_of_sums,"
          "bit_equal", flush=True)
    for shape in SHAPES:
        print(compare(shape, device, copy_gbps), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
