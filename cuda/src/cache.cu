// KV-cache write launcher and its instantiations.
#include "fastinfer/cache/reshape_and_cache.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"

namespace fastinfer {
namespace {

template <typename T, typename CacheT>
cudaError_t launch_reshape_and_cache_typed(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t row = p.num_kv_heads * p.head_dim;
  const bool vectorizable = row % kVec == 0 && p.k_token_stride % kVec == 0 &&
                            p.v_token_stride % kVec == 0 && is_aligned(p.k, 16) && is_aligned(p.v, 16) &&
                            is_aligned(p.k_cache, 16) && is_aligned(p.v_cache, 16) &&
                            // per-KV-head scales: a vector must not straddle two heads
                            (p.head_dim % kVec == 0 || (p.k_scale_stride == 0 && p.v_scale_stride == 0));
  return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
    int64_t threads = (row / VEC + 31) / 32 * 32;
    if (threads > cache::kMaxThreads) threads = cache::kMaxThreads;
    return launch_kernel(cache::reshape_and_cache_kernel<T, CacheT, VEC>,
                         dim3(static_cast<unsigned>(p.num_tokens)), dim3(static_cast<unsigned>(threads)), 0,
                         stream, p);
  });
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_tokens > 0x7fffffff || p.num_kv_heads <= 0 || p.head_dim <= 0)
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.cache_dtype == p.dtype) return launch_reshape_and_cache_typed<T, T>(p, stream);
    if (p.cache_dtype == DType::kFloat8E4M3) {
      if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
      return launch_reshape_and_cache_typed<T, __nv_fp8_e4m3>(p, stream);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace fastinfer
