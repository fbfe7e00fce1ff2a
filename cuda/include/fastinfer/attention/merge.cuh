#pragma once
// merge_attention_states: combines two attention results over disjoint key sets.
// CTA of (threads_x, rows_per_cta) threads: threadIdx.y picks a (token, head) row, threadIdx.x
// walks its VEC-element slices. Every thread reads the row's two lse values, computes the
// weights in fp32 and rewrites its own slices (so v_out may alias v_a or v_b elementwise); the
// lse is written after a barrier, so lse_out may alias lse_a or lse_b too.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/vec.cuh"

#include <cmath>

namespace fastinfer::attention::merge {

constexpr int kThreads = 128;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) merge_attention_states_kernel(const MergeAttentionStatesParams p) {
  const int64_t num_rows = p.num_tokens * p.num_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  float lse_a = -INFINITY, lse_b = -INFINITY;
  bool keep_a = false;  // a masked-out token: state a, copied bit for bit
  if (active) {
    lse_a = p.lse_a[row];
    lse_b = p.lse_b[row];
    keep_a = p.mask != nullptr && !p.mask[row / p.num_heads];
  }
  // -inf safe: both -inf -> weights 0 and lse -inf. A NaN lse (either side) gives NaN weights, v
  // and lse: NaN in, NaN out (fmaxf would drop it and keep the other side). (+inf inputs are not
  // meaningful.)
  const float m = max_nan(lse_a, lse_b);
  const float ref = m == -INFINITY ? 0.f : m;
  const float ea = expf(lse_a - ref), eb = expf(lse_b - ref);
  const float sum = ea + eb;
  const bool seen = !(sum <= 0.f);  // sum > 0, or NaN
  const float wa = seen ? ea / sum : 0.f;
  const float wb = seen ? eb / sum : 0.f;

  if (active) {
    const int64_t base = row * p.head_dim;
    const T* va = static_cast<const T*>(p.v_a) + base;
    const T* vb = static_cast<const T*>(p.v_b) + base;
    T* vo = static_cast<T*>(p.v_out) + base;
    for (int d = threadIdx.x * VEC; d < p.head_dim; d += blockDim.x * VEC) {
      Vec<T, VEC> a, b;
      a.load(va + d);
      b.load(vb + d);
      if (!keep_a) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) a[i] = from_float<T>(wa * to_float(a[i]) + wb * to_float(b[i]));
      }
      a.store(vo + d);
    }
  }
  __syncthreads();  // every lse read of the CTA happens before lse_out (which may alias) is written
  if (active && threadIdx.x == 0 && p.lse_out != nullptr) p.lse_out[row] = keep_a ? lse_a : (seen ? m + logf(sum) : -INFINITY);
}

}  // namespace fastinfer::attention::merge
