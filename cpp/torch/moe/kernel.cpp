// CUDA implementation of the MoE routing ops (also built for simt, see kernel_backend.h):
// validate, allocate the outputs through the caching allocator, fill the Params, launch.
#include "kernel_backend.h"
#include "moe/contract.h"

namespace fastinfer::binding {
namespace {

std::tuple<Tensor, Tensor> moe_topk(const Tensor& router_logits, int64_t top_k, bool renormalize,
                                    std::string_view scoring_str) {
  const char* op = "moe_topk";
  const MoeScoring scoring = validate_moe_topk(op, router_logits, top_k, renormalize, scoring_str);
  check_device(router_logits, op, "router_logits");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  auto weights = empty_on(router_logits, {T, top_k}, kFloat);
  auto ids = empty_on(router_logits, {T, top_k}, kInt);
  if (T == 0) return {weights, ids};
  KernelScope scope(op, router_logits);
  MoeTopkParams p;
  p.router_logits = router_logits.data_ptr();
  p.topk_weights = weights.mutable_data_ptr<float>();
  p.topk_ids = ids.mutable_data_ptr<int32_t>();
  p.num_tokens = static_cast<int32_t>(T);
  p.num_experts = static_cast<int32_t>(E);
  p.top_k = static_cast<int32_t>(top_k);
  p.renormalize = renormalize;
  p.scoring = scoring;
  p.logits_dtype = to_dtype(router_logits.scalar_type());
  check_launch(launch_moe_topk(p, scope.stream()), op);
  return {weights, ids};
}

// No host sync (unless FASTINFER_CHECK_INDICES=1): num_tokens_post_padded stays on the device and
// the output sizes depend on the shapes only.
std::tuple<Tensor, Tensor, Tensor> moe_align(const Tensor& topk_ids, int64_t num_experts, int64_t block_m) {
  const char* op = "moe_align";
  validate_moe_align(op, topk_ids, num_experts, block_m);
  check_device(topk_ids, op, "topk_ids");
  const int64_t sorted_size = moe_align_sorted_size(topk_ids.numel(), num_experts, block_m);
  auto sorted = empty_on(topk_ids, {sorted_size}, kInt);
  auto experts = empty_on(topk_ids, {(sorted_size + block_m - 1) / block_m}, kInt);
  auto total = empty_on(topk_ids, {1}, kInt);
  KernelScope scope(op, topk_ids);
  MoeAlignParams p;
  p.topk_ids = topk_ids.numel() > 0 ? topk_ids.data_ptr() : nullptr;
  p.sorted_token_ids = sorted.mutable_data_ptr<int32_t>();
  p.expert_ids = experts.mutable_data_ptr<int32_t>();
  p.num_tokens_post_padded = total.mutable_data_ptr<int32_t>();
  p.num_slots = static_cast<int32_t>(topk_ids.numel());
  p.num_experts = static_cast<int32_t>(num_experts);
  p.block_m = static_cast<int32_t>(block_m);
  p.index_type = to_index_type(topk_ids.scalar_type());
  check_launch(launch_moe_align(p, scope.stream()), op);
  return {sorted, experts, total};
}

// The kernel is not written yet: the arguments are checked, then a clear error (never a silent
// fallback to another device).
Tensor fused_moe(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& topk_weights,
                 const Tensor& topk_ids, std::string_view activation, std::optional<double> swiglu_alpha,
                 std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                 const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe";
  validate_fused_moe(op, x, w13, w2, topk_weights, topk_ids, activation, swiglu_alpha, swiglu_limit, w13_bias,
                     w2_bias, /*allow_fp32=*/false);
  check_device(x, op, "x");
  fail(op, "the CUDA kernel of fused_moe is not built yet; the CPU implementation "
       "(torch.ops.fastinfer.fused_moe on CPU tensors) is the only one");
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk));
  m.impl("moe_align", TORCH_BOX(&fastinfer::binding::moe_align));
  m.impl("fused_moe", TORCH_BOX(&fastinfer::binding::fused_moe));
}
