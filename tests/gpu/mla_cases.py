"""Random paged-MLA decode problems for the GPU tests, checked against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from trtllm_mla_plugin.ops import (
    UNIT_SCALES,
    DecodeBatch,
    DecodeSpec,
    KVScales,
    mla_decode_reference,
)
from trtllm_mla_plugin.ops.platform import platform_of
from trtllm_mla_plugin.ops.routes import ROUTES

KV_LORA_RANK, ROPE_DIM = 512, 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
SOFTMAX_SCALE = 1.0 / (192**0.5)
FP8 = torch.float8_e4m3fn

#: The marks of every kernel test module: a GPU test, skipped where there is no CUDA GPU.
GPU_TEST_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
#: Every kernel route the plugin has (not the float64 reference they are checked against);
#: each test skips a route that declines its case, with the route's own reason.
KERNEL_ROUTES = [name for name in ROUTES if name != "torch-reference"]

# Bounds on ||out - ref|| / ||ref|| and on max|out - ref| / max|ref| against the float64
# reference. bf16 has an 8-bit mantissa (fp16: 11), and the kernels round P to the input
# dtype before P.V; FP8 caches add nothing here (the reference reads the same FP8 values)
# unless a kernel quantises the query too.
REL_BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAX_BOUND = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
FP8_REL_BOUND, FP8_MAX_BOUND = 4e-2, 8e-2
# Routes that read the query in FP8 (``DecodeRoute.fp8_query``: FlashMLA's FP8 kernel) are
# checked against the reference on the FP8 query they read (``reference(p, route)``): the
# query's rounding is the documented trade (docs/benchmarks.md), the kernel's own error (FP8
# P.V) must stay inside the FP8 bounds.
FP8_MAX = 448.0


@dataclass
class Problem:
    spec: DecodeSpec
    batch: DecodeBatch
    query: torch.Tensor  # [tokens, heads, 576]
    kv_cache: torch.Tensor  # [blocks, block, 576]
    scales: KVScales


def route_skip_reason(name: str, spec: DecodeSpec, device: torch.device) -> str | None:
    reason = ROUTES[name].unsupported_reason(spec, platform_of(device))
    return None if reason is None else f"{name} not eligible: {reason}"


def with_host_lengths(batch: DecodeBatch) -> DecodeBatch:
    """``batch`` with exact host copies of its lengths (as vLLM's builder passes them), so
    host-side planners take their sync-free path."""
    cu = batch.cu_seqlens_q
    return replace(batch, seq_lens_host=batch.seq_lens.cpu(),
                   cu_seqlens_q_host=None if cu is None else cu.cpu())


def in_fixed_buffers(template: DecodeBatch):
    """A function that writes a batch's block table and lengths into two buffers shaped like
    ``template``'s and returns the batch on them, marked ``DecodeBatch.persistent``: the
    engine's way (vLLM's model runner rewrites its inputs in place at fixed addresses)."""
    tables = torch.empty_like(template.block_table)
    lens = torch.empty_like(template.seq_lens)

    def write(batch: DecodeBatch) -> DecodeBatch:
        tables.copy_(batch.block_table)
        lens.copy_(batch.seq_lens)
        return replace(batch, block_table=tables, seq_lens=lens, persistent=True)

    return write


def make_problem(
    *,
    heads: int,
    block: int,
    lens: list[int],
    q_lens: int | list[int],
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    scales: KVScales = UNIT_SCALES,
    device: torch.device,
    width: int | None = None,
    spec_q_len: int | None = None,
    generator: torch.Generator | None = None,
) -> Problem:
    """Fresh random problem; blocks scattered over a larger cache via randperm."""
    b = len(lens)
    ragged = isinstance(q_lens, list)
    per_req = q_lens if ragged else [q_lens] * b
    assert all(n <= L for n, L in zip(per_req, lens, strict=True))
    need = [-(-L // block) for L in lens]
    width = width or max(need)
    num_blocks = sum(need) + 7
    perm = torch.randperm(num_blocks, device=device, generator=generator).to(torch.int32)
    table = torch.zeros(b, width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    # Unused columns point at a real block of random data: a kernel reading past a
    # request's length would pick it up and fail the comparison.
    for i, n in enumerate(need):
        table[i, n:] = perm[-1]
    kv = torch.randn(num_blocks, block, HEAD_DIM, device=device, generator=generator)
    # FP8: store real / k_scale so the dequantised values are again ~N(0, 1).
    kv = (kv / scales.k_scale).clamp(-448, 448).to(FP8) if kv_dtype == FP8 else kv.to(kv_dtype)
    tokens = sum(per_req)
    query = torch.randn(tokens, heads, HEAD_DIM, device=device, generator=generator).to(dtype)
    cu = None
    if ragged:
        cu = torch.tensor([0, *torch.tensor(per_req).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    max_q = max(per_req)
    spec = DecodeSpec(
        num_heads=heads, kv_lora_rank=KV_LORA_RANK, rope_dim=ROPE_DIM, block_size=block,
        q_dtype=dtype, kv_dtype=kv_dtype, softmax_scale=SOFTMAX_SCALE,
        max_q_len=spec_q_len or max_q,
    )
    batch = DecodeBatch(
        block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_seq_len=max(lens), cu_seqlens_q=cu, max_q_len=max_q,
        num_tokens=tokens if ragged else None,
    )
    return Problem(spec, batch, query, kv, scales)


def reference(p: Problem, route: str | None = None) -> torch.Tensor:
    """float64 oracle on the same (possibly FP8) stored values; for a route that reads an
    FP8 query (``DecodeRoute.fp8_query``), on the query rounded as that route rounds it."""
    query = p.query
    if route is not None and ROUTES[route].fp8_query and p.spec.fp8_kv and query.dtype != FP8:
        query = query.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return mla_decode_reference(
        query.to(torch.float64), p.kv_cache.to(torch.float64), p.batch.block_table,
        p.batch.seq_lens, p.spec.softmax_scale, p.spec.kv_lora_rank,
        cu_seqlens_q=p.batch.cu_seqlens_q, max_seq_len=p.batch.max_seq_len, scales=p.scales,
    )


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.to(torch.float64) - ref
    rel = (diff.norm() / ref.norm()).item()
    worst = (diff.abs().max() / ref.abs().max()).item()
    return rel, worst


def bounds(p: Problem) -> tuple[float, float]:
    if p.spec.fp8_kv:
        return FP8_REL_BOUND, FP8_MAX_BOUND
    return REL_BOUND[p.spec.q_dtype], MAX_BOUND[p.spec.q_dtype]


def capture_decode(decoder, query: torch.Tensor, cache: torch.Tensor,
                   out: torch.Tensor) -> torch.cuda.CUDAGraph:
    """Capture one ``decoder.run`` (already planned) in a CUDA graph, after a warm-up run on
    a side stream (JIT, lazy allocations) as torch's graph capture requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.run(query, cache, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.run(query, cache, out=out)
    return graph


TensorAndBase = tuple[torch.Tensor, torch.Tensor]


def vllm_query_parts(query: torch.Tensor, latent_layout: str = "token-major"
                     ) -> tuple[TensorAndBase, TensorAndBase]:
    """``query`` ``[tokens, heads, 576]`` as vLLM hands it over, ``((latent, its base),
    (rope, its base))``: the rope part a strided view of a ``[tokens, heads, 128 + 64]``
    projection (its other columns random), the latent part token-major (vLLM's own buffer)
    or ``"head-major"`` (a ``[heads, tokens, 512]`` buffer seen transposed, as vLLM's bmm
    leaves it where it pads heads); each base the contiguous tensor the view is of."""
    projected = torch.randn(*query.shape[:2], 128 + 64, dtype=query.dtype,
                            device=query.device)
    projected[..., 128:] = query[..., 512:]
    if latent_layout == "token-major":
        latent_base = latent = query[..., :512].contiguous()
    else:
        latent_base = query[..., :512].transpose(0, 1).contiguous()
        latent = latent_base.transpose(0, 1)
    return (latent, latent_base), (projected[..., 128:], projected)


def splitk_decode(p: Problem, config=None, query=None) -> torch.Tensor:
    """``p`` decoded once by the CUDA split-KV kernel (``SplitKMLADecode``, launch
    ``config``), into an output poisoned with NaN first; synchronised. ``query``: the
    query as the kernel takes it instead of ``p.query`` (e.g. its two parts)."""
    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKMLADecode

    device, b = p.query.device, p.batch.batch_size
    kernel = SplitKMLADecode(device, p.spec.num_heads, p.spec.max_q_len, p.spec.block_size,
                             b, p.spec.q_dtype, config, kv_dtype=p.spec.kv_dtype)
    cu = p.batch.cu_seqlens_q
    if cu is None:
        cu = torch.arange(b + 1, dtype=torch.int32, device=device) * p.batch.max_q_len
    out = torch.full((p.query.shape[0], p.spec.num_heads, KV_LORA_RANK), float("nan"),
                     dtype=p.spec.q_dtype, device=device)
    kernel.plan(p.batch.seq_lens)
    s = p.scales
    kernel.run(p.query if query is None else query, p.kv_cache, p.batch.block_table,
               p.batch.seq_lens, cu, out,
               p.spec.softmax_scale, s.q_scale, s.k_scale, s.v_scale)
    torch.cuda.synchronize()
    return out
