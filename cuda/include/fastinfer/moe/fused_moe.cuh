#pragma once
// fused_moe kernels (contract in moe/fused_moe.h; launcher cuda/src/fused_moe.cu). After moe_align
// has grouped the slots s = t * k + j by expert into blocks of kBlockM rows:
//
//   moe_gemm_kernel<kGateUp>: per (row block, column tile) the block's expert's gate rows and up
//     rows of w13 for the same kBlockN columns (two B tiles in one stage, two accumulator sets per
//     warp), so the activation runs on the accumulators: a = act(gate + b, up + b) -> workspace
//     a[s, :] in the dtype. The A rows are gathered: tile row r reads x[s_r / k].
//   moe_gemm_kernel<kDown>: per (row block, column tile) y[s, :] = a[s, :] @ w2[e]^T + b in fp32
//     (A rows gathered from a by slot).
//   moe_combine_kernel: out[t] = sum over j = 0..k-1 in order of topk_weights[t, j] * y[t k + j],
//     fp32, rounded once.
//
// e4m3 weights (fused_moe_fp8): the launcher quantises x with fp8_quantize's kernels; a is
// quantised per 64-column group by the gate/up epilogue where a CTA's columns are one group (the
// medium tier: one write of a, in e4m3, instead of a in the dtype, a kernel reading it back and a
// second write), else by fp8_quantize's group kernel between the GEMMs, bitwise alike. The GEMMs
// read e4m3 A and B rows (a 128-byte k-tile is 128 elements, four mma.m16n8k32 steps: the same
// ldmatrix fragments as 16-bit data); per channel, the weight scales and x's row scale apply in the
// epilogue; A's group scales (x blockwise, a always) per group of k (partial accumulators, then
// acc += part * sa * sb with sb the 128 x 128 weight block's scale, as gemm/fp8_gemm.cuh).
//
// Both GEMMs are the dense GEMM's pipeline (common/mma.cuh: 128-byte k-tile rows, the XOR
// swizzle, a kStages-deep cp.async ring, ldmatrix fragments, mma.m16n8k16) with gathered A rows;
// the grid is (row blocks, column tiles), row blocks fastest, so the CTAs of one expert's blocks
// run together and share its weight tile in L2. The grid has an upper bound of row blocks (the
// used count, num_tokens_post_padded, stays on the device): a CTA past it returns at once.
//
// Batch invariance: every output element of both GEMMs accumulates the k16 steps of its row in
// order into an fp32 accumulator that starts at 0 (no split-K), whatever the tile configuration
// (chosen by the launcher from T k / E), so y[s] depends only on the token's row and its expert;
// the combine sums a token's slots in slot order. A token's output is bitwise the same alone or in
// any batch.
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8_quantize.cuh"
#include "fastinfer/moe/fused_moe.h"

#include <cstdint>

namespace fastinfer::moe {

enum class MoeGemm { kGateUp, kDown };

// The launcher's carve-up of the workspace (fused_moe.h).
struct FusedMoeWorkspace {
  void* act = nullptr;                         // [T k, I] the dtype, by slot
  void* y = nullptr;                           // [T k, H] the dtype, by slot
  const void* x_q = nullptr;                   // e4m3 weights: x quantised [T, H] and its scales
  const float* x_scale = nullptr;              //   [T] or [T, H / 128]
  void* act_q = nullptr;                       //   a quantised [T k, I] and its scales
  float* act_scale = nullptr;                  //   [T k, I / kActGroup]
  const int32_t* sorted_token_ids = nullptr;   // moe_align's layout
  const int32_t* expert_ids = nullptr;
  const int32_t* num_tokens_post_padded = nullptr;
};

// One CTA: a kBlockM-row block of one expert x kBlockN output columns, kWarpsM x kWarpsN warps.
// kGateUp stages kBlockN gate rows then kBlockN up rows of w13 (the same columns of both halves:
// a warp holds gate and up of its columns and applies the activation in registers).
template <int kBlockM_, int kBlockN_, int kWarpsM_, int kWarpsN_, int kStages_, MoeGemm kGemm_>
struct MoeGemmConfig : mma::GemmConfig<kBlockM_, kBlockN_, kWarpsM_, kWarpsN_, kStages_> {
  using Base = mma::GemmConfig<kBlockM_, kBlockN_, kWarpsM_, kWarpsN_, kStages_>;
  static constexpr MoeGemm kGemm = kGemm_;
  static constexpr int kHalves = kGemm == MoeGemm::kGateUp ? 2 : 1;
  static constexpr int kHalfBytes = kBlockN_ * mma::kGemmKTileBytes;
  static constexpr int kBBytes = kHalves * kHalfBytes;
  static constexpr int kStageBytes = Base::kABytes + kBBytes;
  static constexpr int kSmemBytes = kStages_ * kStageBytes;
};

constexpr int kScaleBlock = 128;  // blockwise e4m3 scales: 128 x 128 weight blocks, 128-groups of x
constexpr int kActGroup = 64;     // a's e4m3 groups, either weight format (fused_moe.h)

// Whether a gate/up configuration quantises a in its epilogue: with e4m3 weights, where a CTA's
// columns are exactly one group of a (the launcher quantises a for the others).
template <typename Cfg>
constexpr bool gate_up_quantizes_act(MoeWeightFormat weights) {
  return (weights == MoeWeightFormat::kFp8PerChannel || weights == MoeWeightFormat::kFp8Blockwise) &&
         Cfg::kGemm == MoeGemm::kGateUp &&
         Cfg::kBlockN == kActGroup;
}

// The activation of one (gate, up) pair in fp32 (fused_moe.h).
__device__ __forceinline__ float expert_activation(const FusedMoeParams& p, float gate, float up) {
  if (p.activation == MoeActivation::kSilu) return gate / (1.0f + expf(-gate)) * up;
  // clamps as torch.clamp: a NaN stays NaN (fminf / fmaxf would return the bound)
  const float limit = p.swiglu_limit;
  const float g = gate > limit ? limit : gate;
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  return (u + 1.0f) * (g / (1.0f + expf(-p.swiglu_alpha * g)));
}

// The slot of each row of a row block (-1: padding) and the row of A it reads (the token for the
// gate/up GEMM, the slot for the down GEMM), into shared memory; returns the number of used rows,
// after a barrier. moe_align pads each expert's run at its end, so the used rows are a prefix.
template <int kBlockM, int kThreads, bool kGateUp>
__device__ __forceinline__ int load_block_rows(const FusedMoeParams& p, const FusedMoeWorkspace& w,
                                               int64_t block_row0, int32_t* slot_of, int32_t* a_row_of) {
  static_assert(kBlockM <= kThreads, "a thread per row");
  const int32_t num_slots = static_cast<int32_t>(p.num_tokens * p.top_k);
  const int r = threadIdx.x;
  bool used = false;
  if (r < kBlockM) {
    const int32_t s = w.sorted_token_ids[block_row0 + r];
    used = s < num_slots;
    slot_of[r] = used ? s : -1;
    a_row_of[r] = used ? (kGateUp ? s / p.top_k : s) : -1;
  }
  return __syncthreads_count(used);
}

// The end of both grouped GEMMs for the output columns n, n + 1 of a slot: v[half] the pair of each
// half in fp32 (scaled); + the expert's bias (its gate, then up rows), then kGateUp stores the
// activation of (gate, up) into a, kDown y, both in the dtype (y in fp32 was twice the bytes of
// the down GEMM's stores and the combine's loads: at Qwen3-30B-A3B shapes and 4096 tokens, FP8
// experts, the two were 40% of the layer's time in bench/model.py).
template <typename T, int kHalves>
__device__ __forceinline__ void add_bias_pair(const T* bias, int64_t I, int64_t n, float (&v)[kHalves][2]) {
  if (bias != nullptr) {
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      v[half][0] += to_float(bias[half * I + n]);
      v[half][1] += to_float(bias[half * I + n + 1]);
    }
  }
}

template <typename T, bool kGateUp, int kHalves>
__device__ __forceinline__ void finish_output_pair(const FusedMoeParams& p, const FusedMoeWorkspace& w,
                                                   const T* bias, int32_t slot, int64_t n, float (&v)[kHalves][2]) {
  const int64_t I = p.intermediate;
  add_bias_pair<T, kHalves>(bias, I, n, v);
  if constexpr (kGateUp) {
    T* act = static_cast<T*>(w.act) + static_cast<int64_t>(slot) * I + n;
    *reinterpret_cast<uint32_t*>(act) = mma::pack2<T>(expert_activation(p, v[0][0], v[kHalves - 1][0]),
                                                      expert_activation(p, v[0][1], v[kHalves - 1][1]));
  } else {
    T* y = static_cast<T*>(w.y) + static_cast<int64_t>(slot) * p.hidden + n;
    *reinterpret_cast<uint32_t*>(y) = mma::pack2<T>(v[0][0], v[0][1]);
  }
}

// grid (row blocks (upper bound), ceil(N / kBlockN)), block Cfg::kThreads, dynamic smem
// Cfg::kSmemBytes; N = I (kGateUp) or H (kDown), K = H or I.
template <typename Cfg, typename T, MoeWeightFormat kWeights>
__global__ void __launch_bounds__(Cfg::kThreads, 1) moe_gemm_kernel(const FusedMoeParams p,
                                                                     const FusedMoeWorkspace w) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kMi = Cfg::kMi, kNi = Cfg::kNi, kHalves = Cfg::kHalves;
  constexpr bool kGateUp = Cfg::kGemm == MoeGemm::kGateUp;
  constexpr bool kFp8 = kWeights != MoeWeightFormat::kFloat;
  constexpr bool kBlockwise = kWeights == MoeWeightFormat::kFp8Blockwise;
  // A with a scale per row and k group: x by 128-group (blockwise) for the gate/up GEMM, a by
  // 64-group for every e4m3 down GEMM. A k-tile (128 elements) holds kFolds groups; each group's
  // mmas accumulate into zeroed partials, then acc += part * sa * sb (sb: the weights' 128 x 128
  // block scale, blockwise; per channel it is applied in the epilogue).
  constexpr bool kGroupedA = kBlockwise || (kFp8 && !kGateUp);
  constexpr int kAGroup = kGateUp ? kScaleBlock : kActGroup;
  constexpr int kKSteps = mma::kGemmKTileBytes / 32;  // 32 bytes of k per e4m3 mma step
  constexpr int kFolds = kGroupedA ? mma::kGemmKTileBytes / kAGroup : 1;
  constexpr int kStepsPerFold = kKSteps / kFolds;
  constexpr bool kQuantizeAct = gate_up_quantizes_act<Cfg>(kWeights);
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  const int64_t block_row0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
  if (block_row0 >= *w.num_tokens_post_padded) return;  // the whole CTA: past the used blocks
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_m = warp / Cfg::kWarpsN, warp_n = warp % Cfg::kWarpsN;
  const int g = lane / 4, t = lane % 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kBlockN;
  const int64_t H = p.hidden, I = p.intermediate;
  const int64_t N = kGateUp ? I : H, K = kGateUp ? H : I;
  const int64_t expert = w.expert_ids[blockIdx.x];

  // The slot of each tile row (-1: padding) and the row of A it reads.
  __shared__ int32_t slot_of[kBlockM];
  __shared__ int32_t a_row_of[kBlockM];
  const int used_rows = load_block_rows<kBlockM, Cfg::kThreads, kGateUp>(p, w, block_row0, slot_of, a_row_of);
  // A warp whose rows are all padding (an expert's last block is on average half padding) skips
  // its fragments and mmas; the skip is per warp, since a per-tile predicate on the mmas costs
  // ptxas the unrolled schedule (half the registers, the loads no longer hoisted).
  const bool warp_live = warp_m * Cfg::kWarpM < used_rows;

  // A: x (or its e4m3 copy) by token for kGateUp, a (or its e4m3 copy) by slot for kDown; the
  // e4m3 inputs' scales per A row ([rows] or [rows, a_groups]) and the expert's weight scales.
  const void* a_src = kGateUp ? (kFp8 ? w.x_q : p.x) : (kFp8 ? w.act_q : w.act);
  const uint8_t* __restrict__ a_bytes = static_cast<const uint8_t*>(a_src);
  const float* __restrict__ a_scale = kGateUp ? w.x_scale : w.act_scale;
  const int64_t w_rows = kGateUp ? 2 * I : H;  // the expert's weight rows
  const uint8_t* b_expert = static_cast<const uint8_t*>(kGateUp ? p.w13 : p.w2) + expert * w_rows * K * kElemBytes;
  const int64_t k_groups = (K + kScaleBlock - 1) / kScaleBlock;
  const int64_t a_groups = (K + kAGroup - 1) / kAGroup;
  const float* __restrict__ w_scale = kGateUp ? p.w13_scale : p.w2_scale;
  if (kFp8) w_scale += expert * (kBlockwise ? (w_rows / kScaleBlock) * k_groups : w_rows);
  const int64_t row_bytes = K * kElemBytes;
  const int num_k_tiles = static_cast<int>((row_bytes + mma::kGemmKTileBytes - 1) / mma::kGemmKTileBytes);
  uint8_t* smem = dynamic_smem<uint8_t>();

  // Rows of K elements are a multiple of 16 bytes: a chunk is all in or all out. Half 1 of kGateUp:
  // the up rows, I rows below the gate rows.
  auto load_tile = [&](int kt, int stage) {
    uint8_t* tile = smem + stage * Cfg::kStageBytes;
    mma::load_k_tile_gathered<kBlockM, Cfg::kThreads>(tile, a_bytes, a_row_of, row_bytes, kt, tid);
#pragma unroll
    for (int half = 0; half < kHalves; ++half)
      mma::load_k_tile_rows<kBlockN, Cfg::kThreads>(tile + Cfg::kABytes + half * Cfg::kHalfBytes,
                                                     b_expert + half * I * row_bytes, n0, N, row_bytes, row_bytes, kt, tid);
  };

  float acc[kHalves][kMi][kNi][4];
#pragma unroll
  for (int half = 0; half < kHalves; ++half)
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int j = 0; j < kNi; ++j) acc[half][i][j][0] = acc[half][i][j][1] = acc[half][i][j][2] = acc[half][i][j][3] = 0.f;

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
    // The scales of this k-tile's groups, read before the mmas so that their latency hides.
    float blk_scale[kGroupedA ? kFolds : 1][kGroupedA ? kHalves : 1][kGroupedA ? kMi : 1][2];
    float part[kGroupedA ? kHalves : 1][kGroupedA ? kMi : 1][kGroupedA ? kNi : 1][4];
    if constexpr (kGroupedA) {
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
        // kBlockN divides 128 and I is a multiple of 128: the CTA's rows of a half are in one block
        const float sb = kBlockwise ? w_scale[((half * I + n0) / kScaleBlock) * k_groups + kt] : 1.f;
#pragma unroll
        for (int i = 0; i < kMi; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int32_t row = a_row_of[warp_m * Cfg::kWarpM + i * 16 + g + 8 * h];
            const int64_t group0 = static_cast<int64_t>(kt) * kFolds;
            const float* row_scales = a_scale + static_cast<int64_t>(row) * a_groups + group0;
            if (kFolds == 2 && row >= 0 && a_groups % 2 == 0) {  // the k-tile's two groups: one 8-byte load
              const float2 s2 = *reinterpret_cast<const float2*>(row_scales);
              blk_scale[0][half][i][h] = s2.x * sb;
              blk_scale[kFolds - 1][half][i][h] = s2.y * sb;
            } else {
#pragma unroll
              for (int f = 0; f < kFolds; ++f)
                blk_scale[f][half][i][h] = row >= 0 && group0 + f < a_groups ? row_scales[f] * sb : 0.f;
            }
          }
#pragma unroll
        for (int i = 0; i < kMi; ++i)
#pragma unroll
          for (int j = 0; j < kNi; ++j)
            part[half][i][j][0] = part[half][i][j][1] = part[half][i][j][2] = part[half][i][j][3] = 0.f;
      }
    }
    const uint8_t* stage = smem + (kt % kStages) * Cfg::kStageBytes;
    if (warp_live)
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      uint32_t af[kMi][4];
#pragma unroll
      for (int i = 0; i < kMi; ++i)
        mma::load_a<mma::kGemmKTileChunks>(af[i], stage, lanes.a_row + 16 * i, 2 * ks + lanes.a_chunk);
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
        uint32_t bf[kNi][2];
#pragma unroll
        for (int j = 0; j < kNi / 2; ++j)
          mma::load_b_pair<mma::kGemmKTileChunks>(bf[2 * j], bf[2 * j + 1],
                                                  stage + Cfg::kABytes + half * Cfg::kHalfBytes,
                                                  lanes.b_row + 16 * j, 2 * ks + lanes.b_chunk);
#pragma unroll
        for (int i = 0; i < kMi; ++i)
#pragma unroll
          for (int j = 0; j < kNi; ++j) {
            if constexpr (kGroupedA)
              ptx::mma_m16n8k32_e4m3(part[half][i][j], af[i], bf[j], part[half][i][j]);
            else if constexpr (kFp8)
              ptx::mma_m16n8k32_e4m3(acc[half][i][j], af[i], bf[j], acc[half][i][j]);
            else
              ptx::mma_m16n8k16<T>(acc[half][i][j], af[i], bf[j]);
          }
      }
      if constexpr (kGroupedA) {
        if (ks % kStepsPerFold == kStepsPerFold - 1) {  // the end of a group: fold it in
          const int f = ks / kStepsPerFold;
#pragma unroll
          for (int half = 0; half < kHalves; ++half)
#pragma unroll
            for (int i = 0; i < kMi; ++i)
#pragma unroll
              for (int j = 0; j < kNi; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  acc[half][i][j][e] = fmaf(part[half][i][j][e], blk_scale[f][half][i][e / 2], acc[half][i][j][e]);
                  part[half][i][j][e] = 0.f;
                }
        }
      }
    }
  }
  ptx::cp_async_wait<0>();  // only empty groups can be pending; keeps the emulator's bookkeeping clean

  // Epilogue in the mma C layout: lane (g, t) holds rows g and g + 8 of each 16-row tile, columns
  // 2t and 2t + 1 of each n8 tile (N is even: a pair is all in or all out). Per channel: the weight
  // scale per column, and for the gate/up GEMM x's scale per row.
  const T* __restrict__ bias = static_cast<const T*>(kGateUp ? p.w13_bias : p.w2_bias);
  if (bias != nullptr) bias += expert * (kGateUp ? 2 * I : H);
  constexpr bool kRowScale = kWeights == MoeWeightFormat::kFp8PerChannel && kGateUp;
  // kQuantizeAct: a of the tile's pairs in the dtype (held as float) and each row's amax
  float act_v[kQuantizeAct ? kMi : 1][2][kQuantizeAct ? kNi : 1][2];
  float row_amax[kQuantizeAct ? kMi : 1][2];
#pragma unroll
  for (int i = 0; i < kMi; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
      const int32_t slot = slot_of[r];
      if constexpr (kQuantizeAct) row_amax[i][h] = 0.f;
      if (slot < 0) continue;
      const float sa = kRowScale ? a_scale[a_row_of[r]] : 1.f;
#pragma unroll
      for (int j = 0; j < kNi; ++j) {
        const int64_t n = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t;
        if constexpr (kQuantizeAct) act_v[i][h][j][0] = act_v[i][h][j][1] = 0.f;
        if (n >= N) continue;
        float v[kHalves][2];
#pragma unroll
        for (int half = 0; half < kHalves; ++half) {
          v[half][0] = acc[half][i][j][2 * h];
          v[half][1] = acc[half][i][j][2 * h + 1];
          if constexpr (kWeights == MoeWeightFormat::kFp8PerChannel) {
            v[half][0] *= sa * w_scale[half * I + n];
            v[half][1] *= sa * w_scale[half * I + n + 1];
          }
        }
        if constexpr (kQuantizeAct) {
          add_bias_pair<T, kHalves>(bias, I, n, v);
#pragma unroll
          for (int c = 0; c < 2; ++c) {  // rounded to the dtype first, as a stored and then quantised
            act_v[i][h][j][c] = to_float(from_float<T>(expert_activation(p, v[0][c], v[1][c])));
            row_amax[i][h] = max_nan(row_amax[i][h], fabsf(act_v[i][h][j][c]));
          }
        } else {
          finish_output_pair<T, kGateUp, kHalves>(p, w, bias, slot, n, v);
        }
      }
    }
  }
  if constexpr (kQuantizeAct) {
    // The CTA's columns are one group of a: each row's amax over the 4 lanes of a row, then over
    // the kWarpsN warps of a row through shared memory; e4m3 codes and the group's scale as
    // fp8_quantize's per-group kernel computes them from a in the dtype (bitwise the launcher's
    // path, which the small tier takes).
    __shared__ float tile_amax[Cfg::kWarpsN][kBlockM];
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m = warp_reduce_max_nan<4>(row_amax[i][h]);
        if (t == 0) tile_amax[warp_n][warp_m * Cfg::kWarpM + i * 16 + g + 8 * h] = m;
      }
    __syncthreads();
    uint8_t* __restrict__ act_q = static_cast<uint8_t*>(w.act_q);
    const int64_t act_groups = (I + kActGroup - 1) / kActGroup;
#pragma unroll
    for (int i = 0; i < kMi; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_m * Cfg::kWarpM + i * 16 + g + 8 * h;
        const int32_t slot = slot_of[r];
        if (slot < 0) continue;
        float m = tile_amax[0][r];
#pragma unroll
        for (int wn = 1; wn < Cfg::kWarpsN; ++wn) m = max_nan(m, tile_amax[wn][r]);
        const float scale = fp8::scale_from_amax(m);
#pragma unroll
        for (int j = 0; j < kNi; ++j) {
          const int64_t n = n0 + warp_n * Cfg::kWarpN + j * 8 + 2 * t;
          if (n >= N) continue;
          *reinterpret_cast<uint16_t*>(act_q + static_cast<int64_t>(slot) * I + n) =
              static_cast<uint16_t>(fp8::quantize1(act_v[i][h][j][0], scale) |
                                    (fp8::quantize1(act_v[i][h][j][1], scale) << 8));
        }
        if (warp_n == 0 && t == 0) w.act_scale[static_cast<int64_t>(slot) * act_groups + n0 / kActGroup] = scale;
      }
  }
}

constexpr int kCombineThreads = 128;
constexpr int kCombineColumns = 2 * kCombineThreads;  // a CTA's columns of one token

// grid (T, ceil(H / kCombineColumns)), block kCombineThreads: out[t] from the y of its k slots, in
// slot order (several CTAs per token, so that a decode step's few tokens still spread over SMs).
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const FusedMoeParams p,
                                                                       const FusedMoeWorkspace w) {
  const int64_t token = blockIdx.x;
  const int64_t H = p.hidden;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kCombineColumns + 2 * threadIdx.x;
  if (c >= H) return;  // H is even: the pair (c, c + 1) is all in or all out
  const int k = p.top_k;
  float acc0 = 0.f, acc1 = 0.f;
  for (int j = 0; j < k; ++j) {
    const int64_t s = token * k + j;
    const int32_t e = p.topk_ids[s];
    if (e < 0 || e >= p.num_experts) continue;  // moe_align skipped the slot: no y
    const float weight = p.topk_weights[s];
    const T* y = static_cast<const T*>(w.y) + s * H + c;
    acc0 += weight * to_float(y[0]);
    acc1 += weight * to_float(y[1]);
  }
  *reinterpret_cast<uint32_t*>(static_cast<T*>(p.out) + token * H + c) = mma::pack2<T>(acc0, acc1);
}

}  // namespace fastinfer::moe
