// Page-balanced split-KV MLA decode for SM80+ (written for SM90): a bf16 or fp16 query
// over a cache of the same dtype or of FP8 e4m3.
//
// Why this kernel: on the H200 every peer (FlashMLA, FlashInfer FA3, vLLM's FA3 MLA) pads
// the query rows of one request (heads x query tokens) to a 64-row tile, so with 16 heads a
// CTA multiplies four times the rows it needs, and each adds fixed costs (a scheduling
// kernel, a combine kernel) that dominate typical decode shapes (docs/benchmarks-history.md,
// "Issue 11"). Here a warp's mma.sync m16n8k16 tile has exactly 16 rows, the schedule is
// computed inside the kernel from a [batch + 1] tile prefix sum (one torch.cumsum per step,
// shared by every layer), and a request that lies inside one CTA's range is written
// straight to the output; only cut requests go through the combine kernel.
//
// Layout (elements):
//   q            latent part of query row (token, head) at q + token * q_token_stride +
//                head * q_head_stride, 512 elements; bf16 or fp16. Rows of a request:
//                qt * heads + h. The rope part (64) at q_rope with its own two strides:
//                vLLM hands the two parts apart (the rope a strided view of its projection),
//                and a joined [num_tokens, heads, 576] query is q_rope = q + 512, the same
//                strides. Row bases and strides keep 8-byte alignment (FP8 caches load the
//                query 4 elements at a time).
//   kv           page p at kv + p * kv_page_stride, [page_size, 576] per page, q's dtype
//                or FP8 e4m3 (scores scaled by q_scale * k_scale, output by v_scale)
//   block_table  [batch, bt_stride] int32
//   seq_lens     [batch] int32 (tokens in the cache, this step's query tokens included)
//   cu_q         [batch + 1] int32 query-token offsets
//   tile_prefix  [batch + 1] int32 prefix sums of ceil(seq_len / 32)
//   out          [num_tokens, heads, 512] q's dtype
//   part_o       [head_blocks, 2 * num_ctas, ROWS, 512] fp32, partial output / softmax sum
//   part_lse     [head_blocks, 2 * num_ctas, ROWS] fp32, log2-sum-exp of the partial
//   merge_count  [head_blocks, 1024] int32, zero between launches (SPLITK_FUSE_MAX_SPLITS)
//
// Schedule: the batch's 32-token tiles are laid end to end and cut into `active` equal
// ranges (`active` = min(num_ctas, ceil(T / min_tiles))); CTA c reads tiles
// [c*T/active, (c+1)*T/active). A CTA cuts at most two requests (its first and its last),
// whose partials go to slots 2c and 2c+1, merged by the combine kernel; built with
// SPLITK_FUSE_MAX_SPLITS=K > 0, a request cut into at most K pieces is merged instead by
// the decode CTA that finishes its piece last (a counter per request and head block), so
// the combine kernel has nothing to wait for unless a request is cut more ways. Query row r of a request with L keys and n query
// tokens sees keys < L - n + r / heads + 1 (bottom-right causal).
//
// No headers: the source compiles the same under nvcc and NVRTC, and, with SPLITK_EMULATE,
// as host C++ in the CPU emulator of the tests.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

namespace {

constexpr int kLatent = 512;
constexpr int kHeadDim = 576;
constexpr int kTile = 32;                     // KV tokens per pipeline stage
constexpr int kChunks = kHeadDim / 8;         // 16-byte chunks per cache row (72)
constexpr int kRowBytes = kHeadDim * 2;       // 1152
constexpr int kTileBytes = kTile * kRowBytes; // 36864
constexpr int kMaxBatch = 1024;
// FP8 (e4m3) caches: one byte per element.
constexpr int kRowBytes8 = kHeadDim;             // 576
constexpr int kChunks8 = kHeadDim / 16;          // 36
constexpr int kTileBytes8 = kTile * kRowBytes8;  // 18432
// Combine: requests cut into more than kHeavySplits pieces get kHelperParts helper items.
constexpr int kHeavySplits = 16;
constexpr int kHelperParts = 16;
// Combine CTAs per SM the registers must allow, by row groups: one row group fits four in
// 128 registers without spilling (the helper path would otherwise take it to 164 and three),
// two fit three in 167.
constexpr int kCombineCtasPerSm[3] = {0, 4, 3};

}  // namespace

struct SplitKParams {
  const u16* q;
  const u16* kv;
  const int* block_table;
  const int* seq_lens;
  const int* cu_q;
  const int* tile_prefix;
  u16* out;
  float* part_o;
  float* part_lse;
  i64 kv_page_stride;
  int bt_stride;
  int batch;
  int heads;
  int page_size;
  int num_ctas;
  int min_tiles;
  float scale_log2;  // score -> log2 units: softmax scale * log2(e); FP8 caches: q_scale * k_scale
  float q_prescale;  // FP8 caches: the query is multiplied by this (softmax scale * log2(e))
  float out_scale;   // output multiplier: v_scale for FP8 caches, else 1
  int* merge_count;  // per (head block, request): pieces finished (SPLITK_FUSE_MAX_SPLITS)
  const u16* q_rope;  // the query's rope part (see the layout above)
  int q_token_stride;  // query strides, in elements
  int q_head_stride;
  int q_rope_token_stride;
  int q_rope_head_stride;
};

// Requests cut into at most this many pieces are merged inside the decode grid (0: all by
// the combine kernel).
#ifndef SPLITK_FUSE_MAX_SPLITS
#define SPLITK_FUSE_MAX_SPLITS 0
#endif
// Heavy requests (cut into more than kHeavySplits pieces, e.g. one long request among short
// ones): the first SPLITK_HELPED_REQUESTS of them in batch order are merged by kHelperParts
// combine items each instead of four (0: none).
#ifndef SPLITK_HELPED_REQUESTS
#define SPLITK_HELPED_REQUESTS 4
#endif

namespace {

// The hardware primitives. A CPU emulation of the kernel (tests/cuda/splitk_emulator.cpp)
// defines SPLITK_EMULATE and brings its own, with the same names and PTX semantics.
#ifndef SPLITK_EMULATE
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// d += a (16x16, row) * b (16x8, col), 16-bit floats in (bf16 or fp16), fp32 accumulate.
template <bool FP16>
__device__ __forceinline__ void mma16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (FP16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats to a 16-bit pair (bf16 or fp16), `lo` in the low half (the lower address).
template <bool FP16>
__device__ __forceinline__ u32 pack16(float lo, float hi) {
  u32 r;
  if constexpr (FP16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// Two e4m3 values (low byte first) to an fp16 pair, exactly.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 pair) {
  u32 r;
  const u16 bits = static_cast<u16>(pair);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(bits));
  return r;
}

template <bool FP16>
__device__ __forceinline__ float to_float(u32 bits16) {
  if constexpr (FP16) {
    float f;
    const u16 h = static_cast<u16>(bits16);
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
  } else {
    return __uint_as_float(bits16 << 16);
  }
}

// Programmatic dependent launch (SM90): the decode grid lets the combine grid start early;
// the combine waits for the decode grid to finish and its writes to be visible. Both are
// no-ops when the combine is launched without the attribute.
__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
}
__device__ __forceinline__ void wait_for_prior_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
#endif  // SPLITK_EMULATE

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The schedule, shared by both kernels and host-compiled by the CPU tests
// (tests/test_splitk_kernel_cpu.py): CTAs that get tiles, the first tile of CTA c, the CTA
// holding tile x, and where partial results go.
__host__ __device__ __forceinline__ int active_ctas(int total, int num_ctas, int min_tiles) {
  const int want = (total + min_tiles - 1) / min_tiles;
  return want < 1 ? 1 : (want < num_ctas ? want : num_ctas);
}
__host__ __device__ __forceinline__ int range_start(int c, int total, int active) {
  return static_cast<int>(static_cast<i64>(c) * total / active);
}
// The largest c with range_start(c) <= x.
__host__ __device__ __forceinline__ int cta_of(int x, int total, int active) {
  return static_cast<int>((static_cast<i64>(x + 1) * active - 1) / total);
}
// Slot of the partial that CTA c (range starting at `start`) leaves for the request whose
// tiles inside the range begin at `seg_first`: 2c for the request the range starts in,
// 2c + 1 for the one it ends in.
__host__ __device__ __forceinline__ int partial_slot(int c, int seg_first, int start) {
  return 2 * c + (seg_first == start ? 0 : 1);
}
// Slot of split s of a request whose tiles start at `first`, held first by CTA `c_first`:
// split 0 begins at `first`, later splits begin their CTA's range.
__host__ __device__ __forceinline__ int split_slot(int s, int c_first, int first, int total,
                                                   int active) {
  const int c = c_first + s;
  const int start = range_start(c, total, active);
  return partial_slot(c, s == 0 ? first : start, start);
}

// Query row `rr` of a request whose first query token is `tok0` (token tok0 + rr / heads,
// head rr % heads): where its latent and rope parts start; `at` gives query dim d's address.
struct QueryRow {
  const u16* latent;
  const u16* rope;
  __host__ __device__ __forceinline__ const u16* at(int d, bool in_rope) const {
    return in_rope ? rope + (d - kLatent) : latent + d;
  }
};
__host__ __device__ __forceinline__ QueryRow query_row(const SplitKParams& p, int tok0,
                                                       int rr) {
  const i64 tok = tok0 + rr / p.heads, head = rr % p.heads;
  return {p.q + tok * p.q_token_stride + head * p.q_head_stride,
          p.q_rope + tok * p.q_rope_token_stride + head * p.q_rope_head_stride};
}

// Where a tile's 16-byte chunks sit in shared memory and which ones each lane hands to
// ldmatrix: host-compiled by the CPU tests, which run them through a model of ldmatrix and
// mma.sync (tests/test_splitk_fragments_cpu.py). Rows of 1152 bytes put every row at the
// same banks; XOR-ing the chunk with row % 8 spreads 8 rows over 8 bank groups.
__host__ __device__ __forceinline__ int stage_offset(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}
// cp.async: thread `tid` of `threads` copies, in pass `pass`, row load_row(...) and chunks
// load_chunk(tid, k) for k < kChunks / 8 (8 threads per row: 128-byte runs per row).
__host__ __device__ __forceinline__ int load_row(int pass, int tid, int threads) {
  return pass * (threads / 8) + (tid >> 3);
}
__host__ __device__ __forceinline__ int load_chunk(int tid, int k) { return (tid & 7) + 8 * k; }
// Element index (in the 576 dims) of the first of the two query values in A-fragment
// register a0 / a1 of lane quad position t, for warp quarter wq and k-step ks (a2 / a3:
// 8 further).
__host__ __device__ __forceinline__ int query_dim(int wq, int ks, int t) {
  return wq * 144 + ks * 16 + 2 * t;
}
// Scores: the cache row (token in the tile) and chunk whose address `lane` gives to
// ldmatrix.x4 for k-step ks and token half np (16 tokens: n-tiles 2np and 2np + 1).
__host__ __device__ __forceinline__ int score_token(int lane, int np) {
  return np * 16 + (lane & 7) + ((lane >> 4) << 3);
}
__host__ __device__ __forceinline__ int score_chunk(int lane, int wq, int ks) {
  return wq * 18 + ks * 2 + ((lane >> 3) & 1);
}
// Token (in the tile) of score fragment element e (0-3) of n-tile n held by quad position t.
__host__ __device__ __forceinline__ int fragment_token(int n, int t, int e) {
  return n * 8 + 2 * t + (e & 1);
}
// Output: the cache row and chunk whose address `lane` gives to ldmatrix.x4.trans for token
// k-step kk and column pair n2 of warp quarter wq (n-tiles 2 n2 and 2 n2 + 1).
__host__ __device__ __forceinline__ int value_token(int lane, int kk) {
  return kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
}
__host__ __device__ __forceinline__ int value_chunk(int lane, int wq, int n2) {
  return wq * 16 + n2 * 2 + (lane >> 4);
}
// Latent column of output fragment n-tile n, quad position t (and the next column).
__host__ __device__ __forceinline__ int output_column(int wq, int n, int t) {
  return wq * 128 + n * 8 + 2 * t;
}

// FP8 caches. Rows of 576 bytes: row r starts in bank group 4 * (r % 2); XOR-ing the chunk
// (36 per row, groups of 4) with (r / 2) % 4 puts 8 consecutive rows on 8 bank groups.
__host__ __device__ __forceinline__ int stage_offset8(int row, int chunk) {
  return row * kRowBytes8 + ((chunk ^ ((row >> 1) & 3)) << 4);
}
// Scores: ldmatrix.x4 over the tile's four n-tiles at one 16-dim chunk (lane = token); each
// lane gets 4 bytes = dims 4t .. 4t + 3, i.e. the B pairs (4t, 4t + 1) and (4t + 2, 4t + 3),
// so the query's A pairs are taken at the same dims (query_dim8).
__host__ __device__ __forceinline__ int score_chunk8(int wq, int ks) { return wq * 9 + ks; }
__host__ __device__ __forceinline__ int query_dim8(int wq, int ks, int t) {
  return wq * 144 + ks * 16 + 4 * t;
}
// Output: ldmatrix.x4.trans over 16-bit pairs of dims: (tokens 0-7 | 8-15) x (chunk c0 |
// c0 + 1) of k-step kk, c0 = value_chunk8's base for chunk pair cp of warp quarter wq. A
// lane gets tokens 2t, 2t + 1 at dims 2g, 2g + 1 of the chunk; split by a byte permute into
// an n-tile of the chunk's even dims and one of its odd dims.
// __byte_perm selector turning those 4 bytes (V[2t][2g], V[2t][2g+1], V[2t+1][2g],
// V[2t+1][2g+1]) into (even dim's two tokens | odd dim's two tokens).
constexpr unsigned kEvenOddBytes = 0x3120;
__host__ __device__ __forceinline__ int value_chunk8(int lane, int wq, int cp) {
  return wq * 8 + cp * 2 + (lane >> 4);
}
// First of the four consecutive latent columns a quad position t holds for chunk cc of warp
// quarter wq: (even n-tile c0, odd c0, even c1, odd c1).
__host__ __device__ __forceinline__ int output_column8(int wq, int cc, int t) {
  return wq * 128 + cc * 16 + 4 * t;
}

}  // namespace

namespace {

// Where one pipeline stage's tile comes from; `page` is loaded one iteration before use.
struct TileSource {
  int page;
  int first_token;  // offset inside the page
  int valid;        // tokens of the tile inside the request; < 0: no tile
};

}  // namespace

// Merging one cut request's partials (rows of head block hb), by NT threads: its splits'
// weights from their log-sum-exps into s_w, then 128 output columns at a time. Used by the
// combine kernel and, with SPLITK_FUSE_MAX_SPLITS, by the decode CTA that finishes the
// request last. Every thread of the CTA calls both (barriers inside).
template <int NT, int ROWS, typename SlotOf>
__device__ __forceinline__ void merge_weights(const SplitKParams& p, i64 base, int splits,
                                              SlotOf slot_of, float* s_w) {
  constexpr int kWarps = NT / 32, kRowsPerWarp = ROWS / kWarps;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int idx = tid; idx < splits * ROWS; idx += NT) {
    const int s = idx / ROWS, r = idx % ROWS;
    s_w[idx] = __ldcg(p.part_lse + (base + slot_of(s)) * ROWS + r);
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + kWarps * i;
    float mx = neg_inf();
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, s_w[s * ROWS + r]);
#pragma unroll
    for (int k = 16; k; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
    const float msub = mx == neg_inf() ? 0.f : mx;
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) sum += exp2f(s_w[s * ROWS + r] - msub);
#pragma unroll
    for (int k = 16; k; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    __syncwarp();
    for (int s = lane; s < splits; s += 32)
      s_w[s * ROWS + r] = exp2f(s_w[s * ROWS + r] - msub) * inv;
  }
  __syncthreads();
}

// COLS output columns (128, or a helper's 32) of a cut request's ROWS rows, by NT threads:
// COLS / 4 threads per row (a float4 each), NT / (COLS / 4) rows per pass.
template <bool FP16, int NT, int ROWS, int COLS, typename SlotOf>
__device__ __forceinline__ void merge_columns(const SplitKParams& p, i64 base, int splits,
                                              SlotOf slot_of, const float* s_w, int col0,
                                              i64 qrow0, int qrows, int hb) {
  constexpr int kColThreads = COLS / 4, kRowsPerPass = NT / kColThreads;
  constexpr int kRowsPerThread = ROWS / kRowsPerPass;
  static_assert(kRowsPerThread >= 1 && ROWS % kRowsPerPass == 0, "rows per pass");
  constexpr int kBatchSplits = 16 / kRowsPerThread;  // splits loaded together (16 float4 each)
  const int row0 = threadIdx.x / kColThreads;
  const int col = col0 + (threadIdx.x % kColThreads) * 4;
  // Every row's loads of a batch of splits are issued before any output is stored (a
  // store in between would keep the compiler from hoisting the next row's loads).
  float4 acc[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < splits; s0 += kBatchSplits) {
    float4 v[kRowsPerThread][kBatchSplits];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int u = 0; u < kBatchSplits; ++u)
        v[i][u] = s0 + u < splits
                      ? __ldcg(reinterpret_cast<const float4*>(
                            p.part_o + ((base + slot_of(s0 + u)) * ROWS + row0 + kRowsPerPass * i) * kLatent + col))
                      : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int u = 0; u < kBatchSplits; ++u) {
        const float w = s0 + u < splits ? s_w[(s0 + u) * ROWS + row0 + kRowsPerPass * i] : 0.f;
        acc[i].x += w * v[i][u].x; acc[i].y += w * v[i][u].y;
        acc[i].z += w * v[i][u].z; acc[i].w += w * v[i][u].w;
      }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int rr = hb * ROWS + row0 + kRowsPerPass * i;
    if (rr >= qrows) continue;
    u16* dst = p.out + (qrow0 + rr) * kLatent + col;
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(pack16<FP16>(acc[i].x, acc[i].y), pack16<FP16>(acc[i].z, acc[i].w));
  }
}

// FP16: the query (and output) is fp16, else bf16. KV8: the cache is FP8 e4m3 (products in
// fp16: e4m3 widens to fp16 exactly; the query is scaled by q_prescale first), else the
// query's dtype.
template <bool FP16, bool KV8, int RG, int STAGES>
__device__ __forceinline__ void decode_body(const SplitKParams& p) {
  constexpr int NT = 128 * RG;
  constexpr int ROWS = 16 * RG;
  constexpr int ROWS_PER_PASS = NT / 8;
  constexpr int TILE_BYTES = KV8 ? kTileBytes8 : kTileBytes;
  constexpr bool MMA_FP16 = FP16 || KV8;

  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* s_kv = smem;
  float4* s_part = reinterpret_cast<float4*>(smem + STAGES * TILE_BYTES);  // [RG][4][4][32]
  int* s_pref = reinterpret_cast<int*>(smem + STAGES * TILE_BYTES + RG * 8192);
  int* s_len = s_pref + kMaxBatch + 1;
  int* s_cuq = s_len + kMaxBatch;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t = lane & 3;
  const int nb = p.batch;
  const int hb = blockIdx.y;
  allow_dependent_launch();

  for (int i = tid; i <= nb; i += NT) {
    s_pref[i] = p.tile_prefix[i];
    s_cuq[i] = p.cu_q[i];
    if (i < nb) s_len[i] = p.seq_lens[i];
  }
  __syncthreads();

  const int total = s_pref[nb];
  if (total <= 0) return;
  const int active = active_ctas(total, p.num_ctas, p.min_tiles);
  const int c = blockIdx.x;
  if (c >= active) return;
  const int start = range_start(c, total, active);
  const int end = range_start(c + 1, total, active);
  if (start >= end) return;
#ifdef SPLITK_DIAG_EMPTY  // benchmarks/splitk_profile.py: launch + schedule only
  return;
#endif

  // The request holding tile `start`: the last i with s_pref[i] <= start.
  int first_req = 0;
  {
    int lo = 0, hi = nb;  // s_pref[lo] <= start < s_pref[hi]
    while (hi - lo > 1) {
      int mid = (lo + hi) >> 1;
      if (s_pref[mid] <= start) lo = mid; else hi = mid;
    }
    first_req = lo;
  }

  const u32 kv_base = smem_addr(s_kv);
  const unsigned char* kv_bytes = reinterpret_cast<const unsigned char*>(p.kv);

  int prod_req = first_req;
  auto source_of = [&](int x) -> TileSource {
    TileSource s;
    if (x >= end) {
      s.page = 0; s.first_token = 0; s.valid = -1;
      return s;
    }
    while (s_pref[prod_req + 1] <= x) ++prod_req;
    const int tok0 = (x - s_pref[prod_req]) * kTile;
    s.page = p.block_table[static_cast<i64>(prod_req) * p.bt_stride + tok0 / p.page_size];
    s.first_token = tok0 % p.page_size;
    s.valid = min(kTile, s_len[prod_req] - tok0);
    return s;
  };
  auto issue = [&](int stage, const TileSource& s) {
#ifdef SPLITK_DIAG_SKIP_KV  // benchmarks/splitk_profile.py: math over stale shared memory
    return;
#endif
    if (s.valid < 0) return;
    const i64 first = static_cast<i64>(s.page) * p.kv_page_stride +
                      static_cast<i64>(s.first_token) * kHeadDim;  // elements
    const u32 stage_base = kv_base + stage * TILE_BYTES;
    if constexpr (KV8) {
      const unsigned char* page_base = kv_bytes + first;
      for (int i = tid; i < kTile * kChunks8; i += NT) {
        const int r = i / kChunks8, ch = i - r * kChunks8;
        cp_async16(stage_base + stage_offset8(r, ch), page_base + r * kRowBytes8 + ch * 16,
                   r < s.valid ? 16 : 0);
      }
      return;
    }
    const unsigned char* page_base = kv_bytes + first * 2;
#pragma unroll
    for (int pass = 0; pass < kTile / ROWS_PER_PASS; ++pass) {
      const int r = load_row(pass, tid, NT);
      const int bytes = r < s.valid ? 16 : 0;  // zero-fill past the request's last key
      const unsigned char* src = page_base + r * kRowBytes;
#pragma unroll
      for (int k = 0; k < kChunks / 8; ++k) {
        const int ch = load_chunk(tid, k);
        cp_async16(stage_base + stage_offset(r, ch), src + ch * 16, bytes);
      }
    }
  };

  // Pipeline prologue: tiles start .. start + STAGES - 2 (their page ids loaded together,
  // not one round trip each).
  TileSource first[STAGES];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) first[s] = source_of(start + s);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    issue(s, first[s]);
    cp_async_commit();
  }
  TileSource next = first[STAGES - 1];

  // Per-segment state (one segment = the tiles of one request inside this CTA's range).
  int req = first_req;
  int seg_first = start;
  u32 qf[9][4];
  float o[16][4];
  float m[2], l[2];
  int limit[2];
  bool row_ok[2];
  const int row_local[2] = {rg * 16 + g, rg * 16 + g + 8};

  // The query words of request r's rows this lane multiplies (raw, 36 registers): loaded
  // one tile before the request's first tile, so a new segment does not wait for them.
  auto load_query = [&](int r, u32 (&raw)[9][4]) {
    const int qrows = (s_cuq[r + 1] - s_cuq[r]) * p.heads;
    const int rr0 = hb * ROWS + row_local[0], rr1 = hb * ROWS + row_local[1];
    const bool ok0 = rr0 < qrows, ok1 = rr1 < qrows;
    const QueryRow q0 = query_row(p, s_cuq[r], ok0 ? rr0 : 0);
    const QueryRow q1 = query_row(p, s_cuq[r], ok1 ? rr1 : 0);
#pragma unroll
    for (int ks = 0; ks < 9; ++ks) {
      // A k-step's 16 dims lie in one part (512 is a multiple of 16 past a quarter's start).
      const bool in_rope = query_dim(wq, ks, 0) >= kLatent;
      if constexpr (KV8) {  // dims 4t .. 4t + 3 (query_dim8): (a0 | a1) low words, (a2 | a3) high
        const int d = query_dim8(wq, ks, t);
        const uint2 v0 = ok0 ? __ldg(reinterpret_cast<const uint2*>(q0.at(d, in_rope)))
                             : make_uint2(0u, 0u);
        const uint2 v1 = ok1 ? __ldg(reinterpret_cast<const uint2*>(q1.at(d, in_rope)))
                             : make_uint2(0u, 0u);
        raw[ks][0] = v0.x, raw[ks][1] = v1.x, raw[ks][2] = v0.y, raw[ks][3] = v1.y;
      } else {
        const int d = query_dim(wq, ks, t);
        const u32* a0 = reinterpret_cast<const u32*>(q0.at(d, in_rope));
        const u32* a1 = reinterpret_cast<const u32*>(q1.at(d, in_rope));
        raw[ks][0] = ok0 ? __ldg(a0) : 0u;
        raw[ks][1] = ok1 ? __ldg(a1) : 0u;
        raw[ks][2] = ok0 ? __ldg(a0 + 4) : 0u;  // dims d + 8, d + 9
        raw[ks][3] = ok1 ? __ldg(a1 + 4) : 0u;
      }
    }
  };

  auto begin_segment = [&](const u32 (&raw)[9][4]) {
    const int qlen = s_cuq[req + 1] - s_cuq[req];
    const int len = s_len[req];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rr = hb * ROWS + row_local[h];
      row_ok[h] = rr < qlen * p.heads;
      limit[h] = row_ok[h] ? len - qlen + rr / p.heads + 1 : 0;
      m[h] = neg_inf();
      l[h] = 0.f;
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 9; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (KV8) {  // scaled into fp16 pairs
          const float sc = p.q_prescale;
          qf[ks][i] = pack16<true>(to_float<FP16>(raw[ks][i] & 0xffffu) * sc,
                                   to_float<FP16>(raw[ks][i] >> 16) * sc);
        } else {
          qf[ks][i] = raw[ks][i];
        }
      }
  };

  auto end_segment = [&](int seg_end) {
    const bool whole = seg_first == s_pref[req] && seg_end == s_pref[req + 1];
    const i64 qrow0 = static_cast<i64>(s_cuq[req]) * p.heads;
    const int slot = partial_slot(c, seg_first, start);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(l[h]);
      if (!row_ok[h]) continue;
      const float inv = sum > 0.f ? p.out_scale / sum : 0.f;
      const i64 prow = (static_cast<i64>(hb) * 2 * p.num_ctas + slot) * ROWS + row_local[h];
      u16* out_row = p.out + (qrow0 + hb * ROWS + row_local[h]) * kLatent;
      float* part_row = p.part_o + prow * kLatent;
      if constexpr (KV8) {
        // chunk cc: even-dim n-tile o[2cc], odd-dim o[2cc + 1] -> 4 consecutive columns
#pragma unroll
        for (int cc = 0; cc < 8; ++cc) {
          const float* e = o[2 * cc];
          const float* d = o[2 * cc + 1];
          const float v0 = e[2 * h] * inv, v1 = d[2 * h] * inv;
          const float v2 = e[2 * h + 1] * inv, v3 = d[2 * h + 1] * inv;
          const int col = output_column8(wq, cc, t);
          if (whole)
            *reinterpret_cast<uint2*>(out_row + col) =
                make_uint2(pack16<FP16>(v0, v1), pack16<FP16>(v2, v3));
          else
            *reinterpret_cast<float4*>(part_row + col) = make_float4(v0, v1, v2, v3);
        }
      } else if (whole) {
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<u32*>(out_row + output_column(wq, n, t)) =
              pack16<FP16>(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      } else {
#pragma unroll
        for (int n = 0; n < 16; ++n)
          *reinterpret_cast<float2*>(part_row + output_column(wq, n, t)) =
              make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
      }
      if (!whole) {
        if (wq == 0 && t == 0) p.part_lse[prow] = sum > 0.f ? m[h] + __log2f(sum) : neg_inf();
      }
    }
  };

  u32 qnext[9][4];  // the query of the segment that starts next
  load_query(req, qnext);
  begin_segment(qnext);

  for (int x = start; x < end; ++x) {
    // Tile x sits in stage (x - start) % STAGES (the prologue filled stages 0, 1, ...). Once
    // it has landed and every warp is past tile x - 1 (one barrier for both), tile
    // x + STAGES - 1 goes into tile x - 1's stage: STAGES - 1 tiles stay in flight.
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    issue((x - start + STAGES - 1) % STAGES, next);
    cp_async_commit();
    next = source_of(x + STAGES);

    if (x != start && x == s_pref[req + 1]) {
      end_segment(x);
      while (s_pref[req + 1] <= x) ++req;
      seg_first = x;
      begin_segment(qnext);
    }
    if (x + 1 < end && x + 1 == s_pref[req + 1]) {  // a request starts with the next tile
      int r = req + 1;
      while (s_pref[r + 1] <= x + 1) ++r;
      load_query(r, qnext);
    }

#ifdef SPLITK_DIAG_SKIP_MATH  // benchmarks/splitk_profile.py: loads and schedule only
    continue;
#endif
    const u32 st = kv_base + ((x - start) % STAGES) * TILE_BYTES;
    const int tok0 = (x - s_pref[req]) * kTile;

    // Scores: this warp's 144 of the 576 dims, for all 32 tokens of the tile.
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    if constexpr (KV8) {
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
        u32 w[4];  // n-tile j: token 8j + g, dims 4t .. 4t + 3 of the chunk
        ldsm_x4(st + stage_offset8(lane, score_chunk8(wq, ks)), w[0], w[1], w[2], w[3]);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          mma16<true>(s[j], qf[ks], e4m3x2_to_f16x2(w[j]), e4m3x2_to_f16x2(w[j] >> 16));
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          u32 b0, b1, b2, b3;
          ldsm_x4(st + stage_offset(score_token(lane, np), score_chunk(lane, wq, ks)), b0, b1,
                  b2, b3);
          mma16<FP16>(s[2 * np], qf[ks], b0, b1);
          mma16<FP16>(s[2 * np + 1], qf[ks], b2, b3);
        }
      }
    }
    // Sum the four warps' partial scores (same fragment layout in every warp, fixed order).
#pragma unroll
    for (int n = 0; n < 4; ++n)
      s_part[((rg * 4 + wq) * 4 + n) * 32 + lane] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
    __syncthreads();
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      float4 acc = s_part[((rg * 4 + 0) * 4 + n) * 32 + lane];
#pragma unroll
      for (int w = 1; w < 4; ++w) {
        const float4 v = s_part[((rg * 4 + w) * 4 + n) * 32 + lane];
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
      }
      s[n][0] = acc.x; s[n][1] = acc.y; s[n][2] = acc.z; s[n][3] = acc.w;
    }

    // Online softmax in base 2; rows g (h = 0) and g + 8 (h = 1).
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = tok0 + fragment_token(n, t, e);
        const float v = tok < limit[e >> 1] ? s[n][e] * p.scale_log2 : neg_inf();
        s[n][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float alpha[2], msub[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));
      msub[h] = m_new == neg_inf() ? 0.f : m_new;
      alpha[h] = exp2f(m[h] - msub[h]);
      m[h] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = exp2f(s[n][e] - msub[e >> 1]);
        s[n][e] = pv;
        rowsum[e >> 1] += pv;
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rowsum[h];
    if (alpha[0] != 1.f || alpha[1] != 1.f) {  // most tiles leave the running maximum alone
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
        o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
      }
    }

    // Output: this warp's 128 of the 512 latent columns, over the tile's 32 tokens.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const u32 pa[4] = {pack16<MMA_FP16>(s[2 * kk][0], s[2 * kk][1]),
                         pack16<MMA_FP16>(s[2 * kk][2], s[2 * kk][3]),
                         pack16<MMA_FP16>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                         pack16<MMA_FP16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      if constexpr (KV8) {
#pragma unroll
        for (int cp = 0; cp < 4; ++cp) {
          u32 w[4];  // (tokens 0-7 | 8-15) x (chunk c0 | c0 + 1): bytes V[2t][2g], V[2t][2g+1],
                     // V[2t+1][2g], V[2t+1][2g+1]
          ldsm_x4_trans(st + stage_offset8(value_token(lane, kk), value_chunk8(lane, wq, cp)),
                        w[0], w[1], w[2], w[3]);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            // low 16 bits: the even dim's two tokens, high: the odd dim's
            const u32 lo = __byte_perm(w[2 * half], 0, kEvenOddBytes);
            const u32 hi = __byte_perm(w[2 * half + 1], 0, kEvenOddBytes);
            const int cc = cp * 2 + half;
            mma16<true>(o[2 * cc], pa, e4m3x2_to_f16x2(lo), e4m3x2_to_f16x2(hi));
            mma16<true>(o[2 * cc + 1], pa, e4m3x2_to_f16x2(lo >> 16), e4m3x2_to_f16x2(hi >> 16));
          }
        }
      } else {
#pragma unroll
        for (int n2 = 0; n2 < 8; ++n2) {
          u32 b0, b1, b2, b3;
          ldsm_x4_trans(st + stage_offset(value_token(lane, kk), value_chunk(lane, wq, n2)), b0,
                        b1, b2, b3);
          mma16<FP16>(o[2 * n2], pa, b0, b1);
          mma16<FP16>(o[2 * n2 + 1], pa, b2, b3);
        }
      }
    }
  }
  end_segment(end);
  cp_async_wait<0>();
#if SPLITK_FUSE_MAX_SPLITS > 0
  // This CTA's cut requests (its first and its last): count its piece; the CTA that counts
  // a request's last piece merges it (its partials are in L2, written before each count).
  __syncthreads();  // every warp is past the pipeline: its shared memory is free
  int* s_last = reinterpret_cast<int*>(smem);
  float* s_weights = reinterpret_cast<float*>(smem) + 4;
  for (int k = 0; k < 2; ++k) {
    const int r = k == 0 ? first_req : req;
    if (k == 1 && r == first_req) break;
    const int r_first = s_pref[r], tiles = s_pref[r + 1] - r_first;
    if (r_first >= start && r_first + tiles <= end) continue;  // whole: already in the output
    const int c_first = cta_of(r_first, total, active);
    const int splits = cta_of(r_first + tiles - 1, total, active) - c_first + 1;
    if (splits > SPLITK_FUSE_MAX_SPLITS) continue;  // the combine kernel's
    int* count = p.merge_count + hb * kMaxBatch + r;
    __threadfence();  // this thread's partial stores before the count
    __syncthreads();
    if (tid == 0) *s_last = atomicAdd(count, 1) == splits - 1;
    __syncthreads();
    if (*s_last) {
      __threadfence();  // then the other pieces' stores, counted before, are visible
      const i64 base = static_cast<i64>(hb) * 2 * p.num_ctas;
      auto slot_of = [&](int s) { return split_slot(s, c_first, r_first, total, active); };
      const int qrows = (s_cuq[r + 1] - s_cuq[r]) * p.heads;
      const i64 qrow0 = static_cast<i64>(s_cuq[r]) * p.heads;
      merge_weights<NT, ROWS>(p, base, splits, slot_of, s_weights);
      for (int chunk = 0; chunk < kLatent / 128; ++chunk)
        merge_columns<FP16, NT, ROWS, 128>(p, base, splits, slot_of, s_weights, chunk * 128,
                                           qrow0, qrows, hb);
      if (tid == 0) *count = 0;  // ready for the next launch
    }
    __syncthreads();  // s_last and s_weights are rewritten for the next request
  }
#endif
}

// Heavy requests among requests [0, n), by the whole CTA (128 threads, barriers inside):
// with want >= 0 the index of the want-th (-1 when there are fewer), else how many.
// s_scan: 130 ints of shared memory. One round of loads (8 requests per thread at most);
// the count and search run only when some request is heavy.
__device__ __forceinline__ int heavy_requests(const SplitKParams& p, int n, int want,
                                              int total, int active, int* s_scan) {
  constexpr int kPer = kMaxBatch / 128;
  const int tid = threadIdx.x;
  const int per = (n + 127) / 128;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int pref[kPer + 1];
#pragma unroll
  for (int i = 0; i <= kPer; ++i) pref[i] = lo + i <= hi ? p.tile_prefix[lo + i] : 0;
  unsigned heavy = 0;  // bit i: request lo + i
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int tiles = pref[i + 1] - pref[i];
    // A request is cut into at most tiles * active / total + 2 pieces: the exact count
    // (two 64-bit divisions) only for the few that can be heavy.
    if (lo + i < hi &&
        static_cast<i64>(tiles) * active > static_cast<i64>(kHeavySplits - 2) * total &&
        cta_of(pref[i + 1] - 1, total, active) - cta_of(pref[i], total, active) + 1 >
            kHeavySplits)
      heavy |= 1u << i;
  }
  if (tid == 0) s_scan[129] = 0;
  __syncthreads();
  if (heavy) s_scan[129] = 1;
  s_scan[tid] = __popc(heavy);
  __syncthreads();
  if (!s_scan[129]) {
    __syncthreads();  // s_scan is rewritten by the next call
    return want < 0 ? 0 : -1;
  }
  if (tid == 0) {
    int run = 0;
    for (int t = 0; t < 128; ++t) {
      const int c = s_scan[t];
      s_scan[t] = run;
      run += c;
    }
    s_scan[128] = run;
  }
  __syncthreads();
  const int before = s_scan[tid], count = __popc(heavy), all = s_scan[128];
  __syncthreads();
  if (tid == 0) s_scan[0] = -1;
  __syncthreads();
  if (want >= before && want < before + count) {
    int k = before;
    for (int i = 0; i < kPer; ++i)
      if ((heavy >> i) & 1u) {
        if (k == want) s_scan[0] = lo + i;
        ++k;
      }
  }
  __syncthreads();
  const int found = s_scan[0];
  __syncthreads();
  return want < 0 ? all : found;
}

// Combines the partials of every request cut by range borders (into more than
// SPLITK_FUSE_MAX_SPLITS pieces). Work items: SPLITK_HELPED_REQUESTS x kHelperParts helper
// items (heavy request, 32-column part), then (request, 128-column chunk): one
// per CTA (the grid covers them; a stride loop keeps any grid correct). A request cut into
// more than kHeavySplits pieces, among the first SPLITK_HELPED_REQUESTS such, is merged by
// its helper items, so that its many partials are read by 16 CTAs rather than 4 (one 64k
// request among 2k ones is cut ~70 ways). The schedule (tile prefix sums, query offsets:
// written before the decode launch) is read before waiting for the decode grid, so an item
// that has nothing to combine exits and the rest overlap the decode's tail; after the wait,
// one round of loads for the log-sum-exps and one per batch of partial outputs. Requests
// without keys (an engine's padding rows) get zeros rather than stale memory, so nothing
// undefined flows into the layers after attention.
template <bool FP16, int RG>
__device__ __forceinline__ void combine_body(const SplitKParams& p) {
  constexpr int ROWS = 16 * RG;
  constexpr int kChunks = kLatent / 128;
  constexpr int kHelperCols = kLatent / kHelperParts;
  // [splits][ROWS] weights, then the heavy-request search's 130 ints
  extern __shared__ __align__(16) float s_w[];
  int* s_scan = reinterpret_cast<int*>(s_w + p.num_ctas * ROWS);
  const int hb = blockIdx.y;
  const int total = p.tile_prefix[p.batch];
  const int active = total > 0 ? active_ctas(total, p.num_ctas, p.min_tiles) : 1;
  // Helper items first: CTAs start in index order, so their search runs while the decode
  // grid drains (before the wait) rather than after the regular items.
  constexpr int kHelpers = SPLITK_HELPED_REQUESTS * kHelperParts;

  for (int item = blockIdx.x; item < kHelpers + p.batch * kChunks; item += gridDim.x) {
    const bool helper = item < kHelpers;
    int req, col0;
    if (helper) {
      req = heavy_requests(p, p.batch, item / kHelperParts, total, active, s_scan);
      if (req < 0) continue;
      col0 = (item % kHelperParts) * kHelperCols;
    } else {
      req = (item - kHelpers) / kChunks;
      col0 = (item - kHelpers) % kChunks * 128;
    }
    const int first = p.tile_prefix[req], tiles = p.tile_prefix[req + 1] - first;
    const int qrows = (p.cu_q[req + 1] - p.cu_q[req]) * p.heads;
    const i64 qrow0 = static_cast<i64>(p.cu_q[req]) * p.heads;
    if (tiles <= 0) {  // the decode never writes these rows: no need to wait for it
#pragma unroll
      for (int i = 0; i < ROWS / 4; ++i) {
        const int rr = hb * ROWS + (threadIdx.x >> 5) + 4 * i;
        if (rr < qrows)
          *reinterpret_cast<uint2*>(p.out + (qrow0 + rr) * kLatent + col0 +
                                    (threadIdx.x & 31) * 4) = make_uint2(0u, 0u);
      }
      continue;
    }
    const int c_first = cta_of(first, total, active);
    const int splits = cta_of(first + tiles - 1, total, active) - c_first + 1;
    if (splits <= 1 || splits <= SPLITK_FUSE_MAX_SPLITS) continue;
    if (!helper && splits > kHeavySplits &&
        heavy_requests(p, req, -1, total, active, s_scan) < SPLITK_HELPED_REQUESTS)
      continue;  // its helper items merge it
    const i64 base = static_cast<i64>(hb) * 2 * p.num_ctas;
    auto slot_of = [&](int s) { return split_slot(s, c_first, first, total, active); };
    wait_for_prior_grid();  // the partials are the decode grid's (returns at once when repeated)
    merge_weights<128, ROWS>(p, base, splits, slot_of, s_w);
    if (!helper)
      merge_columns<FP16, 128, ROWS, 128>(p, base, splits, slot_of, s_w, col0, qrow0, qrows,
                                          hb);
    else
      merge_columns<FP16, 128, ROWS, kHelperCols>(p, base, splits, slot_of, s_w, col0, qrow0,
                                                  qrows, hb);
    __syncthreads();  // s_w is rewritten by the next item
  }
}

// Entry points with C names (looked up by name from the driver API): decode of a bf16 or
// fp16 query over a cache of the same dtype or of FP8 e4m3 ("_fp8kv"), with RG row groups of
// 16 query rows per CTA (128 * RG threads) and a STAGES-deep KV pipeline; and the combine.
#define SPLITK_DECODE(NAME, FP16, KV8, RG, STAGES)                                         \
  extern "C" __global__ void __launch_bounds__(128 * RG, 1)                               \
      splitk_mla_decode_##NAME##_rg##RG##_s##STAGES(const SplitKParams p) {                \
    decode_body<FP16, KV8, RG, STAGES>(p);                                                 \
  }
#define SPLITK_COMBINE(NAME, FP16, RG)                                                     \
  extern "C" __global__ void __launch_bounds__(128, kCombineCtasPerSm[RG])                \
      splitk_mla_combine_##NAME##_rg##RG(const SplitKParams p) {                           \
    combine_body<FP16, RG>(p);                                                             \
  }
#define SPLITK_DTYPE(NAME, FP16)                                                           \
  SPLITK_DECODE(NAME, FP16, false, 1, 2)                                                   \
  SPLITK_DECODE(NAME, FP16, false, 1, 3)                                                   \
  SPLITK_DECODE(NAME, FP16, false, 1, 4)                                                   \
  SPLITK_DECODE(NAME, FP16, false, 2, 2)                                                   \
  SPLITK_DECODE(NAME, FP16, false, 2, 3)                                                   \
  SPLITK_DECODE(NAME, FP16, false, 2, 4)                                                   \
  SPLITK_DECODE(NAME##_fp8kv, FP16, true, 1, 4)                                            \
  SPLITK_DECODE(NAME##_fp8kv, FP16, true, 1, 8)                                            \
  SPLITK_DECODE(NAME##_fp8kv, FP16, true, 2, 4)                                            \
  SPLITK_DECODE(NAME##_fp8kv, FP16, true, 2, 8)                                            \
  SPLITK_COMBINE(NAME, FP16, 1)                                                            \
  SPLITK_COMBINE(NAME, FP16, 2)

#ifndef SPLITK_SCHEDULE_ONLY  // host builds of the helpers (CPU tests) skip kernels
SPLITK_DTYPE(bf16, false)
SPLITK_DTYPE(fp16, true)
#endif
