"""Host side of the CUDA split-KV decode kernel (``cuda/splitk_mla_decode.cu``).

``SplitKMLADecode`` compiles the kernel for the device at first use (``nvcc_build``), owns
the buffers its launches read (persistent, so a captured CUDA graph replays after the next
``plan``), computes each step's tile prefix sum in ``plan`` (one small torch op per step,
shared by every layer) and launches decode + combine in ``run``.

Fixed shapes: latent 512 + RoPE 64 (DeepSeek-V2/V3, Kimi-K2), pages of a multiple of 32
tokens, up to ``MAX_BATCH`` requests. The cache is the query's dtype (bf16/fp16) or FP8 e4m3
read with the bf16/fp16 query (products in fp16: e4m3 widens to fp16 exactly). Query rows
of a request (heads x query tokens) are tiled 16 or 32 per CTA (``row_groups``); more rows
add CTAs along the grid's y axis.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ..spec import split_query
from .cuda_driver import CubinModule
from .nvcc_build import build_cubin

SOURCE = Path(__file__).with_name("cuda") / "splitk_mla_decode.cu"
#: The GPU generation the kernel is built and measured for (Hopper).
CAPABILITY = (9, 0)
KV_LORA_RANK, ROPE_DIM = 512, 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
#: KV tokens per pipeline stage; pages must hold a whole number of tiles.
TILE_TOKENS = 32
#: Requests per launch (the kernel keeps lengths and offsets in shared memory).
MAX_BATCH = 1024
#: The combine kernel's work items per request: 128-column chunks of the 512 latent columns.
COMBINE_CHUNKS = 4
#: Helper items per heavy request (a request cut into more pieces than ``HEAVY_SPLITS``):
#: 32-column parts, merged by 16 CTAs instead of 4 (``cuda/splitk_mla_decode.cu``).
HELPER_PARTS, HEAVY_SPLITS = 16, 16
#: Shared memory of the combine's heavy-request search (ints).
SCAN_INTS = 130
MAX_GRID_X = 2**31 - 1
LOG2E = 1.4426950408889634
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
FP8 = torch.float8_e4m3fn
#: Pipeline depths compiled per cache kind (an FP8 tile is half the bytes).
STAGES = {False: (2, 3, 4), True: (4, 8)}


class SplitKParams(ctypes.Structure):
    """Mirror of ``struct SplitKParams`` in the CUDA source (``tests`` compare the layout
    with a C++ compiler's)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("cu_q", ctypes.c_void_p),
        ("tile_prefix", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("part_o", ctypes.c_void_p),
        ("part_lse", ctypes.c_void_p),
        ("kv_page_stride", ctypes.c_int64),
        ("bt_stride", ctypes.c_int),
        ("batch", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("page_size", ctypes.c_int),
        ("num_ctas", ctypes.c_int),
        ("min_tiles", ctypes.c_int),
        ("scale_log2", ctypes.c_float),
        ("q_prescale", ctypes.c_float),
        ("out_scale", ctypes.c_float),
        ("merge_count", ctypes.c_void_p),
        ("q_rope", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int),
        ("q_head_stride", ctypes.c_int),
        ("q_rope_token_stride", ctypes.c_int),
        ("q_rope_head_stride", ctypes.c_int),
    ]


@dataclass(frozen=True)
class SplitKConfig:
    """Launch choices; ``None`` takes ``default_launch``'s measured choice.

    Attributes:
        stages: KV tiles in flight per CTA (``STAGES``: 2-4 for 16-bit caches, 4 or 8 for
            FP8).
        ctas_per_sm: decode CTAs per SM (one wave: the grid is ``SMs x ctas_per_sm``).
        min_tiles: fewest 32-token tiles per CTA; small batches use fewer CTAs (fewer
            partial results to combine).
        fuse_max_splits: requests cut into at most this many pieces are merged inside the
            decode grid, by the CTA that finishes the last piece, instead of by the combine
            kernel after the whole grid (a separate build, ``SPLITK_FUSE_MAX_SPLITS``); 0:
            every cut request by the combine kernel. Correct on the H200 but slower on
            every shape measured (run 55, docs/benchmarks-history.md), so not the default.
        helped_requests: heavy requests (cut into more than ``HEAVY_SPLITS`` pieces, e.g. one
            long request among short ones) merged by ``HELPER_PARTS`` combine CTAs each
            instead of four: the first this many in batch order (0: none; a separate build,
            ``SPLITK_HELPED_REQUESTS``).
    """

    stages: int | None = None
    ctas_per_sm: int | None = None
    min_tiles: int = 4
    fuse_max_splits: int = 0
    helped_requests: int = 4


#: GPUs (``torch.cuda.get_device_properties().name`` containing one of these) where one
#: row group of a 16-bit cache runs one CTA per SM with three stages (``default_launch``;
#: the H200 measured slower so, run 271).
ONE_CTA_GPUS = ("H100",)


def default_launch(groups: int, fp8_kv: bool, gpu_name: str = "") -> tuple[int, int]:
    """``(stages, ctas_per_sm)`` for ``groups`` row groups on the GPU named ``gpu_name``.
    One row group (128 threads, ~236 registers) fits two CTAs per SM: twice the warps to
    hide the per-tile latency chain, which ``benchmarks/splitk_profile.py`` shows is what
    limits one CTA (H200, run 44: math alone over stale tiles 99 against 129 us, loads
    alone 145 against 142 us, at h16 b128 8k); shared memory then holds two 16-bit stages
    or four FP8 ones per CTA. On the H100 (``ONE_CTA_GPUS``; a third less bandwidth than
    the H200 for the same math, so loads rather than math set the pace) a 16-bit cache runs
    one CTA per SM with three stages instead: half the grid cuts requests into half the
    pieces, which short contexts pay for in partial outputs and their combine. Runs 253
    and 255 (H100, 8-16 query rows, 33-1024 requests; the kernel alone, against two CTAs
    per SM at min_tiles 1-2, timed alongside): 1.035-1.040x on geomean, per shape
    0.995-1.175x, short contexts gaining most; on 40 fresh shapes (seeds 601-602) the
    kernel alone scored 1.023 of the faster of vLLM's two calls (worst 0.770) where two
    CTAs at min_tiles 2 scored 0.984 (0.718). The H200 keeps two CTAs: there one CTA per SM
    with three stages ran 0.905x two CTAs with two stages on geomean (run 271: 35 shapes of
    8-16 rows at 33-1024 requests, seeds 603-604 and three grid shapes; 0.80-0.83x on long
    contexts, where fewer loads in flight fall short of the H200's bandwidth). Not measured
    with an FP8 cache. Two row groups (256 threads) fit one CTA per SM."""
    if groups == 1:
        if not fp8_kv and any(name in gpu_name for name in ONE_CTA_GPUS):
            return 3, 1
        return (4 if fp8_kv else 2), 2
    return (8 if fp8_kv else 4), 1


def query_parts(query: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's two query views, ``(latent [tokens, heads, 512], rope [tokens, heads,
    64])``, of ``query`` ``[tokens, heads, 576]`` or of its two parts as vLLM hands them
    (the latent part contiguous, the rope part a strided view of the projection), read where
    they lie. The kernel addresses row (token, head) of each part by its own token and head
    strides and loads up to 8 bytes at a time: a part whose innermost stride is not 1, or
    whose start or strides are not 8-byte aligned, is copied first."""
    latent, rope = split_query(query, KV_LORA_RANK)
    return _loadable(latent), _loadable(rope)


def _loadable(part: torch.Tensor) -> torch.Tensor:
    aligned = (part.stride(-1) == 1 and part.data_ptr() % 8 == 0
               and part.stride(0) % 4 == 0 and part.stride(1) % 4 == 0)
    return part if aligned else part.contiguous()


def row_groups(heads: int, max_q_len: int) -> int:
    """16-row groups per CTA: 1 when a request has at most 16 query rows, else 2."""
    return 1 if heads * max_q_len <= 16 else 2


def head_blocks(heads: int, max_q_len: int) -> int:
    """CTAs along the grid's y axis: query rows of a request over the rows one CTA takes."""
    return math.ceil(heads * max_q_len / (16 * row_groups(heads, max_q_len)))


def launch_scales(fp8_kv: bool, softmax_scale: float, q_scale: float = 1.0,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[float, float, float]:
    """``(scale_log2, q_prescale, out_scale)`` of the launch struct. FP8 caches: the query
    enters the fp16 product pre-scaled to log2 units, the FP8 scales multiply after it."""
    if fp8_kv:
        return q_scale * k_scale, softmax_scale * LOG2E, v_scale
    return softmax_scale * LOG2E * q_scale * k_scale, 1.0, v_scale


def stage_bytes(fp8_kv: bool) -> int:
    return TILE_TOKENS * HEAD_DIM * (1 if fp8_kv else 2)


def decode_shared_bytes(stages: int, groups: int, fp8_kv: bool = False) -> int:
    """Dynamic shared memory of the decode kernel: KV stages, the cross-warp score
    exchange (8 KiB per row group), tile prefix / lengths / query offsets."""
    return stages * stage_bytes(fp8_kv) + groups * 8192 + (3 * MAX_BATCH + 2) * 4


def decode_kernel_name(dtype: torch.dtype, fp8_kv: bool, groups: int, stages: int) -> str:
    return (f"splitk_mla_decode_{DTYPE_NAMES[dtype]}{'_fp8kv' if fp8_kv else ''}"
            f"_rg{groups}_s{stages}")


def build_defines(config: SplitKConfig) -> tuple[str, ...]:
    """Preprocessor defines of the build ``config`` launches (none for the default)."""
    if config.fuse_max_splits < 0:
        raise ValueError(f"fuse_max_splits={config.fuse_max_splits}: 0 or more")
    if config.helped_requests < 0:
        raise ValueError(f"helped_requests={config.helped_requests}: 0 or more")
    defines = []
    if config.fuse_max_splits:
        defines.append(f"SPLITK_FUSE_MAX_SPLITS={config.fuse_max_splits}")
    if config.helped_requests != SplitKConfig.helped_requests:
        defines.append(f"SPLITK_HELPED_REQUESTS={config.helped_requests}")
    return tuple(defines)


@cache
def _module(device_index: int, defines: tuple[str, ...] = ()) -> CubinModule:
    capability = torch.cuda.get_device_capability(device_index)
    return CubinModule(build_cubin(SOURCE, capability, defines),
                       torch.device("cuda", device_index))


class SplitKMLADecode:
    """One layer group's decode launches: ``plan`` per step, ``run`` per layer."""

    def __init__(self, device: torch.device, heads: int, max_q_len: int, page_size: int,
                 max_batch: int, dtype: torch.dtype, config: SplitKConfig | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        if page_size % TILE_TOKENS:
            raise ValueError(f"block size {page_size}: the split-KV kernel needs a multiple "
                             f"of {TILE_TOKENS}")
        if max_batch > MAX_BATCH:
            raise ValueError(f"max batch size {max_batch}: the split-KV kernel takes up to "
                             f"{MAX_BATCH} requests per step; lower max_num_seqs or pick "
                             "another route")
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"the split-KV kernel takes bf16/fp16 queries, got {dtype}")
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in (dtype, FP8):
            raise ValueError(f"the split-KV kernel reads a {dtype} or FP8 e4m3 cache, got "
                             f"{kv_dtype}")
        self.fp8_kv = kv_dtype == FP8
        self.device = torch.device(device)
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device())
        self.config = config or SplitKConfig()
        self.heads, self.page_size, self.dtype = heads, page_size, dtype
        self.groups = row_groups(heads, max_q_len)
        rows = 16 * self.groups
        self.head_blocks = head_blocks(heads, max_q_len)
        props = torch.cuda.get_device_properties(index)
        sms = props.multi_processor_count
        default_stages, default_ctas = default_launch(self.groups, self.fp8_kv, props.name)
        self.ctas_per_sm = self.config.ctas_per_sm or default_ctas
        self.num_ctas = sms * self.ctas_per_sm
        stages = self.config.stages or default_stages
        if stages not in STAGES[self.fp8_kv]:
            raise ValueError(f"stages={stages}: compiled depths are {STAGES[self.fp8_kv]}")
        self.stages = stages
        if self.config.fuse_max_splits * rows * 4 + 16 > stages * stage_bytes(self.fp8_kv):
            raise ValueError(f"fuse_max_splits={self.config.fuse_max_splits}: the merge "
                             "weights must fit in the pipeline's shared memory")
        self.decode_shared = decode_shared_bytes(stages, self.groups, self.fp8_kv)
        self.combine_shared = (self.num_ctas * rows + SCAN_INTS) * 4
        self.use_module(_module(index, build_defines(self.config)))
        #: [max_batch + 1] prefix sums of each request's 32-token tiles, written by ``plan``.
        self.tile_prefix = torch.zeros(max_batch + 1, dtype=torch.int32, device=self.device)
        slots = self.head_blocks * 2 * self.num_ctas * rows
        #: Partial outputs (normalised) and their log2-sum-exp: two slots per CTA.
        self.part_o = torch.empty(slots * KV_LORA_RANK, dtype=torch.float32,
                                  device=self.device)
        self.part_lse = torch.empty(slots, dtype=torch.float32, device=self.device)
        #: Pieces finished per (head block, request) of the fused merge; every launch leaves
        #: them at zero (read only by builds with ``fuse_max_splits``).
        self.merge_count = torch.zeros(self.head_blocks * MAX_BATCH, dtype=torch.int32,
                                       device=self.device)
        self._params = SplitKParams(num_ctas=self.num_ctas, min_tiles=self.config.min_tiles,
                                    heads=heads, page_size=page_size,
                                    part_o=self.part_o.data_ptr(),
                                    part_lse=self.part_lse.data_ptr(),
                                    tile_prefix=self.tile_prefix.data_ptr(),
                                    merge_count=self.merge_count.data_ptr())

    def plan(self, seq_lens: torch.Tensor) -> None:
        """Tile prefix sums of ``seq_lens`` ``[batch]`` int32 (device)."""
        b = seq_lens.shape[0]
        tiles = (seq_lens + (TILE_TOKENS - 1)) // TILE_TOKENS
        torch.cumsum(tiles, 0, dtype=torch.int32, out=self.tile_prefix[1: b + 1])

    def run(self, query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
            kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, cu_q: torch.Tensor, out: torch.Tensor,
            softmax_scale: float, q_scale: float = 1.0, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Decode ``query`` ``[tokens, heads, 576]`` (or its two parts, ``query_parts``)
        over ``kv_cache`` ``[pages, page_size, 576]`` (page stride free, rows contiguous) for
        the planned batch: ``block_table`` ``[batch, width]`` int32 (rows contiguous),
        ``seq_lens`` ``[batch]`` and ``cu_q`` ``[batch + 1]`` int32, into contiguous ``out``
        ``[tokens, heads, 512]``; returns ``out``. Scores are ``query * q_scale`` dot
        ``cache * k_scale``, values ``cache[..., :512] * v_scale`` (FP8 caches; 1 otherwise)."""
        p = self.launch_params(query, kv_cache, block_table, seq_lens, cu_q, out,
                               softmax_scale, q_scale, k_scale, v_scale)
        self.launch_decode(p)
        # The combine may start while the decode grid drains (it waits for it on the GPU).
        self.launch_combine(p)
        return out

    def launch_params(self, query: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                      kv_cache: torch.Tensor, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, cu_q: torch.Tensor, out: torch.Tensor,
                      softmax_scale: float, q_scale: float = 1.0, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> SplitKParams:
        """The launch struct of ``run``'s arguments (checked)."""
        if kv_cache.stride(2) != 1 or kv_cache.stride(1) != HEAD_DIM:
            raise ValueError("the split-KV kernel needs cache rows of 576 contiguous elements")
        if block_table.stride(1) != 1:
            raise ValueError("the split-KV kernel needs block-table rows contiguous")
        p = self._params
        latent, rope = query_parts(query)
        p.q, p.q_rope = latent.data_ptr(), rope.data_ptr()
        p.q_token_stride, p.q_head_stride = latent.stride(0), latent.stride(1)
        p.q_rope_token_stride, p.q_rope_head_stride = rope.stride(0), rope.stride(1)
        p.kv = kv_cache.data_ptr()
        p.block_table = block_table.data_ptr()
        p.seq_lens = seq_lens.data_ptr()
        p.cu_q = cu_q.data_ptr()
        p.out = out.data_ptr()
        p.kv_page_stride = kv_cache.stride(0)
        p.bt_stride = block_table.stride(0)
        p.batch = seq_lens.shape[0]
        p.scale_log2, p.q_prescale, p.out_scale = launch_scales(
            self.fp8_kv, softmax_scale, q_scale, k_scale, v_scale)
        return p

    def launch_decode(self, p: SplitKParams) -> None:
        self._module.launch(self._decode, (self.num_ctas, self.head_blocks), 128 * self.groups,
                            self.decode_shared, p)

    def launch_combine(self, p: SplitKParams) -> None:
        # One CTA per (request, 128-column chunk) and per helper item: an item without
        # partials exits before waiting for the decode grid.
        items = min(COMBINE_CHUNKS * max(p.batch, 1)
                    + self.config.helped_requests * HELPER_PARTS, MAX_GRID_X)
        self._module.launch(self._combine, (items, self.head_blocks), 128,
                            self.combine_shared, p, programmatic=True)

    def use_module(self, module: CubinModule) -> None:
        """Launch from ``module``: the default build, or one of the same source with other
        defines (``benchmarks/splitk_profile.py``'s variants)."""
        self._module = module
        self._decode = module.function(
            decode_kernel_name(self.dtype, self.fp8_kv, self.groups, self.stages),
            self.decode_shared)
        self._combine = module.function(
            f"splitk_mla_combine_{DTYPE_NAMES[self.dtype]}_rg{self.groups}", self.combine_shared)
