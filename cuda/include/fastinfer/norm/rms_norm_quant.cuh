#pragma once
// RMSNorm fused with the e4m3 / int8 activation quantisation of the W8A8 GEMMs: one CTA per row,
// the threads, vectors and sum order of rms_norm_kernel / fused_add_rms_norm_kernel (so the rounded
// norm is bit for bit theirs), then the codes of gemm/fp8_quantize.cuh / gemm/int8_quantize.cuh.
// The normalised row is not held across passes: each pass re-reads its vectors of x (or of the
// updated residual), which the row's first pass left in L1/L2, and recomputes the norm. Holding
// it in registers spills on sm_100a / sm_120a, where 1024-thread blocks cap a thread at 64
// registers. Per-token scales need a second block reduction (amax); a given per-tensor scale does not.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8_quantize.cuh"
#include "fastinfer/gemm/int8_quantize.cuh"
#include "fastinfer/norm/rms_norm.cuh"

namespace fastinfer::norm {

// The code formats: a row's scale from its amax, and one value's code byte.
struct E4m3Codes {
  static __device__ __forceinline__ float scale_from_amax(float amax) { return fp8::scale_from_amax(amax); }
  static __device__ __forceinline__ uint32_t code(float v, float scale) { return fp8::quantize1(v, scale); }
};
struct Int8Codes {
  static __device__ __forceinline__ float scale_from_amax(float amax) {
    return int8::Int8Format<true>::scale_from_amax(amax);
  }
  static __device__ __forceinline__ uint32_t code(float v, float scale) {
    return static_cast<uint32_t>(int8::code1<true>(v, scale, 0)) & 0xffu;
  }
};

// Vector i of the row: residual <- round(x + residual) with a residual (stored), then the value
// normalised, as fused_add_rms_norm_kernel / rms_norm_kernel compute it.
template <typename T, int VEC, bool kAdd>
__device__ __forceinline__ Vec<T, VEC> load_sum(const T* x, T* residual, int64_t i) {
  Vec<T, VEC> v;
  v.load(x + i * VEC);
  if constexpr (kAdd) {
    Vec<T, VEC> r;
    r.load(residual + i * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) r[j] = from_float<T>(to_float(v[j]) + to_float(r[j]));
    r.store(residual + i * VEC);
    return r;
  }
  return v;
}

template <typename T, int VEC>
__device__ __forceinline__ void normalise(Vec<T, VEC>& v, const T* weight, float offset, float inv_rms, int64_t i,
                                          float& amax) {
  float w[VEC];
  load_weight<T, VEC>(w, weight, offset, i);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    v[j] = from_float<T>(to_float(v[j]) * inv_rms * w[j]);
    amax = max_nan(amax, fabsf(to_float(v[j])));
  }
}

// VEC code bytes of vector i (VEC = 8: one 8-byte store; the row starts 8-byte aligned then).
template <typename Codes, typename T, int VEC>
__device__ __forceinline__ void store_codes(uint8_t* out, const Vec<T, VEC>& v, float scale, int64_t i) {
  if constexpr (VEC == 8) {
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j / 4] |= Codes::code(to_float(v[j]), scale) << (8 * (j % 4));
    reinterpret_cast<uint2*>(out)[i] = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[i * VEC + j] = static_cast<uint8_t>(Codes::code(to_float(v[j]), scale));
  }
}

template <typename T, int VEC, typename Codes, bool kAdd>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_quant_kernel(const RmsNormQuantParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* __restrict__ x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  T* residual = kAdd ? static_cast<T*>(p.residual) + row * p.residual_row_stride : nullptr;
  const T* __restrict__ weight = static_cast<const T*>(p.weight);
  uint8_t* __restrict__ out = static_cast<uint8_t*>(p.out) + row * p.hidden;
  const int64_t num_vecs = p.hidden / VEC;
  const int64_t stride = blockDim.x;
  // The row the norm reads: the updated residual (written by this same thread in pass 1) or x.
  const T* normed = kAdd ? residual : x;

  // Pass 1: the sum of squares (each thread over vectors t, t + blockDim, ... as rms_norm_kernel).
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_vecs; i += stride) {
    const Vec<T, VEC> v = load_sum<T, VEC, kAdd>(x, residual, i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float f = to_float(v[j]);
      sum_sq += f * f;
    }
  }
  const float inv_rms = rsqrtf(block_reduce_sum(sum_sq, scratch) / static_cast<float>(p.hidden) + p.eps);

  // Pass 2 (per-token scales only): the amax of the norm rounded to T.
  float amax = 0.f;
  if (p.given_scale == nullptr) {
    for (int64_t i = threadIdx.x; i < num_vecs; i += stride) {
      Vec<T, VEC> v;
      v.load(normed + i * VEC);
      normalise<T, VEC>(v, weight, p.weight_offset, inv_rms, i, amax);
    }
  }
  const float scale =
      p.given_scale != nullptr ? *p.given_scale : Codes::scale_from_amax(block_reduce_max(amax, scratch));
  if (threadIdx.x == 0 && (p.given_scale == nullptr || row == 0)) p.scale[p.given_scale == nullptr ? row : 0] = scale;

  // Pass 3: the codes of the norm, recomputed as pass 2 computed it.
  for (int64_t i = threadIdx.x; i < num_vecs; i += stride) {
    Vec<T, VEC> v;
    v.load(normed + i * VEC);
    float unused = 0.f;
    normalise<T, VEC>(v, weight, p.weight_offset, inv_rms, i, unused);
    store_codes<Codes, T, VEC>(out, v, scale, i);
  }
}

}  // namespace fastinfer::norm
