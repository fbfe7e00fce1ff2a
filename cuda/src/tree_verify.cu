// tree_verify launcher: logits {fp32, fp16, bf16} x {16-byte vectors, scalar}. Index dtype
// (int32/int64) and draft/greedy modes are runtime branches (few instantiations: build time).
#include "fastinfer/common/launch.cuh"
#include "fastinfer/speculative/tree_verify.cuh"

#include <type_traits>

namespace fastinfer {
namespace {

template <typename T>
cudaError_t launch_tree_verify_typed(const TreeVerifyParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool sampling_draft = p.draft_probs != nullptr && !p.greedy;
  const bool vectorizable = p.vocab_size % kVec == 0 && is_aligned(p.target_logits, 16) &&
                            (!sampling_draft || (is_aligned(p.draft_probs, 16) && is_aligned(p.workspace, 16)));
  auto launch = [&](auto vec_tag) -> cudaError_t {
    constexpr int VEC = decltype(vec_tag)::value;
    // Warps: enough for >= 4 vectors per lane, at most 32 (one CTA per sequence).
    const int64_t num_vecs = (static_cast<int64_t>(p.vocab_size) + VEC - 1) / VEC;
    int64_t warps = (num_vecs + 32 * 4 - 1) / (32 * 4);
    if (warps < 1) warps = 1;
    if (warps > speculative::kMaxWarps) warps = speculative::kMaxWarps;
    const size_t smem = static_cast<size_t>(p.num_nodes) * sizeof(int);  // rejected-token list
    return launch_kernel(speculative::tree_verify_kernel<T, VEC>, dim3(static_cast<unsigned>(p.batch_size)),
                         dim3(static_cast<unsigned>(warps * 32)), smem, stream, p);
  };
  if (vectorizable) return launch(std::integral_constant<int, kVec>{});
  return launch(std::integral_constant<int, 1>{});
}

}  // namespace

size_t tree_verify_workspace_size(const TreeVerifyParams& p) {
  if (p.draft_probs == nullptr || p.greedy || p.batch_size <= 0 || p.vocab_size <= 0) return 0;
  return static_cast<size_t>(2) * p.batch_size * p.vocab_size * sizeof(float);
}

cudaError_t launch_tree_verify(const TreeVerifyParams& p, cudaStream_t stream) {
  if (p.batch_size == 0) return cudaSuccess;
  if (p.batch_size < 0 || p.num_nodes < 1 || p.num_nodes > kTreeVerifyMaxNodes || p.vocab_size < 1)
    return cudaErrorInvalidValue;
  if (p.draft_tokens == nullptr || p.parents == nullptr || p.target_logits == nullptr || p.uniforms == nullptr ||
      p.accepted_nodes == nullptr || p.num_accepted == nullptr || p.next_token == nullptr)
    return cudaErrorInvalidValue;
  if (!p.greedy && p.temperature == nullptr) return cudaErrorInvalidValue;
  if (!p.greedy && p.draft_probs != nullptr && p.workspace == nullptr) return cudaErrorInvalidValue;
  switch (p.logits_dtype) {
    case DType::kFloat32: return launch_tree_verify_typed<float>(p, stream);
    case DType::kFloat16: return launch_tree_verify_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_tree_verify_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fastinfer
