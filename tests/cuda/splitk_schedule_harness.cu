// Host program over the split-KV kernel's schedule helpers (compiled from the kernel's own
// source; nothing runs on a GPU). Reads `num_ctas min_tiles batch` and `batch` tile counts
// from stdin; prints the ranges, every partial the decode CTAs write ("W request slot") and
// every partial the combine reads ("R request slot"). tests/test_splitk_kernel_cpu.py
// checks these against a brute-force walk.
#include <cstdio>
#include <vector>

#include "../../trtllm_mla_plugin/ops/kernels/cuda/splitk_mla_decode.cu"

int main() {
  int num_ctas, min_tiles, batch;
  if (std::scanf("%d %d %d", &num_ctas, &min_tiles, &batch) != 3) return 2;
  std::vector<int> prefix(batch + 1, 0);
  for (int i = 0; i < batch; ++i) {
    int tiles;
    if (std::scanf("%d", &tiles) != 1) return 2;
    prefix[i + 1] = prefix[i] + tiles;
  }
  const int total = prefix[batch];
  if (total <= 0) return 0;
  const int active = active_ctas(total, num_ctas, min_tiles);
  std::printf("active %d\n", active);
  for (int c = 0; c < active; ++c) {
    const int start = range_start(c, total, active), end = range_start(c + 1, total, active);
    std::printf("range %d %d %d\n", c, start, end);
    // The decode kernel's walk: a segment ends where the range or the request ends.
    int req = 0;
    while (prefix[req + 1] <= start) ++req;
    int seg_first = start;
    for (int x = start; x <= end; ++x) {
      if (x == end || (x != start && x == prefix[req + 1])) {
        const bool whole = seg_first == prefix[req] && x == prefix[req + 1];
        if (!whole) std::printf("W %d %d\n", req, partial_slot(c, seg_first, start));
        if (x == end) break;
        while (prefix[req + 1] <= x) ++req;
        seg_first = x;
      }
    }
  }
  for (int i = 0; i < batch; ++i) {
    const int first = prefix[i], tiles = prefix[i + 1] - first;
    if (tiles <= 0) continue;
    const int c_first = cta_of(first, total, active);
    const int splits = cta_of(first + tiles - 1, total, active) - c_first + 1;
    if (splits <= 1) continue;
    for (int s = 0; s < splits; ++s)
      std::printf("R %d %d\n", i, split_slot(s, c_first, first, total, active));
  }
  return 0;
}
