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

// Fills the Params every variant shares, allocates out and the workspace (the activations and
// expert outputs of every slot, the aligned layout; the caching allocator, no host sync) and
// launches.
Tensor launch_checked(const char* op, const FusedMoeArgs& args, FusedMoeParams& p, const Tensor& x,
                      const Tensor& w13, const Tensor& w2, const Tensor& topk_weights, const Tensor& topk_ids,
                      const std::optional<Tensor>& w13_bias, const std::optional<Tensor>& w2_bias) {
  check_device(x, op, "x");
  FI_CHECK(args.num_experts <= kMoeAlignMaxExperts, op, "w13 must have num_experts <= ", kMoeAlignMaxExperts,
           " on CUDA (the expert histogram of the alignment lives in shared memory), got ", args.num_experts);
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{x, "x"}, {w13, "w13"}, {w2, "w2"}})
    if (t.numel() > 0) check_aligned16(t, op, name);
  auto out = empty_on(x, {args.num_tokens, args.hidden});
  if (args.num_tokens == 0) return out;
  p.x = x.data_ptr();
  p.w13 = w13.data_ptr();
  p.w2 = w2.data_ptr();
  p.w13_bias = w13_bias.has_value() ? w13_bias->data_ptr() : nullptr;
  p.w2_bias = w2_bias.has_value() ? w2_bias->data_ptr() : nullptr;
  p.topk_weights = topk_weights.const_data_ptr<float>();
  p.topk_ids = topk_ids.const_data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.num_tokens = args.num_tokens;
  p.hidden = static_cast<int32_t>(args.hidden);
  p.intermediate = static_cast<int32_t>(args.intermediate);
  p.num_experts = static_cast<int32_t>(args.num_experts);
  p.top_k = static_cast<int32_t>(args.top_k);
  p.activation = args.activation;
  p.swiglu_alpha = args.swiglu_alpha;
  p.swiglu_limit = args.swiglu_limit;
  p.dtype = to_dtype(x.scalar_type());
  auto workspace = empty_on(x, {static_cast<int64_t>(fused_moe_workspace_size(p))}, kByte);
  p.workspace = workspace.data_ptr();
  KernelScope scope(op, x);
  const cudaError_t err = launch_fused_moe(p, scope.stream());
  const bool fp8 = p.weights == MoeWeightFormat::kFp8PerChannel || p.weights == MoeWeightFormat::kFp8Blockwise;
  FI_CHECK(err != cudaErrorNotSupported, op,
           !fp8 ? "requires sm_80+ (bf16 tensor-core mma: Ampere or later)"
               : "requires sm_89+ (e4m3 tensor-core mma: Ada, Hopper or later) and a build for it");
  check_launch(err, op);
  return out;
}

Tensor fused_moe(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& topk_weights,
                 const Tensor& topk_ids, std::string_view activation, std::optional<double> swiglu_alpha,
                 std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                 const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe";
  const FusedMoeArgs args = validate_fused_moe(op, x, w13, w2, topk_weights, topk_ids, activation, swiglu_alpha,
                                               swiglu_limit, w13_bias, w2_bias, /*allow_fp32=*/false);
  FusedMoeParams p;
  return launch_checked(op, args, p, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias);
}

Tensor fused_moe_fp8(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scale,
                     const Tensor& w2_scale, const Tensor& topk_weights, const Tensor& topk_ids,
                     std::string_view activation, std::optional<double> swiglu_alpha,
                     std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                     const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_fp8";
  const auto [args, blockwise] =
      validate_fused_moe_fp8(op, x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, swiglu_alpha,
                             swiglu_limit, w13_bias, w2_bias, /*allow_fp32=*/false);
  FusedMoeParams p;
  p.w13_scale = w13_scale.const_data_ptr<float>();
  p.w2_scale = w2_scale.const_data_ptr<float>();
  p.weights = blockwise ? MoeWeightFormat::kFp8Blockwise : MoeWeightFormat::kFp8PerChannel;
  return launch_checked(op, args, p, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias);
}

Tensor fused_moe_int4(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
                      const Tensor& w2_scales, const std::optional<Tensor>& w13_zeros,
                      const std::optional<Tensor>& w2_zeros, const Tensor& topk_weights, const Tensor& topk_ids,
                      int64_t group_size, std::string_view activation, std::optional<double> swiglu_alpha,
                      std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                      const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_int4";
  const FusedMoeArgs args =
      validate_fused_moe_int4(op, x, w13, w2, w13_scales, w2_scales, w13_zeros, w2_zeros, topk_weights, topk_ids,
                              group_size, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias,
                              /*allow_fp32=*/false);
  FusedMoeParams p;
  p.w13_group_scales = w13_scales.const_data_ptr();
  p.w2_group_scales = w2_scales.const_data_ptr();
  p.w13_zeros = zero_points_of(w13_zeros);
  p.w2_zeros = zero_points_of(w2_zeros);
  p.group_size = static_cast<int32_t>(group_size);
  p.weights = MoeWeightFormat::kInt4;
  // the scales and zero points move in 16-byte cp.async chunks
  check_aligned16(w13_scales, op, "w13_scales");
  check_aligned16(w2_scales, op, "w2_scales");
  if (w13_zeros.has_value()) check_aligned16(*w13_zeros, op, "w13_zeros");
  if (w2_zeros.has_value()) check_aligned16(*w2_zeros, op, "w2_zeros");
  return launch_checked(op, args, p, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias);
}

Tensor fused_moe_fp4(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
                     const Tensor& w2_scales, const std::optional<Tensor>& w13_global_scale,
                     const std::optional<Tensor>& w2_global_scale, const Tensor& topk_weights,
                     const Tensor& topk_ids, std::string_view format, std::string_view activation,
                     std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit,
                     const std::optional<Tensor>& w13_bias, const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_fp4";
  const auto [args, weights] =
      validate_fused_moe_fp4(op, x, w13, w2, w13_scales, w2_scales, w13_global_scale, w2_global_scale, topk_weights,
                             topk_ids, format, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias,
                             /*allow_fp32=*/false);
  FusedMoeParams p;
  p.w13_group_scales = w13_scales.const_data_ptr();
  p.w2_group_scales = w2_scales.const_data_ptr();
  p.w13_global_scale = w13_global_scale.has_value() ? w13_global_scale->const_data_ptr<float>() : nullptr;
  p.w2_global_scale = w2_global_scale.has_value() ? w2_global_scale->const_data_ptr<float>() : nullptr;
  p.weights = weights;
  // the scale bits move in 16-byte cp.async chunks
  check_aligned16(w13_scales, op, "w13_scales");
  check_aligned16(w2_scales, op, "w2_scales");
  return launch_checked(op, args, p, x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk));
  m.impl("moe_align", TORCH_BOX(&fastinfer::binding::moe_align));
  m.impl("fused_moe", TORCH_BOX(&fastinfer::binding::fused_moe));
  m.impl("fused_moe_fp8", TORCH_BOX(&fastinfer::binding::fused_moe_fp8));
  m.impl("fused_moe_int4", TORCH_BOX(&fastinfer::binding::fused_moe_int4));
  m.impl("fused_moe_fp4", TORCH_BOX(&fastinfer::binding::fused_moe_fp4));
}
