#pragma once
// Dynamic int8 quantisation (the exact arithmetic is in gemm/int8.h): the kernels of
// gemm/quantize.cuh with the int8 formats below.
//  - per token (kToken): the block reduction is of amax (symmetric) or of max(x, 0) and max(-x, 0)
//    (asymmetric: scale and zero point from the two), then 8 bytes per vector.
//  - per tensor (kTensor): with a given scale one flat elementwise pass (asymmetric: with a given
//    zero point too); otherwise the reduction pass first (symmetric).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/int8.h"
#include "fastinfer/gemm/quantize.cuh"

#include <cstdint>

namespace fastinfer::int8 {

constexpr float kMinRange = 1e-12f;  // guards an all-zero row (scale 1e-12 / 127, codes 0)

// The code of one value, and code1 of 8 values -> 8 bytes (uint2), lower index in the lowest byte:
// rne(clamp(x / scale + 0, lo, hi)) + azp clamped (symmetric: azp = 0, [-127, 127]). x / scale NaN
// (a NaN value, or a row's NaN scale) has code 0: int8 has no NaN, the scale carries it.
template <bool kSymmetric>
__device__ __forceinline__ int32_t code1(float v, float scale, int32_t azp) {
  const float x = v / scale;
  if (x != x) return 0;
  if constexpr (kSymmetric) {
    return __float2int_rn(fminf(fmaxf(x, -127.f), 127.f));
  } else {
    // |x| <= 255 (the range holds every value), so the rounded value fits an int before the clamp.
    const int32_t q = __float2int_rn(fminf(fmaxf(x, -256.f), 256.f)) + azp;
    return q < -128 ? -128 : (q > 127 ? 127 : q);
  }
}

template <typename T, bool kSymmetric>
__device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, float scale, int32_t azp) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    w[i / 4] |= (static_cast<uint32_t>(code1<kSymmetric>(to_float(v[i]), scale, azp)) & 0xffu) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

// The int8 formats of gemm/quantize.cuh's kernels. Symmetric: scale = max(amax, 1e-12) / 127, no
// zero point; asymmetric (per token): scale = max(hi + lo, 1e-12) / 255 over hi = max(x, 0) and
// lo = max(-x, 0), zero point clamp(rne(lo / scale) - 128, -128, 127).
template <bool kSymmetric>
struct Int8Format {
  using Params = Int8QuantizeParams;
  struct Range {
    float hi = 0.f, lo = 0.f;  // max(x, 0) and max(-x, 0); symmetric uses max(hi, lo) = amax
    template <typename T>
    __device__ __forceinline__ void add(const Vec<T, 8>& v) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float x = to_float(v[i]);
        hi = max_nan(hi, x);
        lo = max_nan(lo, -x);
      }
    }
  };
  // The floor of a range, a NaN range (a NaN in the row) kept.
  static __device__ __forceinline__ float floored(float range) {
    return range != range ? range : fmaxf(range, kMinRange);
  }
  static __device__ __forceinline__ float scale_from_amax(float amax) { return floored(amax) / 127.f; }
  static __device__ __forceinline__ int32_t given_zero_point(const Params& p) {
    return kSymmetric || p.given_azp == nullptr ? 0 : *p.given_azp;
  }
  static __device__ __forceinline__ quant::QuantScale row_scale(const Range& range, float* scratch) {
    if constexpr (kSymmetric) {
      return {scale_from_amax(block_reduce_max(max_nan(range.hi, range.lo), scratch)), 0};
    } else {
      const float hi = block_reduce_max(range.hi, scratch);
      const float lo = block_reduce_max(range.lo, scratch);
      const float scale = floored(hi + lo) / 255.f;
      if (scale != scale) return {scale, 0};  // a NaN row: codes 0, zero point 0
      int32_t azp = __float2int_rn(lo / scale) - 128;
      azp = azp < -128 ? -128 : (azp > 127 ? 127 : azp);
      return {scale, azp};
    }
  }
  static __device__ __forceinline__ void store_row_scale(const Params& p, int64_t row, const quant::QuantScale& s) {
    p.scale[row] = s.scale;
    if constexpr (!kSymmetric) p.azp[row] = s.zero_point;
  }
  template <typename T>
  static __device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, const quant::QuantScale& s) {
    return int8::quantize8<T, kSymmetric>(v, s.scale, s.zero_point);
  }
};

}  // namespace fastinfer::int8
