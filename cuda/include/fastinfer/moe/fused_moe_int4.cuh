#pragma once
// fused_moe's grouped GEMMs on INT4 (W4A16) experts (MoeWeightFormat::kInt4; launcher
// cuda/src/fused_moe.cu). The structure of moe/fused_moe.cuh's moe_gemm_kernel (row blocks of one
// expert from moe_align, A rows gathered by token or slot, the activation on the gate/up
// accumulators, y by slot in fp32) with the B operand of gemm/int4_gemm.cuh: every lane cp.async's
// the 16 bytes of packed words it dequantises (lop3 magic numbers, exact integer subtraction of the
// zero point, one rounding for the scale) straight into mma.m16n8k16 B fragments.
//
// A stage is one 64-wide k unit: per warp and half the 64 x 16 weight unit (512 bytes), the block's
// kBlockM A rows of 64 elements (128 bytes, swizzled: one mma::load_k_tile_gathered k-tile), and
// the two group rows of scales and zero points the unit can span (G % 64 != 0), for the CTA's
// columns of each half. Warp w owns the n16 tile w of each half: kGateUp runs 4 warps over 64
// columns, a gate tile and the up tile of the same columns each (the activation stays in
// registers); kDown 8 warps over 128 columns (4 over 64 with 16-row blocks).
//
// Batch invariance as moe_gemm_kernel: each accumulator runs over the k16 steps in order, no
// split-K, whatever the tier.
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/gemm/int4_gemm.cuh"
#include "fastinfer/moe/fused_moe.cuh"

#include <cstdint>

namespace fastinfer::moe {

template <int kBlockM_, MoeGemm kGemm_>
struct MoeInt4Config {
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
  static constexpr int kUnitBytes = 128 * 4;          // one 64 x 16 unit of packed words
  static constexpr int kBBytes = kHalves * kWarps * kUnitBytes;
  static constexpr int kABytes = kBlockM * mma::kGemmKTileBytes;
  static constexpr int kSBytes = 2 * kHalves * kCols * 2;  // two group rows of scales per half
  static constexpr int kZBytes = 2 * kHalves * kCols;      // and of zero points
  static constexpr int kAOffset = kBBytes;
  static constexpr int kSOffset = kAOffset + kABytes;
  static constexpr int kZOffset = kSOffset + kSBytes;
  static constexpr int kStageBytes = kZOffset + kZBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static_assert(kSBytes % 16 == 0 && kZBytes % 16 == 0 && kStageBytes % 16 == 0, "16-byte cp.async chunks");
};

// grid (row blocks (upper bound), ceil(N / kCols)), block Cfg::kThreads, dynamic smem
// Cfg::kSmemBytes; N = I (kGateUp) or H (kDown), K = H or I.
template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads) moe_int4_gemm_kernel(const FusedMoeParams p,
                                                                      const FusedMoeWorkspace w) {
  using gemm::int4::Half2Of;
  constexpr int kBlockM = Cfg::kBlockM, kStages = Cfg::kStages, kHalves = Cfg::kHalves, kCols = Cfg::kCols;
  constexpr bool kGateUp = Cfg::kGemm == MoeGemm::kGateUp;
  const int64_t block_row0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  if (block_row0 >= *w.num_tokens_post_padded) return;  // the whole CTA: past the used blocks
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t H = p.hidden, I = p.intermediate;
  const int64_t N = kGateUp ? I : H, K = kGateUp ? H : I;
  const int64_t n_total = kGateUp ? 2 * I : H;  // the expert's weight rows (both halves)
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int64_t expert = w.expert_ids[blockIdx.x];
  const int G = p.group_size;
  const bool two_rows = (G % 64) != 0;
  const int64_t groups = K / G;

  __shared__ int32_t slot_of[kBlockM];
  __shared__ int32_t a_row_of[kBlockM];
  const int used_rows = load_block_rows<kBlockM, Cfg::kThreads, kGateUp>(p, w, block_row0, slot_of, a_row_of);
  const int live_mt = (used_rows + 15) / 16;  // 16-row mma tiles holding a used row: padding skips

  const uint8_t* __restrict__ a_bytes = static_cast<const uint8_t*>(kGateUp ? p.x : w.act);
  const int64_t tiles_total = n_total / kInt4TileN;
  const uint32_t* packed =
      static_cast<const uint32_t*>(kGateUp ? p.w13 : p.w2) + expert * (K / kInt4TileK) * tiles_total * 128;
  const T* scales = static_cast<const T*>(kGateUp ? p.w13_group_scales : p.w2_group_scales) + expert * groups * n_total;
  const uint8_t* zeros = kGateUp ? p.w13_zeros : p.w2_zeros;
  if (zeros != nullptr) zeros += expert * groups * n_total;
  const int64_t warp_col = n0 + warp * kInt4TileN;  // this warp's n16 tile within a half
  const bool warp_valid = warp_col < N;
  const int num_units = static_cast<int>(K / kInt4TileK);
  uint8_t* smem = dynamic_smem<uint8_t>();

  auto load_unit = [&](int u, int stage) {
    uint8_t* st = smem + stage * Cfg::kStageBytes;
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {  // weights: each lane the 16 bytes it dequantises
      const int64_t tile = (half * I + (warp_valid ? warp_col : 0)) / kInt4TileN;
      ptx::cp_async_cg_16(st + (half * Cfg::kWarps + warp) * Cfg::kUnitBytes + lane * 16,
                          packed + (static_cast<int64_t>(u) * tiles_total + tile) * 128 + lane * 4, warp_valid);
    }
    mma::load_k_tile_gathered<kBlockM, Cfg::kThreads>(st + Cfg::kAOffset, a_bytes, a_row_of, 2 * K, u, tid);
    // Scales: [row][half][kCols] 16-bit (8 per chunk); zero points [row][half][kCols] bytes (16 per chunk).
    constexpr int kSChunks = kCols / 8, kZChunks = kCols / 16;
    for (int c = tid; c < 2 * kHalves * (kSChunks + kZChunks); c += Cfg::kThreads) {
      const bool is_scale = c < 2 * kHalves * kSChunks;
      const int idx = is_scale ? c : c - 2 * kHalves * kSChunks;
      const int per_row = is_scale ? kSChunks : kZChunks;
      const int row = idx / (kHalves * per_row), half = (idx / per_row) % kHalves, ch = idx % per_row;
      if (row == 1 && !two_rows) continue;
      if (!is_scale && zeros == nullptr) continue;
      const int64_t grow = (static_cast<int64_t>(u) * kInt4TileK + 32 * row) / G;
      const int64_t col = n0 + ch * (is_scale ? 8 : 16);
      const bool v = col < N;
      const int64_t src = grow * n_total + half * I + (v ? col : 0);
      if (is_scale)
        ptx::cp_async_cg_16(st + Cfg::kSOffset + ((row * kHalves + half) * kCols + ch * 8) * 2, scales + src, v);
      else
        ptx::cp_async_cg_16(st + Cfg::kZOffset + (row * kHalves + half) * kCols + ch * 16, zeros + src, v);
    }
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
  const uint32_t symmetric_zero = Half2Of<T>::kMagic | 0x00080008u;

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
      uint32_t sc[2][2], zs[2][2];  // [group row][n8 tile]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int rr = two_rows ? r : 0;
        const uint16_t* srow = reinterpret_cast<const uint16_t*>(st + Cfg::kSOffset) + (rr * kHalves + half) * kCols;
        const uint8_t* zrow = st + Cfg::kZOffset + (rr * kHalves + half) * kCols;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          sc[r][nt] = gemm::int4::broadcast_low_half(srow[col_in_cta + 8 * nt]);
          zs[r][nt] = zeros != nullptr ? gemm::int4::magic_plus_zero<T>(zrow[col_in_cta + 8 * nt]) : symmetric_zero;
        }
      }
      const uint32_t words[4] = {bq.x, bq.y, bq.z, bq.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // k16 step j of the unit
        uint32_t b[4];
        const int r = j >> 1;
        gemm::int4::dequant_word<T>(words[j], zs[r][0], sc[r][0], zs[r][1], sc[r][1], b);
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
  if (bias != nullptr) bias += expert * n_total;
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
        }
        finish_output_pair<T, kGateUp, kHalves>(p, w, bias, slot, n, v);
      }
    }
  }
}

}  // namespace fastinfer::moe
