#pragma once
// W4A16 GEMM kernel (Marlin-style): int4 weights in the int4_pack layout (gemm/int4.h) are
// dequantised in registers with the lop3 magic-number trick straight into mma.m16n8k16 B
// fragments; group scales and zero points are applied in registers (half2 sub + mul: exact
// integer subtraction, one rounding for the scale product).
//
// CTA: 256 threads (8 warps), output tile BM (16, 32 or 64) rows x 128 columns; warp w owns the
// 16 columns [16 w, 16 w + 16) of the tile (two n8 mma tiles) for all BM rows (BM / 16 m16 tiles).
// K is consumed in units of 64; a pipeline stage is one unit: the 128 x 64 weight block (4 KB,
// each lane cp.async's exactly the 16 bytes it will dequantise), the BM x 64 activation block
// (XOR-swizzled 16-byte chunks, read with ldmatrix.x4), and the unit's rows of scales and zeros:
// kRows = 2 holds one row per 32 k (the second a copy of the first when G % 64 == 0), kRows = 4
// one per k16 step (G a multiple of 16 but not of 32: GGUF Q6_K's 16-weight sub-blocks). kStages
// stages are in flight
// (cp.async.cg multi-stage pipeline, one __syncthreads per unit).
//
// Split-K: grid (N / 128, ceil(M / BM), splits); split s reduces units [s * ups, (s + 1) * ups).
// With splits > 1 each CTA stores its fp32 partial tile to the workspace [splits, M, N], then
// counts itself in counters[tile]; the last CTA of a tile sums the partials in split order (so
// the result does not depend on which CTA finishes last) and writes out, resetting the counter.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/gemm/int4.h"

#include <cstring>

namespace fastinfer::gemm::int4 {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = kWarps * kInt4TileN;  // 128 columns per CTA
constexpr int kUnitK = kInt4TileK;            // 64
constexpr int kUnitWords = 128;               // words of one 64 x 16 unit
constexpr int kAChunksPerRow = kUnitK * 2 / mma::kChunkBytes;  // 8: an activation row of a unit
constexpr uint32_t kNibbleMask = 0x000F000Fu;
constexpr int kLop3AndOr = 0xEA;              // (a & b) | c

template <typename T> struct Half2Of;
template <> struct Half2Of<__half> {
  using type = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // fp16 1024.0: mantissa bits 0-9 hold the nibble
};
template <> struct Half2Of<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // bf16 128.0: mantissa bits 0-6 hold the nibble
};

template <int BM, int kRows>
struct Config {
  static_assert(BM == 16 || BM == 32 || BM == 64, "BM 16, 32 or 64");
  static_assert(kRows == 2 || kRows == 4, "scale rows per unit: 2 (G % 32 == 0) or 4 (G % 16 == 0)");
  static constexpr int kMTiles = BM / 16;
  static constexpr int kStages = BM <= 32 ? 8 : 6;
  static constexpr int kBBytes = kBlockN * kUnitK / 2;  // 4096
  static constexpr int kABytes = BM * kUnitK * 2;       // BM rows of 128 bytes
  static constexpr int kSBytes = kRows * kBlockN * 2;   // kRows scale rows
  static constexpr int kZBytes = kRows * kBlockN;       // kRows zero-point rows
  static constexpr int kAOffset = kBBytes;
  static constexpr int kSOffset = kAOffset + kABytes;
  static constexpr int kZOffset = kSOffset + kSBytes;
  static constexpr int kStageBytes = kZOffset + kZBytes;
  static constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * kStageBytes;
  // Two CTAs per SM for the small tiles (registers capped at 128).
  static constexpr int kMinCtas = BM <= 32 ? 2 : 1;
};

template <typename T2>
__device__ __forceinline__ T2 bits_to_pair(uint32_t x) {
  T2 r;
  memcpy(&r, &x, sizeof(r));
  return r;
}
template <typename T2>
__device__ __forceinline__ uint32_t pair_to_bits(T2 x) {
  uint32_t r;
  memcpy(&r, &x, sizeof(r));
  return r;
}

// Broadcast of a 16-bit value (low half of x) to both halves.
__device__ __forceinline__ uint32_t broadcast_low_half(uint32_t x) { return ptx::prmt(x, 0u, 0x1010u); }

// magic + z in both halves, from the zero point in the low byte of z (z <= 15 fits the mantissa).
template <typename T>
__device__ __forceinline__ uint32_t magic_plus_zero(uint32_t z) {
  return ptx::prmt(z, Half2Of<T>::kMagic, 0x5050u);
}

// One packed word -> the four b registers of two n8 tiles (see the layout in gemm/int4.h):
// b[0..1] for columns n0 + g (zero/scale pair 0), b[2..3] for n0 + 8 + g (pair 1).
// (magic + q) - (magic + z) is an exact small integer; times s rounds once.
template <typename T>
__device__ __forceinline__ void dequant_word(uint32_t q, uint32_t zs0, uint32_t s0, uint32_t zs1, uint32_t s1,
                                             uint32_t (&b)[4]) {
  using T2 = typename Half2Of<T>::type;
  constexpr uint32_t kMagic = Half2Of<T>::kMagic;
  const uint32_t v0 = ptx::lop3<kLop3AndOr>(q, kNibbleMask, kMagic);
  const uint32_t v1 = ptx::lop3<kLop3AndOr>(q >> 4, kNibbleMask, kMagic);
  const uint32_t v2 = ptx::lop3<kLop3AndOr>(q >> 8, kNibbleMask, kMagic);
  const uint32_t v3 = ptx::lop3<kLop3AndOr>(q >> 12, kNibbleMask, kMagic);
  const T2 z0 = bits_to_pair<T2>(zs0), z1 = bits_to_pair<T2>(zs1);
  const T2 sc0 = bits_to_pair<T2>(s0), sc1 = bits_to_pair<T2>(s1);
  b[0] = pair_to_bits(__hmul2(__hsub2(bits_to_pair<T2>(v0), z0), sc0));
  b[1] = pair_to_bits(__hmul2(__hsub2(bits_to_pair<T2>(v1), z0), sc0));
  b[2] = pair_to_bits(__hmul2(__hsub2(bits_to_pair<T2>(v2), z1), sc1));
  b[3] = pair_to_bits(__hmul2(__hsub2(bits_to_pair<T2>(v3), z1), sc1));
}

template <typename T, int BM, int kRows>
__global__ void __launch_bounds__(kThreads, Config<BM, kRows>::kMinCtas)
    int4_gemm_kernel(const Int4GemmParams p, int32_t units_per_split, int32_t num_splits) {
  using Cfg = Config<BM, kRows>;
  constexpr int kStages = Cfg::kStages;
  unsigned char* smem = dynamic_smem<unsigned char>();
  __shared__ int s_is_last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int n_block = blockIdx.x, m_block = blockIdx.y, split = blockIdx.z;
  const int64_t m0 = static_cast<int64_t>(m_block) * BM;
  const int rows_valid = static_cast<int>(p.m - m0 < BM ? p.m - m0 : BM);
  const int n_cta = n_block * kBlockN;
  const int n_tiles = p.n / kInt4TileN;
  const int warp_tile = n_block * kWarps + warp;  // n16 tile of this warp
  const bool warp_valid = warp_tile < n_tiles;
  const int units_total = p.k / kUnitK;
  const int u_begin = split * units_per_split;
  const int u_end = u_begin + units_per_split < units_total ? u_begin + units_per_split : units_total;
  const int num_units = u_end - u_begin;
  const int G = p.group_size;
  // distinct group rows in a unit: with kRows = 2, one when G % 64 == 0 (row 1 repeats row 0)
  const bool all_rows = kRows == 4 || (G % 64) != 0;
  const bool has_zeros = p.zeros != nullptr;
  const T* a = static_cast<const T*>(p.a);
  const T* scales = static_cast<const T*>(p.scales);

  auto load_unit = [&](int u, int slot) {
    unsigned char* st = smem + slot * Cfg::kStageBytes;
    // Weights: every lane copies the 16 bytes it will dequantise.
    const uint32_t* bsrc =
        p.packed + (static_cast<int64_t>(u) * n_tiles + (warp_valid ? warp_tile : 0)) * kUnitWords + lane * 4;
    ptx::cp_async_cg_16(st + warp * (kUnitWords * 4) + lane * 16, bsrc, warp_valid);
    // Activations: BM rows x 8 chunks of 16 bytes, swizzled.
#pragma unroll
    for (int c = tid; c < BM * 8; c += kThreads) {
      const int r = c >> 3, ch = c & 7;
      const bool v = r < rows_valid;
      const T* asrc = a + (m0 + (v ? r : 0)) * p.a_row_stride + u * kUnitK + ch * 8;
      ptx::cp_async_cg_16(st + Cfg::kAOffset + mma::swizzle<kAChunksPerRow>(r, ch), asrc, v);
    }
    // Scales (16 chunks of 8 columns per row) and zero points (8 chunks of 16 columns per row);
    // row r covers k [64 u + r kUnitK / kRows, ...).
    if (tid < 16 * kRows) {
      const int row = tid >> 4, ch = tid & 15;
      if (row == 0 || all_rows) {
        const int64_t grow = (static_cast<int64_t>(u) * kUnitK + row * (kUnitK / kRows)) / G;
        const int col = n_cta + ch * 8;
        const bool v = col < p.n;
        ptx::cp_async_cg_16(st + Cfg::kSOffset + row * (kBlockN * 2) + ch * 16, scales + grow * p.n + (v ? col : 0),
                            v);
      }
    } else if (tid < 24 * kRows && has_zeros) {
      const int i = tid - 16 * kRows, row = i >> 3, ch = i & 7;
      if (row == 0 || all_rows) {
        const int64_t grow = (static_cast<int64_t>(u) * kUnitK + row * (kUnitK / kRows)) / G;
        const int col = n_cta + ch * 16;
        const bool v = col < p.n;
        ptx::cp_async_cg_16(st + Cfg::kZOffset + row * kBlockN + ch * 16, p.zeros + grow * p.n + (v ? col : 0), v);
      }
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
  const uint32_t symmetric_zero = Half2Of<T>::kMagic | 0x00080008u;

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
    uint32_t sc[kRows][2], zs[kRows][2];  // [scale row][n8 tile]
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int rr = all_rows ? r : 0;
      const uint16_t* srow = reinterpret_cast<const uint16_t*>(st + Cfg::kSOffset) + rr * kBlockN;
      const uint8_t* zrow = st + Cfg::kZOffset + rr * kBlockN;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        sc[r][nt] = broadcast_low_half(srow[col_in_cta + 8 * nt]);
        zs[r][nt] = has_zeros ? magic_plus_zero<T>(zrow[col_in_cta + 8 * nt]) : symmetric_zero;
      }
    }
    const uint32_t words[4] = {bq.x, bq.y, bq.z, bq.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b[4];
      const int r = j * kRows / 4;  // the k16 step's scale row
      dequant_word<T>(words[j], zs[r][0], sc[r][0], zs[r][1], sc[r][1], b);
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
              mma::pack2<T>(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
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
    dst[0] = mma::pack2<T>(sum.x, sum.y);
    dst[1] = mma::pack2<T>(sum.z, sum.w);
  }
}

// One thread per packed word: 8 weights of w[N, K], dequantised exactly as in the GEMM. A word
// holds columns 2t, 2t + 1 and 2t + 8, 2t + 9 of two rows, so each of the four 4-byte stores of a
// warp fills half of 8 sectors (8 sectors per request, 4 ideal: simt profile); the other halves
// come from the next store of the same warp, so L2 merges them and DRAM sees whole sectors.
// Regrouping the pairs per thread would take two shuffles per store for this M >= 512 path.
constexpr int kDequantThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kDequantThreads) int4_dequantize_kernel(const Int4DequantizeParams p) {
  const int64_t word = static_cast<int64_t>(blockIdx.x) * kDequantThreads + threadIdx.x;
  const int n_tiles = p.n / kInt4TileN;
  const int64_t total = static_cast<int64_t>(p.n) * p.k / 8;
  if (word >= total) return;
  const int64_t unit = word / kUnitWords;
  const int within = static_cast<int>(word % kUnitWords);
  const int lane = within >> 2, j = within & 3, g = lane >> 2, t = lane & 3;
  const int64_t kt = unit / n_tiles;
  const int nt = static_cast<int>(unit % n_tiles);
  const int64_t k0 = kt * kUnitK + 16 * j;
  const int n0 = nt * kInt4TileN;
  const int64_t grow = k0 / p.group_size;
  const uint16_t* srow = static_cast<const uint16_t*>(p.scales) + grow * p.n;
  const uint32_t s0 = broadcast_low_half(srow[n0 + g]), s1 = broadcast_low_half(srow[n0 + 8 + g]);
  uint32_t z0 = Half2Of<T>::kMagic | 0x00080008u, z1 = z0;
  if (p.zeros != nullptr) {
    z0 = magic_plus_zero<T>(p.zeros[grow * p.n + n0 + g]);
    z1 = magic_plus_zero<T>(p.zeros[grow * p.n + n0 + 8 + g]);
  }
  uint32_t b[4];
  dequant_word<T>(p.packed[word], z0, s0, z1, s1, b);
  T* w = static_cast<T*>(p.w);
  const int64_t r0 = static_cast<int64_t>(n0 + g) * p.k, r1 = static_cast<int64_t>(n0 + 8 + g) * p.k;
  *reinterpret_cast<uint32_t*>(w + r0 + k0 + 2 * t) = b[0];
  *reinterpret_cast<uint32_t*>(w + r0 + k0 + 2 * t + 8) = b[1];
  *reinterpret_cast<uint32_t*>(w + r1 + k0 + 2 * t) = b[2];
  *reinterpret_cast<uint32_t*>(w + r1 + k0 + 2 * t + 8) = b[3];
}

}  // namespace fastinfer::gemm::int4
