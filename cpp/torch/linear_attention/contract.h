#pragma once
// The contract of the linear-attention ops: schemas, and the shape, dtype, device and index rules
// of causal_conv1d and gated_delta_rule shared by the CPU and the CUDA/sim impls (docs/design.md
// "Linear attention").
#include <algorithm>
#include <cmath>
#include <string_view>

#include "attention/contract.h"
#include "common.h"
#include "fastinfer/linear_attention/causal_conv1d.h"
#include "fastinfer/linear_attention/gated_delta_rule.h"

namespace fastinfer::binding {

inline void define_linear_attention_ops(StableLibrary& m) {
  m.def("causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor cu_seqlens, Tensor(a!) conv_states, "
        "Tensor state_indices, Tensor? has_initial_state=None, str activation='silu') -> Tensor");
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
        "Tensor(a!) states, Tensor state_indices, Tensor? has_initial_state=None, float? scale=None, "
        "bool use_qk_l2norm=False, Tensor(b!)? state_history=None, bool deterministic=False) -> Tensor");
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

// ---- gated_delta_rule ----------------------------------------------------------------------------

struct GatedDeltaRuleShape {
  int64_t T, B, Hk, Hv, Dk, Dv;
  float scale;
};

// q, k [T, Hk, Dk] and v [T, Hv, Dv] of one dtype (packed heads, any token stride), g fp32 [T, Hv],
// beta fp32 or q's dtype [T, Hv], cu_seqlens int32 [B + 1], states fp32 [P, Hv, Dk, Dv],
// state_indices int32/int64 [B], has_initial_state bool [B] or None, state_history fp32
// [T, Hv, Dk, Dv] or None; Hv a multiple of Hk, Dk and Dv in {64, 128}, scale finite and > 0.
inline GatedDeltaRuleShape validate_gated_delta_rule(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                                     const Tensor& g, const Tensor& beta, const Tensor& cu_seqlens,
                                                     const Tensor& states, const Tensor& state_indices,
                                                     const std::optional<Tensor>& has_initial_state,
                                                     std::optional<double> scale,
                                                     const std::optional<Tensor>& state_history) {
  check_dim(q, 3, op, "q", "[num_tokens, num_k_heads, head_dim_k]");
  check_dtype_in(q, {kFloat, kHalf, kBFloat16}, op, "q");
  check_dim(k, 3, op, "k", "[num_tokens, num_k_heads, head_dim_k]");
  check_same_dtype(k, q, op, "k", "q");
  check_same_device(k, q, op, "k", "q");
  FI_CHECK(shape_of(k) == shape_of(q), op, "k must have the shape of q ", shape_str(q), ", got ", shape_str(k));
  check_dim(v, 3, op, "v", "[num_tokens, num_v_heads, head_dim_v]");
  check_same_dtype(v, q, op, "v", "q");
  check_same_device(v, q, op, "v", "q");
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  FI_CHECK(v.size(0) == T, op, "v must have num_tokens = ", T, " rows (q.size(0)), got shape ", shape_str(v));
  FI_CHECK(Hk > 0 && Hv % Hk == 0, op, "num_v_heads (", Hv, ", v.size(1)) must be a multiple of num_k_heads (", Hk,
           ", q.size(1))");
  FI_CHECK(gated_delta_rule_head_dim_supported(Dk), op, "q's head_dim_k must be 64 or 128, got ", Dk);
  FI_CHECK(gated_delta_rule_head_dim_supported(Dv), op, "v's head_dim_v must be 64 or 128, got ", Dv);
  check_dim(g, 2, op, "g", "[num_tokens, num_v_heads] float32");
  FI_CHECK(g.scalar_type() == kFloat, op, "g must be float32 (the log decay), got ", g.scalar_type());
  check_same_device(g, q, op, "g", "q");
  FI_CHECK(g.size(0) == T && g.size(1) == Hv, op, "g must have shape [", T, ", ", Hv, "], got ", shape_str(g));
  check_dim(beta, 2, op, "beta", "[num_tokens, num_v_heads]");
  FI_CHECK(beta.scalar_type() == kFloat || beta.scalar_type() == q.scalar_type(), op,
           "beta must be float32 or the dtype of q (", q.scalar_type(), "), got ", beta.scalar_type());
  check_same_device(beta, q, op, "beta", "q");
  FI_CHECK(beta.size(0) == T && beta.size(1) == Hv, op, "beta must have shape [", T, ", ", Hv, "], got ",
           shape_str(beta));
  validate_index_vector(op, cu_seqlens, "cu_seqlens", "[batch + 1]", q);
  FI_CHECK(cu_seqlens.size(0) >= 1, op, "cu_seqlens must have batch + 1 >= 1 entries, got shape ", shape_str(cu_seqlens));
  const int64_t B = cu_seqlens.size(0) - 1;
  check_dim(states, 4, op, "states", "[num_slots, num_v_heads, head_dim_k, head_dim_v] float32");
  FI_CHECK(states.scalar_type() == kFloat, op, "states must be float32, got ", states.scalar_type());
  check_same_device(states, q, op, "states", "q");
  FI_CHECK(states.size(1) == Hv && states.size(2) == Dk && states.size(3) == Dv, op,
           "states must have shape [num_slots, ", Hv, ", ", Dk, ", ", Dv, "], got ", shape_str(states));
  check_dim(state_indices, 1, op, "state_indices", "[batch] (each sequence's slot in states)");
  check_dtype_in(state_indices, {kInt, kLong}, op, "state_indices");
  check_same_device(state_indices, q, op, "state_indices", "q");
  FI_CHECK(state_indices.size(0) == B, op, "state_indices must have batch = ", B, " entries (cu_seqlens has ", B + 1,
           "), got shape ", shape_str(state_indices));
  if (has_initial_state.has_value()) {
    check_dim(*has_initial_state, 1, op, "has_initial_state", "[batch] bool");
    FI_CHECK(has_initial_state->scalar_type() == kBool, op, "has_initial_state must be bool, got ",
             has_initial_state->scalar_type());
    check_same_device(*has_initial_state, q, op, "has_initial_state", "q");
    FI_CHECK(has_initial_state->size(0) == B, op, "has_initial_state must have batch = ", B, " entries, got shape ",
             shape_str(*has_initial_state));
  }
  if (state_history.has_value()) {
    check_dim(*state_history, 4, op, "state_history", "[num_tokens, num_v_heads, head_dim_k, head_dim_v] float32");
    FI_CHECK(state_history->scalar_type() == kFloat, op, "state_history must be float32, got ",
             state_history->scalar_type());
    check_same_device(*state_history, q, op, "state_history", "q");
    FI_CHECK(state_history->size(0) == T && state_history->size(1) == Hv && state_history->size(2) == Dk &&
                 state_history->size(3) == Dv,
             op, "state_history must have shape [", T, ", ", Hv, ", ", Dk, ", ", Dv, "], got ",
             shape_str(*state_history));
  }
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(Dk));
  FI_CHECK(std::isfinite(s) && s > 0, op, "scale must be finite and > 0, got ", s);
  return {T, B, Hk, Hv, Dk, Dv, static_cast<float>(s)};
}

inline void check_gated_delta_rule_layout(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& g, const Tensor& beta, const Tensor& states,
                                          const std::optional<Tensor>& state_history) {
  check_packed_heads(q, op, "q");
  check_packed_heads(k, op, "k");
  check_packed_heads(v, op, "v");
  check_contiguous(g, op, "g");
  check_contiguous(beta, op, "beta");
  check_contiguous(states, op, "states");
  if (state_history.has_value()) check_contiguous(*state_history, op, "state_history");
}

// The token stride of a [T, H, D] tensor with packed heads (any value when T <= 1).
inline int64_t token_stride_of(const Tensor& t) { return t.size(0) <= 1 ? t.size(1) * t.size(2) : t.stride(0); }

// cu_seqlens from 0 to T, non-decreasing; slots in range and distinct.
inline void check_gated_delta_rule_indices(const char* op, const Tensor& q, const Tensor& cu_seqlens,
                                           const Tensor& states, const Tensor& state_indices) {
  if (!check_indices_enabled(cu_seqlens)) return;
  check_cu_seqlens(op, cu_seqlens, "cu_seqlens", q.size(0), 0, nullptr);
  check_index_range(state_indices, 0, states.size(0), op, "state_indices", "slots of states");
  auto slots = host_indices(state_indices);
  std::sort(slots.begin(), slots.end());
  for (size_t i = 1; i < slots.size(); ++i)
    FI_CHECK(slots[i] != slots[i - 1], op, "state_indices must be distinct (each sequence owns its slot), slot ",
             slots[i], " appears twice");
}

}  // namespace fastinfer::binding
