// CUDA implementations of causal_conv1d and gated_delta_rule (also built for simt, see
// kernel_backend.h): validate, fill the Params, launch. No host sync unless
// FASTINFER_CHECK_INDICES=1 asks for the index checks.
#include "kernel_backend.h"
#include "linear_attention/contract.h"

namespace fastinfer::binding {
namespace {

Tensor causal_conv1d(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                     const Tensor& cu_seqlens_in, Tensor& conv_states, const Tensor& state_indices_in,
                     const std::optional<Tensor>& has_initial_state_in, std::string_view activation) {
  const char* op = "causal_conv1d";
  validate_causal_conv1d(op, x, weight, bias, cu_seqlens_in, conv_states, state_indices_in, has_initial_state_in);
  const bool silu = conv_activation_is_silu(op, activation);
  check_device(x, op, "x");
  check_causal_conv1d_layout(op, x, weight, bias, conv_states);
  check_causal_conv1d_indices(op, x, cu_seqlens_in, conv_states, state_indices_in);
  auto out = empty_on(x, {x.size(0), x.size(1)});
  const int64_t B = cu_seqlens_in.size(0) - 1;
  if (B == 0 || x.size(1) == 0) return out;
  const auto cu_seqlens = index_layout(cu_seqlens_in);
  const auto state_indices = index_layout(state_indices_in);
  std::optional<Tensor> has_initial_state;
  if (has_initial_state_in.has_value()) has_initial_state = torch::stable::contiguous(*has_initial_state_in);
  KernelScope scope(op, x);
  CausalConv1dParams p;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.conv_states = conv_states.data_ptr();
  p.cu_seqlens = cu_seqlens.const_data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr();
  p.has_initial_state = has_initial_state.has_value() ? has_initial_state->const_data_ptr<bool>() : nullptr;
  p.num_tokens = x.size(0);
  p.num_seqs = B;
  p.num_slots = conv_states.size(0);
  p.dim = static_cast<int32_t>(x.size(1));
  p.width = static_cast<int32_t>(weight.size(1));
  p.x_row_stride = x.size(0) <= 1 ? x.size(1) : x.stride(0);
  p.silu = silu;
  p.dtype = to_dtype(x.scalar_type());
  p.index_type = to_index_type(state_indices.scalar_type());
  check_launch(launch_causal_conv1d(p, scope.stream()), op);
  return out;
}

// One path, the per-token recurrence: deterministic already, so the flag changes nothing here.
Tensor gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& cu_seqlens_in, Tensor& states, const Tensor& state_indices_in,
                        const std::optional<Tensor>& has_initial_state_in, std::optional<double> scale,
                        bool use_qk_l2norm, const std::optional<Tensor>& state_history, bool /*deterministic*/) {
  const char* op = "gated_delta_rule";
  const auto shape = validate_gated_delta_rule(op, q, k, v, g, beta, cu_seqlens_in, states, state_indices_in,
                                               has_initial_state_in, scale, state_history);
  check_device(q, op, "q");
  check_gated_delta_rule_layout(op, q, k, v, g, beta, states, state_history);
  check_gated_delta_rule_indices(op, q, cu_seqlens_in, states, state_indices_in);
  auto out = empty_on(q, {shape.T, shape.Hv, shape.Dv});
  if (shape.B == 0 || shape.Hv == 0) return out;
  const auto cu_seqlens = index_layout(cu_seqlens_in);
  const auto state_indices = index_layout(state_indices_in);
  std::optional<Tensor> has_initial_state;
  if (has_initial_state_in.has_value()) has_initial_state = torch::stable::contiguous(*has_initial_state_in);
  KernelScope scope(op, q);
  GatedDeltaRuleParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.g = g.const_data_ptr<float>();
  p.beta = beta.data_ptr();
  p.out = out.data_ptr();
  p.states = states.mutable_data_ptr<float>();
  p.state_history = state_history.has_value() ? state_history->mutable_data_ptr<float>() : nullptr;
  p.cu_seqlens = cu_seqlens.const_data_ptr<int32_t>();
  p.state_indices = state_indices.data_ptr();
  p.has_initial_state = has_initial_state.has_value() ? has_initial_state->const_data_ptr<bool>() : nullptr;
  p.num_tokens = shape.T;
  p.num_seqs = shape.B;
  p.num_slots = states.size(0);
  p.num_k_heads = static_cast<int32_t>(shape.Hk);
  p.num_v_heads = static_cast<int32_t>(shape.Hv);
  p.head_dim_k = static_cast<int32_t>(shape.Dk);
  p.head_dim_v = static_cast<int32_t>(shape.Dv);
  p.q_token_stride = token_stride_of(q);
  p.k_token_stride = token_stride_of(k);
  p.v_token_stride = token_stride_of(v);
  p.scale = shape.scale;
  p.use_qk_l2norm = use_qk_l2norm;
  p.beta_fp32 = beta.scalar_type() == kFloat;
  p.dtype = to_dtype(q.scalar_type());
  p.index_type = to_index_type(state_indices.scalar_type());
  check_launch(launch_gated_delta_rule(p, scope.stream()), op);
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("causal_conv1d", TORCH_BOX(&fastinfer::binding::causal_conv1d));
  m.impl("gated_delta_rule", TORCH_BOX(&fastinfer::binding::gated_delta_rule));
}
