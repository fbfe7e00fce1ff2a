#pragma once
// The contract of the fused elementwise ops (and the cache write reshape_and_cache): schemas, and
// the shape, dtype and same-device rules shared by the CPU and the CUDA/sim impls so that both
// enforce exactly the same contract (the fake impls only compute output shapes). Layout (strides)
// and index-range checks: the check_*_layout functions below and check_index_range.
#include <cmath>
#include <string>
#include <string_view>

#include "common.h"
#include "fastinfer/activation/gated.h"

namespace fastinfer::binding {

// The schemas of the elementwise ops (schema.cpp registers them for every module).
inline void define_elementwise_ops(StableLibrary& m) {
  // Fused elementwise ops around the big kernels (docs/design.md "Fused elementwise").
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset=0.) -> Tensor");
  m.def("rms_norm_out(Tensor(a!) out, Tensor x, Tensor? weight, float eps, float weight_offset=0.) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor? weight, float eps, "
        "float weight_offset=0.) -> ()");
  // RMSNorm then e4m3 / int8 quantisation of the rounded result: a given per-tensor scale [1], or
  // dynamic per-token scales [num_rows]; returns (codes, scale).
  m.def("rms_norm_quant(Tensor x, Tensor? weight, float eps, ScalarType out_dtype, Tensor? scale=None, "
        "float weight_offset=0.) -> (Tensor out, Tensor scale)");
  m.def("fused_add_rms_norm_quant(Tensor x, Tensor(a!) residual, Tensor? weight, float eps, ScalarType out_dtype, "
        "Tensor? scale=None, float weight_offset=0.) -> (Tensor out, Tensor scale)");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor? weight, float eps, float weight_offset=0.) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("activation(Tensor x, str activation) -> Tensor");
  m.def("activation_out(Tensor(a!) out, Tensor x, str activation) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, bool is_neox=True) -> ()");
  // Attention-side cache maintenance.
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

// weight None: the weightless RMSNorm (elementwise_affine=False), exactly a weight of ones.
// weight_offset: the norm multiplies by weight + weight_offset (1 for the zero-centred weights of
// Gemma and Qwen3.5, added in fp32); it needs a weight.
inline void validate_rms_norm(const char* op, const Tensor& x, const std::optional<Tensor>& weight, double eps,
                              double weight_offset, bool allow_fp32) {
  FI_CHECK(x.dim() >= 1, op, "x must have shape [..., hidden], got a 0-D tensor");
  check_activation_dtype(x, allow_fp32, op, "x");
  if (weight.has_value()) {
    check_dim(*weight, 1, op, "weight", "[hidden]");
    check_same_dtype(*weight, x, op, "weight", "x");
    check_same_device(*weight, x, op, "weight", "x");
    FI_CHECK(weight->size(0) == x.size(-1), op, "weight must have shape [hidden] = [", x.size(-1),
             "] (the last dim of x), got ", shape_str(*weight));
  }
  FI_CHECK(std::isfinite(eps) && eps >= 0, op, "eps must be a finite number >= 0, got ", eps);
  FI_CHECK(std::isfinite(weight_offset), op, "weight_offset must be a finite number, got ", weight_offset);
  FI_CHECK(weight_offset == 0 || weight.has_value(), op,
           "weight_offset must be 0 without a weight (the weightless norm), got ", weight_offset);
}

// rms_norm_quant / fused_add_rms_norm_quant (residual given): the norm's rules, a last dim >= 1 (a
// row's scale needs an element), out_dtype float8_e4m3fn or int8, and a given (static) scale float32
// with 1 element on x's device. residual has the shape, dtype and device of x.
inline void validate_rms_norm_quant(const char* op, const Tensor& x, const Tensor* residual,
                                    const std::optional<Tensor>& weight, double eps, ScalarType out_dtype,
                                    const std::optional<Tensor>& scale, double weight_offset, bool allow_fp32) {
  validate_rms_norm(op, x, weight, eps, weight_offset, allow_fp32);
  if (residual != nullptr) validate_like(op, *residual, "residual", x, "x");
  FI_CHECK(x.size(-1) >= 1, op, "x must have a last dim (hidden) >= 1, got shape ", shape_str(x));
  FI_CHECK(out_dtype == kFloat8_e4m3fn || out_dtype == kChar, op,
           "out_dtype must be torch.float8_e4m3fn or torch.int8, got ", out_dtype);
  if (scale.has_value()) {
    FI_CHECK(scale->scalar_type() == kFloat, op, "scale must be float32, got ", scale->scalar_type());
    check_same_device(*scale, x, op, "scale", "x");
    FI_CHECK(scale->numel() == 1, op, "scale must have exactly 1 element (a static per-tensor scale), got shape ",
             shape_str(*scale));
  }
}

// gated_rms_norm: the gate z has the shape, dtype and device of x.
inline void validate_gated_rms_norm(const char* op, const Tensor& x, const Tensor& gate,
                                    const std::optional<Tensor>& weight, double eps, double weight_offset,
                                    bool allow_fp32) {
  validate_rms_norm(op, x, weight, eps, weight_offset, allow_fp32);
  FI_CHECK(shape_of(gate) == shape_of(x), op, "gate must have the shape of x ", shape_str(x), ", got ",
           shape_str(gate));
  check_same_dtype(gate, x, op, "gate", "x");
  check_same_device(gate, x, op, "gate", "x");
}

inline void validate_gated_and_mul(const char* op, const Tensor& x, bool allow_fp32) {
  FI_CHECK(x.dim() >= 1, op, "x must have shape [..., 2 * F], got a 0-D tensor");
  check_activation_dtype(x, allow_fp32, op, "x");
  FI_CHECK(x.size(-1) % 2 == 0, op, "x must have an even last dim [..., 2 * F] (gate then up), got ",
               shape_str(x));
}

inline Shape gated_and_mul_out_shape(const Tensor& x) {
  auto shape = shape_of(x);
  shape.back() = shape.back() / 2;
  return shape;
}

inline void validate_gated_and_mul_out(const char* op, const Tensor& out, const Tensor& x, bool allow_fp32) {
  validate_gated_and_mul(op, x, allow_fp32);
  const auto shape = gated_and_mul_out_shape(x);
  FI_CHECK(shape_of(out) == shape, op, "out must have shape [..., F] = ", shape, ", got ", shape_str(out));
  check_same_dtype(out, x, op, "out", "x");
  check_same_device(out, x, op, "out", "x");
}

// The plain activations by transformers' names (ACT2FN keys).
inline Activation parse_activation(const char* op, std::string_view activation) {
  if (activation == "gelu_new") return Activation::kGeluNew;
  if (activation == "gelu_fast") return Activation::kGeluFast;
  if (activation == "quick_gelu") return Activation::kQuickGelu;
  fail(op, "activation must be 'gelu_new', 'gelu_fast' or 'quick_gelu', got '", std::string(activation), "'");
}

inline void validate_activation(const char* op, const Tensor& x, std::string_view activation, bool allow_fp32) {
  check_activation_dtype(x, allow_fp32, op, "x");
  parse_activation(op, activation);
}

inline void validate_activation_out(const char* op, const Tensor& out, const Tensor& x, std::string_view activation,
                                    bool allow_fp32) {
  validate_activation(op, x, activation, allow_fp32);
  validate_like(op, out, "out", x, "x");
}

inline void validate_rotary_embedding(const char* op, const Tensor& positions, const Tensor& q,
                                      const Tensor& k, const Tensor& cos_sin_cache, bool allow_fp32) {
  check_dim(positions, 1, op, "positions", "[num_tokens]");
  check_dtype_in(positions, {kInt, kLong}, op, "positions");
  check_dim(q, 3, op, "q", "[num_tokens, num_q_heads, head_dim]");
  check_dim(k, 3, op, "k", "[num_tokens, num_kv_heads, head_dim]");
  check_activation_dtype(q, allow_fp32, op, "q");
  check_same_dtype(k, q, op, "k", "q");
  for (const auto& [t, name] : {std::pair{&positions, "positions"}, {&k, "k"}, {&cos_sin_cache, "cos_sin_cache"}})
    check_same_device(*t, q, op, name, "q");
  FI_CHECK(q.size(0) == positions.size(0), op, "q must have num_tokens = positions.size(0) = ",
               positions.size(0), " rows, got shape ", shape_str(q));
  FI_CHECK(k.size(0) == positions.size(0), op, "k must have num_tokens = positions.size(0) = ",
               positions.size(0), " rows, got shape ", shape_str(k));
  FI_CHECK(k.size(2) == q.size(2), op, "k must have the head_dim of q (", q.size(2), "), got shape ",
               shape_str(k));
  check_dim(cos_sin_cache, 2, op, "cos_sin_cache", "[max_position, rotary_dim]");
  FI_CHECK(cos_sin_cache.scalar_type() == kFloat || cos_sin_cache.scalar_type() == q.scalar_type(), op,
           "cos_sin_cache must be float32 or the dtype of q (", q.scalar_type(), "), got ",
           cos_sin_cache.scalar_type());
  const auto rot = cos_sin_cache.size(1);
  FI_CHECK(rot % 2 == 0 && rot > 0 && rot <= q.size(2), op,
               "cos_sin_cache must have an even rotary_dim in [2, head_dim = ", q.size(2),
               "] as its last dim (cat(cos, sin)), got shape ", shape_str(cos_sin_cache));
}

// The dequantisation scales of a paged KV cache (reshape_and_cache writes with them, the attention
// ops read with them): required for a float8_e4m3fn cache, float32 with 1 element (per tensor) or
// num_kv_heads elements (per KV head), contiguous, on the device of `ref`; None for any other cache.
inline void validate_kv_cache_scales(const char* op, const Tensor& k_cache, const Tensor& ref, const char* ref_name,
                                     const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const bool fp8 = k_cache.scalar_type() == kFloat8_e4m3fn;
  const std::pair<const std::optional<Tensor>*, const char*> scales[] = {{&k_scale, "k_scale"}, {&v_scale, "v_scale"}};
  for (const auto& [scale, name] : scales) {
    if (!fp8) {
      FI_CHECK(!scale->has_value(), op, name, " must be None unless the cache is float8_e4m3fn (cache dtype is ",
               k_cache.scalar_type(), ")");
      continue;
    }
    FI_CHECK(scale->has_value(), op, name,
             " is required with a float8_e4m3fn cache (float32, 1 element or one per KV head)");
    const int64_t kv_heads = k_cache.size(2);
    FI_CHECK((*scale)->scalar_type() == kFloat && (*scale)->dim() <= 1 &&
                 ((*scale)->numel() == 1 || (*scale)->numel() == kv_heads),
             op, name, " must be float32 with 1 element (per tensor) or num_kv_heads = ", kv_heads,
             " elements (per KV head), got ", (*scale)->scalar_type(), " ", shape_str(**scale));
    check_same_device(**scale, ref, op, name, ref_name);
    check_contiguous(**scale, op, name);
  }
}

inline void validate_reshape_and_cache(const char* op, const Tensor& k, const Tensor& v,
                                       const Tensor& k_cache, const Tensor& v_cache,
                                       const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                                       const std::optional<Tensor>& v_scale, bool allow_fp32) {
  check_dim(k, 3, op, "k", "[num_tokens, num_kv_heads, head_dim]");
  check_activation_dtype(k, allow_fp32, op, "k");
  validate_like(op, v, "v", k, "k");
  for (const auto& [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&slot_mapping, "slot_mapping"}})
    check_same_device(*t, k, op, name, "k");
  check_dim(k_cache, 4, op, "k_cache", "[num_blocks, block_size, num_kv_heads, head_dim]");
  FI_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), op,
               "k_cache must have shape [num_blocks, block_size, ", k.size(1), ", ", k.size(2),
               "] to match k, got ", shape_str(k_cache));
  validate_same_shape(op, v_cache, "v_cache", k_cache, "k_cache");
  const bool fp8 = k_cache.scalar_type() == kFloat8_e4m3fn;
  FI_CHECK(fp8 || k_cache.scalar_type() == k.scalar_type(), op, "k_cache must have the dtype of k (",
           k.scalar_type(), ") or float8_e4m3fn, got ", k_cache.scalar_type());
  check_same_dtype(v_cache, k_cache, op, "v_cache", "k_cache");
  check_dim(slot_mapping, 1, op, "slot_mapping", "[num_tokens]");
  check_dtype_in(slot_mapping, {kInt, kLong}, op, "slot_mapping");
  FI_CHECK(slot_mapping.size(0) == k.size(0), op, "slot_mapping must have num_tokens = ",
               k.size(0), " entries (k.size(0)), got ", shape_str(slot_mapping));
  validate_kv_cache_scales(op, k_cache, k, "k", k_scale, v_scale);
}

// Layout rules (need real strides, so not part of the fake impls' checks): identical for the CPU and
// CUDA impls, so code developed against one runs unchanged on the other.
// `other`: out of rms_norm_out, residual of fused_add_rms_norm or gate of gated_rms_norm (named by
// other_name).
// x, out and residual: rows (check_rows: the last dim contiguous, any row stride, so a slice of a
// wider buffer is read and written in place without a copy); the weight contiguous.
inline void check_rms_norm_layout(const char* op, const Tensor& x, const std::optional<Tensor>& weight,
                                  const Tensor* other, const char* other_name) {
  check_rows(x, op, "x");
  if (weight.has_value()) check_contiguous(*weight, op, "weight");
  if (other != nullptr) check_rows(*other, op, other_name);
}

inline void check_gated_and_mul_layout(const char* op, const Tensor& x, const Tensor* out) {
  check_rows(x, op, "x");
  if (out != nullptr) check_rows(*out, op, "out");
}

inline void check_activation_layout(const char* op, const Tensor& x, const Tensor* out) {
  check_rows(x, op, "x");
  if (out != nullptr) check_rows(*out, op, "out");
}

// The row stride of a tensor the layout checks above accepted.
inline int64_t row_stride(const Tensor& x) { return row_stride_of(x); }

inline void check_rotary_embedding_layout(const char* op, const Tensor& positions, const Tensor& q,
                                          const Tensor& k, const Tensor& cos_sin_cache) {
  check_contiguous(positions, op, "positions");
  check_contiguous(cos_sin_cache, op, "cos_sin_cache");
  check_packed_heads(q, op, "q");
  check_packed_heads(k, op, "k");
}

inline void check_reshape_and_cache_layout(const char* op, const Tensor& k, const Tensor& v,
                                           const Tensor& k_cache, const Tensor& v_cache,
                                           const Tensor& slot_mapping) {
  check_packed_heads(k, op, "k");
  check_packed_heads(v, op, "v");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  check_contiguous(slot_mapping, op, "slot_mapping");
}

}  // namespace fastinfer::binding
