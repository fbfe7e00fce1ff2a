#pragma once
// RMSNorm kernels: one CTA per row. Pass 1 reads the row with 16-byte loads and reduces the sum
// of squares in fp32; pass 2 re-reads it (from L1/L2) and writes the scaled row. At decode sizes
// (T <= 16 rows) the grid has fewer CTAs than SMs (bench/model.py): the op then moves tens of KB
// and is latency-bound; splitting a row over CTAs would need a second launch for the reduction.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/norm/rms_norm.h"

namespace fastinfer::norm {

constexpr int kMaxThreads = 1024;

// Vector i of the weight; a null weight (the weightless norm) reads as ones, and x * inv_rms * 1
// rounds exactly as x * inv_rms. The branch is uniform over the grid.
template <typename T, int VEC>
__device__ __forceinline__ Vec<T, VEC> load_weight(const T* weight, int64_t i) {
  Vec<T, VEC> w;
  if (weight != nullptr) {
    w.load(weight + i * VEC);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = from_float<T>(1.0f);
  }
  return w;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_kernel(const RmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* __restrict__ x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  T* __restrict__ out = static_cast<T*>(p.out) + row * p.out_row_stride;
  const T* __restrict__ weight = static_cast<const T*>(p.weight);
  const int64_t num_vecs = p.hidden / VEC;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Vec<T, VEC> v;
    v.load(x + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(v[j]);
      sum_sq += f * f;
    }
  }
  const float inv_rms = rsqrtf(block_reduce_sum(sum_sq, scratch) / static_cast<float>(p.hidden) + p.eps);

  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Vec<T, VEC> v;
    v.load(x + i * VEC);
    const Vec<T, VEC> w = load_weight<T, VEC>(weight, i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = from_float<T>(to_float(v[j]) * inv_rms * to_float(w[j]));
    v.store(out + i * VEC);
  }
}

// residual <- round(x + residual); x <- rms_norm(residual). Each thread touches the same
// elements in both passes, so the in-place update needs no extra barrier.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) fused_add_rms_norm_kernel(const FusedAddRmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  T* __restrict__ x = static_cast<T*>(p.x) + row * p.x_row_stride;
  T* __restrict__ residual = static_cast<T*>(p.residual) + row * p.residual_row_stride;
  const T* __restrict__ weight = static_cast<const T*>(p.weight);
  const int64_t num_vecs = p.hidden / VEC;

  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Vec<T, VEC> v, r;
    v.load(x + i * VEC);
    r.load(residual + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      r[j] = from_float<T>(to_float(v[j]) + to_float(r[j]));
      const float f = to_float(r[j]);  // normalise the stored (rounded) residual
      sum_sq += f * f;
    }
    r.store(residual + i * VEC);
  }
  const float inv_rms = rsqrtf(block_reduce_sum(sum_sq, scratch) / static_cast<float>(p.hidden) + p.eps);

  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Vec<T, VEC> r;
    r.load(residual + i * VEC);
    const Vec<T, VEC> w = load_weight<T, VEC>(weight, i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) r[j] = from_float<T>(to_float(r[j]) * inv_rms * to_float(w[j]));
    r.store(x + i * VEC);
  }
}

// Threads per row: enough for one vector each, a multiple of 32, at most 1024.
inline unsigned threads_for_row(int64_t num_vecs) {
  int64_t t = (num_vecs + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > kMaxThreads) t = kMaxThreads;
  return static_cast<unsigned>(t);
}

}  // namespace fastinfer::norm
