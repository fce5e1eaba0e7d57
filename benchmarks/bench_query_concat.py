"""What joining vLLM's two query parts costs, per way of joining them, on one GPU.

vLLM's MLA layer hands a 16-bit decode query to ``forward_mqa`` as ``(ql_nope, q_pe)``:
``ql_nope [tokens, heads, 512]`` contiguous and ``q_pe [tokens, heads, 64]`` a strided view
into the query projection's ``[tokens, heads, 128 + 64]`` output
(``decode_kernels.engine_query_parts``). Routes whose kernel reads one ``[tokens, heads,
576]`` tensor (FlashMLA) need them joined; vLLM's FLASHMLA backend does it with
``torch.cat``, its sparse backends with its ``concat_mla_q`` CUDA op. Each way is captured
in a CUDA graph of ``--reps`` calls and timed as the kernel benchmarks time graphs
(``bench_decode.capture_calls``, ``time_replays``: ``triton.testing.do_bench`` medians),
against the copy ceiling measured in the same run (``bench_decode.ceilings``): ``pct_copy``
is the bytes a join must move (read both parts, write the whole) at the ceiling's speed
over its time.

    python benchmarks/bench_query_concat.py --out concat-out [--shapes 480x128,32x16,...]
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable
from pathlib import Path

import torch
from bench_decode import capture_calls, ceilings, time_replays
from decode_kernels import engine_query_parts

from trtllm_mla_plugin.ops import join_query_parts

LATENT, ROPE = 512, 64
#: tokens x heads: the engine's tall MTP step (160 requests x 3 tokens, 128 heads), and
#: decode batches of 16-128 heads at 1-3 tokens a request.
SHAPES = ("480x128", "384x128", "256x128", "96x128", "32x128", "384x64", "256x16", "32x16")


def joins(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways to join the parts that can run here; each returns or fills a ``[tokens,
    heads, 576]`` tensor."""
    out = ql_nope.new_empty(*ql_nope.shape[:2], LATENT + ROPE)

    def two_copies() -> torch.Tensor:  # the decoder's own join
        join_query_parts(ql_nope, q_pe, out)
        return out

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "torch.cat": lambda: torch.cat((ql_nope, q_pe), dim=-1),
        "two_copies": two_copies,
    }
    try:
        from vllm import _custom_ops as vllm_ops

        def concat_mla_q() -> torch.Tensor:
            vllm_ops.concat_mla_q(ql_nope, q_pe, out)
            return out

        concat_mla_q()
        ways["vllm.concat_mla_q"] = concat_mla_q
    except Exception as exc:
        print(f"vllm concat_mla_q unavailable: {type(exc).__name__}: {str(exc)[:160]}")
    return ways


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("concat-out"))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="TOKENSxHEADS, comma-separated")
    ap.add_argument("--reps", type=int, default=20, help="joins per captured graph")
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbps = ceilings(device)["copy_GBps"]
    print(f"copy ceiling {copy_gbps:.0f} GB/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        tokens, heads = (int(x) for x in shape.split("x"))
        query = torch.randn(tokens, heads, LATENT + ROPE, dtype=torch.bfloat16, device=device)
        ql_nope, q_pe = engine_query_parts(query, LATENT)
        moved = 2 * query.numel() * query.element_size()
        for name, fn in joins(ql_nope, q_pe).items():
            status = "ok" if torch.equal(fn(), query) else "WRONG"  # also the warm-up
            us = time_replays(capture_calls(lambda _, join=fn: join(), args.reps), args.reps)
            row = {"tokens": tokens, "heads": heads, "join": name, "us": round(us, 2),
                   "pct_copy": round(100 * moved / (copy_gbps * 1e3) / us, 1),
                   "status": status}
            rows.append(row)
            print(f"{shape} {name}: {us:.1f} us, {row['pct_copy']}% of the copy ceiling "
                  f"{status}", flush=True)
    with (args.out / "concat.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
