#pragma once
// fused_moe's grouped GEMMs on 4-bit (W4A16) experts: INT4 (MoeWeightFormat::kInt4) and FP4
// (kNvfp4, kMxfp4); launcher cuda/src/fused_moe.cu. The structure of moe/fused_moe.cuh's
// moe_gemm_kernel (row blocks of one expert from moe_align, A rows gathered by token or slot, the
// activation on the gate/up accumulators, y by slot) with the B operand of gemm/int4_gemm.cuh: every
// lane cp.async's the 16 bytes of packed words it decodes straight into mma.m16n8k16 B fragments.
// Both formats share the packed layout (int4_pack's, the 4-bit codes as nibbles), so one kernel
// template serves them; a weight decoder (Int4Weights, Fp4Weights below) stages a unit's scales and
// turns a word into B fragments, as gemm/fp4_gemm.cuh reuses int4_gemm.cuh's pipeline.
//
// A stage is one 64-wide k unit: per warp and half the 64 x 16 weight unit (512 bytes), the block's
// kBlockM A rows of 64 elements (128 bytes, swizzled: one mma::load_k_tile_gathered k-tile), and
// the decoder's scale bytes of the unit for the CTA's columns of each half. Warp w owns the n16
// tile w of each half: kGateUp runs 4 warps over 64 columns, a gate tile and the up tile of the
// same columns each (the activation stays in registers); kDown 8 warps over 128 columns (4 over 64
// with 16-row blocks).
//
// Batch invariance as moe_gemm_kernel: each accumulator runs over the k16 steps in order, no
// split-K, whatever the tier.
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/gemm/fp4_gemm.cuh"
#include "fastinfer/gemm/int4_gemm.cuh"
#include "fastinfer/moe/fused_moe.cuh"

#include <cstdint>

namespace fastinfer::moe {

// The tile of one GEMM of a tier: rows, warps, columns per half, ring depth (the decoder adds its
// scale bytes to each stage).
template <int kBlockM_, MoeGemm kGemm_>
struct MoeW4Shape {
  static_assert(kBlockM_ == 16 || kBlockM_ == 64, "16- or 64-row blocks");
  static constexpr int kBlockM = kBlockM_;
  static constexpr MoeGemm kGemm = kGemm_;
  static constexpr int kHalves = kGemm == MoeGemm::kGateUp ? 2 : 1;
  // kGateUp: 4 warps of gate + up tiles; kDown: 8 warps (4 with 16-row blocks, whose 128 A chunks
  // must be whole cp.async passes)
  static constexpr int kWarps = kGemm == MoeGemm::kGateUp || kBlockM == 16 ? 4 : 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kCols = kWarps * kInt4TileN;  // columns per half of a CTA
  static constexpr int kMTiles = kBlockM / 16;
  static constexpr int kStages = kBlockM <= 16 ? 8 : 6;
  static constexpr int kUnitBytes = 128 * 4;  // one 64 x 16 unit of packed words
  static constexpr int kBBytes = kHalves * kWarps * kUnitBytes;
  static constexpr int kABytes = kBlockM * mma::kGemmKTileBytes;
};

// The weight stack of one GEMM of expert `expert`: w13 (kGateUp, N = I per half, 2I rows) or w2.
struct W4Operand {
  const uint32_t* packed;  // the expert's [K / 64, 8 n_total] words
  int64_t N, K, n_total, I;
};

__device__ __forceinline__ W4Operand w4_operand(const FusedMoeParams& p, bool gate_up, int64_t expert) {
  W4Operand o;
  o.I = p.intermediate;
  o.N = gate_up ? p.intermediate : p.hidden;
  o.K = gate_up ? p.hidden : p.intermediate;
  o.n_total = gate_up ? 2 * o.I : o.N;
  o.packed = static_cast<const uint32_t*>(gate_up ? p.w13 : p.w2) + expert * (o.K / kInt4TileK) * (o.n_total / kInt4TileN) * 128;
  return o;
}

// INT4: the two group rows of scales (the dtype) and zero points (uint8) a unit can span
// (G % 64 != 0), [row][half][kCols] each; (q - z) * s in registers (gemm/int4_gemm.cuh).
template <typename T, typename Shape>
struct Int4Weights {
  static constexpr int kHalves = Shape::kHalves, kCols = Shape::kCols;
  static constexpr int kSBytes = 2 * kHalves * kCols * 2;
  static constexpr int kZBytes = 2 * kHalves * kCols;
  static constexpr int kBytes = kSBytes + kZBytes;
  static_assert(kSBytes % 16 == 0 && kZBytes % 16 == 0, "16-byte cp.async chunks");

  const T* scales;
  const uint8_t* zeros;  // nullptr: symmetric (z = 8)
  int G;
  bool two_rows;

  __device__ __forceinline__ Int4Weights(const FusedMoeParams& p, bool gate_up, int64_t expert, const W4Operand& o) {
    G = p.group_size;
    two_rows = (G % 64) != 0;
    const int64_t groups = static_cast<int32_t>(o.K) / G;  // 32-bit divisions: no division routine call
    scales = static_cast<const T*>(gate_up ? p.w13_group_scales : p.w2_group_scales) + expert * groups * o.n_total;
    zeros = gate_up ? p.w13_zeros : p.w2_zeros;
    if (zeros != nullptr) zeros += expert * groups * o.n_total;
  }

  // Unit u's scales and zero points of columns n0 .. n0 + kCols of each half into dst.
  __device__ __forceinline__ void load(uint8_t* dst, int u, int tid, const W4Operand& o, int64_t n0) const {
    constexpr int kSChunks = kCols / 8, kZChunks = kCols / 16;  // 16-bit scales, byte zero points
    for (int c = tid; c < 2 * kHalves * (kSChunks + kZChunks); c += Shape::kThreads) {
      const bool is_scale = c < 2 * kHalves * kSChunks;
      const int idx = is_scale ? c : c - 2 * kHalves * kSChunks;
      const int per_row = is_scale ? kSChunks : kZChunks;
      const int row = idx / (kHalves * per_row), half = (idx / per_row) % kHalves, ch = idx % per_row;
      if (row == 1 && !two_rows) continue;
      if (!is_scale && zeros == nullptr) continue;
      const int grow = (u * kInt4TileK + 32 * row) / G;  // 32-bit: K < 2^31
      const int64_t col = n0 + ch * (is_scale ? 8 : 16);
      const bool v = col < o.N;
      const int64_t src = grow * o.n_total + half * o.I + (v ? col : 0);
      if (is_scale)
        ptx::cp_async_cg_16(dst + ((row * kHalves + half) * kCols + ch * 8) * 2, scales + src, v);
      else
        ptx::cp_async_cg_16(dst + kSBytes + (row * kHalves + half) * kCols + ch * 16, zeros + src, v);
    }
  }

  struct Unit {
    uint32_t sc[2][2], zs[2][2];  // [group row][n8 tile]
  };
  // The scale and zero point pairs of one half's columns col, col + 8 (col = col_in_cta) of the unit.
  __device__ __forceinline__ Unit unit(const uint8_t* src, int half, int col) const {
    const uint32_t symmetric_zero = gemm::int4::Half2Of<T>::kMagic | 0x00080008u;
    Unit un;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rr = two_rows ? r : 0;
      const uint16_t* srow = reinterpret_cast<const uint16_t*>(src) + (rr * kHalves + half) * kCols;
      const uint8_t* zrow = src + kSBytes + (rr * kHalves + half) * kCols;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        un.sc[r][nt] = gemm::int4::broadcast_low_half(srow[col + 8 * nt]);
        un.zs[r][nt] = zeros != nullptr ? gemm::int4::magic_plus_zero<T>(zrow[col + 8 * nt]) : symmetric_zero;
      }
    }
    return un;
  }
  // The B fragments of k16 step j (b[0..1]: n8 tile 0, b[2..3]: tile 1) from its word.
  __device__ __forceinline__ static void decode(const Unit& un, uint32_t word, int j, uint32_t (&b)[4]) {
    const int r = j >> 1;
    gemm::int4::dequant_word<T>(word, un.zs[r][0], un.sc[r][0], un.zs[r][1], un.sc[r][1], b);
  }
  // The accumulators as they are (the scales are in the weights).
  __device__ __forceinline__ void finish(int, float&, float&) const {}
};

// FP4: the unit's scale rows (4 of NVFP4's e4m3, 2 of MXFP4's e8m0; bytes [row][half][kCols]),
// converted to the dtype per unit; e2m1 decoded by prmt table lookup and one multiply, as
// gemm/fp4_gemm.cuh; the accumulators divided by the expert's global scale of the half (NVFP4).
template <typename T, typename Shape, Fp4Format F>
struct Fp4Weights {
  static constexpr int kHalves = Shape::kHalves, kCols = Shape::kCols;
  static constexpr int kRows = kInt4TileK / fp4_group_size(F);  // scale rows per unit
  static constexpr int kStepsPerRow = 4 / kRows;                 // k16 steps per scale row
  static constexpr int kBytes = kRows * kHalves * kCols;
  static_assert(kBytes % 16 == 0 && kCols % 16 == 0, "16-byte cp.async chunks");

  const uint8_t* scales;
  const float* global;  // the expert's kHalves divisors, or nullptr

  __device__ __forceinline__ Fp4Weights(const FusedMoeParams& p, bool gate_up, int64_t expert, const W4Operand& o) {
    scales = static_cast<const uint8_t*>(gate_up ? p.w13_group_scales : p.w2_group_scales) +
             expert * (o.K / fp4_group_size(F)) * o.n_total;
    global = gate_up ? p.w13_global_scale : p.w2_global_scale;
    if (global != nullptr) global += expert * kHalves;
  }

  __device__ __forceinline__ void load(uint8_t* dst, int u, int tid, const W4Operand& o, int64_t n0) const {
    constexpr int kChunks = kCols / 16;
    for (int c = tid; c < kRows * kHalves * kChunks; c += Shape::kThreads) {
      const int row = c / (kHalves * kChunks), half = (c / kChunks) % kHalves, ch = c % kChunks;
      const int64_t grow = static_cast<int64_t>(u) * kRows + row;
      const int64_t col = n0 + ch * 16;
      const bool v = col < o.N;
      ptx::cp_async_cg_16(dst + (row * kHalves + half) * kCols + ch * 16,
                          scales + grow * o.n_total + half * o.I + (v ? col : 0), v);
    }
  }

  struct Unit {
    uint32_t sc[kRows][2];  // [scale row][n8 tile]: the scale as a pair of T
  };
  __device__ __forceinline__ Unit unit(const uint8_t* src, int half, int col) const {
    Unit un;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const float s = gemm::fp4::scale_value<F>(src[(r * kHalves + half) * kCols + col + 8 * nt]);
        un.sc[r][nt] = mma::pack2<T>(s, s);
      }
    return un;
  }
  __device__ __forceinline__ static void decode(const Unit& un, uint32_t word, int j, uint32_t (&b)[4]) {
    using T2 = typename gemm::int4::Half2Of<T>::type;
    const int r = j / kStepsPerRow;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      b[q] = gemm::int4::pair_to_bits(__hmul2(gemm::int4::bits_to_pair<T2>(gemm::fp4::e2m1_pair<T>(word >> (4 * q))),
                                              gemm::int4::bits_to_pair<T2>(un.sc[r][q >> 1])));
  }
  __device__ __forceinline__ void finish(int half, float& v0, float& v1) const {
    if constexpr (F == Fp4Format::kMxfp4) return;  // no global scale (the launcher refuses one)
    if (global == nullptr) return;
    const float gs = global[half];
    v0 = __fdiv_rn(v0, gs);
    v1 = __fdiv_rn(v1, gs);
  }
};

template <typename Shape, typename Weights>
struct MoeW4Config : Shape {
  static constexpr int kAOffset = Shape::kBBytes;
  static constexpr int kSOffset = kAOffset + Shape::kABytes;
  static constexpr int kStageBytes = kSOffset + Weights::kBytes;
  static constexpr int kSmemBytes = Shape::kStages * kStageBytes;
  static_assert(kStageBytes % 16 == 0, "16-byte cp.async chunks");
};

// grid (row blocks (upper bound), ceil(N / kCols)), block Shape::kThreads, dynamic smem
// MoeW4Config<Shape, Weights>::kSmemBytes; N = I (kGateUp) or H (kDown), K = H or I.
template <typename Shape, typename Weights, typename T>
__global__ void __launch_bounds__(Shape::kThreads) moe_w4_gemm_kernel(const FusedMoeParams p,
                                                                    const FusedMoeWorkspace w) {
  using Cfg = MoeW4Config<Shape, Weights>;
  constexpr int kBlockM = Cfg::kBlockM, kStages = Cfg::kStages, kHalves = Cfg::kHalves, kCols = Cfg::kCols;
  constexpr bool kGateUp = Cfg::kGemm == MoeGemm::kGateUp;
  const int64_t block_row0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  if (block_row0 >= *w.num_tokens_post_padded) return;  // the whole CTA: past the used blocks
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int64_t expert = w.expert_ids[blockIdx.x];

  const W4Operand o = w4_operand(p, kGateUp, expert);
  const Weights weights(p, kGateUp, expert, o);

  __shared__ int32_t slot_of[kBlockM];
  __shared__ int32_t a_row_of[kBlockM];
  const int used_rows = load_block_rows<kBlockM, Cfg::kThreads, kGateUp>(p, w, block_row0, slot_of, a_row_of);
  const int live_mt = (used_rows + 15) / 16;  // 16-row mma tiles holding a used row: padding skips
  const uint8_t* __restrict__ a_bytes = static_cast<const uint8_t*>(kGateUp ? p.x : w.act);
  const int64_t tiles_total = o.n_total / kInt4TileN;
  const int64_t warp_col = n0 + warp * kInt4TileN;  // this warp's n16 tile within a half
  const bool warp_valid = warp_col < o.N;
  const int num_units = static_cast<int>(o.K / kInt4TileK);
  uint8_t* smem = dynamic_smem<uint8_t>();

  auto load_unit = [&](int u, int stage) {
    uint8_t* st = smem + stage * Cfg::kStageBytes;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {  // weights: each lane the 16 bytes it decodes
      const int64_t tile = (half * o.I + (warp_valid ? warp_col : 0)) / kInt4TileN;
      ptx::cp_async_cg_16(st + (half * Cfg::kWarps + warp) * Cfg::kUnitBytes + lane * 16,
                          o.packed + (static_cast<int64_t>(u) * tiles_total + tile) * 128 + lane * 4, warp_valid);
    }
    mma::load_k_tile_gathered<kBlockM, Cfg::kThreads>(st + Cfg::kAOffset, a_bytes, a_row_of, 2 * o.K, u, tid);
    weights.load(st + Cfg::kSOffset, u, tid, o, n0);
  };

  float acc[kHalves][Cfg::kMTiles][2][4];
#pragma unroll
  for (int half = 0; half < kHalves; ++half)
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) acc[half][mt][nt][0] = acc[half][mt][nt][1] = acc[half][mt][nt][2] = acc[half][mt][nt][3] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_units) load_unit(s, s);
    ptx::cp_async_commit();
  }

  const mma::LdmatrixLane a_lane(lane);
  const int col_in_cta = warp * kInt4TileN + g;  // columns col_in_cta and col_in_cta + 8 of each half

  for (int u = 0; u < num_units; ++u) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = u + kStages - 1;
      if (next < num_units) load_unit(next, next % kStages);
      ptx::cp_async_commit();
    }
    const uint8_t* st = smem + (u % kStages) * Cfg::kStageBytes;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      const uint4 bq = *reinterpret_cast<const uint4*>(st + (half * Cfg::kWarps + warp) * Cfg::kUnitBytes + lane * 16);
      const typename Weights::Unit un = weights.unit(st + Cfg::kSOffset, half, col_in_cta);
      const uint32_t words[4] = {bq.x, bq.y, bq.z, bq.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // k16 step j of the unit
        uint32_t b[4];
        Weights::decode(un, words[j], j, b);
        const uint32_t b0[2] = {b[0], b[1]};
        const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
          if (mt >= live_mt) break;
          uint32_t af[4];
          mma::load_a<mma::kGemmKTileChunks>(af, st + Cfg::kAOffset, a_lane.a_row(mt), 2 * j + a_lane.a_chunk());
          ptx::mma_m16n8k16<T>(acc[half][mt][0], af, b0);
          ptx::mma_m16n8k16<T>(acc[half][mt][1], af, b1);
        }
      }
    }
  }
  ptx::cp_async_wait<0>();

  // Epilogue: acc[half][mt][nt][c] is row mt * 16 + g + 8 (c >> 1), column 8 nt + 2 t + (c & 1)
  // of the warp's n16 tile (N is a multiple of 16: a warp's tile is all in or all out).
  if (!warp_valid) return;
  const T* __restrict__ bias = static_cast<const T*>(kGateUp ? p.w13_bias : p.w2_bias);
  if (bias != nullptr) bias += expert * o.n_total;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int32_t slot = slot_of[mt * 16 + g + 8 * h];
      if (slot < 0) continue;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int64_t n = warp_col + 8 * nt + 2 * t;
        float v[kHalves][2];
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
          v[half][0] = acc[half][mt][nt][2 * h];
          v[half][1] = acc[half][mt][nt][2 * h + 1];
          weights.finish(half, v[half][0], v[half][1]);
        }
        finish_output_pair<T, kGateUp, kHalves>(p, w, bias, slot, n, v);
      }
    }
  }
}

}  // namespace fastinfer::moe
