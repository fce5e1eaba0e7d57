// CPU emulation of the split-KV decode kernel: the kernel's own source (decode_body and
// combine_body of trtllm_mla_plugin/ops/kernels/cuda/splitk_mla_decode.cu) runs on the host,
// every GPU thread a fiber, with the hardware primitives re-implemented after the PTX ISA:
//   * __syncthreads / __syncwarp: barriers over the CTA's / warp's fibers;
//   * ldmatrix (.x4, .trans), mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate),
//     shfl.xor: warp collectives (each lane posts its operands, waits for the warp, reads);
//   * cp.async: a synchronous copy (zero-filled past src_bytes); commit / wait: nothing;
//   * cvt to bf16/fp16 (round to nearest even), e4m3 to fp16 (exact), prmt.
// CTAs run one after another (the kernels never wait on another CTA), in index order or
// reversed (which CTA finishes a request last: the one that merges it when the kernel is
// built with SPLITK_FUSE_MAX_SPLITS); __threadfence is then nothing and atomicAdd a plain
// read-modify-write. What this shows:
// the kernel's indexing, pipeline staging, segment and schedule logic, softmax, scales and
// combine give the right numbers. What it cannot show: timing, races that need real
// concurrency, and how the real instructions behave where this model differs from them.
//
// Build: g++ -std=c++20 -O2 -o emu splitk_emulator.cpp
// Run:   emu INPUT OUTPUT (binary layout: see read_problem / tests/test_splitk_emulated_cpu.py)
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using std::max;
using std::min;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)
#define __launch_bounds__(...)

typedef unsigned int u32;
typedef unsigned short u16;

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  u32 x, y;
};
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }

// ---- fibers ----------------------------------------------------------------------------

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  bool done = false;
};
static ucontext_t g_scheduler;
static Fiber* g_cur = nullptr;
static Dim3 blockIdx, gridDim;
#define threadIdx (g_cur->tid)

struct Barrier {
  int size = 0, count = 0;
  unsigned generation = 0;
};
static Barrier g_cta_barrier;
static Barrier g_warp_barrier[32];

static void yield_fiber() { swapcontext(&g_cur->ctx, &g_scheduler); }

static void arrive(Barrier& b) {
  const unsigned gen = b.generation;
  if (++b.count == b.size) {
    b.count = 0;
    ++b.generation;
    return;
  }
  while (b.generation == gen) yield_fiber();
}

inline void __syncthreads() { arrive(g_cta_barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { arrive(g_warp_barrier[g_cur->tid.x >> 5]); }
inline int lane_id() { return g_cur->tid.x & 31; }
inline int warp_id() { return g_cur->tid.x >> 5; }

// ---- scalar conversions ----------------------------------------------------------------

inline float bits_to_float(u32 b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline u32 float_to_bits(float f) {
  u32 b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float __int_as_float(int b) { return bits_to_float(static_cast<u32>(b)); }
inline float __uint_as_float(u32 b) { return bits_to_float(b); }
inline float __log2f(float x) { return std::log2(x); }
inline int __popc(u32 v) { return __builtin_popcount(v); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
template <typename T>
inline T __ldcg(const T* p) { return *p; }

inline u32 __byte_perm(u32 x, u32 y, u32 s) {
  const unsigned long long both = (static_cast<unsigned long long>(y) << 32) | x;
  u32 r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<u32>((both >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

inline float half_to_float(u16 h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  float v = e == 0 ? std::ldexp(static_cast<float>(m), -24)
            : e == 31 ? (m ? NAN : INFINITY)
                      : std::ldexp(static_cast<float>(m + 1024), e - 25);
  return s ? -v : v;
}
inline u16 float_to_half(float f) {  // round to nearest even
  const u32 b = float_to_bits(f);
  const u32 sign = (b >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (std::isnan(f)) return static_cast<u16>(sign | 0x7e00);
  if (a >= 65520.f) return static_cast<u16>(sign | 0x7c00);
  if (a < std::ldexp(1.f, -14)) {  // subnormal: units of 2^-24
    const float units = std::nearbyint(a * std::ldexp(1.f, 24));
    return static_cast<u16>(sign | static_cast<u32>(units));
  }
  int exp;
  const float frac = std::frexp(a, &exp);  // a = frac * 2^exp, frac in [0.5, 1)
  float mant = std::nearbyint((frac * 2.f - 1.f) * 1024.f);
  int e = exp - 1 + 15;
  if (mant >= 1024.f) {
    mant = 0.f;
    ++e;
  }
  if (e >= 31) return static_cast<u16>(sign | 0x7c00);
  return static_cast<u16>(sign | (e << 10) | static_cast<u32>(mant));
}
inline float bf16_to_float(u16 h) { return bits_to_float(static_cast<u32>(h) << 16); }
inline u16 float_to_bf16(float f) {  // round to nearest even
  const u32 b = float_to_bits(f);
  if (std::isnan(f)) return static_cast<u16>((b >> 16) | 0x40);
  return static_cast<u16>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
inline float e4m3_to_float(unsigned char v) {
  const int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  float r = (e == 15 && m == 7) ? NAN
            : e == 0            ? std::ldexp(static_cast<float>(m), -9)
                                : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -r : r;
}

// ---- shared memory and the warp collectives ----------------------------------------------

alignas(128) unsigned char smem[240 * 1024];
alignas(16) float s_w[64 * 1024];

struct WarpPost {
  u32 addr[32];
  u32 a[32][4];
  u32 b[32][2];
  float v[32];
};
static WarpPost g_post[32];

inline float neg_inf() { return -INFINITY; }
inline u32 smem_addr(const void* p) {
  return static_cast<u32>(static_cast<const unsigned char*>(p) - smem);
}
inline void cp_async16(u32 dst, const void* src, int src_bytes) {
  std::memset(smem + dst, 0, 16);
  std::memcpy(smem + dst, src, src_bytes);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

inline u32 load_u32(u32 addr) {
  u32 v;
  std::memcpy(&v, smem + addr, 4);
  return v;
}
inline u32 load_u16(u32 addr) {
  u16 v;
  std::memcpy(&v, smem + addr, 2);
  return v;
}

// lanes 8j..8j+7 give the rows of matrix j; lane l gets word l % 4 of row l / 4, or with
// .trans the 16-bit elements (row 2(l % 4) + e, column l / 4), e = 0 (low half), 1.
inline void ldsm(bool trans, u32 addr, u32 (&r)[4]) {
  WarpPost& w = g_post[warp_id()];
  const int l = lane_id();
  w.addr[l] = addr;
  __syncwarp();
  for (int j = 0; j < 4; ++j) {
    if (trans)
      r[j] = load_u16(w.addr[8 * j + 2 * (l % 4)] + 2 * (l / 4)) |
             (load_u16(w.addr[8 * j + 2 * (l % 4) + 1] + 2 * (l / 4)) << 16);
    else
      r[j] = load_u32(w.addr[8 * j + l / 4] + 4 * (l % 4));
  }
  __syncwarp();
}
inline void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  u32 r[4];
  ldsm(false, addr, r);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ldsm_x4_trans(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
  u32 r[4];
  ldsm(true, addr, r);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}

template <bool FP16>
inline float half_of(u32 reg, int e) {
  const u16 h = static_cast<u16>(e ? reg >> 16 : reg & 0xffff);
  return FP16 ? half_to_float(h) : bf16_to_float(h);
}

// A[g][2t+e] = a0, A[g+8][..] = a1, A[g][2t+8+e] = a2, A[g+8][2t+8+e] = a3;
// B[2t+e][g] = b0, B[2t+8+e][g] = b1; C/D[g][2t+e] = d0/d1, [g+8][2t+e] = d2/d3.
template <bool FP16>
inline void mma16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  WarpPost& w = g_post[warp_id()];
  const int l = lane_id();
  for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
  w.b[l][0] = b0, w.b[l][1] = b1;
  __syncwarp();
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    double acc = 0.0;
    for (int k = 0; k < 16; ++k) {
      const int a_lane = 4 * (row % 8) + (k % 8) / 2;
      const int a_reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      const int b_lane = 4 * col + (k % 8) / 2;
      const int b_reg = k >= 8 ? 1 : 0;
      acc += static_cast<double>(half_of<FP16>(w.a[a_lane][a_reg], k % 2)) *
             half_of<FP16>(w.b[b_lane][b_reg], k % 2);
    }
    d[i] = static_cast<float>(d[i] + acc);
  }
  __syncwarp();
}

template <bool FP16>
inline u32 pack16(float lo, float hi) {
  if (FP16) return float_to_half(lo) | (static_cast<u32>(float_to_half(hi)) << 16);
  return float_to_bf16(lo) | (static_cast<u32>(float_to_bf16(hi)) << 16);
}
inline u32 e4m3x2_to_f16x2(u32 pair) {
  return float_to_half(e4m3_to_float(pair & 0xff)) |
         (static_cast<u32>(float_to_half(e4m3_to_float((pair >> 8) & 0xff))) << 16);
}
template <bool FP16>
inline float to_float(u32 bits16) {
  return FP16 ? half_to_float(static_cast<u16>(bits16)) : bf16_to_float(static_cast<u16>(bits16));
}
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  WarpPost& w = g_post[warp_id()];
  const int l = lane_id();
  w.v[l] = v;
  __syncwarp();
  const float r = w.v[l ^ mask];
  __syncwarp();
  return r;
}

// Grids run one after another here: nothing to wait for, nothing to start early.
inline void allow_dependent_launch() {}
inline void wait_for_prior_grid() {}
// CTAs run one at a time (and a CTA's fibers only switch at barriers and warp collectives).
inline void __threadfence() {}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}

#define SPLITK_EMULATE
#define SPLITK_SCHEDULE_ONLY
#include "../../trtllm_mla_plugin/ops/kernels/cuda/splitk_mla_decode.cu"

// ---- running a grid ----------------------------------------------------------------------

static void (*g_body)(const SplitKParams&) = nullptr;
static const SplitKParams* g_params = nullptr;

static void fiber_main() {
  g_body(*g_params);
  g_cur->done = true;
  swapcontext(&g_cur->ctx, &g_scheduler);
}

static void run_grid(void (*body)(const SplitKParams&), const SplitKParams& p, unsigned gx,
                     unsigned gy, int threads, bool reversed = false) {
  g_body = body;
  g_params = &p;
  gridDim = {gx, gy, 1};
  std::vector<Fiber> fibers(threads);
  for (auto& f : fibers) f.stack.resize(256 * 1024);
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned i = 0; i < gx; ++i) {
      const unsigned bx = reversed ? gx - 1 - i : i;
      blockIdx = {bx, by, 0};
      std::memset(smem, 0xA5, sizeof(smem));  // stale garbage, as on a GPU
      g_cta_barrier = {threads, 0, 0};
      for (int w = 0; w < 32; ++w) g_warp_barrier[w] = {32, 0, 0};
      for (int i = 0; i < threads; ++i) {
        Fiber& f = fibers[i];
        f.done = false;
        f.tid = {static_cast<unsigned>(i), 0, 0};
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, fiber_main, 0);
      }
      for (bool running = true; running;) {
        running = false;
        for (auto& f : fibers) {
          if (f.done) continue;
          g_cur = &f;
          swapcontext(&g_scheduler, &f.ctx);
          running = running || !f.done;
        }
      }
    }
}

template <bool FP16, bool KV8, int RG, int STAGES>
static void decode_entry(const SplitKParams& p) {
  decode_body<FP16, KV8, RG, STAGES>(p);
}
template <bool FP16, int RG>
static void combine_entry(const SplitKParams& p) {
  combine_body<FP16, RG>(p);
}

template <bool FP16, bool KV8, int RG>
static void (*pick_stages(int stages))(const SplitKParams&) {
  if constexpr (KV8) {  // the depths compiled for the GPU (splitk_mla_decode.py STAGES)
    if (stages == 4) return decode_entry<FP16, KV8, RG, 4>;
    if (stages == 8) return decode_entry<FP16, KV8, RG, 8>;
  } else {
    if (stages == 2) return decode_entry<FP16, KV8, RG, 2>;
    if (stages == 3) return decode_entry<FP16, KV8, RG, 3>;
    if (stages == 4) return decode_entry<FP16, KV8, RG, 4>;
  }
  return nullptr;
}
template <bool FP16, bool KV8>
static void (*pick_rg(int rg, int stages))(const SplitKParams&) {
  return rg == 1 ? pick_stages<FP16, KV8, 1>(stages) : pick_stages<FP16, KV8, 2>(stages);
}

// ---- input / output ----------------------------------------------------------------------

template <typename T>
static std::vector<T> read_array(FILE* f, size_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  FILE* f = std::fopen(argv[1], "rb");
  if (!f) return 2;
  // ints: batch heads page_size num_ctas min_tiles num_pages bt_width num_tokens head_blocks
  //       fp16 kv8 row_groups stages combine_ctas reversed, then for the query's latent and
  //       rope parts each: elements of its buffer, offset of row (0, 0), token stride, head
  //       stride; floats: scale_log2 q_prescale out_scale
  auto hdr = read_array<int>(f, 23);
  auto scales = read_array<float>(f, 3);
  const int batch = hdr[0], heads = hdr[1], page = hdr[2], num_ctas = hdr[3];
  const int pages = hdr[5], width = hdr[6], tokens = hdr[7], head_blocks = hdr[8];
  const bool fp16 = hdr[9], kv8 = hdr[10];
  const int rg = hdr[11], stages = hdr[12], combine_ctas = hdr[13];
  const bool reversed = hdr[14];
  auto q = read_array<u16>(f, hdr[15]);
  auto q_rope = read_array<u16>(f, hdr[19]);
  auto kv = read_array<unsigned char>(
      f, static_cast<size_t>(pages) * page * kHeadDim * (kv8 ? 1 : 2));
  auto table = read_array<int>(f, static_cast<size_t>(batch) * width);
  auto lens = read_array<int>(f, batch);
  auto cu_q = read_array<int>(f, batch + 1);
  auto prefix = read_array<int>(f, batch + 1);
  std::fclose(f);

  const int rows = 16 * rg;
  std::vector<u16> out(static_cast<size_t>(tokens) * heads * kLatent, 0x7fc0);  // NaN poison
  std::vector<float> part_o(static_cast<size_t>(head_blocks) * 2 * num_ctas * rows * kLatent,
                            NAN);
  std::vector<float> part_lse(static_cast<size_t>(head_blocks) * 2 * num_ctas * rows, NAN);
  std::vector<int> merge_count(static_cast<size_t>(head_blocks) * kMaxBatch, 0);
  SplitKParams p{};
  p.q = q.data() + hdr[16];
  p.q_token_stride = hdr[17];
  p.q_head_stride = hdr[18];
  p.q_rope = q_rope.data() + hdr[20];
  p.q_rope_token_stride = hdr[21];
  p.q_rope_head_stride = hdr[22];
  p.kv = reinterpret_cast<const u16*>(kv.data());
  p.block_table = table.data();
  p.seq_lens = lens.data();
  p.cu_q = cu_q.data();
  p.tile_prefix = prefix.data();
  p.out = out.data();
  p.part_o = part_o.data();
  p.part_lse = part_lse.data();
  p.kv_page_stride = static_cast<i64>(page) * kHeadDim;
  p.bt_stride = width;
  p.batch = batch;
  p.heads = heads;
  p.page_size = page;
  p.num_ctas = num_ctas;
  p.min_tiles = hdr[4];
  p.scale_log2 = scales[0];
  p.q_prescale = scales[1];
  p.out_scale = scales[2];
  p.merge_count = merge_count.data();

  auto decode = fp16 ? (kv8 ? pick_rg<true, true>(rg, stages) : pick_rg<true, false>(rg, stages))
                     : (kv8 ? pick_rg<false, true>(rg, stages) : pick_rg<false, false>(rg, stages));
  if (!decode) return 3;
  run_grid(decode, p, num_ctas, head_blocks, 128 * rg, reversed);
  auto combine = fp16 ? (rg == 1 ? combine_entry<true, 1> : combine_entry<true, 2>)
                      : (rg == 1 ? combine_entry<false, 1> : combine_entry<false, 2>);
  run_grid(combine, p, combine_ctas, head_blocks, 128, reversed);
  for (int c : merge_count)
    if (c != 0) return 4;  // a counter not reset for the next launch

  FILE* o = std::fopen(argv[2], "wb");
  std::fwrite(out.data(), sizeof(u16), out.size(), o);
  std::fclose(o);
  return 0;
}
