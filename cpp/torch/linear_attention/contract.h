#pragma once
// The contract of the linear-attention ops: schemas, and the shape, dtype, device and index rules
// of causal_conv1d shared by the CPU and the CUDA/sim impls (docs/design.md "Linear attention").
#include <algorithm>
#include <string_view>

#include "attention/contract.h"
#include "common.h"
#include "fastinfer/linear_attention/causal_conv1d.h"

namespace fastinfer::binding {

inline void define_linear_attention_ops(StableLibrary& m) {
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, Tensor(a!) conv_states, "
        "Tensor state_indices, Tensor? has_initial_state=None, str activation='silu') -> Tensor");
}

inline bool conv_activation_is_silu(const char* op, std::string_view activation) {
  FI_CHECK(activation == "silu" || activation == "none", op, "activation must be 'silu' or 'none', got '",
           std::string(activation), "'");
  return activation == "silu";
}

// x [T, D] (rows may be strided, channels contiguous), weight [D, W] with W in 2..4, bias [D] or
// None, cu_seqlens int32 [B + 1], conv_states [S, W - 1, D] contiguous, state_indices int32/int64
// [B], has_initial_state bool [B] or None; x, weight, bias and conv_states of one dtype.
inline void validate_causal_conv1d(const char* op, const Tensor& x, const Tensor& weight,
                                   const std::optional<Tensor>& bias, const Tensor& cu_seqlens,
                                   const Tensor& conv_states, const Tensor& state_indices,
                                   const std::optional<Tensor>& has_initial_state) {
  check_dim(x, 2, op, "x", "[num_tokens, dim]");
  check_dtype_in(x, {kFloat, kHalf, kBFloat16}, op, "x");
  const int64_t D = x.size(1);
  check_dim(weight, 2, op, "weight", "[dim, width] (a depthwise Conv1d weight [dim, 1, width] squeezed)");
  check_same_dtype(weight, x, op, "weight", "x");
  check_same_device(weight, x, op, "weight", "x");
  FI_CHECK(weight.size(0) == D, op, "weight must have dim = ", D, " rows (x.size(1)), got shape ", shape_str(weight));
  const int64_t W = weight.size(1);
  FI_CHECK(W >= kCausalConvMinWidth && W <= kCausalConvMaxWidth, op, "weight's width (the convolution's taps) must be in [",
           kCausalConvMinWidth, ", ", kCausalConvMaxWidth, "], got ", W);
  if (bias.has_value()) {
    check_dim(*bias, 1, op, "bias", "[dim]");
    check_same_dtype(*bias, x, op, "bias", "x");
    check_same_device(*bias, x, op, "bias", "x");
    FI_CHECK(bias->size(0) == D, op, "bias must have dim = ", D, " entries, got shape ", shape_str(*bias));
  }
  validate_index_vector(op, cu_seqlens, "cu_seqlens", "[batch + 1]", x);
  FI_CHECK(cu_seqlens.size(0) >= 1, op, "cu_seqlens must have batch + 1 >= 1 entries, got shape ", shape_str(cu_seqlens));
  const int64_t B = cu_seqlens.size(0) - 1;
  check_dim(conv_states, 3, op, "conv_states", "[num_slots, width - 1, dim]");
  check_same_dtype(conv_states, x, op, "conv_states", "x");
  check_same_device(conv_states, x, op, "conv_states", "x");
  FI_CHECK(conv_states.size(1) == W - 1 && conv_states.size(2) == D, op, "conv_states must have shape [num_slots, ",
           W - 1, ", ", D, "] (width - 1 rows of dim channels per slot), got ", shape_str(conv_states));
  check_dim(state_indices, 1, op, "state_indices", "[batch] (each sequence's slot in conv_states)");
  check_dtype_in(state_indices, {kInt, kLong}, op, "state_indices");
  check_same_device(state_indices, x, op, "state_indices", "x");
  FI_CHECK(state_indices.size(0) == B, op, "state_indices must have batch = ", B, " entries (cu_seqlens has ", B + 1,
           "), got shape ", shape_str(state_indices));
  if (has_initial_state.has_value()) {
    check_dim(*has_initial_state, 1, op, "has_initial_state", "[batch] bool");
    FI_CHECK(has_initial_state->scalar_type() == kBool, op, "has_initial_state must be bool, got ",
             has_initial_state->scalar_type());
    check_same_device(*has_initial_state, x, op, "has_initial_state", "x");
    FI_CHECK(has_initial_state->size(0) == B, op, "has_initial_state must have batch = ", B, " entries, got shape ",
             shape_str(*has_initial_state));
  }
}

inline void check_causal_conv1d_layout(const char* op, const Tensor& x, const Tensor& weight,
                                       const std::optional<Tensor>& bias, const Tensor& conv_states) {
  FI_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, "x must have contiguous channels (stride(1) == 1), got strides ",
           str(strides_of(x)));
  FI_CHECK(x.size(0) <= 1 || x.stride(0) >= x.size(1), op, "x's row stride must be at least dim = ", x.size(1),
           ", got strides ", str(strides_of(x)));
  check_contiguous(weight, op, "weight");
  if (bias.has_value()) check_contiguous(*bias, op, "bias");
  check_contiguous(conv_states, op, "conv_states");
}

// cu_seqlens from 0 to T, non-decreasing; slots in range and distinct (a slot written twice would
// hold either sequence's state).
inline void check_causal_conv1d_indices(const char* op, const Tensor& x, const Tensor& cu_seqlens,
                                        const Tensor& conv_states, const Tensor& state_indices) {
  if (!check_indices_enabled(cu_seqlens)) return;
  check_cu_seqlens(op, cu_seqlens, "cu_seqlens", x.size(0), 0, nullptr);
  check_index_range(state_indices, 0, conv_states.size(0), op, "state_indices", "slots of conv_states");
  auto slots = host_indices(state_indices);
  std::sort(slots.begin(), slots.end());
  for (size_t i = 1; i < slots.size(); ++i)
    FI_CHECK(slots[i] != slots[i - 1], op, "state_indices must be distinct (each sequence owns its slot), slot ",
             slots[i], " appears twice");
}

}  // namespace fastinfer::binding
