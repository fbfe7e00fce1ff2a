#pragma once
// Constants and warp reductions shared by the kernels (attention, fp8 quantisation, norms, tree
// verification). The reductions are xor butterflies over __shfl_xor_sync with the full mask: every
// lane of a group gets the result, the combination order is fixed (offsets kWidth / 2, ..., 2, 1),
// so the result is the same in every lane and from run to run.
#include "fastinfer/common/platform.cuh"

namespace fastinfer {

constexpr unsigned kFullWarpMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2):   log(x) = log2(x) * kLn2

constexpr int ilog2(int x) { return x <= 1 ? 0 : 1 + ilog2(x / 2); }
constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

// Reduction over each group of kWidth consecutive lanes (kWidth a power of two <= 32; 32 = the
// whole warp). All 32 lanes must call it (full-mask shuffles).
template <int kWidth = 32, typename T, typename Op>
__device__ __forceinline__ T warp_allreduce(T x, Op op) {
  static_assert(is_pow2(kWidth) && kWidth <= 32, "group width: a power of two <= 32");
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset >>= 1) x = op(x, __shfl_xor_sync(kFullWarpMask, x, offset));
  return x;
}

template <int kWidth = 32>
__device__ __forceinline__ float warp_reduce_sum(float x) {
  return warp_allreduce<kWidth>(x, [](float a, float b) { return a + b; });
}
template <int kWidth = 32>
__device__ __forceinline__ int warp_reduce_sum(int x) {
  return warp_allreduce<kWidth>(x, [](int a, int b) { return a + b; });
}
template <int kWidth = 32>
__device__ __forceinline__ float warp_reduce_max(float x) {
  return warp_allreduce<kWidth>(x, [](float a, float b) { return fmaxf(a, b); });
}
// max(a, b), NaN when either is (torch.amax's rule; fmaxf drops a NaN operand). The quantisers'
// amax: a NaN in x becomes a NaN scale.
__device__ __forceinline__ float max_nan(float a, float b) { return (a > b || a != a) ? a : b; }
template <int kWidth = 32>
__device__ __forceinline__ float warp_reduce_max_nan(float x) {
  return warp_allreduce<kWidth>(x, [](float a, float b) { return max_nan(a, b); });
}
template <int kWidth = 32>
__device__ __forceinline__ int warp_reduce_max(int x) {
  return warp_allreduce<kWidth>(x, [](int a, int b) { return a > b ? a : b; });
}

}  // namespace fastinfer
