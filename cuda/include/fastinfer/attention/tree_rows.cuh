#pragma once
// The tree rows kernel: per query row of a tree (custom mask), its depth (tree attention with a
// window) and, in the deterministic mode, its visible keys by rank. Runs before the prefill kernel
// on the same stream (attention_prefill.cu).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"
#include "fastinfer/attention/mask.cuh"

#include <cstdint>

namespace fastinfer::attention {

// ---- tree rows: depths (tree attention with a window) and keys by rank (deterministic mode) ---
// One warp per query row t of a sequence: tree_depth[t] = (number of true entries of mask row t)
// - 1, the node's depth when the row sees exactly its ancestors and itself; with `keys` (the
// deterministic mode under a custom mask) also keys[t][0 .. count) = the trailing keys the row
// sees in index order and seq[t] = b. The lanes read the row coalesced, 32 entries a step, and
// count / place them with a ballot and popcounts (exact integers).
// grid (ceil(max_seqlen_q / kTreeDepthWarps), batch), block kTreeDepthWarps * 32, no smem.
__global__ void __launch_bounds__(kTreeDepthWarps * 32)
    tree_rows_kernel(const PrefillAttentionParams p, int32_t* depth, int32_t* seq, int32_t* keys) {
  const int b = blockIdx.y;
  const int q_start = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int row = blockIdx.x * kTreeDepthWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= q_len) return;  // uniform over the warp: the ballots below see all 32 lanes
  const CustomMask mask = custom_mask_of(p, b);
  int32_t* dst = keys != nullptr ? keys + static_cast<int64_t>(q_start + row) * p.max_seqlen_q : nullptr;
  int count = 0;
  for (int c0 = 0; c0 < q_len; c0 += 32) {
    const int c = c0 + lane;
    const bool sees = c < q_len && mask.sees(row, c, q_len);
    const unsigned bits = __ballot_sync(kFullWarpMask, sees);
    const int at = count + __popc(bits & ((1u << lane) - 1u));
    if (dst != nullptr && sees && at < p.max_seqlen_q) dst[at] = c;  // (q_len <= max_seqlen_q: the caller's promise)
    count += __popc(bits);
  }
  if (lane == 0) {
    depth[q_start + row] = count - 1;
    if (seq != nullptr) seq[q_start + row] = b;
  }
}

}  // namespace fastinfer::attention
