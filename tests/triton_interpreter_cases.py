"""Run the plugin's Triton decode kernel under Triton's CPU interpreter on small problems and
compare with the float64 reference. Executed as a script by tests/test_triton_kernel_cpu.py
(``TRITON_INTERPRET=1`` must be set before the kernel module is imported)."""

from __future__ import annotations

import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from trtllm_mla_plugin.ops import mla_decode_reference  # noqa: E402
from trtllm_mla_plugin.ops.kernels.balanced_mla_decode import balanced_mla_decode  # noqa: E402

DC, DR, SCALE = 64, 16, 0.3
FP8 = torch.float8_e4m3fn


def run_case(lens, q_lens, heads, page, num_ctas, kv_dtype, k_scale=1.0, v_scale=1.0,
             min_pages=1):
    """``q_lens``: int (every request) or list; query rows grouped per request."""
    gen = torch.Generator().manual_seed(len(lens) * 1000 + heads * 10 + page)
    b = len(lens)
    per_req = q_lens if isinstance(q_lens, list) else [q_lens] * b
    need = [-(-L // page) for L in lens]
    blocks = sum(need) + 3
    perm = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.full((b, max(max(need), 1)), int(perm[-1]), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start:start + n]
        start += n
    kv = torch.randn(blocks, page, DC + DR, generator=gen).to(kv_dtype)
    rows = sum(per_req)
    query = torch.randn(rows, heads, DC + DR, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(per_req), 0)
    page_start = torch.zeros(b + 1, dtype=torch.int32)
    page_start[1:] = torch.cumsum(torch.tensor(need), 0)
    max_q = 1 << (max(per_req) - 1).bit_length()
    block_h = max(min(1 << (heads - 1).bit_length(), 64 // max_q), max(1, 16 // max_q))
    out = torch.full((rows, heads, DC), float("nan"))
    part_out = torch.full((num_ctas * 2 * max_q * heads * DC,), float("nan"))
    part_lse = torch.full((num_ctas * 2 * max_q * heads,), float("nan"))
    balanced_mla_decode(query, kv, table, lens_t, cu, page_start, out, part_out, part_lse,
                        kv_lora_rank=DC, max_q_len=max_q, block_h=block_h, num_ctas=num_ctas,
                        min_pages=min_pages, search_steps=b.bit_length() + 1, softmax_scale=SCALE,
                        k_scale=k_scale, v_scale=v_scale, block_n=16)
    from trtllm_mla_plugin.ops import KVScales

    ref = mla_decode_reference(query.double(), kv, table, lens_t, SCALE, DC,
                               cu_seqlens_q=cu, scales=KVScales(1.0, k_scale, v_scale))
    live = torch.tensor([L > 0 for L, n in zip(lens, per_req, strict=True) for _ in range(n)])
    err = ((out[live].double() - ref[live]).norm() / ref[live].norm()).item()
    return err


CASES = [
    # (lens, q_lens, heads, page, num_ctas, kv dtype, k_scale, v_scale)
    ([5, 40, 17], 1, 16, 16, 4, torch.float32, 1.0, 1.0),  # requests cut by CTA borders
    ([100, 3, 64, 33], 1, 8, 32, 5, torch.float32, 1.0, 1.0),  # padded head tile
    ([7, 70], 3, 4, 16, 9, torch.float32, 1.0, 1.0),  # causal, q_len 3 padded to 4
    ([64, 500, 129, 4], [1, 3, 4, 2], 16, 16, 7, torch.float32, 1.0, 1.0),  # ragged q
    ([1, 1, 2], 1, 16, 16, 8, torch.float32, 1.0, 1.0),  # more CTAs than pages
    ([200], 2, 16, 16, 3, torch.float32, 1.0, 1.0),  # one request over all CTAs
    ([33, 0, 20, 0], 1, 16, 16, 3, torch.float32, 1.0, 1.0),  # empty (padding) requests
    ([90, 17], 1, 16, 16, 4, FP8, 0.5, 0.25),  # FP8 cache with k != v scales
    ([300, 20, 5], 2, 16, 16, 16, torch.float32, 1.0, 1.0, 3),  # fewer active CTAs
    ([16], 1, 16, 16, 16, torch.float32, 1.0, 1.0, 4),  # one page, one active CTA
]

def run_route_steps(cuda_graph: bool) -> list[float]:
    """The route ``triton-balanced`` itself (plan per step, run per layer) over three steps
    of one decoder: uniform one-token, uniform two-token and ragged query lengths."""
    from types import SimpleNamespace

    from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, KVScales
    from trtllm_mla_plugin.ops.routes.triton_balanced import LaunchConfig, TritonBalancedRoute

    torch.cuda.get_device_properties = lambda device: SimpleNamespace(multi_processor_count=3)
    spec = DecodeSpec(16, DC, DR, 16, torch.float32, FP8, SCALE, max_q_len=2)
    route = TritonBalancedRoute(spec, torch.device("cpu"), max_batch_size=4,
                                cuda_graph=cuda_graph)
    route.config = LaunchConfig(block_n=16, min_tokens_per_cta=16)
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(40, 16, DC + DR, generator=gen).to(FP8)
    scales = KVScales(1.0, 0.5, 0.25)
    errors = []
    steps = [([70, 5, 33], None), ([17, 90, 2, 40], 2), ([60, 9], [2, 1])]
    for lens, q_lens in steps:
        b = len(lens)
        per_req = q_lens if isinstance(q_lens, list) else [q_lens or 1] * b
        cu = torch.zeros(b + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(per_req), 0)
        table = torch.randperm(40, generator=gen)[: b * 8].view(b, 8).to(torch.int32)
        batch = DecodeBatch(table, torch.tensor(lens, dtype=torch.int32), max(lens),
                            cu_seqlens_q=cu if isinstance(q_lens, list) else None,
                            max_q_len=max(per_req), num_tokens=int(cu[-1]))
        route.plan(batch)
        query = torch.randn(int(cu[-1]), 16, DC + DR, generator=gen)
        out = torch.full((int(cu[-1]), 16, DC), float("nan"))
        route.run(query, cache, out, scales)
        ref = mla_decode_reference(query.double(), cache, table, batch.seq_lens, SCALE, DC,
                                   cu_seqlens_q=cu, scales=scales)
        errors.append(((out.double() - ref).norm() / ref.norm()).item())
    return errors


if __name__ == "__main__" and sys.argv[1:] == ["--route"]:
    errors = run_route_steps(False) + run_route_steps(True)
    print("route steps: rel err " + ", ".join(f"{e:.2e}" for e in errors))
    failed = [e for e in errors if not e < 1e-5]
    print(f"route: {len(failed)} of {len(errors)} steps above 1e-5")
    sys.exit(1 if failed else 0)
elif __name__ == "__main__":
    errors = []
    for case in CASES:
        errors.append(run_case(*case))
        print(f"{case[:5]} {case[5]}: rel err {errors[-1]:.2e}")
    failed = [e for e in errors if not e < 1e-5]  # NaN fails too
    print(f"{len(failed)} of {len(errors)} cases above 1e-5")
    sys.exit(1 if failed else 0)
