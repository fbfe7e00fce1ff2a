// CUDA implementation of tree_verify (also built for simt, see kernel_backend.h): validate,
// allocate outputs and the fp32 residual workspace through the caching allocator (no host sync
// unless FASTINFER_CHECK_INDICES=1 asks for the value checks), fill the Params, launch.
#include "kernel_backend.h"
#include "speculative/contract.h"

namespace fastinfer::binding {
namespace {

std::tuple<Tensor, Tensor, Tensor> tree_verify(const Tensor& draft_tokens, const Tensor& parents,
                                                           const Tensor& target_logits,
                                                           const std::optional<Tensor>& draft_probs,
                                                           const Tensor& temperature, const Tensor& uniforms,
                                                           bool greedy) {
  const char* op = "tree_verify";
  validate_tree_verify(op, draft_tokens, parents, target_logits, draft_probs, temperature, uniforms);
  check_device(draft_tokens, op, "draft_tokens");
  check_tree_verify_layout(op, draft_tokens, parents, target_logits, draft_probs, temperature, uniforms);
  const int64_t B = draft_tokens.size(0), N = draft_tokens.size(1), V = target_logits.size(2);
  check_tree_verify_values(op, draft_tokens, parents, V, temperature, uniforms, greedy);
  check_tree_verify_logits(op, target_logits);
  FI_CHECK(B <= 0x7fffffff, op, "draft_tokens must have batch < 2^31, got ", B);
  auto accepted = empty_on(draft_tokens, {B, N});
  auto num = empty_on(draft_tokens, {B});
  auto next = empty_on(draft_tokens, {B});
  if (B == 0) return {accepted, num, next};
  KernelScope scope(op, draft_tokens);
  TreeVerifyParams p;
  p.draft_tokens = draft_tokens.data_ptr();
  p.parents = parents.data_ptr();
  p.target_logits = target_logits.data_ptr();
  p.draft_probs = draft_probs.has_value() ? draft_probs->mutable_data_ptr<float>() : nullptr;
  p.temperature = temperature.mutable_data_ptr<float>();
  p.uniforms = uniforms.mutable_data_ptr<float>();
  p.accepted_nodes = accepted.data_ptr();
  p.num_accepted = num.data_ptr();
  p.next_token = next.data_ptr();
  p.batch_size = static_cast<int32_t>(B);
  p.num_nodes = static_cast<int32_t>(N);
  p.vocab_size = static_cast<int32_t>(V);
  p.greedy = greedy;
  p.logits_dtype = to_dtype(target_logits.scalar_type());
  p.index_type = to_index_type(draft_tokens.scalar_type());
  Tensor workspace;
  const size_t ws = tree_verify_workspace_size(p);
  if (ws > 0) {
    workspace = empty_on(target_logits, {static_cast<int64_t>(ws / sizeof(float))}, kFloat);
    p.workspace = workspace.mutable_data_ptr<float>();
  }
  check_launch(launch_tree_verify(p, scope.stream()), op);
  return {accepted, num, next};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("tree_verify", TORCH_BOX(&fastinfer::binding::tree_verify));
}
