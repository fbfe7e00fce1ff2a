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

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk));
}
