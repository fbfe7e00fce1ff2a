// MoE routing launchers: moe_topk for logits {fp32, fp16, bf16}; moe_align (the index dtype is a
// runtime branch).
#include "fastinfer/common/launch.cuh"
#include "fastinfer/moe/routing.cuh"

namespace fastinfer {
namespace {

template <typename T>
cudaError_t launch_moe_topk_typed(const MoeTopkParams& p, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((p.num_tokens + moe::kTopkWarpsPerBlock - 1) / moe::kTopkWarpsPerBlock);
  return launch_kernel(moe::moe_topk_kernel<T>, dim3(blocks), dim3(moe::kTopkWarpsPerBlock * 32), 0, stream, p);
}

}  // namespace

cudaError_t launch_moe_topk(const MoeTopkParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.num_experts < 1 || p.top_k < 1 || p.top_k > p.num_experts || p.top_k > kMoeTopkMaxK)
    return cudaErrorInvalidValue;
  if (p.router_logits == nullptr || p.topk_weights == nullptr || p.topk_ids == nullptr) return cudaErrorInvalidValue;
  switch (p.logits_dtype) {
    case DType::kFloat32: return launch_moe_topk_typed<float>(p, stream);
    case DType::kFloat16: return launch_moe_topk_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_moe_topk_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_moe_align(const MoeAlignParams& p, cudaStream_t stream) {
  if (p.num_slots < 0 || p.num_experts < 1 || p.num_experts > kMoeAlignMaxExperts || p.block_m < 1 ||
      (p.block_m & (p.block_m - 1)) != 0 ||
      moe_align_sorted_size(p.num_slots, p.num_experts, p.block_m) > int64_t{0x7fffffff})
    return cudaErrorInvalidValue;
  if ((p.num_slots > 0 && p.topk_ids == nullptr) || p.sorted_token_ids == nullptr || p.expert_ids == nullptr ||
      p.num_tokens_post_padded == nullptr)
    return cudaErrorInvalidValue;
  return launch_kernel(moe::moe_align_kernel, dim3(static_cast<unsigned>(p.num_experts)), dim3(moe::kAlignThreads), 0,
                       stream, p);
}

}  // namespace fastinfer
