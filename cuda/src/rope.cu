// Rotary embedding launcher and its instantiations.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/rope/rotary_embedding.cuh"

namespace fastinfer {
namespace {

// Pairs per work item: as many as keep every access of a lane a single load of at most 16 bytes
// (x1 / x2 of VP elements or, interleaved, xy of 2 VP; cos / sin of VP cache elements). Wider items
// split a lane's access into 16-byte loads 32 bytes apart, so each warp request touched twice the
// sectors it used (fp32 cos/sin with 8 bf16 pairs: 8 sectors for 4; simt profile, bench/model.py).
template <typename T, typename CT, bool kNeox>
constexpr int vec_pairs() {
  constexpr int x = kNeox ? 16 / sizeof(T) : 8 / sizeof(T);
  constexpr int c = 16 / sizeof(CT);
  return x < c ? x : c;
}

template <typename T, typename CT>
cudaError_t launch_rotary_typed(const RotaryEmbeddingParams& p, cudaStream_t stream) {
  const int kVecPairs = p.is_neox ? vec_pairs<T, CT, true>() : vec_pairs<T, CT, false>();
  // Elements a vector access of q / k spans (x1 of VP, or interleaved xy of 2 VP): the alignment
  // the head offsets and token strides must keep.
  const int kAlign = p.is_neox ? kVecPairs : 2 * kVecPairs;
  const int64_t half = p.rotary_dim / 2;
  const bool k_ok = p.k == nullptr || (is_aligned(p.k, 16) && p.k_token_stride % kAlign == 0);
  const bool vectorizable = half % kVecPairs == 0 && p.head_dim % kAlign == 0 &&
                            p.q_token_stride % kAlign == 0 && is_aligned(p.q, 16) && k_ok &&
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
    constexpr int kVP = vec_pairs<T, CT, true>();
    return vectorizable ? launch(rope::rotary_embedding_kernel<T, CT, true, kVP>, kVP)
                        : launch(rope::rotary_embedding_kernel<T, CT, true, 1>, 1);
  }
  constexpr int kVP = vec_pairs<T, CT, false>();
  return vectorizable ? launch(rope::rotary_embedding_kernel<T, CT, false, kVP>, kVP)
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
