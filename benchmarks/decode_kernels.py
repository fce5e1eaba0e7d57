"""The kernels the decode benchmark times, each behind one ``Kernel`` interface.

A kernel is built for one ``Case`` (planned once) and exposes ``call(cache)``: one decode
of the case's query over ``cache`` (``[num_blocks, block, 576]``) into its output buffer
(``[tokens, heads, 512]``). ``absent`` is set (and ``call`` is ``None``) when the kernel
cannot run here; the reason is reported, never dropped.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, replace

import torch

from trtllm_mla_plugin.ops import (
    DecodeBatch,
    DecodeSpec,
    MLADecoder,
    QueryJoin,
    engine_query_dtype,
)
from trtllm_mla_plugin.ops.platform import platform_of
from trtllm_mla_plugin.ops.routes import ROUTES

FLASHMLA_MODULE = "vllm.third_party.flashmla.flash_mla_interface"
FLASHMLA_FP8_MODULE = "vllm._flashmla_extension_C"
TRITON_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
VLLM_FA3_MODULE = "vllm.vllm_flash_attn.flash_attn_interface"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
#: ``bench_decode.py --query-parts``: a 16-bit query reaches the plugin's decoder in the two
#: parts vLLM's MLA layer hands over (``engine_query_parts``), and vLLM's FLASHMLA peer
#: concatenates them as its ``forward_mqa`` does, so the copy a route that cannot read the
#: parts apart makes is timed (vLLM's FA3 reads them apart; run 217: the plugin on FlashMLA
#: at 0.91x FLASH_ATTN_MLA in the engine where the kernels alone ran 1.04x FA3's speed).
#: Off: every route and peer gets one ``[tokens, heads, 576]`` tensor (runs 1-218).
QUERY_PARTS = False
#: DeepSeek-V2/V3's ``qk_nope_head_dim``: the rope part is a view into the query
#: projection's output of ``nope + rope`` columns a head.
QK_NOPE_DIM = 128


@dataclass
class Case:
    """One benchmark shape with its inputs on the GPU.

    ``query [b * q_len, heads, 576]``, ``caches``: rotation copies of
    ``[num_blocks, block, 576]``; ``block_table [b, width]`` int32; ``seq_lens [b]`` int32.
    ``batch`` is as vLLM's builder hands it over, with the exact host lengths
    (``seq_lens_host``: vLLM's ``seq_lens_cpu_upper_bound``, exact outside asynchronous
    speculation): an eager decoder ranks by them (FA3's plan imbalance,
    ``policy.wants_lengths``; until run 148 the bench's eager rows went without them and
    ranked by the fallback thresholds), under CUDA graphs only the ``vllm-fa3-mla`` split
    rule reads them.
    """

    name: str
    spec: DecodeSpec
    batch: DecodeBatch
    query: torch.Tensor
    caches: list[torch.Tensor]
    lens_host: list[int]
    q_len: int
    info: dict = field(default_factory=dict)



@dataclass
class Kernel:
    name: str
    call: object = None  # callable(cache) -> out tensor
    absent: str | None = None
    out: torch.Tensor | None = None
    obj: object = None  # the decoder, for host-overhead measurements


def engine_query_parts(query: torch.Tensor,
                       kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [tokens, heads, Dc + Dr]`` as vLLM's MLA layer hands a 16-bit decode query to
    ``forward_mqa``: ``ql_nope [tokens, heads, Dc]`` contiguous (its ``bmm`` with ``W_UK``
    writes it token-major) and ``q_pe [tokens, heads, Dr]``, a strided view into the query
    projection's ``[tokens, heads, QK_NOPE_DIM + Dr]`` output. Same values as ``query``."""
    tokens, heads, width = query.shape
    ql_nope = query[..., :kv_lora_rank].contiguous()
    projected = torch.empty(tokens, heads, QK_NOPE_DIM + width - kv_lora_rank,
                            dtype=query.dtype, device=query.device)
    projected[..., QK_NOPE_DIM:] = query[..., kv_lora_rank:]
    return ql_nope, projected[..., QK_NOPE_DIM:]


def engine_query_join(spec: DecodeSpec) -> QueryJoin | None:
    """The join of the query's parts the vLLM backend hands its decoders
    (``vllm_query_join``: vLLM's fused ``concat_mla_q``), or ``None`` (the decoder's own
    two copies) where vLLM or its op is missing."""
    try:
        from trtllm_mla_plugin.vllm_backend.query_join import vllm_query_join

        return vllm_query_join(spec)
    except ImportError:
        return None


def fp8_query(query: torch.Tensor) -> torch.Tensor:
    """``query`` as vLLM hands it to an FP8-query decode (q_scale 1: saturated to e4m3)."""
    return query.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def decoder_kernel(
    name: str, case: Case, route: str | None, sort: bool | None = None,
    engine_query: bool = False, cuda_graph: bool = False,
) -> Kernel:
    """``MLADecoder`` (``route=None``: the policy's pick per batch). ``engine_query``: the
    query dtype vLLM would hand over (``engine_query_dtype``: FP8 for FP8-query routes) and
    no output buffer where the route returns its own, as the engine calls it.
    ``cuda_graph``: the route's CUDA-graph set-up (the engine's default), for routes whose
    schedule depends on it (``vllm-fa3-mla`` caps its KV splits). With ``QUERY_PARTS``, an
    ``engine_query`` of 16 bits is handed over in vLLM's two parts."""
    spec, device = case.spec, case.query.device
    query = case.query
    if engine_query:
        spec = replace(spec, q_dtype=engine_query_dtype(spec, platform_of(device), route))
        if spec.q_dtype == FP8:
            query = fp8_query(query)
        elif QUERY_PARTS:
            query = engine_query_parts(query, spec.kv_lora_rank)
    if route is not None:
        reason = ROUTES[route].unsupported_reason(spec, platform_of(device))
        if reason is not None:
            return Kernel(name, absent=f"not eligible: {reason}")
    dec = MLADecoder(spec, device, case.batch.batch_size, route=route, cuda_graph=cuda_graph,
                     query_join=engine_query_join(spec) if isinstance(query, tuple) else None)
    dec.sort_override = sort
    dec.plan(case.batch)
    out = torch.empty(case.query.shape[0], spec.num_heads, spec.kv_lora_rank,
                      dtype=dec.output_dtype, device=device)
    own = engine_query and dec.route.own_output

    def call(cache: torch.Tensor) -> torch.Tensor:
        return dec.run(query, cache, out=None if own else out)

    return Kernel(name, call, out=out, obj=dec)


def replanned(kernel: Kernel, case: Case, **route_settings: object) -> Kernel:
    """``kernel`` (a ``decoder_kernel``) with ``route_settings`` set on its route and the
    case's batch planned again; unchanged where the route is absent."""
    if kernel.obj is not None:
        for name, value in route_settings.items():
            setattr(kernel.obj.route, name, value)
        kernel.obj.plan(case.batch)
    return kernel


#: ``--extra-routes`` variants: the route settings each forces (``replanned``).
ROUTE_VARIANTS = {
    # FA3 on the requests longest first at any batch size.
    ("vllm-fa3-mla", "sorted"): {"length_order_override": True},
    # The route's own splits per request on every plan FA3 spills past one wave, outside
    # their band too (run 153 timed that in the caller's order; since run 158 batches of
    # >= 33 run longest first).
    ("vllm-fa3-mla", "balanced"): {"balanced_splits_override": True,
                                   "spill_override": math.inf},
}


def extra_route_kernel(spec: str, case: Case) -> Kernel:
    """``--extra-routes`` entry ``spec``: a route timed forced under CUDA graphs, as the
    row ``route:SPEC``; ``ROUTE:VARIANT`` with the settings of ``ROUTE_VARIANTS``
    (``vllm-fa3-mla:sorted``, ``vllm-fa3-mla:balanced``)."""
    route, _, variant = spec.partition(":")
    if variant and (route, variant) not in ROUTE_VARIANTS:
        raise ValueError(f"unknown route variant {spec!r}; known: "
                         + ", ".join(f"{r}:{v}" for r, v in ROUTE_VARIANTS))
    kernel = decoder_kernel(f"route:{spec}", case, route, cuda_graph=True)
    if not variant:
        return kernel
    return replanned(kernel, case, **ROUTE_VARIANTS[route, variant])


def plugin_kernels(case: Case, mode: str = "grid") -> list[Kernel]:
    """The plugin's dispatch (as vLLM calls it) and plugin routes forced (FA3 also with
    sorting off, which is FlashInfer's wrapper as any caller would use it; FP8 caches: the
    routes with a bf16 query too, the bf16-query accuracy option). ``train``: just the
    routes the bf16 policy chooses between; ``random``: FP8 caches without the slower
    bf16-query levers; ``graph`` (bf16): the CUDA-graph decoder and the two routes its
    rule picks between, no FlashInfer."""
    fp8 = case.spec.fp8_kv
    ks = []
    if mode not in ("train", "graph"):
        ks.append(decoder_kernel("plugin", case, None, engine_query=True))
        ks[0].name = f"plugin[{ks[0].obj.route.name}]"
    if mode != "train" and not fp8:
        # The engine's default: a CUDA-graph decoder (its route picked from the batch size
        # and query rows alone, as in a captured graph).
        graph = decoder_kernel("plugin-graph", case, None, engine_query=True, cuda_graph=True)
        graph.name = f"plugin-graph[{graph.obj.route.name}]"
        ks.append(graph)
    if mode == "graph":
        ks.append(decoder_kernel("flashmla", case, "flashmla", engine_query=True))
        ks.append(decoder_kernel("vllm-fa3-mla", case, "vllm-fa3-mla", cuda_graph=True))
        # FA3 with its own splits (the route's balanced ones off): what the route ran before.
        own = decoder_kernel("vllm-fa3-mla-own", case, "vllm-fa3-mla", cuda_graph=True)
        ks.append(replanned(own, case, balanced_splits_override=False))
        return ks
    if not (fp8 and mode == "random"):
        ks.append(decoder_kernel("fa3-sorted", case, "flashinfer-fa3", sort=True))
    ks.append(decoder_kernel("peer:flashinfer-fa3", case, "flashinfer-fa3", sort=False))
    if fp8:
        ks.append(decoder_kernel("flashmla-fp8-bf16q", case, "flashmla-fp8"))
    else:
        # As the engine calls it (no output buffer: the route hands back FlashMLA's own),
        # so policy replays from these rows (evaluate_policy.py) see the engine's cost.
        ks.append(decoder_kernel("flashmla", case, "flashmla", engine_query=True))
        ks.append(decoder_kernel("vllm-fa3-mla", case, "vllm-fa3-mla", cuda_graph=True))
        if mode == "random":
            # As an eager decoder runs it: the kernel chooses its KV splits (no graph cap).
            ks.append(decoder_kernel("vllm-fa3-mla-eager", case, "vllm-fa3-mla"))
    if mode == "train":
        return ks
    if fp8 and mode == "grid":
        ks.append(decoder_kernel("triton-balanced", case, "triton-balanced"))
    if case.info.get("with_fa2"):
        ks.append(decoder_kernel("fa2", case, "flashinfer-fa2"))
    reason = ROUTES["trtllm-gen"].unsupported_reason(case.spec, platform_of(case.query.device))
    ks.append(Kernel("trtllm-gen", absent=reason or "not timed"))
    return ks


def flashmla_peer(case: Case, sort: bool = False) -> Kernel:
    """vLLM's bundled FlashMLA ``flash_mla_with_kvcache`` called directly; with ``sort``
    the requests are reordered longest first (lever (a)) and the output put back.

    As vLLM's FLASHMLA (bf16) runs it: its builder hands each step an empty schedule, which
    the step's first call fills on the GPU, so a captured graph (here: one step of
    ``REPS_PER_GRAPH`` calls) starts with FlashMLA's schedule kernel (26 us at h16 b1 on
    the H200, run 78). Before run 78 this peer filled its schedule once, outside the graph,
    and its times left that kernel out (2-3 us per call at 10 calls per step)."""
    name = "peer:vllm-flashmla" + ("-sorted" if sort else "")
    spec, b, m = case.spec, case.batch.batch_size, case.q_len
    if spec.fp8_kv or spec.block_size != 64:
        return Kernel(name, absent="needs a bf16 cache of 64-token pages (FP8 uses another "
                      "cache layout)")
    try:
        fm = importlib.import_module(FLASHMLA_MODULE)
    except Exception as exc:
        return Kernel(name, absent=f"import failed: {exc!r}")
    table, lens = case.batch.block_table, case.batch.seq_lens
    q = case.query.view(b, m, spec.num_heads, spec.head_dim)
    parts = engine_query_parts(case.query, spec.kv_lora_rank) if QUERY_PARTS else None
    perm = None
    if sort:
        perm = torch.argsort(lens, descending=True)
        table, lens = table[perm].contiguous(), lens[perm].contiguous()
        q_sorted = torch.empty_like(q)
    step = {"meta": fm.get_mla_metadata()[0], "capturing": False}
    out4 = torch.empty(b, m, spec.num_heads, spec.kv_lora_rank, dtype=q.dtype, device=q.device)
    out = torch.empty_like(out4)

    def call(cache: torch.Tensor) -> torch.Tensor:
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not step["capturing"]:
            step["meta"] = fm.get_mla_metadata()[0]  # a new step: FlashMLA schedules anew
        step["capturing"] = capturing
        # vLLM's FLASHMLA concatenates the parts (``forward_mqa``), one copy per layer.
        qq = q if parts is None else torch.cat(parts, dim=-1).view(q.shape)
        if perm is not None:
            torch.index_select(qq, 0, perm, out=q_sorted)
            qq = q_sorted
        # vLLM's FLASHMLA passes causal=True, also for one query token, and no ``out=``
        # (FlashMLA's ``out=`` fails for q_len > 1).
        result, _ = fm.flash_mla_with_kvcache(
            q=qq, k_cache=cache.unsqueeze(-2), block_table=table, cache_seqlens=lens,
            head_dim_v=spec.kv_lora_rank, tile_scheduler_metadata=step["meta"],
            softmax_scale=spec.softmax_scale, causal=True, out=out4 if m == 1 else None,
        )
        if perm is not None:
            out.index_copy_(0, perm, result)
            return out.view(b * m, spec.num_heads, spec.kv_lora_rank)
        return result.view(b * m, spec.num_heads, spec.kv_lora_rank)

    return Kernel(name, call, out=out4)


#: vLLM's ``AttentionConfig.flash_attn_max_num_splits_for_cuda_graph`` default.
VLLM_FA3_GRAPH_SPLITS = 32


def vllm_fa3_scheduler_metadata(fa, spec: DecodeSpec, batch_size: int, max_seqlen_q: int,
                                max_seqlen_k: int, cache_seqlens: torch.Tensor,
                                cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """FA3's scheduler metadata as vLLM's FLASH_ATTN_MLA builder makes it under full CUDA
    graphs (``FlashAttnMLAMetadataBuilder._schedule_decode``; ``fa``: the
    ``vllm_flash_attn`` interface module)."""
    return fa.get_scheduler_metadata(
        batch_size=batch_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        num_heads_q=spec.num_heads, num_heads_kv=1, headdim=spec.rope_dim,
        cache_seqlens=cache_seqlens, qkv_dtype=spec.kv_dtype, headdim_v=spec.kv_lora_rank,
        cu_seqlens_q=cu_seqlens_q, page_size=spec.block_size, causal=True,
        num_splits=VLLM_FA3_GRAPH_SPLITS)


def vllm_fa3_mla_peer(case: Case) -> Kernel:
    """vLLM's default MLA backend on SM90 with a bf16 cache, ``FLASH_ATTN_MLA``: FA3's MLA
    decode (``vllm_flash_attn.flash_attn_varlen_func`` with ``q_v``) called as
    ``v1/attention/backends/mla/flashattn_mla.py`` does under full CUDA graphs (scheduler
    metadata made once per step outside the timed call, at most 32 KV splits)."""
    name = "peer:vllm-fa3-mla"
    spec, b, m = case.spec, case.batch.batch_size, case.q_len
    if spec.fp8_kv:
        return Kernel(name, absent="vLLM's FLASH_ATTN_MLA serves bf16/fp16 caches only")
    try:
        fa = importlib.import_module(VLLM_FA3_MODULE)
    except Exception as exc:
        return Kernel(name, absent=f"import failed: {exc!r}")
    dc, splits = spec.kv_lora_rank, VLLM_FA3_GRAPH_SPLITS
    table, lens = case.batch.block_table, case.batch.seq_lens
    cu = torch.arange(0, b * m + 1, m, dtype=torch.int32, device=case.query.device)
    meta = vllm_fa3_scheduler_metadata(fa, spec, b, m, case.batch.max_seq_len, lens, cu)
    q = case.query

    def call(cache: torch.Tensor) -> torch.Tensor:
        kv = cache.unsqueeze(-2)
        return fa.flash_attn_varlen_func(
            q=q[..., dc:], k=kv[..., dc:], v=kv[..., :dc], q_v=q[..., :dc], max_seqlen_q=m,
            cu_seqlens_q=cu, max_seqlen_k=case.batch.max_seq_len, seqused_k=lens,
            block_table=table, softmax_scale=spec.softmax_scale, causal=True, fa_version=3,
            scheduler_metadata=meta, num_splits=splits)

    return Kernel(name, call, out=torch.empty(0, device=q.device))


def flashmla_fp8_peer(case: Case) -> Kernel:
    """vLLM's FLASHMLA backend on an FP8 cache: FlashMLA's dense FP8 kernel called as
    ``v1/attention/backends/mla/flashmla.py`` does (FP8 query, scheduling metadata made
    once per step, outside the timed call)."""
    name = "peer:vllm-flashmla-fp8"
    spec, b, m = case.spec, case.batch.batch_size, case.q_len
    if not spec.fp8_kv or spec.block_size != 64:
        return Kernel(name, absent="FP8 caches of 64-token pages only")
    try:
        importlib.import_module(FLASHMLA_FP8_MODULE)
        ops = torch.ops._flashmla_extension_C
    except Exception as exc:
        return Kernel(name, absent=f"import failed: {exc!r}")
    q = fp8_query(case.query).view(b, m, spec.num_heads, spec.head_dim)
    table, lens = case.batch.block_table, case.batch.seq_lens
    tiles, splits = ops.get_mla_decoding_metadata_dense_fp8(lens, m * spec.num_heads, 1)
    one = torch.ones(1, dtype=torch.float32, device=q.device)

    def call(cache: torch.Tensor) -> torch.Tensor:
        out, _ = ops.fwd_kvcache_mla_fp8(
            q, cache.unsqueeze(-2), spec.kv_lora_rank, lens, table, spec.softmax_scale,
            True, tiles, splits, one, one)
        return out.view(b * m, spec.num_heads, spec.kv_lora_rank)

    return Kernel(name, call, out=torch.empty(0, device=q.device))


def triton_peer(case: Case) -> Kernel:
    """vLLM's Triton MLA decode (``decode_attention_fwd``, is_mla=True) with vLLM's split
    rule (``triton_mla.py``: next_pow2(max_seq_len // 512) capped at 2 * SMs)."""
    name = "peer:vllm-triton"
    spec, b = case.spec, case.batch.batch_size
    if case.q_len > 1:
        return Kernel(name, absent="not timed here for q_len > 1 (one-token decode only)")
    try:
        tri = importlib.import_module(TRITON_MODULE)
        import triton
    except Exception as exc:
        return Kernel(name, absent=f"import failed: {exc!r}")
    sms = torch.cuda.get_device_properties(case.query.device).multi_processor_count
    splits = min(triton.next_power_of_2(max(1, case.batch.max_seq_len // 512)), 2 * sms)
    h = spec.num_heads
    out = torch.empty(b, h, spec.kv_lora_rank, dtype=case.query.dtype, device=case.query.device)
    lse = torch.empty(b, h, dtype=case.query.dtype, device=case.query.device)
    logits = torch.empty(b, h, splits, spec.kv_lora_rank + 1, dtype=torch.float32,
                         device=case.query.device)
    one = torch.tensor(1.0, dtype=torch.float32, device=case.query.device)

    def call(cache: torch.Tensor) -> torch.Tensor:
        kv = cache.unsqueeze(2)
        tri.decode_attention_fwd(
            case.query, kv, kv[..., : spec.kv_lora_rank], out, lse, case.batch.block_table,
            case.batch.seq_lens, logits, splits, spec.softmax_scale, spec.block_size,
            k_scale=one, v_scale=one, is_mla=True,
        )
        return out

    return Kernel(name, call, out=out)


def planned_splitk(case: Case, config=None) -> tuple:
    """The CUDA split-KV kernel (``SplitKMLADecode``, launch ``config``) built and planned
    for ``case``: ``(kernel, query offsets [b + 1] int32, output [tokens, heads, 512])``."""
    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKMLADecode

    spec, device, b = case.spec, case.query.device, case.batch.batch_size
    kernel = SplitKMLADecode(device, spec.num_heads, case.q_len, spec.block_size, b,
                             spec.q_dtype, config, kv_dtype=spec.kv_dtype)
    kernel.plan(case.batch.seq_lens)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device) * case.q_len
    out = torch.empty(case.query.shape[0], spec.num_heads, spec.kv_lora_rank,
                      dtype=spec.q_dtype, device=device)
    return kernel, cu_q, out


def splitk_call(case: Case, config=None) -> tuple:
    """``planned_splitk``'s kernel and a call of it over one cache: ``(kernel,
    call(cache, combine=True) -> output, output)``; ``combine=False`` launches the decode
    grid alone (what a call costs without the combine)."""
    kernel, cu_q, out = planned_splitk(case, config)

    def call(cache: torch.Tensor, combine: bool = True) -> torch.Tensor:
        p = kernel.launch_params(case.query, cache, case.batch.block_table,
                                 case.batch.seq_lens, cu_q, out, case.spec.softmax_scale)
        kernel.launch_decode(p)
        if combine:
            kernel.launch_combine(p)
        return out

    return kernel, call, out


def splitk_label(stages: int, ctas_per_sm: int, min_tiles: int, fuse_max_splits: int = 0
                 ) -> str:
    """Row name of a split-KV launch configuration: ``splitk[s{stages}c{ctas}m{min_tiles}]``,
    ``f{fuse_max_splits}`` added for the fused-merge build."""
    fused = f"f{fuse_max_splits}" if fuse_max_splits else ""
    return f"splitk[s{stages}c{ctas_per_sm}m{min_tiles}{fused}]"


def splitk_kernel(case: Case, stages: int, ctas_per_sm: int, min_tiles: int,
                  fuse_max_splits: int = 0) -> Kernel:
    """The CUDA split-KV kernel (route ``cuda-splitk``) under one launch configuration,
    called directly (planned once), named by ``splitk_label`` (0: the kernel's default,
    ``splitk_mla_decode.default_launch``; ``fuse_max_splits``: ``SplitKConfig``'s). FP8
    caches are read with the bf16 query (unit scales, as the benchmark's cases)."""
    name = splitk_label(stages, ctas_per_sm, min_tiles, fuse_max_splits)
    spec = case.spec
    reason = ROUTES["cuda-splitk"].unsupported_reason(spec, platform_of(case.query.device))
    if reason is not None:
        return Kernel(name, absent=f"not eligible: {reason}")
    from trtllm_mla_plugin.ops.kernels.splitk_mla_decode import SplitKConfig

    config = SplitKConfig(stages=stages or None, ctas_per_sm=ctas_per_sm or None,
                          min_tiles=min_tiles, fuse_max_splits=fuse_max_splits)
    _, call, out = splitk_call(case, config)
    return Kernel(name, call, out=out, obj=config)
