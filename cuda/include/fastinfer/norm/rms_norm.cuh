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
// The gated norm holds x, the gate and the weight of a vector at once: at most 512 threads per row
// (128 registers each) keeps it free of spills; its rows are head-sized (Dv = 128) anyway.
constexpr int kMaxGatedThreads = 512;

// Vector i of weight + offset in fp32; a null weight (the weightless norm, offset 0) reads as ones,
// and x * inv_rms * 1 rounds exactly as x * inv_rms. The branch is uniform over the grid.
template <typename T, int VEC>
__device__ __forceinline__ void load_weight(float (&w)[VEC], const T* weight, float offset, int64_t i) {
  if (weight != nullptr) {
    Vec<T, VEC> v;
    v.load(weight + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = to_float(v[j]) + offset;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) w[j] = 1.0f;
  }
}

// silu(z) = z / (1 + exp(-z)) in fp32, the activations' formula (activation/gated.cuh).
__device__ __forceinline__ float silu_gate(float z) { return z / (1.0f + expf(-z)); }

// kGated: the output is also multiplied by silu(gate) (fp32, one rounding).
template <typename T, int VEC, bool kGated>
__global__ void __launch_bounds__(kGated ? kMaxGatedThreads : kMaxThreads) rms_norm_kernel(const RmsNormParams p) {
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

  const T* __restrict__ gate = kGated ? static_cast<const T*>(p.gate) + row * p.gate_row_stride : nullptr;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    Vec<T, VEC> v;
    v.load(x + i * VEC);
    float w[VEC];
    load_weight<T, VEC>(w, weight, p.weight_offset, i);
    if constexpr (kGated) {
      Vec<T, VEC> z;
      z.load(gate + i * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = from_float<T>(to_float(v[j]) * inv_rms * w[j] * silu_gate(to_float(z[j])));
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[j] = from_float<T>(to_float(v[j]) * inv_rms * w[j]);
    }
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
    float w[VEC];
    load_weight<T, VEC>(w, weight, p.weight_offset, i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) r[j] = from_float<T>(to_float(r[j]) * inv_rms * w[j]);
    r.store(x + i * VEC);
  }
}

// Threads per row: enough for one vector each, a multiple of 32, at most max_threads.
inline unsigned threads_for_row(int64_t num_vecs, int max_threads = kMaxThreads) {
  int64_t t = (num_vecs + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > max_threads) t = max_threads;
  return static_cast<unsigned>(t);
}

}  // namespace fastinfer::norm
