"""The CUDA split-KV kernel's fragment addressing, checked on the CPU: the kernel's own
address helpers (host-compiled from ``splitk_mla_decode.cu`` by
``tests/cuda/splitk_fragment_harness.cu``) drive a model of the PTX instructions the kernel
issues, and one tile's scores and output must equal numpy's ``Q K^T`` and ``P V``.

The model follows the PTX ISA's fragment layouts (lane = 4 * group + t):
* ``ldmatrix.m8n8.x4.b16``: lanes 8j..8j+7 give the row addresses of matrix j; lane l gets,
  from each matrix, the 32-bit word ``l % 4`` of row ``l / 4``. With ``.trans`` it gets the
  16-bit elements (row 2(l % 4), column l / 4) and (row 2(l % 4) + 1, column l / 4).
* ``mma.m16n8k16.row.col``: A[g][2t + e] = a0, A[g + 8][..] = a1, A[g][2t + 8 + e] = a2,
  A[g + 8][2t + 8 + e] = a3; B[2t + e][g] = b0, B[2t + 8 + e][g] = b1; C[g][2t + e] = c0/c1,
  C[g + 8][2t + e] = c2/c3 (e = 0, 1: the two 16-bit halves, low first).
Shared memory holds the id of the value stored in each 16-bit slot (each byte for FP8
caches), so a misplaced address shows as a wrong product, not as a coincidence of values.
FP8 caches add ``cvt.rn.f16x2.e4m3x2`` (low byte to the low half) and ``prmt`` (PTX byte
selectors, as ``__byte_perm``); e4m3 widens to fp16 exactly, so values are tracked as is.
"""

from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from trtllm_mla_plugin.ops.kernels import nvcc_build

HARNESS = Path(__file__).with_name("cuda") / "splitk_fragment_harness.cu"
NVCC = nvcc_build.find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
TOKENS, DIMS, LATENT = 32, 576, 512


@pytest.fixture(scope="module")
def addresses(tmp_path_factory) -> dict[str, list[list[int]]]:
    exe = tmp_path_factory.mktemp("frag") / "harness"
    subprocess.run([NVCC, *nvcc_build.target_flags((9, 0)), "-DSPLITK_SCHEDULE_ONLY", "-O1",
                    "-std=c++17", "-o", str(exe), str(HARNESS)], check=True,
                   capture_output=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    table: dict[str, list[list[int]]] = defaultdict(list)
    for line in out.splitlines():
        kind, *vals = line.split()
        table[kind].append([int(v) for v in vals])
    return table


def _shared_tile(writes: list[list[int]]) -> np.ndarray:
    """16-bit slots of one stage -> id ``token * DIMS + dim`` of the value cp.async put there
    (-1: never written)."""
    slots = np.full(TOKENS * DIMS, -1, dtype=np.int64)
    for row, chunk, offset in writes:
        assert offset % 16 == 0
        for e in range(8):
            assert slots[offset // 2 + e] == -1, "two copies write one slot"
            slots[offset // 2 + e] = row * DIMS + chunk * 8 + e
    return slots


def _ldmatrix(slots: np.ndarray, row_addr: list[int], trans: bool) -> np.ndarray:
    """[32 lanes, 4 matrices, 2 halves] value ids."""
    got = np.empty((32, 4, 2), dtype=np.int64)
    for lane in range(32):
        for j in range(4):
            if trans:
                for e in range(2):
                    got[lane, j, e] = slots[row_addr[8 * j + 2 * (lane % 4) + e] // 2 + lane // 4]
            else:
                base = row_addr[8 * j + lane // 4] // 2 + 2 * (lane % 4)
                got[lane, j] = slots[base: base + 2]
    return got


def _mma(a: np.ndarray, b0: np.ndarray, b1: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a [32, 4, 2], b0/b1 [32, 2], c [32, 4] values -> d [32, 4]."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a[lane, 0, e], a[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a[lane, 2, e], a[lane, 3, e]
            B[2 * t + e, g], B[2 * t + 8 + e, g] = b0[lane, e], b1[lane, e]
            C[g, 2 * t + e], C[g + 8, 2 * t + e] = c[lane, e], c[lane, 2 + e]
    D = A @ B + C
    d = np.empty((32, 4))
    for lane in range(32):
        g, t = divmod(lane, 4)
        d[lane, :2], d[lane, 2:] = D[g, 2 * t: 2 * t + 2], D[g + 8, 2 * t: 2 * t + 2]
    return d


def _query_a(q: np.ndarray, qdim: dict, wq: int, ks: int, second: int) -> np.ndarray:
    """A fragment [32, 4, 2] of the query for warp quarter wq, k-step ks: pairs at the
    harness's dims d (a0, a1) and d + ``second`` (a2, a3)."""
    a = np.empty((32, 4, 2))
    for lane in range(32):
        g, t = divmod(lane, 4)
        d = qdim[wq, ks, t]
        a[lane] = [q[g, d: d + 2], q[g + 8, d: d + 2], q[g, d + second: d + second + 2],
                   q[g + 8, d + second: d + second + 2]]
    return a


def _score_matrix(s: np.ndarray, addresses: dict) -> np.ndarray:
    """Score fragments [4 n-tiles, 32, 4] -> [16 rows, TOKENS] by the kernel's tokens."""
    token = {(n, t, e): tok for n, t, e, tok in addresses["F"]}
    scores = np.full((16, TOKENS), np.nan)
    for n in range(4):
        for lane in range(32):
            g, t = divmod(lane, 4)
            for e in range(4):
                scores[g + 8 * (e // 2), token[n, t, e]] = s[n, lane, e]
    return scores


def _p_fragment(p: np.ndarray, kk: int) -> np.ndarray:
    """A fragment of P for token k-step kk, from the score fragments (as the kernel packs)."""
    return np.stack([p[2 * kk][:, :2], p[2 * kk][:, 2:], p[2 * kk + 1][:, :2],
                     p[2 * kk + 1][:, 2:]], axis=1)


def _by_call(rows: list[list[int]], key_len: int) -> dict[tuple, list[int]]:
    """Harness rows (key..., lane, offset) -> per key, the 32 lanes' offsets."""
    calls: dict[tuple, list[int]] = defaultdict(list)
    for row in rows:
        calls[tuple(row[:key_len])].append(row[-1])
    return calls


def test_one_tile_of_scores_and_output_equals_numpy(addresses):
    rng = np.random.default_rng(7)
    kv = rng.standard_normal((TOKENS, DIMS))
    q = rng.standard_normal((16, DIMS))
    slots = _shared_tile(addresses["W"])
    assert (slots >= 0).all(), "some slots of the stage are never written"
    value = kv.reshape(-1)

    qdim = {(wq, ks, t): d for wq, ks, t, d in addresses["Q"]}
    kaddr = _by_call(addresses["K"], 3)
    # Scores: each warp quarter its 144 dims, then summed over the four warps.
    s = np.zeros((4, 32, 4))
    for wq in range(4):
        for ks in range(9):
            a = _query_a(q, qdim, wq, ks, 8)
            for np_ in range(2):
                b = value[_ldmatrix(slots, kaddr[wq, ks, np_], trans=False)]
                s[2 * np_] = _mma(a, b[:, 0], b[:, 1], s[2 * np_])
                s[2 * np_ + 1] = _mma(a, b[:, 2], b[:, 3], s[2 * np_ + 1])
    scores = _score_matrix(s, addresses)
    np.testing.assert_allclose(scores, q @ kv.T, rtol=1e-12, atol=1e-10)

    # Output: P (any function of the score fragments) times V, each warp its 128 columns.
    p = np.tanh(s)
    vaddr = _by_call(addresses["V"], 3)
    column = {(wq, n, t): c for wq, n, t, c in addresses["O"]}
    out = np.full((16, LATENT), np.nan)
    for wq in range(4):
        o = np.zeros((16, 32, 4))
        for kk in range(2):
            pa = _p_fragment(p, kk)
            for n2 in range(8):
                b = value[_ldmatrix(slots, vaddr[wq, kk, n2], trans=True)]
                o[2 * n2] = _mma(pa, b[:, 0], b[:, 1], o[2 * n2])
                o[2 * n2 + 1] = _mma(pa, b[:, 2], b[:, 3], o[2 * n2 + 1])
        for n in range(16):
            for lane in range(32):
                g, t = divmod(lane, 4)
                c = column[wq, n, t]
                out[g, c: c + 2], out[g + 8, c: c + 2] = o[n, lane, :2], o[n, lane, 2:]
    np.testing.assert_allclose(out, np.tanh(scores) @ kv[:, :LATENT], rtol=1e-12, atol=1e-10)


def test_ldmatrix_reads_hit_eight_bank_groups(addresses):
    """Eight lanes of one ldmatrix phase read 16 bytes each: conflict-free when the eight
    addresses fall in eight different 16-byte groups of a 128-byte bank line."""
    for kind in ("K", "V"):
        for offs in _by_call(addresses[kind], 3).values():
            for j in range(4):
                groups = {(off // 16) % 8 for off in offs[8 * j: 8 * j + 8]}
                assert len(groups) == 8, (kind, offs[8 * j: 8 * j + 8])


def _shared_tile8(writes: list[list[int]]) -> np.ndarray:
    """Bytes of one FP8 stage -> value id ``token * DIMS + dim`` (-1: never written)."""
    slots = np.full(TOKENS * DIMS, -1, dtype=np.int64)
    for row, chunk, offset in writes:
        assert offset % 16 == 0
        for e in range(16):
            assert slots[offset + e] == -1, "two copies write one byte"
            slots[offset + e] = row * DIMS + chunk * 16 + e
    return slots


def _ldmatrix8(slots: np.ndarray, row_addr: list[int], trans: bool) -> np.ndarray:
    """ldmatrix over FP8 bytes: [32 lanes, 4 matrices, 4 bytes] value ids, byte 0 lowest."""
    got = np.empty((32, 4, 4), dtype=np.int64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(4):
            if trans:  # 16-bit elements (row 2t, column g) and (row 2t + 1, column g)
                for e in range(2):
                    base = row_addr[8 * j + 2 * t + e] + 2 * g
                    got[lane, j, 2 * e: 2 * e + 2] = slots[base: base + 2]
            else:
                base = row_addr[8 * j + g] + 4 * t
                got[lane, j] = slots[base: base + 4]
    return got


def _byte_perm(word: np.ndarray, selector: int) -> np.ndarray:
    """``__byte_perm(word, 0, selector)`` on [..., 4] byte ids (selectors 0-3 only)."""
    return np.stack([word[..., (selector >> (4 * i)) & 0xF] for i in range(4)], axis=-1)


def test_fp8_tile_scores_and_output_equal_numpy(addresses):
    rng = np.random.default_rng(8)
    kv = rng.standard_normal((TOKENS, DIMS))
    q = rng.standard_normal((16, DIMS))
    slots = _shared_tile8(addresses["W8"])
    assert (slots >= 0).all(), "some bytes of the stage are never written"
    value = kv.reshape(-1)
    qdim = {(wq, ks, t): d for wq, ks, t, d in addresses["Q8"]}
    kaddr = _by_call(addresses["K8"], 2)
    s = np.zeros((4, 32, 4))
    for wq in range(4):
        for ks in range(9):
            a = _query_a(q, qdim, wq, ks, 2)
            w = value[_ldmatrix8(slots, kaddr[wq, ks], trans=False)]
            for j in range(4):  # b0 = bytes 0-1 (low 16 bits), b1 = bytes 2-3
                s[j] = _mma(a, w[:, j, 0:2], w[:, j, 2:4], s[j])
    scores = _score_matrix(s, addresses)
    np.testing.assert_allclose(scores, q @ kv.T, rtol=1e-12, atol=1e-10)

    p = np.tanh(s)
    vaddr = _by_call(addresses["V8"], 3)
    column = {(wq, cc, t): c for wq, cc, t, c in addresses["O8"]}
    out = np.full((16, LATENT), np.nan)
    for wq in range(4):
        o = np.zeros((16, 32, 4))
        for kk in range(2):
            pa = _p_fragment(p, kk)
            for cp in range(4):
                w = _byte_perm(_ldmatrix8(slots, vaddr[wq, kk, cp], trans=True),
                               addresses["P"][0][0])
                w = value[w]
                for half in range(2):
                    lo, hi = w[:, 2 * half], w[:, 2 * half + 1]
                    cc = cp * 2 + half
                    o[2 * cc] = _mma(pa, lo[:, 0:2], hi[:, 0:2], o[2 * cc])
                    o[2 * cc + 1] = _mma(pa, lo[:, 2:4], hi[:, 2:4], o[2 * cc + 1])
        for cc in range(8):
            even, odd = o[2 * cc], o[2 * cc + 1]
            for lane in range(32):
                g, t = divmod(lane, 4)
                c = column[wq, cc, t]
                out[g, c: c + 4] = [even[lane, 0], odd[lane, 0], even[lane, 1], odd[lane, 1]]
                out[g + 8, c: c + 4] = [even[lane, 2], odd[lane, 2], even[lane, 3],
                                        odd[lane, 3]]
    np.testing.assert_allclose(out, np.tanh(scores) @ kv[:, :LATENT], rtol=1e-12, atol=1e-10)


def test_fp8_ldmatrix_reads_hit_eight_bank_groups(addresses):
    for kind, key_len in (("K8", 2), ("V8", 3)):
        for offs in _by_call(addresses[kind], key_len).values():
            for j in range(4):
                groups = {(off // 16) % 8 for off in offs[8 * j: 8 * j + 8]}
                assert len(groups) == 8, (kind, offs[8 * j: 8 * j + 8])
