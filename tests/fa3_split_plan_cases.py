"""Random decode steps for the GPU plan of the ``vllm-fa3-mla`` route: the planner of FA3's
splits (``kernels.fa3_split_plan``) against the host's ``fa3_splits.balanced_splits`` (the
same splits where the host replans, nothing written where it keeps FA3's plan), the length
order (``kernels.length_order``, ``--length-order``) against numpy's. Imported by
tests/test_fa3_split_plan_cpu.py and tests/gpu/test_cuda_graph_gpu.py; run as a script
(``TRITON_INTERPRET=1`` on the CPU) it checks ``N`` random steps on the default device:

    TRITON_INTERPRET=1 python tests/fa3_split_plan_cases.py [N] [--device cpu|cuda]

``--route`` checks the route's whole plan on the CPU both ways; on a GPU
``--time 33,48,96`` times each kernel's launch per batch size.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
from collections import Counter

import numpy as np
import torch

from trtllm_mla_plugin.ops import fa3_splits

#: What the planner must leave in a slot it does not write.
UNTOUCHED = -7
HEADS = (8, 16, 32, 64, 128)


def random_step(rng: random.Random) -> dict:
    """One step the route could replan: heads x query tokens, a batch inside the widest
    band of ``fa3_splits.may_spill`` for the SM count, lengths near-equal, ragged, short
    or long (some slots empty, as in a padded captured batch), caps as the route plans
    them, and now and then a band given instead of ``spill_band``'s."""
    sms = rng.choice((132, 132, 132, 114, 78, 24))
    rows = rng.choice(HEADS) * rng.randint(1, 4)
    tiles = -(-rows // 64)
    low = math.floor(sms * (1 - 1 / fa3_splits.FA3_SPLIT_MARGIN) / tiles) + 1
    high = max(low, math.floor(fa3_splits.NARROW_SPILL * sms / tiles))
    batch = rng.randint(low, high)
    kind = rng.choice(("even", "even", "ragged", "short", "long", "two"))
    top = rng.choice((640, 2560, 4096, 9000, 20_000, 70_000))
    if kind == "even":
        base = rng.randint(64, top)
        lens = [max(1, int(base * rng.uniform(0.9, 1.0))) for _ in range(batch)]
    elif kind == "ragged":
        lens = [rng.randint(1, top) for _ in range(batch)]
    elif kind == "short":
        lens = [rng.randint(1, 2560) for _ in range(batch)]
    elif kind == "long":
        lens = [rng.randint(top // 2, top) for _ in range(batch)]
    else:
        pair = (rng.randint(64, top), rng.randint(64, top))
        lens = [pair[i % 2] for i in range(batch)]
    for i in rng.sample(range(batch), k=rng.randint(0, max(0, batch // 8))):
        lens[i] = 0
    reserved = rng.choice((32, 64))
    planned = rng.choice((reserved, 32, rng.randint(2, reserved)))
    spill = rng.choice((None, None, None, 1.2, fa3_splits.SPILL, 2.0))
    return dict(lens=lens, rows=rows, tiles=tiles, sms=sms, reserved=reserved,
                planned=min(planned, reserved), spill=spill)


def host_plan(step: dict) -> np.ndarray | None:
    kv_tiles = -(-np.asarray(step["lens"], dtype=np.int64) // 64)
    return fa3_splits.balanced_splits(kv_tiles, step["tiles"], step["reserved"], step["sms"],
                                      step["rows"] / step["tiles"], step["planned"],
                                      step["spill"])


def planner_splits(planner, step: dict, device: torch.device) -> tuple[bool, list[int]]:
    """(launched, the split slots after the planner) for ``step``, the slots filled with
    ``UNTOUCHED`` before."""
    lens = torch.tensor(step["lens"], dtype=torch.int32, device=device)
    splits = torch.full_like(lens, UNTOUCHED)
    launched = planner.write(lens, splits, query_tiles=step["tiles"], request_rows=step["rows"],
                             max_splits=step["reserved"], sms=step["sms"],
                             fa3_cap=step["planned"], spill=step["spill"])
    return launched, splits.cpu().tolist()


def check_steps(count: int, seed: int, device: torch.device) -> Counter:
    """Checks ``count`` random steps (``random_step``); returns how many ended how."""
    from trtllm_mla_plugin.ops.kernels.fa3_split_plan import FA3SplitPlanner

    planner = FA3SplitPlanner(device)
    rng = random.Random(seed)
    outcomes: Counter = Counter()
    for i in range(count):
        step = random_step(rng)
        want = host_plan(step)
        launched, got = planner_splits(planner, step, device)
        expected = [UNTOUCHED] * len(step["lens"]) if want is None else want.tolist()
        if got != expected:
            raise AssertionError(f"step {i} {dict(step, lens=step['lens'][:8])}: "
                                 f"device {got[:12]} host {expected[:12]}")
        outcomes["replanned" if want is not None else
                 "kept" if launched else "not launched"] += 1
        if want is not None:
            own = fa3_splits.fa3_splits(np.maximum(-(-np.asarray(step["lens"]) // 64), 1),
                                        step["tiles"], step["planned"], step["sms"])
            band = step["spill"] or fa3_splits.spill_band(step["rows"], -(-np.asarray(
                step["lens"]) // 64))
            outcomes["replanned past the band" if step["tiles"] * own.sum()
                     > band * step["sms"] else "replanned in the band"] += 1
    return outcomes


def check_length_order(count: int, seed: int, device: torch.device) -> int:
    """``kernels.length_order`` on ``count`` random batches (2-300 requests, many equal
    lengths, block tables of 1-600 columns as views of wider rows) against numpy's stable
    argsort longest first: the packed offsets, lengths, query rows and order, and the
    ordered block-table rows. Returns how many batches had equal lengths to break ties."""
    from trtllm_mla_plugin.ops.kernels.length_order import length_order

    rng = np.random.default_rng(seed)
    ties = 0
    for _ in range(count):
        b = int(rng.integers(2, 301))
        max_batch = b + int(rng.integers(0, 40))
        lens = rng.integers(0, int(rng.choice([4, 64, 9000])), b).astype(np.int32)
        width = int(rng.integers(1, 601))
        q_len = int(rng.integers(1, 5))
        wide = torch.from_numpy(rng.integers(0, 1 << 20, (b, width + 7)).astype(np.int32))
        table = wide.to(device)[:, 3: 3 + width]
        packed = torch.full((4 * max_batch + 1,), -5, dtype=torch.int32, device=device)
        ordered = torch.full((max_batch, width + 2), -5, dtype=torch.int32, device=device)
        length_order(torch.from_numpy(lens).to(device), table, q_len, packed, ordered,
                     max_batch)
        order = np.argsort(-lens.astype(np.int64), kind="stable")
        got, n = packed.cpu().numpy(), max_batch
        want = {"offsets": np.append(order * q_len, b * q_len), "lengths": lens[order],
                "query rows": np.full(b, q_len), "order": order}
        have = {"offsets": got[: b + 1], "lengths": got[n + 1: n + 1 + b],
                "query rows": got[2 * n + 1: 2 * n + 1 + b], "order": got[3 * n + 1: 3 * n + 1 + b]}
        for name in want:
            if not np.array_equal(have[name], want[name]):
                raise AssertionError(f"b{b} {name}: {have[name][:12]} want {want[name][:12]}")
        if not torch.equal(ordered[:b, :width].cpu(), table.cpu()[torch.from_numpy(order)]):
            raise AssertionError(f"b{b} width {width}: ordered block-table rows differ")
        ties += len(np.unique(lens)) < b
    return ties


def check_route_steps(count: int, seed: int) -> int:
    """The ``vllm-fa3-mla`` route's plan on the CPU, its FA3 module a stand-in whose
    scheduler metadata is all ones: with its length order and splits computed on the GPU
    (``policy.VLLM_FA3_DEVICE_PLAN``) and on the host, ``count`` random batches in the band
    (launched longest first and as given) must leave the same metadata and, longest first,
    the same ordered tables. Returns how many steps replanned the splits."""
    import sys
    import types

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec
    from trtllm_mla_plugin.ops.routes import vllm_fa3_mla

    fake = types.ModuleType(vllm_fa3_mla.FA3_MODULE)
    fake.get_scheduler_metadata = lambda **kw: torch.ones(
        vllm_fa3_mla.fa3_scheduler_metadata_size(kw["batch_size"]), dtype=torch.int32)
    sys.modules[vllm_fa3_mla.FA3_MODULE] = fake
    rng = random.Random(seed)
    replanned = 0
    for _ in range(count):
        step = random_step(rng)
        heads = rng.choice([h for h in HEADS if step["rows"] % h == 0 and step["rows"] // h <= 4])
        q_len = step["rows"] // heads
        spec = DecodeSpec(heads, 512, 64, 64, torch.bfloat16, torch.bfloat16, 0.1, q_len)
        lens = torch.tensor(step["lens"], dtype=torch.int32)
        b = lens.shape[0]
        width = int(lens.max()) // 64 + 1
        table = torch.arange(b * width, dtype=torch.int32).view(b, width)
        batch = DecodeBatch(table, lens, int(lens.max()), max_q_len=q_len, num_tokens=b * q_len,
                            kv_tokens=int(lens.sum()), seq_lens_host=lens.clone())
        ordered = rng.random() < 0.5
        plans = []
        for on_device in (False, True):
            route = vllm_fa3_mla.VllmFA3MLARoute(spec, torch.device("cpu"), b, cuda_graph=True)
            route.device_plan_override = on_device
            route.length_order_override = ordered
            route.plan(batch)
            order = route._order
            plans.append([route._scheduler.clone()] + ([
                t.clone() for t in (order.cu_seqlens_q, order.seqused_q, order.seq_lens,
                                    order.block_table)] if ordered else []))
        for host, gpu in zip(*plans, strict=True):
            if not torch.equal(host, gpu):
                raise AssertionError(f"route h{heads} q{q_len} b{b} ordered={ordered} "
                                     f"{lens.tolist()[:8]}: host {host.flatten()[:24].tolist()} "
                                     f"GPU plan {gpu.flatten()[:24].tolist()}")
        replanned += bool((plans[0][0] != 1).any())
    return replanned


def time_gpu_plan(batches: list[int], rows: int = 16, reps: int = 20,
                  warps: tuple[int, ...] = (), chunks: tuple[int, ...] = ()) -> list[str]:
    """GPU microseconds a decode step's GPU plan adds, per batch size: one launch of the
    splits planner (at each of ``warps`` and ``chunks``, by default its own launch) and one
    of the length order (a 130-column block table), each ``reps`` launches captured in one
    CUDA graph, ``triton.testing.do_bench`` median of its replays over ``reps``; lengths of
    1-8k tokens."""
    import triton

    from trtllm_mla_plugin.ops.kernels.fa3_split_plan import (
        NUM_WARPS,
        SIZE_CHUNK,
        FA3SplitPlanner,
    )
    from trtllm_mla_plugin.ops.kernels.length_order import length_order

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    planner = FA3SplitPlanner(device)
    warps, chunks = warps or (NUM_WARPS,), chunks or (SIZE_CHUNK,)
    rng = torch.Generator().manual_seed(0)
    lines = []
    for b in batches:
        lens = torch.randint(1, 8192, (b,), generator=rng, dtype=torch.int32).to(device)
        table = torch.randint(0, 1 << 20, (b, 130), generator=rng, dtype=torch.int32).to(device)
        splits, packed = torch.ones_like(lens), torch.zeros(4 * b + 1, dtype=torch.int32,
                                                             device=device)
        ordered = torch.zeros_like(table)

        def plan_splits(num_warps, chunk, lens=lens, splits=splits):
            planner.write(lens, splits, query_tiles=-(-rows // 64), request_rows=rows,
                          max_splits=64, sms=sms, fa3_cap=32, num_warps=num_warps,
                          size_chunk=chunk)

        def order(lens=lens, table=table, packed=packed, ordered=ordered, b=b):
            length_order(lens, table, 1, packed, ordered, b)

        timings = []
        calls = [(f"splits planner ({w} warps, chunk {c})",
                  functools.partial(plan_splits, num_warps=w, chunk=c))
                 for w in warps for c in chunks] + [("length order", order)]
        for name, call in calls:
            call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    call()
            us = triton.testing.do_bench(graph.replay, return_mode="median") * 1e3 / reps
            timings.append(f"{name} {us:.2f} us")
        lines.append(f"b{b}: " + ", ".join(timings))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("count", type=int, nargs="?", default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--route", action="store_true",
                    help="the route's plan on the CPU, the host's against the GPU plan")
    ap.add_argument("--length-order", action="store_true",
                    help="kernels.length_order against numpy's stable argsort")
    ap.add_argument("--time", default="",
                    help="comma-separated batch sizes: GPU time of each kernel's launch (CUDA)")
    ap.add_argument("--warps", default="",
                    help="with --time: the planner's num_warps values (default: its own)")
    ap.add_argument("--chunks", default="",
                    help="with --time: the planner's size chunks (default: its own)")
    args = ap.parse_args()
    if args.time:
        print("\n".join(time_gpu_plan([int(b) for b in args.time.split(",")],
                                       warps=tuple(int(w) for w in args.warps.split(",") if w),
                                       chunks=tuple(int(c) for c in args.chunks.split(",") if c))))
        return
    if args.length_order:
        ties = check_length_order(args.count, args.seed, torch.device(args.device))
        print(f"length order: {args.count} batches equal to numpy's, {ties} with ties")
        return
    if args.route:
        replanned = check_route_steps(args.count, args.seed)
        print(f"route: {args.count} steps, the same plan either way, {replanned} replanned")
        return
    outcomes = check_steps(args.count, args.seed, torch.device(args.device))
    print(f"{args.count} steps equal to the host's plan: "
          + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))


if __name__ == "__main__":
    main()
