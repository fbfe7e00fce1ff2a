#pragma once
// The gated activations: grid (row, column chunk); each thread loads VEC gate and VEC up elements
// with 16-byte loads and stores VEC outputs. fp32 math, one rounding. At decode sizes (T <= 16) the
// grid (7 x T for F = 14336) has fewer CTAs than SMs (bench/model.py): the op moves under 1 MB and
// is latency-bound; every thread already handles a single vector. One kernel per activation (the
// activation a compile-time functor of the shared row body).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/activation/gated.h"

namespace fastinfer::activation {

constexpr int kThreads = 256;

struct Silu {
  __device__ __forceinline__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};
struct GeluTanh {
  __device__ __forceinline__ float operator()(float x) const {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
  }
};

template <typename Act, typename T, int VEC>
__device__ __forceinline__ void gated_row_vector(const GatedActivationParams& p) {
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
  for (int j = 0; j < VEC; ++j) g[j] = from_float<T>(Act()(to_float(g[j])) * to_float(u[j]));
  g.store(out + i);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(const GatedActivationParams p) {
  gated_row_vector<Silu, T, VEC>(p);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) gelu_tanh_and_mul_kernel(const GatedActivationParams p) {
  gated_row_vector<GeluTanh, T, VEC>(p);
}

}  // namespace fastinfer::activation
