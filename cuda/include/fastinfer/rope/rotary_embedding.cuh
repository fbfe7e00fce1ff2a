#pragma once
// Rotary embedding: one CTA per token. A work item is VP consecutive rotation pairs of one head
// (q heads first, then k heads), moved with 16-byte loads when the layout allows (VP is chosen in
// rope.cu so that every access of a lane is one load). At decode sizes (T <= 16) the grid has fewer
// CTAs than SMs (bench/model.py): a token is 20 KB of q/k, latency-bound on any grid.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/rope/rotary_embedding.h"

namespace fastinfer::rope {

constexpr int kMaxThreads = 256;

__device__ __forceinline__ int64_t load_index(const void* ptr, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(ptr)[i])
                                   : static_cast<const int64_t*>(ptr)[i];
}

template <typename T, typename CT, bool kNeox, int VP>
__global__ void __launch_bounds__(kMaxThreads) rotary_embedding_kernel(const RotaryEmbeddingParams p) {
  const int64_t token = blockIdx.x;
  const int64_t pos = load_index(p.positions, p.position_type, token);
  const int64_t half = p.rotary_dim / 2;
  const CT* cos_ptr = static_cast<const CT*>(p.cos_sin_cache) + pos * p.rotary_dim;
  const CT* sin_ptr = cos_ptr + half;
  const int64_t items_per_head = half / VP;
  const int64_t num_heads = p.num_q_heads + (p.k != nullptr ? p.num_kv_heads : 0);

  for (int64_t item = threadIdx.x; item < num_heads * items_per_head; item += blockDim.x) {
    const int64_t head = item / items_per_head;
    const int64_t i0 = (item % items_per_head) * VP;  // first pair index of this item
    T* x = head < p.num_q_heads
               ? static_cast<T*>(p.q) + token * p.q_token_stride + head * p.head_dim
               : static_cast<T*>(p.k) + token * p.k_token_stride + (head - p.num_q_heads) * p.head_dim;
    Vec<CT, VP> c, s;
    c.load(cos_ptr + i0);
    s.load(sin_ptr + i0);
    if constexpr (kNeox) {
      Vec<T, VP> x1, x2;
      x1.load(x + i0);
      x2.load(x + half + i0);
#pragma unroll
      for (int j = 0; j < VP; ++j) {
        const float a = to_float(x1[j]), b = to_float(x2[j]);
        const float cj = to_float(c[j]), sj = to_float(s[j]);
        x1[j] = from_float<T>(a * cj - b * sj);
        x2[j] = from_float<T>(b * cj + a * sj);
      }
      x1.store(x + i0);
      x2.store(x + half + i0);
    } else if constexpr (VP == 1) {  // scalar path: x may be only 2-byte aligned
      const float a = to_float(x[2 * i0]), b = to_float(x[2 * i0 + 1]);
      const float cj = to_float(c[0]), sj = to_float(s[0]);
      x[2 * i0] = from_float<T>(a * cj - b * sj);
      x[2 * i0 + 1] = from_float<T>(b * cj + a * sj);
    } else {
      Vec<T, 2 * VP> xy;
      xy.load(x + 2 * i0);
#pragma unroll
      for (int j = 0; j < VP; ++j) {
        const float a = to_float(xy[2 * j]), b = to_float(xy[2 * j + 1]);
        const float cj = to_float(c[j]), sj = to_float(s[j]);
        xy[2 * j] = from_float<T>(a * cj - b * sj);
        xy[2 * j + 1] = from_float<T>(b * cj + a * sj);
      }
      xy.store(x + 2 * i0);
    }
  }
}

}  // namespace fastinfer::rope
