"""The FlashMLA route's schedule kernel on the GPU (needs CUDA and vLLM's FlashMLA, e.g.
``.peers`` on PYTHONPATH).

``python3 benchmarks/bench_flashmla_schedule.py [--seed S] [--count N]`` prints
1. ``ops/kernels/flashmla_schedule.py`` alone: a CUDA graph of 20 launches, median us per
   launch, for batches 1-1024 (random lengths, and uniform ones, whose boundaries snap to
   request ends most), 132/66/33 SM parts, three (requests per step, warps) settings;
2. FlashMLA's own scheduler alone (batches of the same sizes), by difference of graph
   times; and its dense FP8 scheduler, timed directly, beside this kernel's FP8 layout;
3. the ``flashmla`` route (the plugin's schedule) against ``peer:vllm-flashmla`` (FlashMLA's
   own schedule kernel once per graph of 10 calls, as vLLM's FLASHMLA runs once per step):
   graph-timed medians of three alternations on fixed shapes and on random bf16 set
   ``--seed``, with the geometric mean and the worst of peer / route;
4. ``--sections overhead``: the route on FlashMLA's walk at other costs per request
   (``--overheads``, blocks beside a request's KV blocks; FlashMLA's is 5; a larger cost
   splits fewer requests, so FlashMLA's combine has less to merge) beside vLLM's FA3 MLA
   call under CUDA graphs (``peer:vllm-fa3-mla``, where the kit is installed) and
   FLASHMLA's call, on the shapes where the CUDA-graph rule lost most in run 85 (short
   contexts on FlashMLA, small batches on FA3) and on random bf16 set ``--seed``; writes
   ``--out`` (CSV: shape, kernel, us, extra pieces, difference to the default plan's
   output; beside it ``*.shapes.jsonl``: each shape's lengths, SM parts and query rows, for
   ``fit_flashmla_overhead.py``) and prints, per overhead, the geometric mean of FA3's time
   over the route's.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib
import json
import statistics
from pathlib import Path

import bench_decode as bd
import decode_kernels as dk
import torch

from trtllm_mla_plugin.ops.kernels.flashmla_schedule import (
    REQUEST_SCRATCH_ROWS,
    flashmla_schedule,
)

FIXED = [(16, 1, 1024, "u", 1, bd.BF, 64), (32, 4, 2048, "u", 1, bd.BF, 64),
         (128, 8, 4096, "u", 1, bd.BF, 64), (64, 16, 2048, "u", 2, bd.BF, 64),
         (16, 64, 4096, "u", 1, bd.BF, 64), (16, 64, 4096, "r", 1, bd.BF, 64),
         (16, 256, 2048, "r", 1, bd.BF, 64), (128, 64, 8192, "r", 1, bd.BF, 64),
         (16, 512, 1024, "r", 1, bd.BF, 64), (128, 32, 4096, "u", 4, bd.BF, 64)]


#: Run 85's worst shapes of the CUDA-graph rule, in the two regions it loses in: short
#: contexts at b48-b376 on FlashMLA (vLLM's FA3 1.2-1.4x faster) and small batches on FA3.
LOSS_REGION = [(32, 140, 398, "r0.54", 1, bd.BF, 64), (64, 376, 848, "r0.50", 1, bd.BF, 64),
               (8, 48, 496, "r0.13", 2, bd.BF, 64), (16, 93, 1128, "r0.81", 1, bd.BF, 64),
               (16, 64, 512, "u", 1, bd.BF, 64), (16, 128, 1024, "u", 1, bd.BF, 64),
               (128, 40, 512, "u", 1, bd.BF, 64), (128, 3, 1475, "u", 2, bd.BF, 64),
               (128, 2, 2141, "u", 2, bd.BF, 64), (64, 3, 1209, "u", 2, bd.BF, 64),
               (32, 3, 2265, "u", 4, bd.BF, 64), (128, 5, 1078, "r0.71", 3, bd.BF, 64)]
OVERHEAD_FIELDS = ["shape", "kernel", "us", "extra_pieces", "rel_diff"]


def _graph_us(fn, reps: int = 20) -> float:
    """Median us per call of ``fn`` from replays of a graph of ``reps`` calls."""
    fn()  # warm-up (JIT) outside capture
    return bd.time_replays(bd.capture_calls(lambda _: fn(), reps), reps)


def time_schedule_kernel(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 32, 128, 187, 512, 1024):
        for kind in ("random", "uniform 1315", "uniform 64"):
            if kind == "random":
                lens = torch.randint(1, 8192, (batch,), generator=gen)
            else:
                lens = torch.full((batch,), int(kind.split()[1]))
            lens = lens.to(torch.int32).to(device)
            for parts in (132, 66, 33):
                meta = torch.empty(parts, 8, dtype=torch.int32, device=device)
                splits = torch.empty(batch + 1, dtype=torch.int32, device=device)
                scratch = torch.empty(REQUEST_SCRATCH_ROWS, batch, dtype=torch.int32,
                                      device=device)
                owners = torch.empty(parts + 1, dtype=torch.int32, device=device)
                times = []
                for chunk, warps in ((32, 1), (64, 2), (128, 4)):
                    launch = functools.partial(flashmla_schedule, lens, meta, splits,
                                               scratch, owners, chunk=chunk, num_warps=warps)
                    times.append(f"{chunk}/{warps}w {_graph_us(launch):.2f}")
                print(f"schedule kernel b{batch} {kind} parts{parts}: us per launch "
                      + ", ".join(times), flush=True)


def time_flashmla_own_schedule(device: torch.device) -> None:
    """FlashMLA's own scheduler, by difference: graphs of 20 ``dense_decode_fwd`` calls that
    schedule for themselves (no schedule given, as vLLM's FLASHMLA's first layer of a step)
    against 20 calls on a schedule computed before."""
    importlib.import_module(dk.FLASHMLA_MODULE)
    decode = torch.ops._flashmla_C.dense_decode_fwd
    try:
        importlib.import_module("vllm._flashmla_extension_C")
        fp8_ops = torch.ops._flashmla_extension_C
    except ImportError:
        fp8_ops = None
    gen = torch.Generator().manual_seed(1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for batch in (1, 32, 128, 187, 512, 1024):
        for kind in ("random 2048", "uniform 1315", "uniform 64"):
            if kind.startswith("random"):
                lens = torch.randint(1, 2048, (batch,), generator=gen)
            else:
                lens = torch.full((batch,), int(kind.split()[1]))
            pages = (lens + 63) // 64
            table = torch.arange(int(pages.sum()), dtype=torch.int32)
            width = int(pages.max())
            block_table = torch.zeros(batch, width, dtype=torch.int32)
            start = 0
            for i, n in enumerate(pages.tolist()):
                block_table[i, :n] = table[start:start + n]
                start += n
            block_table = block_table.to(device)
            lens = lens.to(torch.int32).to(device)
            cache = torch.randn(start, 64, 1, 576, dtype=torch.bfloat16, device=device)
            scratch = torch.empty(REQUEST_SCRATCH_ROWS, batch, dtype=torch.int32,
                                  device=device)
            owners = torch.empty(sms + 1, dtype=torch.int32, device=device)
            for heads, q_len in ((64, 1), (128, 1), (128, 2)):
                q = torch.randn(batch, q_len, heads, 576, dtype=torch.bfloat16, device=device)
                _, _, meta, splits = decode(q, cache, 512, lens, block_table, 0.1, q_len > 1,
                                            None, None, None)
                args = (q, cache, 512, lens, block_table, 0.1, q_len > 1)
                own = _graph_us(functools.partial(decode, *args, None, None, None))
                given = _graph_us(functools.partial(decode, *args, meta, splits, None))
                print(f"flashmla own schedule b{batch} {kind} parts{meta.shape[0]}: "
                      f"{own - given:.2f} us per launch (decode {given:.2f} us)", flush=True)
                if fp8_ops is not None:
                    fp8 = _graph_us(functools.partial(
                        fp8_ops.get_mla_decoding_metadata_dense_fp8, lens, q_len * heads, 1))
                    mine = _graph_us(functools.partial(
                        flashmla_schedule, lens, meta, splits, scratch, owners,
                        fp8_layout=True))
                    print(f"flashmla fp8 own schedule b{batch} {kind} parts{meta.shape[0]}: "
                          f"{fp8:.2f} us per launch, the plugin's fp8 layout {mine:.2f}",
                          flush=True)


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
    geomean = statistics.geometric_mean(ratios)
    print(f"route against peer:vllm-flashmla over {len(ratios)} shapes: geomean "
          f"{geomean:.3f}, worst {min(ratios):.3f}, under 0.98: {sum(r < 0.98 for r in ratios)}")


def set_overhead(route, blocks: int) -> None:
    """The ``flashmla`` route's cost per request in its schedule (read by its plan)."""
    route._schedule.overhead_blocks = blocks


def overhead_sweep(device: torch.device, seed: int, count: int, overheads: list[int],
                   out: Path) -> None:
    shapes = [(9, s) for s in LOSS_REGION] + bd.random_set(seed, count, keep=bd.BF)
    gains: dict[int, list[float]] = {o: [] for o in overheads}
    with open(out, "w", newline="") as f, open(out.with_suffix(".shapes.jsonl"), "w") as log:
        writer = csv.DictWriter(f, fieldnames=OVERHEAD_FIELDS)
        writer.writeheader()
        for case_seed, shape in shapes:
            case = bd.make_case(shape, case_seed, device)
            route = dk.decoder_kernel("flashmla", case, "flashmla", engine_query=True)
            if route.call is None:
                continue
            peers = {"peer:vllm-fa3-mla": dk.vllm_fa3_mla_peer(case),
                     "peer:vllm-flashmla": dk.flashmla_peer(case)}
            times = bd.time_kernels(peers, case)
            r, b = route.obj.route, case.batch.batch_size
            for o, us, diff in bd.route_variants(route, case, overheads, set_overhead):
                extra = int(r._schedule.buffers[1][-1]) - b
                times[f"flashmla@{o}"] = us
                writer.writerow(dict(shape=case.name, kernel=f"flashmla@{o}", us=f"{us:.2f}",
                                     extra_pieces=extra, rel_diff=f"{diff:.1e}"))
                if "peer:vllm-fa3-mla" in times:
                    gains[o].append(times["peer:vllm-fa3-mla"] / us)
            log.write(json.dumps(dict(
                shape=case.name, lens=list(case.lens_host), q_len=case.q_len,
                heads=case.spec.num_heads,
                parts=r._schedule.num_parts(case.q_len * case.spec.num_heads))) + "\n")
            bd.write_peer_rows(writer, case.name, list(peers), times)
            f.flush()
            del case
            torch.cuda.empty_cache()
    for o, g in gains.items():
        if g:
            print(f"overhead {o}: vLLM FA3 / flashmla route {bd.ratio_summary(g)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--count", type=int, default=70)
    parser.add_argument("--sections", default="kernel,own,route",
                        help="comma list of kernel (this kernel alone), own (FlashMLA's "
                        "scheduler alone), route (route against peer), overhead (the route "
                        "at other costs per request, beside vLLM's FA3)")
    parser.add_argument("--overheads", default="5,8,16,32,64,1000",
                        help="costs per request in blocks for --sections overhead; the "
                        "first is the plan the others' outputs are compared with")
    parser.add_argument("--out", type=Path, default=Path("flashmla-overheads.csv"))
    args = parser.parse_args()
    device = torch.device("cuda")
    sections = args.sections.split(",")
    if "kernel" in sections:
        time_schedule_kernel(device)
    if "own" in sections:
        time_flashmla_own_schedule(device)
    if "route" in sections:
        route_against_peer(device, args.seed, args.count)
    if "overhead" in sections:
        overhead_sweep(device, args.seed, args.count,
                       [int(o) for o in args.overheads.split(",")], args.out)


if __name__ == "__main__":
    main()
