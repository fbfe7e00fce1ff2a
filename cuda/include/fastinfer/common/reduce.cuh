#pragma once
// Block reductions built on the warp reductions of math.cuh (no warp-synchronous assumptions).
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/platform.cuh"

namespace fastinfer {

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

// Max over the block of non-negative values (0 for an all-zero block), NaN if any value is NaN
// (max_nan), returned to every thread; same contract as block_reduce_sum.
__device__ __forceinline__ float block_reduce_max(float x, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  x = warp_reduce_max_nan(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float m = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = max_nan(m, scratch[w]);
  __syncthreads();
  return m;
}

}  // namespace fastinfer
