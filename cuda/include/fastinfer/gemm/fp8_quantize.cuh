#pragma once
// Dynamic e4m3 quantisation (see gemm/fp8.h for the exact arithmetic).
//
//  - per token and per tensor: the kernels of gemm/quantize.cuh with the e4m3 format below.
//  - per group (kGroup): a flat kernel over 8-element (16-byte) vectors of x; the g / 8 lanes that
//    hold one group (a power of two <= 32, aligned within the warp) reduce amax with xor shuffles,
//    then each lane writes its 8 e4m3 bytes and the group's first lane its scale. One read of x.
//    A row's last group may be shorter (fused_moe's groups of a; the op itself takes whole groups):
//    its missing lanes are idle.
//  - decode-sized inputs (M <= 16 rows) launch fewer CTAs than SMs in every mode; they are a few
//    hundred KB, latency-bound on any grid. Per tensor, bench/model.py's per-launch distinct
//    sectors are 1.67x the ideal bytes (x read by both passes).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8.h"
#include "fastinfer/gemm/quantize.cuh"

#include <cstdint>

namespace fastinfer::fp8 {

constexpr float kE4m3Max = 448.0f;
constexpr float kMinAmax = 1e-12f;  // guards amax = 0 (all-zero rows get scale 1e-12 / 448, q = 0)

// A NaN amax gives a NaN scale (fmaxf alone would give the floor's).
__device__ __forceinline__ float scale_from_amax(float amax) {
  return (amax != amax ? amax : fmaxf(amax, kMinAmax)) / kE4m3Max;
}

// e4m3(clamp(x / scale)), the byte. The clamp keeps a NaN (torch.clamp's rule), which the cast
// writes as e4m3's NaN.
__device__ __forceinline__ uint32_t quantize1(float v, float scale) {
  const float x = v / scale;
  const float q = x != x ? x : fminf(fmaxf(x, -kE4m3Max), kE4m3Max);
  const __nv_fp8_e4m3 e = from_float<__nv_fp8_e4m3>(q);
  return *reinterpret_cast<const uint8_t*>(&e);
}

// quantize1 of 8 values -> 8 bytes (as a uint2), lower index in the lowest byte.
template <typename T>
__device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, float scale) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i / 4] |= quantize1(to_float(v[i]), scale) << (8 * (i % 4));
  return make_uint2(w[0], w[1]);
}

// The e4m3 format of gemm/quantize.cuh's kernels: scale = max(amax, 1e-12) / 448, no zero point.
struct E4m3Format {
  using Params = Fp8QuantizeParams;
  struct Range {
    float amax = 0.f;
    template <typename T>
    __device__ __forceinline__ void add(const Vec<T, 8>& v) {
      amax = max_nan(amax, quant::amax8(v));
    }
  };
  static __device__ __forceinline__ float scale_from_amax(float amax) { return fp8::scale_from_amax(amax); }
  static __device__ __forceinline__ int32_t given_zero_point(const Params&) { return 0; }
  static __device__ __forceinline__ quant::QuantScale row_scale(const Range& range, float* scratch) {
    return {fp8::scale_from_amax(block_reduce_max(range.amax, scratch)), 0};
  }
  static __device__ __forceinline__ void store_row_scale(const Params& p, int64_t row, const quant::QuantScale& s) {
    p.scale[row] = s.scale;
  }
  template <typename T>
  static __device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, const quant::QuantScale& s) {
    return fp8::quantize8(v, s.scale);
  }
};

// ---- per group ---------------------------------------------------------------------------------
// grid ceil(M * group_lanes(K) / kQuantThreads), block kQuantThreads. kLanes = group_size / 8; a
// row has ceil(K / group_size) groups of kLanes lanes (the lanes past K idle).
template <int kLanes>
__host__ __device__ __forceinline__ int64_t group_lanes(int64_t cols) {
  return (cols / 8 + kLanes - 1) / kLanes * kLanes;
}

template <typename T, int kLanes>
__global__ void __launch_bounds__(quant::kQuantThreads) fp8_quantize_group_kernel(const Fp8QuantizeParams p) {
  const int64_t vecs_per_row = p.cols / 8, lanes_per_row = group_lanes<kLanes>(p.cols);
  const int64_t u = static_cast<int64_t>(blockIdx.x) * quant::kQuantThreads + threadIdx.x;
  // whole groups: the lanes are the vectors (row 0, c flat), without a division
  const bool whole = lanes_per_row == vecs_per_row;
  const int64_t row = whole ? 0 : u / lanes_per_row;
  const int64_t c = whole ? u : u % lanes_per_row;
  const int64_t v = row * vecs_per_row + c;  // the vector's index in the (contiguous) output
  const bool valid = (whole || c < vecs_per_row) && v < p.rows * vecs_per_row;
  Vec<T, 8> x;
  float amax = 0.f;
  if (valid) {
    x.load(static_cast<const T*>(p.x) + quant::x_vector_offset(p, v));
    amax = quant::amax8(x);
  }
  amax = warp_reduce_max_nan<kLanes>(amax);
  if (!valid) return;  // after the (full-warp) shuffles
  const float scale = scale_from_amax(amax);
  reinterpret_cast<uint2*>(p.out)[v] = quantize8(x, scale);
  if (c % kLanes == 0) p.scale[(row * lanes_per_row + c) / kLanes] = scale;
}

// ---- given scales per token, channel or group --------------------------------------------------
// grid ceil(M * K / 8 / kQuantThreads), block kQuantThreads: one 8-element vector per thread, each
// element divided by its given scale (a vector never straddles a group: group_size >= 8); the
// thread of a unit's first vector copies its scale to the output.
template <typename T>
__global__ void __launch_bounds__(quant::kQuantThreads) fp8_quantize_given_kernel(const Fp8QuantizeParams p) {
  const int64_t vecs_per_row = p.cols / 8;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * quant::kQuantThreads + threadIdx.x;
  if (v >= p.rows * vecs_per_row) return;
  const int64_t row = v / vecs_per_row, col = v % vecs_per_row * 8;
  Vec<T, 8> x;
  x.load(static_cast<const T*>(p.x) + quant::x_vector_offset(p, v));
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    int64_t unit;
    switch (p.mode) {
      case Fp8QuantMode::kToken: unit = row; break;
      case Fp8QuantMode::kChannel: unit = col + i; break;
      case Fp8QuantMode::kGroup: unit = row * (p.cols / p.group_size) + (col + i) / p.group_size; break;
      default: unit = 0; break;
    }
    const float s = p.given_scale[unit];
    const float q = to_float(x[i]) / s;
    const __nv_fp8_e4m3 e = from_float<__nv_fp8_e4m3>(q != q ? q : fminf(fmaxf(q, -kE4m3Max), kE4m3Max));
    w[i / 4] |= static_cast<uint32_t>(*reinterpret_cast<const uint8_t*>(&e)) << (8 * (i % 4));
    const bool first_of_unit = p.mode == Fp8QuantMode::kToken     ? col + i == 0
                               : p.mode == Fp8QuantMode::kChannel ? row == 0
                                                                   : (col + i) % p.group_size == 0;
    if (first_of_unit) p.scale[unit] = s;
  }
  reinterpret_cast<uint2*>(p.out)[v] = make_uint2(w[0], w[1]);
}

}  // namespace fastinfer::fp8
