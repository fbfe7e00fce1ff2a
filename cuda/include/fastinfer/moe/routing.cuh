#pragma once
// MoE routing kernels (semantics in routing.h).
//
// moe_topk: one warp per token row, kTopkWarpsPerBlock rows per CTA. Each (logit, expert) pair
// maps to a unique 64-bit rank key (order-preserving bits of the logit above the complemented
// expert id), so "descending logit, ties to the lower id, NaN last" is a plain integer max. Round j
// takes the largest key below round j-1's: no per-expert "taken" state, and the k rounds reread
// the row (k passes over E values of one row, which stays in L1; E = 256, k = 8: 64 loads a
// lane). Lane j keeps the j-th selection, so the weights are one warp reduction over the k lanes.
// The shift of the exponentials is the first selection's logit: the row max (unless the row is
// all NaN, which is NaN either way), so no separate max pass is needed.
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/moe/routing.h"

#include <cmath>

namespace fastinfer::moe {

constexpr int kTopkWarpsPerBlock = 4;

// Larger key = earlier in the output. NaN maps to the bottom of the logit order (below -inf, whose
// bits map to 0x007fffff); 0 is below every key, the "nothing yet" of a round.
__device__ __forceinline__ unsigned long long rank_key(float x, int expert) {
  uint32_t ordered = 0u;
  if (!(x != x)) {
    if (x == 0.f) x = 0.f;  // -0.0 ranks as +0.0 (equal logits tie to the lower id)
    const uint32_t bits = __float_as_uint(x);
    ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<unsigned long long>(ordered) << 32) | (0xffffffffu - static_cast<uint32_t>(expert));
}

__device__ __forceinline__ int expert_of(unsigned long long key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

template <typename T>
__global__ void __launch_bounds__(kTopkWarpsPerBlock * 32) moe_topk_kernel(const MoeTopkParams p) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kTopkWarpsPerBlock + threadIdx.x / 32;
  if (token >= p.num_tokens) return;  // the whole warp leaves together
  const int E = p.num_experts, k = p.top_k;
  const T* row = static_cast<const T*>(p.router_logits) + token * E;

  unsigned long long prev = ~0ull;
  float my_logit = 0.f;
  int my_expert = 0;
  for (int j = 0; j < k; ++j) {
    unsigned long long best = 0ull;
    for (int e = lane; e < E; e += 32) {
      const unsigned long long key = rank_key(to_float(row[e]), e);
      if (key < prev && key > best) best = key;
    }
    best = warp_allreduce(best, [](unsigned long long a, unsigned long long b) { return a > b ? a : b; });
    prev = best;
    if (lane == j) {
      my_expert = expert_of(best);
      my_logit = to_float(row[my_expert]);
    }
  }

  const bool selected = lane < k;
  const float shift = __shfl_sync(kFullWarpMask, my_logit, 0);
  float w;
  if (p.scoring == MoeScoring::kSoftmax) {
    float sum = 0.f;  // NaN logits stay in: a NaN anywhere makes the row's weights NaN
    for (int e = lane; e < E; e += 32) sum += expf(to_float(row[e]) - shift);
    sum = warp_reduce_sum(sum);
    w = selected ? expf(my_logit - shift) / sum : 0.f;
    if (p.renormalize) w = w / warp_reduce_sum(w);
  } else {
    const float numerator = selected ? expf(my_logit - shift) : 0.f;
    w = numerator / warp_reduce_sum(numerator);
  }
  if (selected) {
    p.topk_weights[token * k + lane] = w;
    p.topk_ids[token * k + lane] = my_expert;
  }
}

}  // namespace fastinfer::moe
