// Rotary embedding launcher and its instantiations.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/rope/rotary_embedding.cuh"

namespace fastinfer {
namespace {

template <typename T, typename CT>
cudaError_t launch_rotary_typed(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  constexpr int kVecPairs = 16 / sizeof(T);  // 16-byte loads of q/k
  const int64_t half = p.rotary_dim / 2;
  const bool k_ok = p.k == nullptr || (is_aligned(p.k, 16) && p.k_token_stride % kVecPairs == 0);
  const bool vectorizable = half % kVecPairs == 0 && p.head_dim % kVecPairs == 0 &&
                            p.q_token_stride % kVecPairs == 0 && is_aligned(p.q, 16) && k_ok &&
                            is_aligned(p.cos_sin_cache, 16);
  const int64_t heads = p.num_q_heads + (p.k != nullptr ? p.num_kv_heads : 0);
  auto launch = [&](auto kernel, int64_t pairs_per_item) {
    int64_t threads = (heads * (half / pairs_per_item) + 31) / 32 * 32;
    if (threads > rope::kMaxThreads) threads = rope::kMaxThreads;
    if (threads < 32) threads = 32;
    return launch_kernel(kernel, dim3(static_cast<unsigned>(p.num_tokens)),
                         dim3(static_cast<unsigned>(threads)), 0, stream, p);
  };
  if (p.is_neox) {
    return vectorizable ? launch(rope::rotary_embedding_kernel<T, CT, true, kVecPairs>, kVecPairs)
                        : launch(rope::rotary_embedding_kernel<T, CT, true, 1>, 1);
  }
  return vectorizable ? launch(rope::rotary_embedding_kernel<T, CT, false, kVecPairs>, kVecPairs)
                      : launch(rope::rotary_embedding_kernel<T, CT, false, 1>, 1);
}

}  // namespace

cudaError_t launch_rotary_embedding(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_tokens > 0x7fffffff || p.rotary_dim <= 0 || p.rotary_dim % 2 != 0 ||
      p.rotary_dim > p.head_dim || p.num_q_heads <= 0 || (p.k != nullptr && p.num_kv_heads <= 0))
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.cache_dtype == DType::kFloat32) return launch_rotary_typed<T, float>(p, stream);
    if (p.cache_dtype == p.dtype) return launch_rotary_typed<T, T>(p, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace fastinfer
