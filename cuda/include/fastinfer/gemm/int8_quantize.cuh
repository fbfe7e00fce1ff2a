#pragma once
// Dynamic int8 quantisation kernels (the exact arithmetic is in gemm/int8.h).
//  - per token (kToken): one CTA per row, the fp8 per-token scheme (fp8_quantize.cuh): each thread
//    keeps up to kTokenRegVecs 8-element vectors of the row in registers (rows of K <= 8192 are
//    read once), a block reduction of amax (symmetric) or of max(x, 0) and max(-x, 0)
//    (asymmetric), then 8 bytes per vector.
//  - per tensor (kTensor, symmetric): with a given scale one flat elementwise pass; otherwise the
//    fp8 reduction pass (fp8_amax_partials_kernel: one amax per CTA, deterministic, no atomics)
//    and a flat pass whose CTAs reduce the partials again.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8_quantize.cuh"
#include "fastinfer/gemm/int8.h"

#include <cstdint>

namespace fastinfer::int8 {

constexpr float kMinRange = 1e-12f;  // guards an all-zero row (scale 1e-12 / 127, codes 0)
using fp8::kQuantThreads;
using fp8::kTokenRegVecs;

// Codes of 8 values -> 8 bytes (uint2), lower index in the lowest byte:
// rne(clamp(x / scale + 0, lo, hi)) + azp clamped (symmetric: azp = 0, [-127, 127]).
template <typename T, bool kSymmetric>
__device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, float scale, int32_t azp) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = to_float(v[i]) / scale;
    int32_t q;
    if constexpr (kSymmetric) {
      q = __float2int_rn(fminf(fmaxf(x, -127.f), 127.f));
    } else {
      // |x| <= 255 (the range holds every value), so the rounded value fits an int before the clamp.
      q = __float2int_rn(fminf(fmaxf(x, -256.f), 256.f)) + azp;
      q = q < -128 ? -128 : (q > 127 ? 127 : q);
    }
    w[i / 4] |= (static_cast<uint32_t>(q) & 0xffu) << (8 * (i % 4));
  }
  return make_uint2(w[0], w[1]);
}

template <typename T>
__device__ __forceinline__ void minmax8(const Vec<T, 8>& v, float& hi, float& lo) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float x = to_float(v[i]);
    hi = fmaxf(hi, x);
    lo = fmaxf(lo, -x);
  }
}

// ---- per token: grid M, block kQuantThreads --------------------------------------------------
template <typename T, bool kSymmetric>
__global__ void __launch_bounds__(kQuantThreads) int8_quantize_token_kernel(const Int8QuantizeParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.cols / 8);
  const T* x_row = static_cast<const T*>(p.x) + row * p.cols;
  uint2* out_row = reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + row * p.cols);
  const bool in_regs = vecs <= kQuantThreads * kTokenRegVecs;

  Vec<T, 8> regs[kTokenRegVecs];
  float hi = 0.f, lo = 0.f;  // max(x, 0) and max(-x, 0); symmetric uses max(hi, lo) = amax
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) {
        regs[i].load(x_row + static_cast<int64_t>(v) * 8);
        minmax8(regs[i], hi, lo);
      }
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      minmax8(x, hi, lo);
    }
  }
  float scale;
  int32_t azp = 0;
  if constexpr (kSymmetric) {
    scale = fmaxf(block_reduce_max(fmaxf(hi, lo), scratch), kMinRange) / 127.f;
  } else {
    hi = block_reduce_max(hi, scratch);
    lo = block_reduce_max(lo, scratch);
    scale = fmaxf(hi + lo, kMinRange) / 255.f;
    azp = __float2int_rn(lo / scale) - 128;
    azp = azp < -128 ? -128 : (azp > 127 ? 127 : azp);
  }
  if (threadIdx.x == 0) {
    p.scale[row] = scale;
    if constexpr (!kSymmetric) p.azp[row] = azp;
  }
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) out_row[v] = quantize8<T, kSymmetric>(regs[i], scale, azp);
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      out_row[v] = quantize8<T, kSymmetric>(x, scale, azp);
    }
  }
}

// ---- per tensor, flat pass: grid ceil(M * K / 8 / kQuantThreads), block kQuantThreads ----------
// The scale is the given one, or comes from the num_partials amax partials in the workspace.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    int8_quantize_tensor_kernel(const Int8QuantizeParams p, const int num_partials) {
  __shared__ float scratch[32];
  float scale;
  if (p.given_scale != nullptr) {
    scale = *p.given_scale;
  } else {
    const float* partials = static_cast<const float*>(p.workspace);
    float amax = 0.f;
    for (int i = threadIdx.x; i < num_partials; i += kQuantThreads) amax = fmaxf(amax, partials[i]);
    scale = fmaxf(block_reduce_max(amax, scratch), kMinRange) / 127.f;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.scale[0] = scale;
  const int64_t num_vecs = p.rows * p.cols / 8;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  if (v >= num_vecs) return;
  Vec<T, 8> x;
  x.load(static_cast<const T*>(p.x) + v * 8);
  reinterpret_cast<uint2*>(p.out)[v] = quantize8<T, true>(x, scale, 0);
}

}  // namespace fastinfer::int8
