"""The CUDA split-KV kernel's own source run end to end on the CPU: decode_body and
combine_body of ``splitk_mla_decode.cu`` compiled with g++ by
``tests/cuda/splitk_emulator.cpp``, every GPU thread a fiber and the hardware primitives
(barriers, ldmatrix, mma.sync, shfl, cp.async, conversions) re-implemented after the PTX
ISA, against the float64 reference. Covers what the fragment model does not: the pipeline
stages, segments, the in-kernel schedule over several CTAs, the online softmax, masks,
scales, partials and the combine. Timing, real concurrency and the hardware's own
instruction behaviour remain for the GPU tests (tests/gpu/test_splitk_gpu.py)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trtllm_mla_plugin.ops import KVScales
from trtllm_mla_plugin.ops.kernels import splitk_mla_decode as sk

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from mla_cases import bounds, errors, make_problem, reference, vllm_query_parts

EMULATOR = Path(__file__).with_name("cuda") / "splitk_emulator.cpp"
GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++")
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
CPU = torch.device("cpu")
#: FP8 cache read with the 16-bit query: held to bf16-query accuracy (issue 11's aim).
FP8_BF16_QUERY_REL = 5e-3


def build_emulator(tmp_path_factory, defines: tuple[str, ...] = ()) -> Path:
    exe = tmp_path_factory.mktemp("emu") / "splitk_emu"
    subprocess.run([GXX, "-std=c++20", "-O2", *(f"-D{d}" for d in defines), "-o", str(exe),
                    str(EMULATOR)], check=True, capture_output=True)
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory) -> Path:
    return build_emulator(tmp_path_factory)


@pytest.fixture(scope="module")
def fused_emulator(tmp_path_factory) -> Path:
    """The kernel built as ``SplitKConfig(fuse_max_splits=4)`` builds it: requests cut into
    at most 4 pieces merged by the decode CTA that finishes last."""
    return build_emulator(tmp_path_factory, ("SPLITK_FUSE_MAX_SPLITS=4",))


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def part_layout(view: torch.Tensor, base: torch.Tensor) -> tuple[bytes, list[int]]:
    """``view`` (a query part, ``[tokens, heads, D]``) as the emulator reads it: the bytes
    of the contiguous tensor ``base`` it views, and (elements, offset, token stride, head
    stride) in ``base``."""
    assert base.is_contiguous() and view.untyped_storage().data_ptr() == (
        base.untyped_storage().data_ptr())
    offset = view.storage_offset() - base.storage_offset()
    return _bits(base), [base.numel(), offset, view.stride(0), view.stride(1)]


def emulate(exe: Path, tmp: Path, p, *, num_ctas: int, min_tiles: int, stages: int,
            combine_ctas: int | None = None, reversed_ctas: bool = False,
            parts: tuple | None = None) -> torch.Tensor:
    """Run decode + combine of ``p`` in the emulator; returns ``[tokens, heads, 512]``.
    ``combine_ctas``: the combine's grid (``None``: one CTA per work item, as the host
    launches it; fewer exercise its stride loop). ``reversed_ctas``: CTAs run from the last
    index down (another CTA finishes each request last). ``parts``: the query as
    ``((latent view, its base), (rope view, its base))`` (``part_layout``) instead of
    ``p.query`` joined."""
    spec, batch = p.spec, p.batch
    b, heads = batch.batch_size, spec.num_heads
    if combine_ctas is None:
        combine_ctas = sk.COMBINE_CHUNKS * b + sk.SplitKConfig().helped_requests * sk.HELPER_PARTS
    fp8 = spec.fp8_kv
    groups = sk.row_groups(heads, spec.max_q_len)
    cu = batch.cu_seqlens_q
    if cu is None:
        cu = torch.arange(b + 1, dtype=torch.int32) * batch.max_q_len
    tiles = (batch.seq_lens + sk.TILE_TOKENS - 1) // sk.TILE_TOKENS
    prefix = torch.zeros(b + 1, dtype=torch.int32)
    prefix[1:] = torch.cumsum(tiles, 0)
    s = p.scales
    if parts is None:
        joined = p.query.contiguous()
        parts = ((joined[..., :512], joined), (joined[..., 512:], joined))
    (latent_bytes, latent), (rope_bytes, rope) = (part_layout(*part) for part in parts)
    header = [b, heads, spec.block_size, num_ctas, min_tiles, p.kv_cache.shape[0],
              batch.block_table.shape[1], p.query.shape[0],
              sk.head_blocks(heads, spec.max_q_len), int(spec.q_dtype == FP16), int(fp8),
              groups, stages, combine_ctas, int(reversed_ctas), *latent, *rope]
    floats = sk.launch_scales(fp8, spec.softmax_scale, s.q_scale, s.k_scale, s.v_scale)
    blob = struct.pack("23i", *header) + struct.pack("3f", *floats)
    blob += latent_bytes + rope_bytes + _bits(p.kv_cache) + _bits(batch.block_table.to(torch.int32))
    blob += _bits(batch.seq_lens.to(torch.int32)) + _bits(cu.to(torch.int32)) + _bits(prefix)
    inp, out = tmp / "in.bin", tmp / "out.bin"
    inp.write_bytes(blob)
    subprocess.run([str(exe), str(inp), str(out)], check=True, timeout=600)
    raw = np.frombuffer(out.read_bytes(), dtype=np.int16).copy()
    return torch.from_numpy(raw).view(spec.q_dtype).view(p.query.shape[0], heads, 512)


# (id, heads, block, lens, q_lens, q dtype, kv dtype, scales, num_ctas, min_tiles, stages)
CASES = [
    ("one-tile", 16, 64, [32], 1, BF16, BF16, None, 4, 1, 4),
    ("ragged-cut-over-7-ctas", 16, 64, [1, 63, 64, 65, 700, 300], 1, BF16, BF16, None, 7,
     1, 2),
    ("ragged-3-stages-page32", 16, 32, [700, 5, 333, 96], 1, BF16, BF16, None, 5, 2, 3),
    ("one-request-over-every-cta", 16, 64, [1500], 1, BF16, BF16, None, 13, 1, 4),
    ("h8-q2-causal", 8, 64, [2, 130, 700], 2, BF16, BF16, None, 6, 1, 4),
    ("h32-two-row-groups", 32, 64, [40, 500, 1], 1, BF16, BF16, None, 5, 1, 4),
    ("h16-q4-two-head-blocks", 16, 64, [4, 300, 129], 4, BF16, BF16, None, 5, 1, 2),
    ("h24-ragged-q-fp16", 24, 64, [300, 77, 64], [3, 1, 2], FP16, FP16, None, 4, 1, 4),
    ("fp8-unit", 16, 64, [1, 63, 65, 700], 1, BF16, FP8, KVScales(), 6, 1, 4),
    ("fp8-scaled-8-stages", 16, 64, [1, 63, 65, 700, 9], 1, BF16, FP8,
     KVScales(2.0, 0.5, 0.25), 6, 1, 8),
    ("fp8-h32-q2-page32", 32, 32, [2, 400, 70], 2, BF16, FP8, KVScales(1.0, 0.25, 0.5), 4,
     1, 4),
    ("fp8-fp16-query", 16, 64, [200, 31], 1, FP16, FP8, KVScales(0.5, 2.0, 2.0), 3, 1, 8),
    # requests cut into more than HEAVY_SPLITS pieces: the first four merged by helper
    # items (32 columns each), the fifth by its own four items
    ("five-heavy-requests", 16, 64, [700, 40, 700, 700, 5, 700, 700, 64, 300], 1, BF16,
     BF16, None, 100, 1, 2),
    ("heavy-h32-q2-two-head-blocks", 32, 64, [900, 10, 900], 2, BF16, BF16, None, 40, 1, 4),
]


def case_problem(case: tuple):
    """``(problem, launch)`` of one of ``CASES``: the launch as ``emulate``'s keywords."""
    _, heads, block, lens, q_lens, dtype, kv_dtype, scales, num_ctas, min_tiles, stages = case
    torch.manual_seed(len(lens) * 31 + heads)
    p = make_problem(heads=heads, block=block, lens=lens, q_lens=q_lens, dtype=dtype,
                     kv_dtype=kv_dtype, scales=scales or KVScales(), device=CPU)
    return p, dict(num_ctas=num_ctas, min_tiles=min_tiles, stages=stages)


def assert_matches_float64(p, out: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison)"
    rel, worst = errors(out, reference(p))
    rel_bound, max_bound = bounds(p)
    if p.spec.fp8_kv:
        rel_bound = FP8_BF16_QUERY_REL
    assert rel < rel_bound and worst < max_bound, (rel, worst)


def check_case(exe: Path, tmp: Path, case: tuple, reversed_ctas: bool = False) -> None:
    """One of ``CASES`` through the emulator ``exe``, against float64."""
    p, launch = case_problem(case)
    assert_matches_float64(p, emulate(exe, tmp, p, reversed_ctas=reversed_ctas, **launch))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_source_matches_float64(emulator, tmp_path, case):
    check_case(emulator, tmp_path, case)


#: One and two row groups, ragged query lengths, fp16, FP8 caches (4-element query loads).
PARTS_CASES = ["ragged-cut-over-7-ctas", "h8-q2-causal", "h32-two-row-groups",
               "h24-ragged-q-fp16", "fp8-scaled-8-stages", "fp8-h32-q2-page32"]


@pytest.mark.parametrize("latent_layout", ["token-major", "head-major"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in PARTS_CASES],
                         ids=lambda c: c[0])
def test_query_parts_read_where_they_lie(emulator, tmp_path, case, latent_layout):
    """The query as vLLM hands it over: the rope part a strided view of the projection's
    128 + 64 columns a head, the latent part token-major (vLLM's own buffer) or a transposed
    head-major one (vLLM's bmm output where it pads heads): against float64, and
    bit-equal to the same problem read from one joined query."""
    p, launch = case_problem(case)
    out = emulate(emulator, tmp_path, p, parts=vllm_query_parts(p.query, latent_layout),
                  **launch)
    assert_matches_float64(p, out)
    assert torch.equal(out, emulate(emulator, tmp_path, p, **launch))


def test_padding_requests_come_out_zero(emulator, tmp_path):
    p = make_problem(heads=16, block=64, lens=[5, 700, 9], q_lens=1, dtype=BF16,
                     kv_dtype=BF16, device=CPU)
    p.batch.seq_lens[0] = p.batch.seq_lens[2] = 0
    out = emulate(emulator, tmp_path, p, num_ctas=5, min_tiles=1, stages=4)
    assert (out[0] == 0).all() and (out[2] == 0).all()
    p.batch.seq_lens[0] = p.batch.seq_lens[2] = 1  # any length: only row 1 is compared
    rel, _ = errors(out[1:2], reference(p)[1:2])
    assert rel < 1e-2


def test_many_short_requests_per_cta(emulator, tmp_path):
    """40 requests over 3 CTAs: each CTA walks a dozen segments, every one of them with its
    query prefetched one tile ahead; a combine grid of 3 CTAs strides over the 160 items."""
    gen = torch.Generator().manual_seed(40)
    lens = torch.randint(1, 100, (40,), generator=gen).tolist()
    p = make_problem(heads=16, block=32, lens=lens, q_lens=1, dtype=BF16, kv_dtype=BF16,
                     device=CPU, generator=gen)
    out = emulate(emulator, tmp_path, p, num_ctas=3, min_tiles=1, stages=2, combine_ctas=3)
    rel, worst = errors(out, reference(p))
    assert rel < 1e-2 and worst < 2e-2, (rel, worst)


def test_heavy_requests_with_a_small_combine_grid(emulator, tmp_path):
    """Helper items reached by the combine's stride loop: a grid of 5 CTAs over the 36
    regular and 64 helper items of five heavy requests."""
    torch.manual_seed(5)
    p = make_problem(heads=16, block=64, lens=[700, 40, 700, 700, 5, 700, 700, 64, 300],
                     q_lens=1, dtype=BF16, kv_dtype=BF16, device=CPU)
    out = emulate(emulator, tmp_path, p, num_ctas=100, min_tiles=1, stages=2, combine_ctas=5)
    rel, worst = errors(out, reference(p))
    assert rel < 1e-2 and worst < 2e-2, (rel, worst)


@pytest.mark.parametrize("seed", range(8))
def test_seeded_random_problems(emulator, tmp_path, seed):
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    heads, q_len = pick([8, 16, 24, 32]), pick([1, 1, 2, 3])
    b = int(torch.randint(1, 24, (1,), generator=rng))
    lens = [max(q_len, int(v)) for v in torch.randint(1, 600, (b,), generator=rng)]
    dtype = pick([BF16, BF16, FP16])
    fp8 = seed % 3 == 1
    scales = KVScales(pick([1.0, 2.0]), pick([0.5, 1.0]), pick([0.25, 1.0])) if fp8 else None
    p = make_problem(heads=heads, block=pick([32, 64]), lens=lens, q_lens=q_len, dtype=dtype,
                     kv_dtype=FP8 if fp8 else dtype, scales=scales or KVScales(), device=CPU,
                     generator=rng)
    stages = pick([4, 8]) if fp8 else pick([2, 3, 4])
    out = emulate(emulator, tmp_path, p, num_ctas=pick([2, 5, 12]),
                  min_tiles=pick([1, 2, 4]), stages=stages)
    assert torch.isfinite(out).all()
    rel, worst = errors(out, reference(p))
    rel_bound, max_bound = bounds(p)
    if fp8:
        rel_bound = FP8_BF16_QUERY_REL
    assert rel < rel_bound and worst < max_bound, (heads, q_len, lens, rel, worst)


#: Cases whose requests are cut into 2-4 pieces (merged in the decode grid by the fused
#: build) and more (left to the combine kernel), one or two row groups, FP8.
FUSED_CASES = ["ragged-cut-over-7-ctas", "one-request-over-every-cta", "h8-q2-causal",
               "h32-two-row-groups", "h16-q4-two-head-blocks", "fp8-scaled-8-stages"]


@pytest.mark.parametrize("reversed_ctas", [False, True], ids=["in-order", "reversed"])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in FUSED_CASES],
                         ids=lambda c: c[0])
def test_fused_merge_matches_float64(fused_emulator, tmp_path, case, reversed_ctas):
    """Built with SPLITK_FUSE_MAX_SPLITS=4: whichever CTA finishes a cut request last merges
    it, the combine kernel takes the requests cut more ways, every counter is back at zero
    after the launch (the emulator exits non-zero otherwise)."""
    check_case(fused_emulator, tmp_path, case, reversed_ctas)


@pytest.mark.parametrize("seed", range(4))
def test_fused_merge_on_many_short_requests(fused_emulator, tmp_path, seed):
    """Dozens of requests over a few CTAs, most cut in two: every merge in the decode grid."""
    gen = torch.Generator().manual_seed(50 + seed)
    lens = torch.randint(1, 200, (int(torch.randint(8, 40, (1,), generator=gen)),),
                         generator=gen).tolist()
    p = make_problem(heads=16, block=32, lens=lens, q_lens=1, dtype=BF16, kv_dtype=BF16,
                     device=CPU, generator=gen)
    out = emulate(fused_emulator, tmp_path, p, num_ctas=5, min_tiles=1, stages=2,
                  reversed_ctas=seed % 2 == 1)
    rel, worst = errors(out, reference(p))
    assert rel < 1e-2 and worst < 2e-2, (rel, worst)
