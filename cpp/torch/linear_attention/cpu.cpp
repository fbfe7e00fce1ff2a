// CPU implementation of causal_conv1d (contract: cuda/include/fastinfer/linear_attention/
// causal_conv1d.h): the kernels' arithmetic (fp32 from the bias, std::fma over the taps in order,
// silu as x / (1 + exp(-x)), one rounding), sequences on ATen's thread pool; each sequence's
// outputs first, then its new state (its old rows read before they are overwritten).
#include <cmath>
#include <vector>

#include "linear_attention/contract.h"

namespace fastinfer::binding {
namespace {

template <typename T>
void conv_sequences(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, Tensor& out,
                    Tensor& conv_states, const std::vector<int64_t>& cu, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& initial, bool silu) {
  const int64_t D = x.size(1), W = weight.size(1), hist = W - 1, xs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* op = out.mutable_data_ptr<T>();
  T* sp = conv_states.mutable_data_ptr<T>();
  const int64_t B = static_cast<int64_t>(slots.size());
  torch::stable::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pad;  // the sequence's padded input, [hist + L][D] in fp32
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = cu[b], len = cu[b + 1] - start;
      const bool from_state = initial.empty() || initial[b] != 0;
      T* state = sp + slots[b] * hist * D;
      pad.assign(static_cast<size_t>((hist + len) * D), 0.f);
      if (from_state)
        for (int64_t i = 0; i < hist * D; ++i) pad[i] = static_cast<float>(state[i]);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t c = 0; c < D; ++c) pad[(hist + t) * D + c] = static_cast<float>(xp[(start + t) * xs + c]);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t c = 0; c < D; ++c) {
          float acc = bp != nullptr ? static_cast<float>(bp[c]) : 0.f;
          for (int64_t i = 0; i < W; ++i) acc = std::fma(static_cast<float>(wp[c * W + i]), pad[(t + i) * D + c], acc);
          if (silu) acc = acc / (1.f + std::exp(-acc));
          op[(start + t) * D + c] = static_cast<T>(acc);
        }
      for (int64_t i = 0; i < hist * D; ++i) state[i] = static_cast<T>(pad[len * D + i]);
    }
  });
}

Tensor causal_conv1d_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const Tensor& cu_seqlens, Tensor& conv_states, const Tensor& state_indices,
                         const std::optional<Tensor>& has_initial_state, std::string_view activation) {
  const char* op = "causal_conv1d";
  validate_causal_conv1d(op, x, weight, bias, cu_seqlens, conv_states, state_indices, has_initial_state);
  const bool silu = conv_activation_is_silu(op, activation);
  check_on_cpu(x, op, "x");
  check_causal_conv1d_layout(op, x, weight, bias, conv_states);
  check_causal_conv1d_indices(op, x, cu_seqlens, conv_states, state_indices);
  auto out = empty_on(x, {x.size(0), x.size(1)});
  const auto cu = host_indices(cu_seqlens);
  const auto slots = host_indices(state_indices);
  std::vector<int64_t> initial;
  if (has_initial_state.has_value()) initial = host_indices(*has_initial_state);
  if (slots.empty() || x.size(1) == 0) return out;
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), op, [&] {
    conv_sequences<scalar_t>(x, weight, bias, out, conv_states, cu, slots, initial, silu);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("causal_conv1d", TORCH_BOX(&fastinfer::binding::causal_conv1d_cpu));
}
