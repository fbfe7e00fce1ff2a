#pragma once
// Scaled int8 GEMM on mma.sync.m16n8k32.s8.s8.s32 (sm_80+):
//   out[M,N] = sa * sb * (a @ b^T - azp[m] * azp_adj[n]) (+ bias)   (exact int32 accumulation)
//
// The tile geometry, shared-memory layout and pipeline are the fp8 kernel's (gemm/fp8_gemm.cuh,
// whose header explains them; the same mma::GemmConfig tiles of common/mma.cuh): 128-byte k-tile rows with the
// chunk ^ (row & 7) swizzle, so every ldmatrix phase and every cp.async store covers all 32 banks
// once; a kStages-deep cp.async ring with one __syncthreads per k-tile; ldmatrix.x4 fragments (the
// s8 m16n8k32 A / B layouts are the e4m3 ones: 4 bytes of k per register). Only the arithmetic
// differs: int32 accumulators (the sum is exact, so this kernel, the emulator, the CPU
// implementation and the reference agree bit for bit), and the epilogue of gemm/int8.h:
//   c = acc - azp[m] * azp_adj[n] (int32), v = float(c) * (sa[m] * sb[n]) (+ bias[n] by one fma).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/int8.h"

#include <cstdint>

namespace fastinfer::int8 {

constexpr int kBlockK = mma::kGemmKTileBytes;  // k-tile in elements (= bytes)

// M buckets as for fp8 (launcher: cuda/src/gemm_int8.cu).
using Int8ConfigSmall = mma::GemmConfig<16, 32, 1, 2, 4>;    // M <= 16: 2 warps, 24 KiB smem
using Int8ConfigMedium = mma::GemmConfig<64, 128, 2, 4, 3>;  // M <= 64: 8 warps of 32 x 32, 72 KiB
using Int8ConfigLarge = mma::GemmConfig<128, 128, 2, 4, 3>;  // 8 warps of 64 x 32, 96 KiB

// grid (ceil(N / kBlockN), ceil(M / kBlockM)), block Cfg::kThreads, dynamic smem Cfg::kSmemBytes.
template <typename Cfg, typename TOut>
__global__ void __launch_bounds__(Cfg::kThreads, 1) int8_scaled_mm_kernel(const Int8ScaledMmParams p) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kMi = Cfg::kMi, kNi = Cfg::kNi;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBlockM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBlockN;
  const int64_t M = p.m, N = p.n, K = p.k;
  const int num_k_tiles = static_cast<int>((K + kBlockK - 1) / kBlockK);

  const uint8_t* __restrict__ a_ptr = static_cast<const uint8_t*>(p.a);
  const uint8_t* __restrict__ b_ptr = static_cast<const uint8_t*>(p.b);
  uint8_t* smem = dynamic_smem<uint8_t>();

  auto load_tile = [&](int kt, int stage) {  // K % 16 == 0 (one byte per element)
    mma::load_ab_stage<Cfg>(smem + stage * Cfg::kStageBytes, a_ptr, b_ptr, m0, n0, M, N, K, p.lda, kt, tid);
  };


  int32_t acc[kMi][kNi][4];
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int j = 0; j < kNi; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_k_tiles) load_tile(s, s);
    ptx::cp_async_commit();
  }

  const mma::GemmFragmentLanes lanes = mma::gemm_fragment_lanes<Cfg>(warp_m, warp_n, lane);

  for (int kt = 0; kt < num_k_tiles; ++kt) {
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = kt + kStages - 1;
      if (next < num_k_tiles) load_tile(next, next % kStages);
      ptx::cp_async_commit();
    }
    const uint8_t* stage = smem + (kt % kStages) * Cfg::kStageBytes;
#pragma unroll
    for (int ks = 0; ks < kBlockK / 32; ++ks) {
      uint32_t af[kMi][4];
      uint32_t bf[kNi][2];
      mma::load_ab_fragments<Cfg>(af, bf, stage, lanes, ks);
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNi; ++j) ptx::mma_m16n8k32_s8(acc[i][j], af[i], bf[j], acc[i][j]);
    }
  }
  ptx::cp_async_wait<0>();  // only empty groups can be pending; keeps the emulator's bookkeeping clean

  // ---- epilogue: stores in the mma C layout, as the fp8 kernel (see there for the sector count) ----
  TOut* __restrict__ out = static_cast<TOut*>(p.out);
  const TOut* __restrict__ bias = static_cast<const TOut*>(p.bias);
  const float sa_tensor = p.scale_a[0];
  const float sb_tensor = p.scale_b[0];
  const bool has_azp = p.azp != nullptr;
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
      if (m >= M) continue;
      const float sa_m = p.scale_a_per_row ? p.scale_a[m] : sa_tensor;
      const int32_t azp_m = has_azp ? p.azp[p.azp_per_row ? m : 0] : 0;
#pragma unroll
      for (int j = 0; j < kNi; ++j) {
        const int64_t n = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t;
        if (n >= N) continue;  // N is even: the pair (n, n + 1) is all in or all out
        float s0 = sb_tensor, s1 = sb_tensor;
        if (p.scale_b_per_col) {
          s0 = p.scale_b[n];
          s1 = p.scale_b[n + 1];
        }
        int32_t c0 = acc[i][j][2 * h], c1 = acc[i][j][2 * h + 1];
        if (has_azp) {
          c0 -= azp_m * p.azp_adj[n];
          c1 -= azp_m * p.azp_adj[n + 1];
        }
        float v0, v1;
        if (bias != nullptr) {
          v0 = fmaf(static_cast<float>(c0), sa_m * s0, to_float(bias[n]));
          v1 = fmaf(static_cast<float>(c1), sa_m * s1, to_float(bias[n + 1]));
        } else {
          v0 = static_cast<float>(c0) * (sa_m * s0);
          v1 = static_cast<float>(c1) * (sa_m * s1);
        }
        *reinterpret_cast<uint32_t*>(out + m * N + n) = mma::pack2<TOut>(v0, v1);
      }
    }
  }
}

}  // namespace fastinfer::int8
