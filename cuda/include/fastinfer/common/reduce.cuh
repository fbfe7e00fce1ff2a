#pragma once
// Warp and block reductions built on shuffles (no warp-synchronous assumptions).
#include "fastinfer/common/platform.cuh"

namespace fastinfer {

constexpr unsigned kFullWarpMask = 0xffffffffu;

__device__ __forceinline__ float warp_reduce_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullWarpMask, x, offset);
  return x;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32.
// Uses `scratch` (>= 32 floats of shared memory); ends with a barrier so it may be reused.
__device__ __forceinline__ float block_reduce_sum(float x, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  x = warp_reduce_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];  // same order in every thread
  __syncthreads();
  return total;
}

}  // namespace fastinfer
