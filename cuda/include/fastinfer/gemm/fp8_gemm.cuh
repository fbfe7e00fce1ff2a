#pragma once
// Scaled e4m3 GEMM on mma.sync.m16n8k32 (sm_89+): out[M,N] = (a * sa) @ (b * sb)^T (+ bias).
//
// One CTA computes a kBlockM x kBlockN tile of out with kWarpsM x kWarpsN warps; each warp owns a
// (kBlockM / kWarpsM) x (kBlockN / kWarpsN) sub-tile = kMi x kNi mma tiles of 16 x 8 in fp32
// registers for the whole K loop.
//
//   gmem --cp.async (16 B, zero-fill past M / N / K)--> smem ring of kStages k-tiles:
//        A [kBlockM][128 bytes] | B [kBlockN][128 bytes]   (k-tile = 128 e4m3 = one scale block)
//   smem --ldmatrix.x4 (b16 view of byte pairs)--> A fragments (rows g / g+8, k bytes 4t..4t+3 and
//        4t+16..19 = the m16n8k32 A layout) and B fragments (b is [N, K] = the "col" operand:
//        rows n, k bytes 4t..4t+3 / 4t+16..19), 4 k-steps of 32 per k-tile
//   mma.sync.m16n8k32.e4m3 -> fp32
//   kBlockwise: each k-tile accumulates into zeroed partials, then acc += part * sa[m][kt] * sb[n/128][kt]
//               (DeepGEMM-style promotion: the scales are applied in fp32 per 128-wide K block)
//   epilogue:   out = acc * sa(m) * sb(n) (+ bias[n]) (scales per tensor / per token / per channel;
//               kBlockwise: acc already scaled), rounded once to out_dtype, packed 2-element stores.
//
// Shared memory rows are 128 bytes = 8 chunks of 16 bytes; chunk c of row r lives at chunk
// c ^ (r & 7). An ldmatrix phase reads 8 consecutive rows at one logical chunk: 8 distinct chunk
// positions = all 32 banks, no conflicts; the cp.async writes use the same swizzle.
//
// Pipeline: one __syncthreads per k-tile. At iteration kt, after waiting for k-tile kt, the CTA
// prefetches k-tile kt + kStages - 1 into the stage read at iteration kt - 1 (every warp has passed
// the barrier, so it is free), then computes on stage kt % kStages.
//
// The body is compiled only for sm_89+ (and the emulator); for older targets the kernel is a stub
// that traps, and launch_fp8_scaled_mm refuses the launch (cudaErrorNotSupported) when the device is
// older than sm_89 or when the code the driver picked for the kernel is such a stub (a newer GPU
// JIT-compiling the sm_80 PTX).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8.h"

#include <cstdint>
#include <type_traits>

#if defined(FASTINFER_SIMT) || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
#define FASTINFER_FP8_MMA_ENABLED 1
#else
#define FASTINFER_FP8_MMA_ENABLED 0
#endif

namespace fastinfer::fp8 {

constexpr int kBlockK = mma::kGemmKTileBytes;  // k-tile in elements (= bytes); also the blockwise scale block
constexpr int kScaleBlock = 128;

// The configurations, picked by M bucket in the launcher (cuda/src/gemm_fp8.cu).
// M <= 16 (decode): 2 warps of 16 x 16, 24 KiB smem. 32-column tiles: with 64 columns a 4096-wide
// layer was 64 CTAs, half of a 132-SM GPU idle (simt profile / bench/model.py); 32 give 128.
using Fp8ConfigSmall = mma::GemmConfig<16, 32, 1, 2, 4>;
using Fp8ConfigMedium = mma::GemmConfig<64, 128, 2, 4, 3>;   // M <= 64: 8 warps of 32 x 32, 72 KiB
using Fp8ConfigLarge = mma::GemmConfig<128, 128, 2, 4, 3>;   // 8 warps of 64 x 32, 96 KiB (fits sm_89's 99 KiB);
                                                             // not for blockwise (register spills on sm_90a)

// grid (ceil(N / kBlockN), ceil(M / kBlockM)), block Cfg::kThreads, dynamic smem Cfg::kSmemBytes.
template <typename Cfg, typename TOut, bool kBlockwise>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fp8_scaled_mm_kernel(const Fp8ScaledMmParams p) {
  static_assert(kScaleBlock % Cfg::kBlockN == 0, "blockwise: a CTA's columns must share one 128-row block of b");
#if FASTINFER_FP8_MMA_ENABLED
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

  float acc[kMi][kNi][4];
#pragma unroll
  for (int i = 0; i < kMi; ++i)
#pragma unroll
    for (int j = 0; j < kNi; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  // Blockwise scales: rows of this thread's fragments (m0 + warp rows + 16 i + g (+ 8)), the CTA's
  // 128-row block of b, and the row strides of the two scale tensors.
  const int64_t sk = (K + kScaleBlock - 1) / kScaleBlock;
  const int64_t sb_row = n0 / kScaleBlock;

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
    // Blockwise: this k-tile's scales, loaded before the mmas so the latency hides behind them.
    // scale_a is [M, K / 128] row-major (the op's contract), so the 8 rows g of a request are
    // K / 128 floats apart: 8 sectors for 32 bytes (simt profile); the next 7 k-tiles find the
    // same sectors in L1, and the bytes are ~1% of the k-tile's cp.async traffic.
    float blk_scale[kMi][2];
    if constexpr (kBlockwise) {
      const float sbv = p.scale_b[sb_row * sk + kt];
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t m = m0 + warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
          blk_scale[i][h] = m < M ? p.scale_a[m * sk + kt] * sbv : 0.f;
        }
    }
    float part[kBlockwise ? kMi : 1][kBlockwise ? kNi : 1][4];
    if constexpr (kBlockwise) {
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNi; ++j) part[i][j][0] = part[i][j][1] = part[i][j][2] = part[i][j][3] = 0.f;
    }

    const uint8_t* stage = smem + (kt % kStages) * Cfg::kStageBytes;
    // The 128 x 128 tile unrolls its k-steps by 2, not 4: fully unrolled, ptxas hoists the fragments
    // of all four and spilled 16-40 bytes at 255 registers on sm_90a / sm_100a (246, none, at 2).
    constexpr int kKStepUnroll = kMi * kNi >= 16 ? 2 : kBlockK / 32;
#pragma unroll kKStepUnroll
    for (int ks = 0; ks < kBlockK / 32; ++ks) {
      uint32_t af[kMi][4];
      uint32_t bf[kNi][2];
      mma::load_ab_fragments<Cfg>(af, bf, stage, lanes, ks);
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNi; ++j) {
          if constexpr (kBlockwise)
            ptx::mma_m16n8k32_e4m3(part[i][j], af[i], bf[j], part[i][j]);
          else
            ptx::mma_m16n8k32_e4m3(acc[i][j], af[i], bf[j], acc[i][j]);
        }
    }
    if constexpr (kBlockwise) {
#pragma unroll
      for (int i = 0; i < kMi; ++i)
#pragma unroll
        for (int j = 0; j < kNi; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][j][e] = fmaf(part[i][j][e], blk_scale[i][e / 2], acc[i][j][e]);
    }
  }
  ptx::cp_async_wait<0>();  // only empty groups can be pending; keeps the emulator's bookkeeping clean

  // ---- epilogue ----
  // Stores follow the mma C layout: a request writes 4 bytes x 4 lanes = 16 bytes of each of 8 rows,
  // half of 8 sectors (8 sectors per request, 4 ideal: simt profile); the j + 1 tile of the same
  // warp writes the other halves right after, so L2 merges them and DRAM sees whole sectors.
  // Staging the tile through shared memory would trade that for a barrier and smem in a phase
  // that is once per CTA.
  TOut* __restrict__ out = static_cast<TOut*>(p.out);
  const TOut* __restrict__ bias = static_cast<const TOut*>(p.bias);
  const float sa_tensor = kBlockwise ? 1.f : p.scale_a[0];
  const float sb_tensor = kBlockwise ? 1.f : p.scale_b[0];
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
      if (m >= M) continue;
      const float sa_m = (!kBlockwise && p.scale_a_per_row) ? p.scale_a[m] : sa_tensor;
#pragma unroll
      for (int j = 0; j < kNi; ++j) {
        const int64_t n = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t;
        if (n >= N) continue;  // N is even: the pair (n, n + 1) is all in or all out
        float s0 = sb_tensor, s1 = sb_tensor;
        if (!kBlockwise && p.scale_b_per_col) {
          s0 = p.scale_b[n];
          s1 = p.scale_b[n + 1];
        }
        float v0 = acc[i][j][2 * h] * (sa_m * s0);
        float v1 = acc[i][j][2 * h + 1] * (sa_m * s1);
        if (bias != nullptr) {
          v0 += to_float(bias[n]);
          v1 += to_float(bias[n + 1]);
        }
        *reinterpret_cast<uint32_t*>(out + m * N + n) = mma::pack2<TOut>(v0, v1);
      }
    }
  }
#else
  __trap();  // compiled for an architecture without e4m3 mma: never compute silently wrong output
#endif  // FASTINFER_FP8_MMA_ENABLED
}

}  // namespace fastinfer::fp8
