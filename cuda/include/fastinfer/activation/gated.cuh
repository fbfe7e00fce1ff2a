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
struct GeluErf {
  __device__ __forceinline__ float operator()(float x) const {
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
  }
};
// Also transformers' gelu_new (NewGELUActivation): the same formula.
struct GeluTanh {
  __device__ __forceinline__ float operator()(float x) const {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
  }
};
// transformers' FastGELUActivation: x / 2 * (1 + tanh(x * 0.7978845608 * (1 + 0.044715 x^2))).
struct GeluFast {
  __device__ __forceinline__ float operator()(float x) const {
    return 0.5f * x * (1.0f + tanhf(x * 0.7978845608f * (1.0f + 0.044715f * x * x)));
  }
};
// transformers' QuickGELUActivation: x * sigmoid(1.702 x).
struct QuickGelu {
  __device__ __forceinline__ float operator()(float x) const { return x / (1.0f + expf(-1.702f * x)); }
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
__global__ void __launch_bounds__(kThreads) gelu_and_mul_kernel(const GatedActivationParams p) {
  gated_row_vector<GeluErf, T, VEC>(p);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) gelu_tanh_and_mul_kernel(const GatedActivationParams p) {
  gated_row_vector<GeluTanh, T, VEC>(p);
}

// The plain activations: the grid of the gated kernels over rows of width elements.
template <typename Act, typename T, int VEC>
__global__ void __launch_bounds__(kThreads) activation_kernel(const ActivationParams p) {
  const int64_t row = blockIdx.y;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (i >= p.width) return;
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  T* out = static_cast<T*>(p.out) + row * p.out_row_stride;
  Vec<T, VEC> v;
  v.load(x + i);
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = from_float<T>(Act()(to_float(v[j])));
  v.store(out + i);
}

}  // namespace fastinfer::activation
