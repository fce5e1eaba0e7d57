"""The FlashMLA route's schedule kernel on the GPU (needs CUDA and vLLM's FlashMLA, e.g.
``.peers`` on PYTHONPATH).

``python3 benchmarks/bench_flashmla_schedule.py [--seed S] [--count N]`` prints
1. ``ops/kernels/flashmla_schedule.py`` alone: a CUDA graph of 20 launches, median us per
   launch, for batches 1-1024 and 132/66/33 SM parts;
2. the ``flashmla`` route (the plugin's schedule) against ``peer:vllm-flashmla`` (FlashMLA's
   own schedule kernel once per graph of 10 calls, as vLLM's FLASHMLA runs once per step):
   graph-timed medians of three alternations on fixed shapes and on random bf16 set
   ``--seed``, with the geometric mean and the worst of peer / route.
"""

from __future__ import annotations

import argparse
import math

import bench_decode as bd
import decode_kernels as dk
import torch

from trtllm_mla_plugin.ops.kernels.flashmla_schedule import flashmla_schedule

FIXED = [(16, 1, 1024, "u", 1, bd.BF, 64), (32, 4, 2048, "u", 1, bd.BF, 64),
         (128, 8, 4096, "u", 1, bd.BF, 64), (64, 16, 2048, "u", 2, bd.BF, 64),
         (16, 64, 4096, "u", 1, bd.BF, 64), (16, 64, 4096, "r", 1, bd.BF, 64),
         (16, 256, 2048, "r", 1, bd.BF, 64), (128, 64, 8192, "r", 1, bd.BF, 64),
         (16, 512, 1024, "r", 1, bd.BF, 64), (128, 32, 4096, "u", 4, bd.BF, 64)]


def time_schedule_kernel(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32, 128, 512, 1024):
        for parts in (132, 66, 33):
            lens = torch.randint(1, 8192, (batch,), generator=gen).to(torch.int32).to(device)
            meta = torch.empty(parts, 8, dtype=torch.int32, device=device)
            splits = torch.empty(batch + 1, dtype=torch.int32, device=device)
            ends = torch.empty(batch, dtype=torch.int32, device=device)
            owners = torch.empty(parts + 1, dtype=torch.int32, device=device)
            flashmla_schedule(lens, meta, splits, ends, owners)
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                for _ in range(20):
                    flashmla_schedule(lens, meta, splits, ends, owners)
            print(f"schedule kernel b{batch} parts{parts}: "
                  f"{bd.time_replays(graph, 20):.2f} us/launch", flush=True)


def route_against_peer(device: torch.device, seed: int, count: int) -> None:
    shapes = [(7, s) for s in FIXED] + bd.random_set(seed, count, keep=bd.BF)
    ratios = []
    for case_seed, shape in shapes:
        case = bd.make_case(shape, case_seed, device)
        route = dk.decoder_kernel("flashmla", case, "flashmla", engine_query=True)
        peer = dk.flashmla_peer(case)
        if route.call is None or peer.call is None:
            continue
        mine, theirs = [], []
        for _ in range(3):
            mine.append(bd.time_graph(route.call, case))
            theirs.append(bd.time_graph(peer.call, case))
        mine.sort()
        theirs.sort()
        ratios.append(theirs[1] / mine[1])
        print(f"{case.name} route={mine[1]:.2f} peer={theirs[1]:.2f} "
              f"peer/route={ratios[-1]:.3f}", flush=True)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"route against peer:vllm-flashmla over {len(ratios)} shapes: geomean "
          f"{geomean:.3f}, worst {min(ratios):.3f}, under 0.98: {sum(r < 0.98 for r in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--count", type=int, default=70)
    args = parser.parse_args()
    device = torch.device("cuda")
    time_schedule_kernel(device)
    route_against_peer(device, args.seed, args.count)


if __name__ == "__main__":
    main()
