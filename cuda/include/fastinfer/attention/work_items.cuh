#pragma once
// Work items of the prefill kernel: which (sequence, row tile) a CTA owns (find_work_item), the
// tile's geometry as the CTA keeps it (PrefillTile), and which query token and head each of a
// thread's accumulator rows is (fragment_rows, fragment_row_index).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/mask.cuh"

#include <cstdint>

namespace fastinfer::attention {

// ---- work items ------------------------------------------------------------------------------
// The (sequence, tile) of work item `item`: sequence b has tiles_b = ceil(q_len_b * group /
// rows_per_tile) items, numbered sequence after sequence. One warp computes it alone (32 sequences
// per step: tile counts, inclusive prefix sum by shuffles, ballot for the first prefix past the
// item); every warp of the CTA gets the same answer, so no shared memory or barrier is needed.
// b = -1 when the item is past the last one.
struct WorkItem {
  int b;      // -1: none
  int index;  // item within the sequence (0 .. tiles - 1)
  int tiles;
};

__device__ __forceinline__ WorkItem find_work_item(const int32_t* cu_seqlens_q, int batch, int group,
                                                   int rows_per_tile, int64_t item, int lane) {
  WorkItem w{-1, 0, 0};
  int64_t base = 0;
  for (int b0 = 0; b0 < batch; b0 += 32) {  // trip count uniform over the warp
    const int b = b0 + lane;
    int n = 0;
    if (b < batch) {
      const int64_t rows = static_cast<int64_t>(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * group;
      n = static_cast<int>((rows + rows_per_tile - 1) / rows_per_tile);
    }
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(kFullWarpMask, incl, o);
      if (lane >= o) incl += x;
    }
    const unsigned hit = __ballot_sync(kFullWarpMask, item < base + incl);
    if (hit != 0) {
      const int l = __ffs(hit) - 1;
      const int excl = __shfl_sync(kFullWarpMask, incl - n, l);
      w.tiles = __shfl_sync(kFullWarpMask, n, l);
      w.b = b0 + l;
      w.index = static_cast<int>(item - base - excl);
      return w;
    }
    base += __shfl_sync(kFullWarpMask, incl, 31);
  }
  return w;
}

// Geometry of a CTA's tile (uniform over the CTA; a trivial type: it lives in shared memory).
struct PrefillTile {
  int b;
  int q_start, q_len, k_len;
  int64_t k_start;  // contiguous K/V: first key row of the sequence
  int group, kv_head;
  int rows;         // rows of the sequence: q_len * group
  int row0;         // first row of this tile
  // Keys by rank (deterministic tree rows; nullptr otherwise): key j >= key_map_lo is the
  // sequence's key key_map_lo + key_map[j - key_map_lo].
  const int32_t* key_map;
  int key_map_lo;
  // An fp8 cache: the factor of the P V accumulators (the V tiles hold 2^-8 times the stored
  // values): v_scale of the KV head * 2^8. 1 otherwise (and not read).
  float out_scale;
};

// The numerator of the normalisation 1 / l (the fp8 cache's out_scale; exactly 1 otherwise, so
// the other instances compute 1.f / l as before).
template <typename Traits>
__device__ __forceinline__ float out_numerator(const PrefillTile& tile) {
  if constexpr (Traits::kFp8Cache) return tile.out_scale;
  return 1.f;
}

// The fragment rows of a thread (rows g and g + 8 of its warp's 16): token, position, validity.
// Computed where needed (masked tiles, epilogue) rather than kept live through the main loop.
struct FragmentRows {
  int token[2];
  int pos[2];
  bool valid[2];
};

__device__ __forceinline__ FragmentRows fragment_rows(const PrefillTile& tile, const SequenceMask& mask, int warp,
                                                      int lane) {
  FragmentRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.row0 + warp * 16 + lane / 4 + 8 * h;
    rows.valid[h] = row < tile.rows;
    rows.token[h] = rows.valid[h] ? row / tile.group : 0;
    rows.pos[h] = rows.valid[h] ? mask.query_pos(rows.token[h]) : 0;
  }
  return rows;
}

}  // namespace fastinfer::attention
