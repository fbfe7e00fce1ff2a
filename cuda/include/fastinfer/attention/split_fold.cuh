#pragma once
// The prefill kernel's key-split and deterministic paths: the partials of a split CTA
// (epilogue_split), the in-kernel fold of fixed-size chunks (fold_chunk, load_folded_state, the
// tree phases' state lse) and prefill_merge_splits_kernel, which folds the partials of a launch in
// split order. All merge with the one arithmetic of state_merge.cuh.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"
#include "fastinfer/attention/mask.cuh"
#include "fastinfer/attention/prefill_steps.cuh"
#include "fastinfer/attention/prefill_traits.cuh"
#include "fastinfer/attention/state_merge.cuh"
#include "fastinfer/attention/work_items.cuh"

#include <cmath>
#include <cstdint>

namespace fastinfer::attention {

// ---- deterministic mode (attention.h, fixed_split_size) -----------------------------------------
// The in-kernel fold (prefill: one CTA walks all chunks) and prefill_merge_splits_kernel (decode: a
// CTA per chunk) fold with the one arithmetic of state_merge.cuh.

// Row index (token * Hq + head) of fragment half h, or -1 past the sequence.
__device__ __forceinline__ int64_t fragment_row_index(const PrefillAttentionParams& p, const PrefillTile& tile,
                                                      const FragmentRows& rows, int warp, int lane, int h) {
  if (!rows.valid[h]) return -1;
  const int row = tile.row0 + warp * 16 + lane / 4 + 8 * h;
  const int head = tile.kv_head * tile.group + (row - rows.token[h] * tile.group);
  return (tile.q_start + rows.token[h]) * static_cast<int64_t>(p.num_q_heads) + head;
}

// Split-parallel mode (deterministic decode) and the default-mode split: the chunk's (part's)
// normalised fp32 output and lse of each valid row go to split slot blockIdx.z (a row that saw no
// key of it: zeros and -inf, skipped by the merge).
template <typename Traits>
__device__ __forceinline__ void epilogue_split(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                               const PrefillTile& tile,
                                               const SequenceMask& mask, const float (&o)[Traits::kHeadDim / 8][4],
                                               const float (&row_max)[2], const float (&row_sum)[2], int warp,
                                               int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
  const int64_t slot = static_cast<int64_t>(blockIdx.z) * p.num_q_tokens * p.num_q_heads;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_reduce_sum<4>(row_sum[h]);
    const float inv = row_inverse(out_numerator<Traits>(tile), l);
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    if (r >= 0) {
      // The thread's two adjacent elements of each d-tile in one 8-byte store (the quad's four
      // stores fill a 32-byte sector; the row starts 16-byte aligned: D floats from a 16-byte base).
      float2* dst = reinterpret_cast<float2*>(ls.split_out + (slot + r) * D + 2 * (lane % 4));
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) dst[dt * 4] = make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      if (lane % 4 == 0) ls.split_lse[slot + r] = chunk_lse(row_max[h], l);
    }
  }
}

// In-kernel fold (prefill): at the end of each chunk, its partial (o / l, lse) is merged into the
// row's state (fp32 in split_state, each thread its own fragment elements, so no barrier; the
// state's lse in registers, st_lse) and the online-softmax accumulators restart. A chunk the row
// saw nothing of is skipped; the first one the row sees becomes the state as it is. Warp-uniform.
template <typename Traits>
__device__ __forceinline__ void fold_chunk(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                           const PrefillTile& tile,
                                           const SequenceMask& mask, float (&o)[Traits::kHeadDim / 8][4],
                                           float (&row_max)[2], float (&row_sum)[2], float (&st_lse)[2], int warp,
                                           int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_reduce_sum<4>(row_sum[h]);
    const float inv = row_inverse(out_numerator<Traits>(tile), l);
    const float lse_c = chunk_lse(row_max[h], l);
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    const bool store = r >= 0 && lse_c != -INFINITY;  // else the state stays as it is
    const bool first = st_lse[h] == -INFINITY;       // the first chunk the row sees: the state as it is
    const ChunkMerge w = store && !first ? chunk_merge(st_lse[h], lse_c) : ChunkMerge{0.f, 0.f, lse_c};
    float* st = ls.split_state + (store ? r : 0) * D + 2 * (lane % 4);
    // In groups of kFoldGroup d-tiles with a __syncwarp between them (warp-uniform: the predicates
    // are per element), which keeps the compiler from loading the whole state row at once: with the
    // loop's state live, that would spill at head dim 256.
    constexpr int kFoldGroup = 8;
#pragma unroll
    for (int g = 0; g < D / 8; g += kFoldGroup) {
#pragma unroll
      for (int dt = g; dt < g + kFoldGroup; ++dt) {
        if (store) {
          st[dt * 8] = first ? o[dt][2 * h] * inv : chunk_merge_value(w, st[dt * 8], o[dt][2 * h] * inv);
          st[dt * 8 + 1] = first ? o[dt][2 * h + 1] * inv : chunk_merge_value(w, st[dt * 8 + 1], o[dt][2 * h + 1] * inv);
        }
      }
      __syncwarp();
    }
    if (store) st_lse[h] = w.lse;
    row_max[h] = -INFINITY;
    row_sum[h] = 0.f;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][2 * h] = o[dt][2 * h + 1] = 0.f;
  }
}

// In-kernel fold, after the last chunk: the state back into the accumulators with row_sum such
// that the epilogue's quad sum is exactly 1 (4 x 0.25), so it stores the state rounded once; the
// sink merged last, as prefill_merge_splits_kernel does.
template <typename Traits>
__device__ __forceinline__ void load_folded_state(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                                  const PrefillTile& tile,
                                                  const SequenceMask& mask, float (&o)[Traits::kHeadDim / 8][4],
                                                  float (&row_sum)[2], float (&st_lse)[2], int warp, int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    const bool seen = r >= 0 && st_lse[h] != -INFINITY;
    const float* st = ls.split_state + (seen ? r : 0) * D + 2 * (lane % 4);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][2 * h] = seen ? st[dt * 8] : 0.f;
      o[dt][2 * h + 1] = seen ? st[dt * 8 + 1] : 0.f;
    }
    if (p.sinks != nullptr && r >= 0) {
      const ChunkMerge w = sink_merge(st_lse[h], p.sinks[r % p.num_q_heads]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * h] = chunk_merge_value(w, o[dt][2 * h], 0.f);
        o[dt][2 * h + 1] = chunk_merge_value(w, o[dt][2 * h + 1], 0.f);
      }
      st_lse[h] = w.lse;
    }
    row_sum[h] = 0.25f;
  }
}

// The two-launch fold (PrefillLaunchState::tree_phase): each valid row's state lse, stored by
// phase 1 (one lane of the row's quad: all four hold it) and loaded by phase 2.
__device__ __forceinline__ void store_state_lse(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                                const PrefillTile& tile,
                                                const SequenceMask& mask, const float (&st_lse)[2], int warp,
                                                int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    if (r >= 0 && lane % 4 == 0) ls.split_state_lse[r] = st_lse[h];
  }
}
__device__ __forceinline__ void load_state_lse(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                               const PrefillTile& tile,
                                               const SequenceMask& mask, float (&st_lse)[2], int warp, int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    st_lse[h] = r >= 0 ? ls.split_state_lse[r] : -INFINITY;
  }
}

// Split-parallel mode: folds the `splits` partials of this launch, in split order, into each
// (token, head) row's state: from the running state (or empty when `first`) to the running state
// (or, when `last`, out in dtype and lse), with fold_chunk's arithmetic. One warp per row, lane i
// owning elements i, i + 32, ... grid ceil(rows / kSplitMergeWarps), block kSplitMergeWarps * 32.
template <typename T, int D>
__global__ void __launch_bounds__(kSplitMergeWarps * 32)
    prefill_merge_splits_kernel(const PrefillAttentionParams p, const PrefillLaunchState ls, float* running_out,
                                float* running_lse, int splits,
                                bool first, bool last) {
  constexpr int kPerLane = D / 32;
  const int64_t num_rows = p.num_q_tokens * p.num_q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSplitMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= num_rows) return;
  float acc[kPerLane];
  float lse = first ? -INFINITY : running_lse[row];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = lse == -INFINITY ? 0.f : running_out[row * D + lane + 32 * i];
  for (int z = 0; z < splits; ++z) {
    const int64_t r = static_cast<int64_t>(z) * num_rows + row;
    const float lb = ls.split_lse[r];
    const float* vb = ls.split_out + r * D + lane;
    if (lb == -INFINITY) continue;
    if (lse == -INFINITY) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = vb[32 * i];
      lse = lb;
      continue;
    }
    const ChunkMerge w = chunk_merge(lse, lb);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = chunk_merge_value(w, acc[i], vb[32 * i]);
    lse = w.lse;
  }
  if (!last) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) running_out[row * D + lane + 32 * i] = acc[i];
    __syncwarp();  // every lane of the row has read running_lse before lane 0 overwrites it
    if (lane == 0) running_lse[row] = lse;
    return;
  }
  const int64_t token = row / p.num_q_heads;
  const int head = static_cast<int>(row - token * p.num_q_heads);
  if (p.sinks != nullptr) {  // once, after the last split (partials leave it out)
    const ChunkMerge w = sink_merge(lse, p.sinks[head]);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = chunk_merge_value(w, acc[i], 0.f);
    lse = w.lse;
  }
  T* out = static_cast<T*>(p.out) + token * p.out_token_stride + static_cast<int64_t>(head) * D + lane;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) out[32 * i] = from_float<T>(acc[i]);
  if (lane == 0 && p.lse != nullptr) p.lse[row] = lse;
}

}  // namespace fastinfer::attention
