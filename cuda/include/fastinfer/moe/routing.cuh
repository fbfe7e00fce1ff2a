#pragma once
// MoE routing kernels (semantics in routing.h).
//
// moe_topk: one warp per token row, kTopkWarpsPerBlock rows per CTA. Each (logit, expert) pair
// maps to a unique 64-bit rank key (order-preserving bits of the logit above the complemented
// expert id), so "descending logit, ties to the lower id, NaN first" is a plain integer max. Round j
// takes the largest key below round j-1's: no per-expert "taken" state, and the k rounds reread
// the row (k passes over E values of one row, which stays in L1; E = 256, k = 8: 64 loads a
// lane). Lane j keeps the j-th selection, so the weights are one warp reduction over the k lanes.
// The shift of the exponentials is the first selection's logit: the row max, or a NaN (the row's
// weights are NaN either way), so no separate max pass is needed.
//
// moe_align: one kernel, one CTA per expert, so that the slots of an expert are written in
// ascending order without atomics on global memory (deterministic output). Each CTA
//  1. builds the histogram of all experts in shared memory (shared atomics: the counts do not
//     depend on their order) and sums the padded counts of the experts before it (its group's
//     offset) and of all (num_tokens_post_padded);
//  2. compacts its expert's slots in tiles of kAlignThreads: a warp ballot ranks a slot within its
//     warp, the per-warp counts of the tile rank the warps;
//  3. writes its group's padding and block ids; the last expert's CTA also writes what follows all
//     groups (sentinels, expert id 0 of the unused blocks, num_tokens_post_padded).
// Every output element is written by exactly one CTA, once. Cost: each CTA reads topk_ids twice
// (E x 2 x T * top_k ids, L2-resident; a CTA whose expert has no slot skips the second read).
// vLLM's kernel reads the ids once and scatters with global atomics, which orders the slots of an
// expert by the schedule.
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/moe/routing.h"

#include <cmath>

namespace fastinfer::moe {

constexpr int kTopkWarpsPerBlock = 4;

// Larger key = earlier in the output. NaN maps to the top of the logit order (0xff800001, just
// above +inf's 0xff800000), as torch.topk ranks it; no key is ~0 (the first round's bound) and 0 is
// below every key, the "nothing yet" of a round.
__device__ __forceinline__ unsigned long long rank_key(float x, int expert) {
  uint32_t ordered = 0xff800001u;
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

constexpr int kAlignThreads = 256;
constexpr int kAlignWarps = kAlignThreads / 32;

__device__ __forceinline__ int64_t load_expert(const MoeAlignParams& p, int i) {
  return p.index_type == IndexType::kInt64 ? static_cast<const int64_t*>(p.topk_ids)[i]
                                           : static_cast<int64_t>(static_cast<const int32_t*>(p.topk_ids)[i]);
}

__device__ __forceinline__ int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

__global__ void __launch_bounds__(kAlignThreads) moe_align_kernel(const MoeAlignParams p) {
  __shared__ int counts[kMoeAlignMaxExperts];
  __shared__ int warp_a[kAlignWarps];
  __shared__ int warp_b[kAlignWarps];
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int E = p.num_experts, bm = p.block_m, n = p.num_slots;
  const int expert = static_cast<int>(blockIdx.x);

  for (int e = tid; e < E; e += kAlignThreads) counts[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += kAlignThreads) {
    const int64_t id = load_expert(p, i);
    if (id >= 0 && id < E) atomicAdd(&counts[id], 1);
  }
  __syncthreads();

  int before = 0, total = 0;  // padded counts of the experts before this one, of all experts
  for (int e = tid; e < E; e += kAlignThreads) {
    const int padded = round_up(counts[e], bm);
    total += padded;
    if (e < expert) before += padded;
  }
  before = warp_reduce_sum(before);
  total = warp_reduce_sum(total);
  if (lane == 0) {
    warp_a[warp] = before;
    warp_b[warp] = total;
  }
  __syncthreads();
  before = 0;
  total = 0;
  for (int w = 0; w < kAlignWarps; ++w) {
    before += warp_a[w];
    total += warp_b[w];
  }
  const int count = counts[expert];
  __syncthreads();  // warp_a is reused below

  if (count > 0) {
    int placed = 0;
    for (int tile = 0; tile < n; tile += kAlignThreads) {
      const int i = tile + tid;
      const bool mine = i < n && load_expert(p, i) == expert;
      const unsigned ballot = __ballot_sync(kFullWarpMask, mine);
      if (lane == 0) warp_a[warp] = __popc(ballot);
      __syncthreads();
      int rank = placed + __popc(ballot & ((1u << lane) - 1u));
      for (int w = 0; w < kAlignWarps; ++w) {
        if (w < warp) rank += warp_a[w];
        placed += warp_a[w];
      }
      if (mine) p.sorted_token_ids[before + rank] = i;
      __syncthreads();  // warp_a is rewritten by the next tile
    }
  }
  const int padded = round_up(count, bm);
  for (int j = count + tid; j < padded; j += kAlignThreads) p.sorted_token_ids[before + j] = n;
  for (int b = tid; b < padded / bm; b += kAlignThreads) p.expert_ids[before / bm + b] = expert;

  if (expert == E - 1) {
    const int sorted_size = static_cast<int>(moe_align_sorted_size(n, E, bm));
    const int num_blocks = (sorted_size + bm - 1) / bm;
    for (int j = total + tid; j < sorted_size; j += kAlignThreads) p.sorted_token_ids[j] = n;
    for (int b = total / bm + tid; b < num_blocks; b += kAlignThreads) p.expert_ids[b] = 0;
    if (tid == 0) *p.num_tokens_post_padded = total;
  }
}

}  // namespace fastinfer::moe
