#pragma once
// The prefill kernel's compile-time configuration (PrefillTraitsSm80: tile shape, pipeline depth,
// shared-memory layout per head dim and cache type) and the launch state the launcher passes beside
// the caller's params (prefill.cuh). The tile addressing the steps share is common/mma.cuh's.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"

#include <cstdint>
#include <type_traits>

namespace fastinfer::attention {

// ---- traits ----------------------------------------------------------------------------------
// mma.sync (sm_80+) kernel configuration for head dim D, and the paged cache's element type
// (T, or __nv_fp8_e4m3: an fp8 cache).
template <typename T_, int kHeadDim_, typename CacheT_ = T_>
struct PrefillTraitsSm80 {
  using T = T_;
  using CacheT = CacheT_;
  static constexpr bool kFp8Cache = !std::is_same_v<T, CacheT>;
  static constexpr int kHeadDim = kHeadDim_;
  // D = 256: 4 warps and 16-key tiles, so that the 128 fp32 output accumulators of a thread fit
  // in registers beside the scores without spilling (32-key tiles spilled 84 bytes) and the shared
  // memory (Q 32 KiB + two stages of K and V 32 KiB) fits sm_89's 99 KiB; the Q fragments are then read from shared memory at each k-step instead of being kept in
  // 64 registers for the whole kernel.
  static constexpr int kWarps = prefill_rows_per_cta(kHeadDim) / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;  // rows per CTA: (token, query head) pairs, 16 per warp
  static constexpr int kBlockN = prefill_keys_per_tile(kHeadDim);  // keys per K/V tile
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static constexpr int kQFragments = kQInRegisters ? kHeadDim / 16 : 1;  // A operands kept in registers
  // K/V pipeline depth: D=64 tiles are small enough for a third stage.
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(prefill_supports_head_dim(kHeadDim), "head dim 64, 128 or 256");
  static_assert(kPrefillKeysPerTile % kBlockN == 0, "the plans' key unit is whole tiles");
  static constexpr int kElemsPerChunk = 16 / sizeof(T);          // 8
  static constexpr int kChunksPerRow = kHeadDim / kElemsPerChunk;  // 8 or 16 (>= 8 for the swizzle)
  static constexpr int kQBytes = kBlockM * kHeadDim * sizeof(T);
  static constexpr int kTileBytes = kBlockN * kHeadDim * sizeof(T);
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // rows one cp.async sweep covers
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockM % kRowsPerPass == 0, "tile / thread mismatch");
  // An fp8 cache: the cp.async ring holds kStages fp8 tiles per K and V (kBlockN rows of D bytes,
  // unswizzled: each is read once, 16 bytes a thread), converted at the top of each iteration into
  // the one K and one V tile of T that the mma steps read (convert_kv_tile).
  static_assert(!kFp8Cache || std::is_same_v<CacheT, __nv_fp8_e4m3>, "cache: T or e4m3");
  static constexpr int kTileBuffers = kFp8Cache ? 1 : kStages;  // K (and V) tiles of T in smem
  static constexpr int kFp8TileBytes = kBlockN * kHeadDim;
  static constexpr int kFp8ChunksPerRow = kHeadDim / 16;
  static constexpr int kFp8RowsPerPass = kThreads / kFp8ChunksPerRow;
  static_assert(kBlockN % kFp8RowsPerPass == 0, "fp8 tile / thread mismatch");
  static constexpr int kSmemBytes =
      kQBytes + 2 * kTileBuffers * kTileBytes + (kFp8Cache ? 2 * kStages * kFp8TileBytes : 0);
};

static_assert(PrefillTraitsSm80<__half, 64>::kSmemBytes <= 99 * 1024 && PrefillTraitsSm80<__half, 128>::kSmemBytes <= 99 * 1024 &&
                  PrefillTraitsSm80<__half, 256>::kSmemBytes <= 99 * 1024 &&
                  PrefillTraitsSm80<__half, 256, __nv_fp8_e4m3>::kSmemBytes <= 99 * 1024,
              "every instance fits sm_86 / sm_89's 99 KiB of shared memory per block");

// ---- launch state ----------------------------------------------------------------------------
// What launch_prefill_attention sets for one launch beside the caller's params (launch_plan.h: the
// plan's choices and its workspace regions), passed to the kernels as a second argument.
struct PrefillLaunchState {
  // Tree rows (tree_rows_kernel writes them): depth of each query row (custom mask with a window,
  // or keys by rank); keys by rank only: tree_rank_seq [num_q_tokens] the sequence of query row t,
  // tree_rank_keys [num_q_tokens][max_seqlen_q] its visible trailing keys in index order
  // (tree_depth[t] + 1 of them).
  int32_t* tree_depth;
  int32_t* tree_rank_seq;
  int32_t* tree_rank_keys;
  // The in-kernel fold under a custom mask in two launches, where the sequences' own work items
  // fill the GPU (else one launch of per-token items). Phase 1: the sequence's work items over the
  // whole chunks of its prefix, [0, floor(P / F) F) with P = k_len - q_len (every row sees those
  // keys at the same ranks: one K/V read per tree and KV head), leaving each row's state in
  // split_state / split_state_lse; phase 2: a work item per query token over the rest of its keys
  // by rank, from that state. The fold is left to right either way: same bits.
  int32_t tree_phase;  // 0: one launch; 1, 2: the phases
  // In-kernel fold: split_state [num_q_tokens * Hq][D] fp32, split_state_lse [num_q_tokens * Hq]
  // (phases 1 and 2).
  float* split_state;
  float* split_state_lse;
  // Split-parallel and the default-mode split, per launch: split_out [z][num_q_tokens * Hq][D]
  // and split_lse [z][num_q_tokens * Hq] receive the partials of blockIdx.z; deterministic:
  // blockIdx.z + split_begin is the chunk of fixed_split_size keys; default mode (fixed_split_size
  // == 0): blockIdx.z is the part of the CTA's key range, of gridDim.z parts.
  int32_t split_begin;
  float* split_out;
  float* split_lse;
};

}  // namespace fastinfer::attention
