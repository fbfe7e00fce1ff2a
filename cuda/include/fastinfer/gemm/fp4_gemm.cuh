#pragma once
// FP4 W4A16 GEMM kernel: int4_gemm's pipeline (gemm/int4_gemm.cuh: CTA tile BM x 128, 8 warps of
// 16 columns, 64-wide k units in cp.async stages, split-K with fp32 partials summed in split
// order) with e2m1 codes decoded in registers by table lookup (prmt) straight into mma.m16n8k16 B
// fragments, and the group scale bits (e4m3 / e8m0) of each unit staged in shared memory and
// converted to the activation dtype there.
//
// Decoding one b register (two codes, bits 0..3 and 16..19 of x = word >> 4 i): the magnitude
// codes (bits 0..2) become prmt selectors, [c0, 0, c1, 0] and [0, c0, 0, c1] by nibble, that pick
// bytes of the 16-bit encodings of the 8 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 from two-register
// tables (entry 0 is the zero byte, so the unused selector nibbles write zeros): fp16 needs only
// the high bytes (the low ones are zero), bf16 a low-byte and a high-byte table. The sign bit
// (bit 3) is then moved to bit 15 / 31; one multiply by the scale pair rounds e2m1 * s once.
#include "fastinfer/gemm/fp4.h"
#include "fastinfer/gemm/int4_gemm.cuh"

namespace fastinfer::gemm::fp4 {

using int4::kAChunksPerRow;
using int4::kBlockN;
using int4::kThreads;
using int4::kUnitK;
using int4::kUnitWords;
using int4::kWarps;

// prmt tables: byte c (c = 0..7 over the two registers) is a byte of the magnitude E2M1_VALUES[c].
template <typename T> struct E2m1Table;
template <> struct E2m1Table<__half> {
  // fp16 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000, 0x3800, 0x3C00, 0x3E00, 0x4000, 0x4200, 0x4400, 0x4600
  static constexpr uint32_t kHi0 = 0x3E3C3800u, kHi1 = 0x46444240u;
};
template <> struct E2m1Table<__nv_bfloat16> {
  // bf16 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0
  static constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;
  static constexpr uint32_t kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;
};

template <typename T>
__device__ __forceinline__ uint32_t e2m1_magnitudes(uint32_t sel_lo, uint32_t sel_hi);
template <>
__device__ __forceinline__ uint32_t e2m1_magnitudes<__half>(uint32_t, uint32_t sel_hi) {
  return ptx::prmt(E2m1Table<__half>::kHi0, E2m1Table<__half>::kHi1, sel_hi);
}
template <>
__device__ __forceinline__ uint32_t e2m1_magnitudes<__nv_bfloat16>(uint32_t sel_lo, uint32_t sel_hi) {
  using Tab = E2m1Table<__nv_bfloat16>;
  return ptx::prmt(Tab::kLo0, Tab::kLo1, sel_lo) | ptx::prmt(Tab::kHi0, Tab::kHi1, sel_hi);
}

// The e2m1 codes in bits 0..3 and 16..19 of x as a pair of T (low half from bits 0..3).
template <typename T>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t x) {
  const uint32_t y = x & 0x00070007u;
  const uint32_t sel_lo = y | (y >> 8);  // selector nibbles [c0, 0, c1, 0]
  const uint32_t sel_hi = sel_lo << 4;   // [0, c0, 0, c1]
  return ptx::lop3<int4::kLop3AndOr>(x << 12, 0x80008000u, e2m1_magnitudes<T>(sel_lo, sel_hi));
}

// Scale bits -> fp32 value (exact).
__device__ __forceinline__ float e4m3_value(uint32_t bits) {
  const uint32_t em = bits & 0x7Fu;
  float v;
  if (em == 0x7Fu)
    v = __uint_as_float(0x7FC00000u);  // e4m3fn NaN
  else if (em < 8u)
    v = static_cast<float>(em) * 0.001953125f;  // subnormal: m * 2^-9
  else
    v = __uint_as_float((((em >> 3) + 120u) << 23) | ((em & 7u) << 20));  // 2^(e - 7) (1 + m / 8)
  return (bits & 0x80u) ? -v : v;
}
__device__ __forceinline__ float e8m0_value(uint32_t e) {
  return __uint_as_float(e == 0u ? 0x00400000u : (e == 255u ? 0x7FC00000u : e << 23));  // 2^(e - 127)
}

template <Fp4Format F>
__device__ __forceinline__ float scale_value(uint32_t bits) {
  if constexpr (F == Fp4Format::kNvfp4)
    return e4m3_value(bits);
  else
    return e8m0_value(bits);
}

template <int BM, Fp4Format F>
struct Config {
  static_assert(BM == 16 || BM == 32 || BM == 64, "BM 16, 32 or 64");
  static constexpr int kMTiles = BM / 16;
  static constexpr int kStages = BM <= 32 ? 8 : 6;
  static constexpr int kScaleRows = kUnitK / fp4_group_size(F);  // 4 (NVFP4) or 2 (MXFP4) per unit
  static constexpr int kStepsPerRow = 4 / kScaleRows;             // k16 steps per scale row
  static constexpr int kBBytes = kBlockN * kUnitK / 2;  // 4096
  static constexpr int kABytes = BM * kUnitK * 2;       // BM rows of 128 bytes
  static constexpr int kSBytes = kScaleRows * kBlockN;  // scale bytes
  static constexpr int kAOffset = kBBytes;
  static constexpr int kSOffset = kAOffset + kABytes;
  static constexpr int kStageBytes = kSOffset + kSBytes;
  static constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * kStageBytes;
  static constexpr int kMinCtas = BM <= 32 ? 2 : 1;
};

template <typename T, int BM, Fp4Format F>
__global__ void __launch_bounds__(kThreads, (Config<BM, F>::kMinCtas))
    fp4_gemm_kernel(const Fp4GemmParams p, int32_t units_per_split, int32_t num_splits) {
  using Cfg = Config<BM, F>;
  constexpr int kStages = Cfg::kStages;
  using T2 = typename int4::Half2Of<T>::type;
  unsigned char* smem = dynamic_smem<unsigned char>();
  __shared__ int s_is_last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x, m_block = blockIdx.y, split = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(m_block) * BM;
  const int rows_valid = static_cast<int>(p.m - m0 < BM ? p.m - m0 : BM);
  const int n_cta = n_block * kBlockN;
  const int n_tiles = p.n / kInt4TileN;
  const int warp_tile = n_block * kWarps + warp;
  const bool warp_valid = warp_tile < n_tiles;
  const int units_total = p.k / kUnitK;
  const int u_begin = split * units_per_split;
  const int u_end = u_begin + units_per_split < units_total ? u_begin + units_per_split : units_total;
  const int num_units = u_end - u_begin;
  const T* a = static_cast<const T*>(p.a);

  auto load_unit = [&](int u, int slot) {
    unsigned char* st = smem + slot * Cfg::kStageBytes;
    const uint32_t* bsrc =
        p.packed + (static_cast<int64_t>(u) * n_tiles + (warp_valid ? warp_tile : 0)) * kUnitWords + lane * 4;
    ptx::cp_async_cg_16(st + warp * (kUnitWords * 4) + lane * 16, bsrc, warp_valid);
#pragma unroll
    for (int c = tid; c < BM * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool v = r < rows_valid;
      const T* asrc = a + (m0 + (v ? r : 0)) * p.a_row_stride + u * kUnitK + ch * 8;
      ptx::cp_async_cg_16(st + Cfg::kAOffset + mma::swizzle<kAChunksPerRow>(r, ch), asrc, v);
    }
    // Scale rows of the unit: 8 chunks of 16 columns each.
    if (tid < Cfg::kScaleRows * 8) {
      const int row = tid >> 3, ch = tid & 7;
      const int64_t grow = static_cast<int64_t>(u) * Cfg::kScaleRows + row;
      const int col = n_cta + ch * 16;
      const bool v = col < p.n;
      ptx::cp_async_cg_16(st + Cfg::kSOffset + row * kBlockN + ch * 16, p.scales + grow * p.n + (v ? col : 0), v);
    }
  };

  float acc[Cfg::kMTiles][2][4];
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_units) load_unit(u_begin + s, s);
    ptx::cp_async_commit();
  }

  const mma::LdmatrixLane a_lane(lane);
  const int col_in_cta = warp * kInt4TileN + g;  // columns col_in_cta and col_in_cta + 8

  for (int i = 0; i < num_units; ++i) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = i + kStages - 1;
      if (next < num_units) load_unit(u_begin + next, next % kStages);
      ptx::cp_async_commit();
    }
    const unsigned char* st = smem + (i % kStages) * Cfg::kStageBytes;
    const uint4 bq = *reinterpret_cast<const uint4*>(st + warp * (kUnitWords * 4) + lane * 16);
    uint32_t sc[Cfg::kScaleRows][2];  // [scale row][n8 tile]: the scale as a pair of T
#pragma unroll
    for (int r = 0; r < Cfg::kScaleRows; ++r)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float s = scale_value<F>(st[Cfg::kSOffset + r * kBlockN + col_in_cta + 8 * nt]);
        sc[r][nt] = mma::pack2<T>(s, s);
      }
    const uint32_t words[4] = {bq.x, bq.y, bq.z, bq.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = j / Cfg::kStepsPerRow;
      uint32_t b[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        b[q] = int4::pair_to_bits(__hmul2(int4::bits_to_pair<T2>(e2m1_pair<T>(words[j] >> (4 * q))),
                                          int4::bits_to_pair<T2>(sc[r][q >> 1])));
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        uint32_t af[4];
        mma::load_a<kAChunksPerRow>(af, st + Cfg::kAOffset, a_lane.a_row(mt), 2 * j + a_lane.a_chunk());
        ptx::mma_m16n8k16<T>(acc[mt][0], af, b0);
        ptx::mma_m16n8k16<T>(acc[mt][1], af, b1);
      }
    }
  }
  ptx::cp_async_wait<0>();

  const float gs = p.global_scale != nullptr ? *p.global_scale : 1.f;
  // Epilogue. acc[mt][nt][c]: row mt * 16 + g + 8 * (c >> 1), column 8 nt + 2 t + (c & 1) of the warp.
  const int col_base = n_cta + warp * kInt4TileN + 2 * t;
  if (num_splits == 1) {
    if (!warp_valid) return;
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + g + 8 * h;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          *reinterpret_cast<uint32_t*>(out + (m0 + row) * p.out_row_stride + col_base + 8 * nt) =
              mma::pack2<T>(__fdiv_rn(acc[mt][nt][2 * h], gs), __fdiv_rn(acc[mt][nt][2 * h + 1], gs));
      }
    return;
  }

  float* ws = static_cast<float*>(p.workspace);
  if (warp_valid) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = mt * 16 + g + 8 * h;
        if (row >= rows_valid) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          __stcg(reinterpret_cast<float2*>(ws + (split * p.m + m0 + row) * p.n + col_base + 8 * nt),
                 make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]));
      }
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int32_t* counter = p.counters + static_cast<int64_t>(m_block) * gridDim.x + n_block;
    const int prev = atomicAdd(counter, 1);
    s_is_last = prev == num_splits - 1;
    if (s_is_last) *counter = 0;  // every split has arrived: ready for the next launch
  }
  __syncthreads();
  if (!s_is_last) return;
  __threadfence();
  const int cols_valid = p.n - n_cta < kBlockN ? p.n - n_cta : kBlockN;
  T* out = static_cast<T*>(p.out);
  for (int e = tid * 4; e < rows_valid * kBlockN; e += kThreads * 4) {
    const int r = e / kBlockN, c = e % kBlockN;
    if (c >= cols_valid) continue;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < num_splits; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(ws + (s * p.m + m0 + r) * p.n + n_cta + c));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (m0 + r) * p.out_row_stride + n_cta + c);
    dst[0] = mma::pack2<T>(__fdiv_rn(sum.x, gs), __fdiv_rn(sum.y, gs));
    dst[1] = mma::pack2<T>(__fdiv_rn(sum.z, gs), __fdiv_rn(sum.w, gs));
  }
}

}  // namespace fastinfer::gemm::fp4
