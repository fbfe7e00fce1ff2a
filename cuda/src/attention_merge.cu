// merge_attention_states launcher: v in {fp16, bf16, fp32} x {16-byte vectors, scalar}.
#include "fastinfer/attention/merge.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"

namespace fastinfer {
namespace {

template <typename T>
cudaError_t launch_merge_typed(const MergeAttentionStatesParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = p.head_dim % kVec == 0 && is_aligned(p.v_a, 16) && is_aligned(p.v_b, 16) &&
                            is_aligned(p.v_out, 16);
  return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
    const int slices = (p.head_dim + VEC - 1) / VEC;
    int threads_x = 1;
    while (threads_x < slices && threads_x < attention::merge::kThreads) threads_x *= 2;
    const int rows_per_cta = attention::merge::kThreads / threads_x;
    const int64_t rows = p.num_tokens * p.num_heads;
    const int64_t blocks = (rows + rows_per_cta - 1) / rows_per_cta;
    if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
    return launch_kernel(attention::merge::merge_attention_states_kernel<T, VEC>,
                         dim3(static_cast<unsigned>(blocks)), dim3(threads_x, rows_per_cta), 0, stream, p);
  });
}

}  // namespace

cudaError_t launch_merge_attention_states(const MergeAttentionStatesParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_heads == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_heads < 0 || p.head_dim <= 0) return cudaErrorInvalidValue;
  if (p.v_a == nullptr || p.v_b == nullptr || p.v_out == nullptr || p.lse_a == nullptr || p.lse_b == nullptr)
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat16: return launch_merge_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_merge_typed<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_merge_typed<float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fastinfer
