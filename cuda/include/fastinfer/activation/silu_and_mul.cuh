#pragma once
// silu_and_mul: grid (row, column chunk); each thread loads VEC gate and VEC up elements with
// 16-byte loads and stores VEC outputs. fp32 math, one rounding. At decode sizes (T <= 16) the
// grid (7 x T for F = 14336) has fewer CTAs than SMs (bench/model.py): the op moves under 1 MB and
// is latency-bound; every thread already handles a single vector.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/activation/silu_and_mul.h"

namespace fastinfer::activation {

constexpr int kThreads = 256;

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(const SiluAndMulParams p) {
  const int64_t row = blockIdx.y;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (i >= p.width) return;
  const T* gate = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* up = gate + p.width;
  T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
  Vec<T, VEC> g, u;
  g.load(gate + i);
  u.load(up + i);
#pragma unroll
  for (int j = 0; j < VEC; ++j) g[j] = from_float<T>(silu(to_float(g[j])) * to_float(u[j]));
  g.store(out + i);
}

}  // namespace fastinfer::activation
