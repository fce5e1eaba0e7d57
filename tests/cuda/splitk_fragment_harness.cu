// Host program over the split-KV kernel's address helpers (compiled from the kernel's own
// source; nothing runs on a GPU). Prints, for one tile and one row group (4 warps), every
// address the kernel computes: cp.async writes, query fragment dims, ldmatrix row
// addresses for the scores and the output, score fragment tokens and output columns.
// tests/test_splitk_fragments_cpu.py runs them through a model of ldmatrix and mma.sync.
#include <cstdio>

#include "../../trtllm_mla_plugin/ops/kernels/cuda/splitk_mla_decode.cu"

int main() {
  const int threads = 128;
  for (int tid = 0; tid < threads; ++tid)
    for (int pass = 0; pass < kTile / (threads / 8); ++pass)
      for (int k = 0; k < kChunks / 8; ++k) {
        const int row = load_row(pass, tid, threads), chunk = load_chunk(tid, k);
        std::printf("W %d %d %d\n", row, chunk, stage_offset(row, chunk));
      }
  for (int wq = 0; wq < 4; ++wq)
    for (int ks = 0; ks < 9; ++ks)
      for (int t = 0; t < 4; ++t) std::printf("Q %d %d %d %d\n", wq, ks, t, query_dim(wq, ks, t));
  for (int wq = 0; wq < 4; ++wq)
    for (int ks = 0; ks < 9; ++ks)
      for (int np = 0; np < 2; ++np)
        for (int lane = 0; lane < 32; ++lane)
          std::printf("K %d %d %d %d %d\n", wq, ks, np, lane,
                      stage_offset(score_token(lane, np), score_chunk(lane, wq, ks)));
  for (int n = 0; n < 4; ++n)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 4; ++e) std::printf("F %d %d %d %d\n", n, t, e, fragment_token(n, t, e));
  for (int wq = 0; wq < 4; ++wq)
    for (int kk = 0; kk < 2; ++kk)
      for (int n2 = 0; n2 < 8; ++n2)
        for (int lane = 0; lane < 32; ++lane)
          std::printf("V %d %d %d %d %d\n", wq, kk, n2, lane,
                      stage_offset(value_token(lane, kk), value_chunk(lane, wq, n2)));
  for (int wq = 0; wq < 4; ++wq)
    for (int n = 0; n < 16; ++n)
      for (int t = 0; t < 4; ++t) std::printf("O %d %d %d %d\n", wq, n, t, output_column(wq, n, t));
  // FP8 caches: one byte per element.
  std::printf("P %u\n", kEvenOddBytes);
  for (int row = 0; row < kTile; ++row)
    for (int chunk = 0; chunk < kChunks8; ++chunk)
      std::printf("W8 %d %d %d\n", row, chunk, stage_offset8(row, chunk));
  for (int wq = 0; wq < 4; ++wq)
    for (int ks = 0; ks < 9; ++ks)
      for (int t = 0; t < 4; ++t)
        std::printf("Q8 %d %d %d %d\n", wq, ks, t, query_dim8(wq, ks, t));
  for (int wq = 0; wq < 4; ++wq)
    for (int ks = 0; ks < 9; ++ks)
      for (int lane = 0; lane < 32; ++lane)
        std::printf("K8 %d %d %d %d\n", wq, ks, lane, stage_offset8(lane, score_chunk8(wq, ks)));
  for (int wq = 0; wq < 4; ++wq)
    for (int kk = 0; kk < 2; ++kk)
      for (int cp = 0; cp < 4; ++cp)
        for (int lane = 0; lane < 32; ++lane)
          std::printf("V8 %d %d %d %d %d\n", wq, kk, cp, lane,
                      stage_offset8(value_token(lane, kk), value_chunk8(lane, wq, cp)));
  for (int wq = 0; wq < 4; ++wq)
    for (int cc = 0; cc < 8; ++cc)
      for (int t = 0; t < 4; ++t)
        std::printf("O8 %d %d %d %d\n", wq, cc, t, output_column8(wq, cc, t));
  return 0;
}
