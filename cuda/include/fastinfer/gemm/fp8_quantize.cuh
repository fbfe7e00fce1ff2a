#pragma once
// Dynamic e4m3 quantisation kernels (see gemm/fp8.h for the exact arithmetic).
//
//  - per group (kGroup): a flat kernel over 8-element (16-byte) vectors of x; the g / 8 lanes that
//    hold one group (a power of two <= 32, aligned within the warp) reduce amax with xor shuffles,
//    then each lane writes its 8 e4m3 bytes and the group's first lane its scale. One read of x.
//  - per token (kToken): one CTA per row. Each thread keeps up to kRegVecs vectors of the row in
//    registers (rows of K <= kThreads * kRegVecs * 8 = 8192 elements are read once); longer rows
//    re-read x after the block-wide amax (the second read is served by L2).
//  - per tensor (kTensor): with a given scale one flat elementwise pass; otherwise a reduction
//    pass first (fp8_amax_partials_kernel: one amax per CTA into the workspace, no atomics, so
//    the result is deterministic), then the flat pass, whose CTAs each reduce the partials again
//    (a few hundred floats, from L2) and CTA 0 writes the scale. x is read by both passes (in
//    bench/model.py's per-launch distinct sectors 1.67x the ideal bytes; the second read is an L2
//    hit when x fits there): a single pass would need a grid-wide barrier.
//  - decode-sized inputs (M <= 16 rows) launch fewer CTAs than SMs in every mode; they are a few
//    hundred KB, latency-bound on any grid.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/gemm/fp8.h"

#include <cstdint>

namespace fastinfer::fp8 {

constexpr float kE4m3Max = 448.0f;
constexpr float kMinAmax = 1e-12f;  // guards amax = 0 (all-zero rows get scale 1e-12 / 448, q = 0)
constexpr int kQuantThreads = 256;
constexpr int kTokenRegVecs = 4;
constexpr int kMaxAmaxPartials = 512;  // CTAs of the reduction pass

__device__ __forceinline__ float scale_from_amax(float amax) { return fmaxf(amax, kMinAmax) / kE4m3Max; }

// e4m3(clamp(x / scale)) of 8 values -> 8 bytes (as a uint2), lower index in the lowest byte.
template <typename T>
__device__ __forceinline__ uint2 quantize8(const Vec<T, 8>& v, float scale) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float q = fminf(fmaxf(to_float(v[i]) / scale, -kE4m3Max), kE4m3Max);
    const __nv_fp8_e4m3 e = from_float<__nv_fp8_e4m3>(q);
    const uint32_t byte = *reinterpret_cast<const uint8_t*>(&e);
    w[i / 4] |= byte << (8 * (i % 4));
  }
  return make_uint2(w[0], w[1]);
}

template <typename T>
__device__ __forceinline__ float amax8(const Vec<T, 8>& v) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(to_float(v[i])));
  return m;
}

// ---- per group ---------------------------------------------------------------------------------
// grid ceil(M * K / 8 / kQuantThreads), block kQuantThreads. kLanes = group_size / 8.
template <typename T, int kLanes>
__global__ void __launch_bounds__(kQuantThreads) fp8_quantize_group_kernel(const Fp8QuantizeParams p) {
  const int64_t num_vecs = p.rows * p.cols / 8;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  const bool valid = v < num_vecs;  // groups never straddle the end (K % group_size == 0)
  Vec<T, 8> x;
  float amax = 0.f;
  if (valid) {
    x.load(static_cast<const T*>(p.x) + v * 8);
    amax = amax8(x);
  }
  amax = warp_reduce_max<kLanes>(amax);
  if (!valid) return;  // after the (full-warp) shuffles
  const float scale = scale_from_amax(amax);
  reinterpret_cast<uint2*>(p.out)[v] = quantize8(x, scale);
  if (v % kLanes == 0) p.scale[v / kLanes] = scale;
}

// ---- per token ---------------------------------------------------------------------------------
// grid M, block kQuantThreads.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads) fp8_quantize_token_kernel(const Fp8QuantizeParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.cols / 8);
  const T* x_row = static_cast<const T*>(p.x) + row * p.cols;
  uint2* out_row = reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + row * p.cols);
  const bool in_regs = vecs <= kQuantThreads * kTokenRegVecs;

  Vec<T, 8> regs[kTokenRegVecs];
  float amax = 0.f;
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) {
        regs[i].load(x_row + static_cast<int64_t>(v) * 8);
        amax = fmaxf(amax, amax8(regs[i]));
      }
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      amax = fmaxf(amax, amax8(x));
    }
  }
  amax = block_reduce_max(amax, scratch);
  const float scale = scale_from_amax(amax);
  if (threadIdx.x == 0) p.scale[row] = scale;
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) out_row[v] = quantize8(regs[i], scale);
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      out_row[v] = quantize8(x, scale);
    }
  }
}

// ---- per tensor --------------------------------------------------------------------------------
// Reduction pass: grid num_partials (<= kMaxAmaxPartials), block kQuantThreads, grid-stride over
// the vectors; partials[blockIdx.x] = amax of this CTA's vectors.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads) fp8_amax_partials_kernel(const Fp8QuantizeParams p) {
  __shared__ float scratch[32];
  const int64_t num_vecs = p.rows * p.cols / 8;
  float amax = 0.f;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * kQuantThreads) {
    Vec<T, 8> x;
    x.load(static_cast<const T*>(p.x) + v * 8);
    amax = fmaxf(amax, amax8(x));
  }
  amax = block_reduce_max(amax, scratch);
  if (threadIdx.x == 0) static_cast<float*>(p.workspace)[blockIdx.x] = amax;
}

// Quantise pass: grid ceil(M * K / 8 / kQuantThreads), block kQuantThreads. The scale is the given
// one, or comes from the num_partials amax partials in the workspace.
template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_quantize_tensor_kernel(const Fp8QuantizeParams p, const int num_partials) {
  __shared__ float scratch[32];
  float scale;
  if (p.given_scale != nullptr) {
    scale = *p.given_scale;
  } else {
    const float* partials = static_cast<const float*>(p.workspace);
    float amax = 0.f;
    for (int i = threadIdx.x; i < num_partials; i += kQuantThreads) amax = fmaxf(amax, partials[i]);
    scale = scale_from_amax(block_reduce_max(amax, scratch));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.scale[0] = scale;
  const int64_t num_vecs = p.rows * p.cols / 8;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  if (v >= num_vecs) return;
  Vec<T, 8> x;
  x.load(static_cast<const T*>(p.x) + v * 8);
  reinterpret_cast<uint2*>(p.out)[v] = quantize8(x, scale);
}

}  // namespace fastinfer::fp8
