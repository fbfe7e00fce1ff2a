// CUDA implementation of causal_conv1d (also built for simt, see kernel_backend.h): validate, fill
// the Params, launch. No host sync unless FASTINFER_CHECK_INDICES=1 asks for the index checks.
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

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("causal_conv1d", TORCH_BOX(&fastinfer::binding::causal_conv1d));
}
