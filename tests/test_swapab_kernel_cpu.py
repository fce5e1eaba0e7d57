"""The swap-AB Triton decode kernel (``ops.kernels.swapab_mla_decode``) without a GPU: its
arithmetic under Triton's CPU interpreter against float64 torch math, on small latent
dims (Dc 64, Dr 16, pages of 16), ragged lengths, scattered pages, q_len 1 and 3, head
tiling, requests cut by split borders, TMA and pointer KV loads.

The interpreter must be on before the kernel module is imported, and other tests import it
compiled, so the cases run in a subprocess: this file executed as a script.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
DC, DR, PAGE, SCALE = 64, 16, 16, 0.3
TOL = 1e-5


def float64_decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor,
                   lens: list[int], q_lens: list[int]) -> torch.Tensor:
    """Independent oracle: ``q [rows, heads, Dc + Dr]`` (rows grouped per request),
    ``kv [blocks, page, Dc + Dr]`` -> ``[rows, heads, Dc]`` float64; query token ``i`` of a
    request with ``L`` keys and ``n`` tokens sees keys ``< L - n + i + 1``."""
    out = []
    row = 0
    for b, (length, n) in enumerate(zip(lens, q_lens, strict=True)):
        pages = -(-length // PAGE)
        keys = kv[table[b, :pages].long()].reshape(-1, DC + DR)[:length].double()
        for i in range(n):
            seen = keys[: length - n + i + 1]
            scores = torch.einsum("hd,sd->hs", q[row].double(), seen) * SCALE
            out.append(torch.softmax(scores, -1) @ seen[:, :DC])
            row += 1
    return torch.stack(out)


def make_inputs(lens: list[int], q_lens: list[int], heads: int, seed: int,
                junk: float) -> tuple[torch.Tensor, ...]:
    """Pages scattered over a shuffled pool; slots past each request's length (and unused
    pages) hold ``junk``: NaN for masked pointer loads, a large finite value for TMA tiles
    (which read whole pages)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in lens]
    blocks = sum(need) + 3
    perm = torch.randperm(blocks, generator=gen).to(torch.int32)
    table = torch.full((len(lens), max(need) + 2), int(perm[-1]), dtype=torch.int32)
    kv = torch.full((blocks, PAGE, DC + DR), junk)
    start = 0
    for b, (n, length) in enumerate(zip(need, lens, strict=True)):
        table[b, :n] = perm[start:start + n]
        rows = torch.randn(n * PAGE, DC + DR, generator=gen)
        rows[length:] = junk
        kv[perm[start:start + n].long()] = rows.view(n, PAGE, DC + DR)
        start += n
    q = torch.randn(sum(q_lens), heads, DC + DR, generator=gen)
    return q, kv, table


def run_case(lens: list[int], q_lens: int | list[int], heads: int, splits: int,
             seed: int = 0, k_scale: float | None = None, **config) -> float:
    """Relative error of one decode (``q_lens`` int: a 4-D query; list: 3-D + offsets).
    ``k_scale``: the cache is stored in FP8 (e4m3, value / k_scale) and read with it."""
    from trtllm_mla_plugin.ops.kernels.swapab_mla_decode import (
        launch_config,
        swapab_mla_decode,
    )

    per_req = q_lens if isinstance(q_lens, list) else [q_lens] * len(lens)
    cfg = launch_config(heads, max(per_req), PAGE, **{"block_n": PAGE, **config})
    q, kv, table = make_inputs(lens, per_req, heads, seed,
                               junk=1.0e4 if cfg.use_tma else float("nan"))
    scale = {}
    if k_scale is not None:
        # The reference reads the same stored values, dequantised: the kernel's own error.
        kv = (kv / k_scale).to(torch.float8_e4m3fn)
        scale = {"k_scale": k_scale}
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = torch.full((q.shape[0], heads, DC), float("nan"))
    if isinstance(q_lens, list):
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(per_req), 0)
        swapab_mla_decode(q, kv, table, lens_t, SCALE, out, cu_seqlens_q=cu,
                          kv_lora_rank=DC, num_splits=splits, config=cfg, **scale)
    else:
        b = len(lens)
        swapab_mla_decode(q.view(b, q_lens, heads, -1), kv, table, lens_t, SCALE,
                          out.view(b, q_lens, heads, DC), kv_lora_rank=DC,
                          num_splits=splits, config=cfg, **scale)
    if k_scale is not None:
        kv = kv.double() * k_scale
    ref = float64_decode(q, kv, table, lens, per_req)
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES: list[tuple[str, dict]] = [
    ("ragged q1, requests cut by splits", dict(lens=[5, 40, 17, 100], q_lens=1, heads=16,
                                               splits=5)),
    ("ragged q3 (padded to 4, 2 head tiles)", dict(lens=[7, 70, 33], q_lens=3, heads=16,
                                                   splits=4)),
    ("ragged query lengths, 3-D query", dict(lens=[64, 200, 9, 4], q_lens=[1, 3, 2, 4],
                                             heads=16, splits=7)),
    ("32 heads, one request over all splits", dict(lens=[150], q_lens=1, heads=32,
                                                   splits=6)),
    ("20 heads (padded head tile), q3", dict(lens=[30, 90], q_lens=3, heads=20, splits=3)),
    ("more splits than pages", dict(lens=[1, 2, 3], q_lens=1, heads=16, splits=8)),
    ("pointer loads, NaN past lengths", dict(lens=[5, 40, 17, 100], q_lens=3, heads=16,
                                             splits=5, use_tma=False)),
    ("pointer loads, tiles of two pages", dict(lens=[50, 7, 129], q_lens=1, heads=16,
                                               splits=4, use_tma=False, block_n=2 * PAGE)),
    ("one CTA (no partials)", dict(lens=[40, 3], q_lens=1, heads=16, splits=1)),
    ("FP8 cache with a scale, TMA, q3", dict(lens=[5, 40, 17, 100], q_lens=3, heads=16,
                                             splits=5, k_scale=0.05)),
    ("FP8 cache, pointer loads, 3-D query", dict(lens=[64, 200, 9, 4], q_lens=[1, 3, 2, 4],
                                                 heads=16, splits=7, k_scale=2.0,
                                                 use_tma=False)),
]


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    failed = 0
    for name, kw in CASES:
        err = run_case(seed=len(name), **kw)
        ok = err < TOL  # NaN fails
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err {err:.2e}")
    print(f"{failed} of {len(CASES)} cases above {TOL:g}")
    return 1 if failed else 0


def test_swapab_kernel_matches_float64_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE)], env=env, capture_output=True,
                          text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert f"0 of {len(CASES)} cases above" in proc.stdout


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    sys.exit(main())
