"""Seeded randomized sweep of the ``torch-reference`` route through ``MLADecoder``.

Every configuration is drawn from its own seed (``random.Random(seed)`` for the shape,
``torch.Generator().manual_seed(seed)`` for the data) and checked against an independent
float64 loop over requests written here (``mla_decode_reference`` *is* the route, so it is
not the oracle). A failure lists its seeds; rerun one with
``MLA_SWEEP_SEEDS=17,42 pytest tests/test_ops_sweep.py -q``.

What varies: batch composition (1-7 requests), lengths (1, block - 1, block, block + 1,
2 x block, random, long), block sizes 1-64, block tables with scattered blocks, blocks
shared between requests (prefix caching) and blocks reused at random, garbage ids in unused
columns, wider-than-needed tables, int32/int64 indices; heads 1-128 (odd included); latent
widths 32-512 with rope 0-64; q_len 1-4 uniform (with and without ``cu_seqlens_q``) and
ragged; query/cache float32, bfloat16, float16, and FP8 e4m3 caches (bf16/fp16/fp32/FP8
query) with non-unit q/k/v scales; softmax scales over three decades; ``out`` NaN-poisoned
or allocated by the decoder.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import torch

from trtllm_mla_plugin.ops import DecodeBatch, DecodeSpec, KVScales, MLADecoder

FP8 = torch.float8_e4m3fn
NUM_CONFIGS = 600
FIRST_SEED = 1000
WORK_BUDGET = 4_000_000  # tokens x heads x max_len x dims, roughly

# Per-element bound: |out - ref| <= RTOL[out dtype] * |ref| + ATOL * max|ref|. RTOL is the
# output rounding (unit roundoff 2**-8 for bf16, 2**-11 for fp16, doubled for slack); ATOL
# covers the route's float32 arithmetic (inputs are exact in float32, and the oracle reads
# the same stored values).
RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
ATOL = 2e-5


@dataclass
class Config:
    seed: int
    spec: DecodeSpec
    batch: DecodeBatch
    q_lens: list[int]
    query: torch.Tensor
    kv_cache: torch.Tensor
    scales: KVScales
    poison_out: bool
    desc: str


def _lengths(rng: random.Random, block: int, n: int) -> list[int]:
    kinds = ["one", "block-1", "block", "block+1", "2block", "rand", "rand", "long"]
    out = []
    for _ in range(n):
        kind = rng.choice(kinds)
        length = {
            "one": 1,
            "block-1": max(1, block - 1),
            "block": block,
            "block+1": block + 1,
            "2block": 2 * block,
            "rand": rng.randint(1, 3 * block + 2),
            "long": rng.randint(4 * block, max(4 * block, 2000)),
        }[kind]
        out.append(length)
    return out


def _block_table(
    rng: random.Random, lens: list[int], block: int, gen: torch.Generator
) -> tuple[torch.Tensor, int, str]:
    """Table ``[batch, width]`` and the number of physical blocks it may address."""
    need = [-(-L // block) for L in lens]
    width = max(need) + rng.choice([0, 0, 1, 3])
    mode = rng.choice(["scattered", "shared-prefix", "random-reuse"])
    if mode == "random-reuse":
        # Few physical blocks, drawn with replacement: repeats inside and across requests.
        num_blocks = max(1, sum(need) // 2) + rng.randint(0, 2)
        table = torch.randint(0, num_blocks, (len(lens), width), generator=gen)
        return table, num_blocks, mode
    num_blocks = sum(need) + rng.randint(1, 8)
    perm = torch.randperm(num_blocks, generator=gen)
    # Unused columns hold arbitrary valid ids (random data, never read by a correct route).
    table = torch.randint(0, num_blocks, (len(lens), width), generator=gen)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    if mode == "shared-prefix":
        # Prefix caching: a later request starts with some of an earlier request's blocks.
        for i in range(1, len(lens)):
            j = rng.randrange(i)
            k = rng.randint(0, min(need[i], need[j]))
            table[i, :k] = table[j, :k]
    return table, num_blocks, mode


def make_config(seed: int) -> Config:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block = rng.choice([1, 2, 3, 4, 5, 8, 16, 16, 32, 64])
    heads = rng.choice([1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 64, 127, 128])
    if heads >= 64:
        dc, dr = rng.choice([32, 48, 64, 96]), rng.choice([0, 8, 16])
    else:
        dc, dr = rng.choice([32, 64, 128, 256, 512]), rng.choice([0, 8, 16, 32, 64])
    batch_size = rng.choice([1, 1, 2, 3, 4, 5, 7])
    lens = _lengths(rng, block, batch_size)

    q_mode = rng.choice(["uniform", "uniform-cu", "ragged"])
    if q_mode == "ragged":
        q_lens = [rng.randint(1, 4) for _ in lens]
    else:
        q_lens = [rng.randint(1, 4)] * batch_size
    # Keep each configuration cheap: long contexts come with few heads, rows and small dims.
    cap = max(2 * block + 1, WORK_BUDGET // (sum(q_lens) * heads * (dc + 16)))
    lens = [max(min(L, cap), n) for L, n in zip(lens, q_lens, strict=True)]  # L >= rows

    kv_kind = rng.choice(["float32", "bfloat16", "float16", "fp8", "fp8"])
    if kv_kind == "fp8":
        kv_dtype = FP8
        q_dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float32, torch.float16, FP8])
        scales = KVScales(
            q_scale=rng.choice([1.0, 0.5, 2.0, 2.0 ** rng.uniform(-2, 2)]),
            k_scale=2.0 ** rng.uniform(-4, 2),
            v_scale=2.0 ** rng.uniform(-4, 2),
        )
    else:
        kv_dtype = q_dtype = getattr(torch, kv_kind)
        scales = KVScales()

    table, num_blocks, table_mode = _block_table(rng, lens, block, gen)
    index_dtype = rng.choice([torch.int32, torch.int32, torch.int64])
    d = dc + dr
    # Real values ~ N(0, std^2); FP8 caches store real / k_scale (the route multiplies back).
    kv_std, q_std = 2.0 ** rng.uniform(-2, 1.5), 2.0 ** rng.uniform(-2, 1.5)
    kv = torch.randn(num_blocks, block, d, generator=gen) * kv_std
    if kv_dtype == FP8:
        kv = (kv / scales.k_scale).clamp(-448, 448)
    kv = kv.to(kv_dtype)
    tokens = sum(q_lens)
    query = torch.randn(tokens, heads, d, generator=gen) * q_std
    if q_dtype == FP8:
        query = (query / scales.q_scale).clamp(-448, 448)
    query = query.to(q_dtype)

    softmax_scale = rng.choice([1.0 / math.sqrt(d), 1.0 / math.sqrt(d), 1e-3, rng.uniform(0.01, 1)])
    cu = None
    if q_mode != "uniform":
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=index_dtype)
    max_q = max(q_lens)
    spec = DecodeSpec(
        num_heads=heads, kv_lora_rank=dc, rope_dim=dr, block_size=block, q_dtype=q_dtype,
        kv_dtype=kv_dtype, softmax_scale=softmax_scale, max_q_len=max_q + rng.choice([0, 0, 1]),
    )
    # max_seq_len: the exact maximum, or a looser host bound within the table's capacity.
    max_seq_len = max(lens)
    if rng.random() < 0.3:
        max_seq_len = rng.randint(max_seq_len, table.shape[1] * block)
    batch = DecodeBatch(
        block_table=table.to(index_dtype), seq_lens=torch.tensor(lens, dtype=index_dtype),
        max_seq_len=max_seq_len, cu_seqlens_q=cu, max_q_len=max_q,
        num_tokens=tokens if cu is not None else None,
    )
    desc = (
        f"seed={seed} block={block} heads={heads} dims={dc}+{dr} lens={lens} q_lens={q_lens} "
        f"q_mode={q_mode} table={table_mode}/{tuple(table.shape)}/{index_dtype} "
        f"q={q_dtype} kv={kv_dtype} scales={scales} sm_scale={softmax_scale:.3g}"
    )
    return Config(seed, spec, batch, q_lens, query, kv, scales, rng.random() < 0.7, desc)


def oracle(c: Config) -> torch.Tensor:
    """float64, one request at a time: gather its keys page by page, causal rows."""
    spec, s = c.spec, c.scales
    block, dc = spec.block_size, spec.kv_lora_rank
    table = c.batch.block_table.tolist()
    lens = c.batch.seq_lens.tolist()
    out = torch.zeros(c.query.shape[0], spec.num_heads, dc, dtype=torch.float64)
    row = 0
    for r, (L, n) in enumerate(zip(lens, c.q_lens, strict=True)):
        pages = [c.kv_cache[table[r][i]] for i in range(-(-L // block))]
        keys = torch.cat(pages)[:L].to(torch.float64)  # [L, D], stored values
        q = c.query[row : row + n].to(torch.float64) * s.q_scale  # [n, H, D]
        scores = torch.einsum("nhd,ld->nhl", q, keys * s.k_scale) * spec.softmax_scale
        for t in range(n):
            visible = L - n + t + 1  # bottom-right causal inside the request
            x = scores[t, :, :visible]
            w = torch.exp(x - x.max(dim=-1, keepdim=True).values)
            w = w / w.sum(dim=-1, keepdim=True)
            out[row + t] = w @ (keys[:visible, :dc] * s.v_scale)
        row += n
    return out


def check(c: Config) -> tuple[str | None, float]:
    """(``None`` if the route's output is within bounds, else a description; err/bound)."""
    decoder = MLADecoder(c.spec, "cpu", max_batch_size=c.batch.batch_size + 2,
                         route="torch-reference")
    assert decoder.route_name == "torch-reference"
    decoder.plan(c.batch)
    out = None
    if c.poison_out:
        out = torch.full((c.query.shape[0], c.spec.num_heads, c.spec.kv_lora_rank),
                         float("nan"), dtype=decoder.output_dtype)
    got = decoder.run(c.query, c.kv_cache, out=out, scales=c.scales)
    if out is not None and got.data_ptr() != out.data_ptr():
        return "run() did not return the out buffer it was given", math.inf
    if got.dtype != decoder.output_dtype:
        return f"output dtype {got.dtype}, expected {decoder.output_dtype}", math.inf
    if not torch.isfinite(got).all():
        return "non-finite output (NaN poison left or overflow)", math.inf
    ref = oracle(c)
    err = (got.to(torch.float64) - ref).abs()
    scale = ref.abs().max().item()
    bound = RTOL[got.dtype] * ref.abs() + ATOL * scale
    worst = (err / bound).max().item()
    if worst > 1.0:
        return (f"error over bound: max|err|={err.max().item():.3e}, max|ref|={scale:.3e}, "
                f"worst err/bound={worst:.2f}"), worst
    return None, worst


def _seeds() -> list[int]:
    forced = os.environ.get("MLA_SWEEP_SEEDS")
    if forced:
        return [int(s) for s in forced.split(",")]
    return list(range(FIRST_SEED, FIRST_SEED + NUM_CONFIGS))


def test_reference_route_randomized_sweep() -> None:
    seeds = _seeds()
    failures, ran = [], 0
    features: set[str] = set()
    margin: dict[str, float] = {}
    for seed in seeds:
        c = make_config(seed)
        problem, ratio = check(c)
        ran += 1
        key = f"q={c.spec.q_dtype} kv={c.spec.kv_dtype}".replace("torch.", "")
        margin[key] = max(margin.get(key, 0.0), ratio)
        features.add(c.desc.split(" table=")[1].split("/")[0])
        features.add(f"q={c.spec.q_dtype}")
        if problem is not None:
            failures.append(f"{c.desc}\n    -> {problem}")
    print(f"torch-reference sweep: {ran} configurations run, {len(failures)} failed")
    for key, ratio in sorted(margin.items()):
        print(f"  {key}: worst err/bound {ratio:.3f}")
    assert not failures, (
        f"{len(failures)} of {ran} configurations failed (rerun one with "
        f"MLA_SWEEP_SEEDS=<seed>):\n" + "\n".join(failures[:20])
    )
    assert ran == len(seeds)
    if "MLA_SWEEP_SEEDS" not in os.environ:
        assert ran >= 500
        # The sweep really covered what it claims (guards against a sampler regression).
        assert {"scattered", "shared-prefix", "random-reuse"} <= features
        assert {f"q={t}" for t in (torch.float32, torch.bfloat16, torch.float16, FP8)} <= features
