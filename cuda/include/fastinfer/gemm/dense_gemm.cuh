#pragma once
// Dense fp16 / bf16 GEMM on mma.sync.m16n8k16 (sm_80+): out = a @ b^T (+ bias), fp32 accumulation.
//
// The tile geometry, shared-memory layout and pipeline are the fp8 kernel's (gemm/fp8_gemm.cuh,
// whose header explains them; the same mma::GemmConfig tiles of common/mma.cuh, a k-tile being
// 128 bytes = 64 fp16/bf16 elements): 128-byte k-tile rows with the chunk ^ (row & 7) swizzle, so every
// ldmatrix phase and every cp.async store covers all 32 banks once; a kStages-deep cp.async ring
// with one __syncthreads per k-tile; ldmatrix.x4 fragments (16-bit A / B layouts of m16n8k16:
// a 16-byte chunk is 8 elements of k, two chunks one k16 step). The int4 kernel without the
// dequantisation: b is read as it is.
//
// Batch invariance (gemm/dense.h): no split-K; each accumulator runs over the k16 steps of the
// k-tiles in order, whatever the configuration, so a row's bits do not depend on M.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/dense.h"

#include <cstdint>
#include <type_traits>

namespace fastinfer::dense {

constexpr int kElemsPerKTile = mma::kGemmKTileBytes / 2;  // 64 fp16 / bf16 per 128-byte row

// M buckets (launcher: cuda/src/gemm_dense.cu). M <= 16 (decode): 2 warps of 16 x 16, 32-column
// tiles (a 4096-wide layer is 128 CTAs) and 8 stages (48 KiB) so that ~42 KiB of weights are in
// flight per SM; M <= 64: 8 warps of 32 x 32, 4 stages (96 KiB); larger: 8 warps of 64 x 32, 96 KiB,
// where those 128-row tiles fill the SMs (else the M <= 64 tiles: gemm_dense.cu).
using DenseConfigSmall = mma::GemmConfig<16, 32, 1, 2, 8>;
using DenseConfigMedium = mma::GemmConfig<64, 128, 2, 4, 4>;
using DenseConfigLarge = mma::GemmConfig<128, 128, 2, 4, 3>;

// grid (ceil(N / kBlockN), ceil(M / kBlockM)), block Cfg::kThreads, dynamic smem Cfg::kSmemBytes.
template <typename Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) dense_mm_kernel(const DenseMmParams p) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kMi = Cfg::kMi, kNi = Cfg::kNi;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBlockM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBlockN;
  const int64_t M = p.m, N = p.n, K = p.k;
  const int num_k_tiles = static_cast<int>((K + kElemsPerKTile - 1) / kElemsPerKTile);

  const uint8_t* __restrict__ a_bytes = static_cast<const uint8_t*>(p.a);
  const uint8_t* __restrict__ b_bytes = static_cast<const uint8_t*>(p.b);
  uint8_t* smem = dynamic_smem<uint8_t>();

  // K % 8 == 0: rows of 2 K bytes, a 16-byte chunk all in or all out.
  auto load_tile = [&](int kt, int stage) {
    mma::load_ab_stage<Cfg>(smem + stage * Cfg::kStageBytes, a_bytes, b_bytes, m0, n0, M, N, 2 * K, 2 * K, kt, tid);
  };


  float acc[kMi][kNi][4];
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int j = 0; j < kNi; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

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
    for (int ks = 0; ks < kElemsPerKTile / 16; ++ks) {
      uint32_t af[kMi][4];
      uint32_t bf[kNi][2];
      mma::load_ab_fragments<Cfg>(af, bf, stage, lanes, ks);
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNi; ++j) ptx::mma_m16n8k16<T>(acc[i][j], af[i], bf[j]);
    }
  }
  ptx::cp_async_wait<0>();  // only empty groups can be pending; keeps the emulator's bookkeeping clean

  // Epilogue in the mma C layout (see fp8_gemm.cuh for the store pattern): + bias in fp32, one rounding.
  // A lane holds the pair (n, n + 1): one 4-byte store when N is even (the pair is all in or all out
  // and 4-byte aligned), else one 2-byte store per element in range (an odd row stride misaligns every
  // other row's pairs). Only the stores differ: the accumulation, and so a row's bits, do not.
  T* __restrict__ out = static_cast<T*>(p.out);
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  const bool pair_stores = N % 2 == 0;
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
      if (m >= M) continue;
#pragma unroll
      for (int j = 0; j < kNi; ++j) {
        const int64_t n = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t;
        if (n >= N) continue;
        const bool second = n + 1 < N;
        float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
        if (bias != nullptr) {
          v0 += to_float(bias[n]);
          if (second) v1 += to_float(bias[n + 1]);
        }
        if (pair_stores) {
          *reinterpret_cast<uint32_t*>(out + m * N + n) = mma::pack2<T>(v0, v1);
        } else {
          out[m * N + n] = from_float<T>(v0);
          if (second) out[m * N + n + 1] = from_float<T>(v1);
        }
      }
    }
  }
}

}  // namespace fastinfer::dense
