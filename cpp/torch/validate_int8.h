#pragma once
// Shape / dtype / device rules of int8_quantize and int8_scaled_mm (DESIGN.md "GEMM"), shared by
// the Meta, CPU and CUDA/sim impls (symbolic sizes), plus the layout checks the real impls add.
#include <string>

#include "validate.h"

namespace fastinfer::binding {

enum class Int8Mode { kTensor, kToken };

inline Int8Mode validate_int8_quantize(const char* op, const at::Tensor& x, c10::string_view mode,
                                       const std::optional<at::Tensor>& scale, bool symmetric, bool allow_fp32) {
  FI_CHECK(mode == "tensor" || mode == "token", op, "mode must be 'tensor' or 'token', got '", std::string(mode), "'");
  const Int8Mode m = mode == "tensor" ? Int8Mode::kTensor : Int8Mode::kToken;
  check_dim(x, 2, op, "x", "[M, K]");
  check_activation_dtype(x, allow_fp32, op, "x");
  FI_CHECK(x.sym_size(1) % 8 == 0, op, "x must have K (its last dim) a multiple of 8 (16-byte vectors), got shape ",
           shape_str(x), " (pad K)");
  FI_CHECK(symmetric || m == Int8Mode::kToken, op,
           "symmetric=False (zero points) needs mode='token'; per-tensor quantisation is symmetric only");
  if (scale.has_value()) {
    FI_CHECK(m == Int8Mode::kTensor, op, "scale must be None unless mode='tensor' (token scales are always computed)");
    FI_CHECK(scale->scalar_type() == at::kFloat, op, "scale must be float32, got ", scale->scalar_type());
    check_same_device(*scale, x, op, "scale", "x");
    FI_CHECK(scale->sym_numel() == 1, op, "scale must have exactly 1 element (a per-tensor scale), got shape ",
             shape_str(*scale));
  }
  return m;
}

// Outputs: (x_int8 [M, K], scale [1] or [M], azp int32 [M] when asymmetric else empty [0]).
inline std::vector<c10::SymInt> int8_quantize_scale_shape(const at::Tensor& x, Int8Mode mode) {
  return mode == Int8Mode::kTensor ? std::vector<c10::SymInt>{c10::SymInt(1)} : std::vector<c10::SymInt>{x.sym_size(0)};
}

inline void validate_int8_scaled_mm(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                    const at::Tensor& scale_b, at::ScalarType out_dtype,
                                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                                    const std::optional<at::Tensor>& azp, bool allow_fp32) {
  check_dim(a, 2, op, "a", "[M, K] int8");
  check_dim(b, 2, op, "b", "[N, K] int8 (the weight in nn.Linear layout)");
  check_dtype_in(a, {at::kChar}, op, "a");
  check_dtype_in(b, {at::kChar}, op, "b");
  check_same_device(b, a, op, "b", "a");
  const auto M = a.sym_size(0), K = a.sym_size(1), N = b.sym_size(0);
  FI_CHECK(b.sym_size(1) == K, op, "b must have shape [N, K] with K = ", K, " (a.size(1)), got ", shape_str(b),
           " (pass the weight as [out_features, in_features])");
  FI_CHECK(K % 16 == 0, op, "a must have K a multiple of 16 (the kernels move 16-byte chunks), got shape ",
           shape_str(a));
  FI_CHECK(N % 16 == 0, op, "b must have N a multiple of 16, got shape ", shape_str(b));
  const bool ok_out = out_dtype == at::kHalf || out_dtype == at::kBFloat16 || (allow_fp32 && out_dtype == at::kFloat);
  FI_CHECK(ok_out, op, "out_dtype must be torch.bfloat16 or torch.float16", allow_fp32 ? " (or torch.float32 on CPU)" : "",
           ", got ", out_dtype);
  for (const auto& [t, name] : {std::pair{&scale_a, "scale_a"}, {&scale_b, "scale_b"}}) {
    FI_CHECK(t->scalar_type() == at::kFloat, op, name, " must be float32, got ", t->scalar_type());
    check_same_device(*t, a, op, name, "a");
  }
  FI_CHECK(scale_a.dim() == 1 && (scale_a.sym_size(0) == 1 || scale_a.sym_size(0) == M), op,
           "scale_a must have shape [1] (per tensor) or [M] = [", M, "] (per token), got ", shape_str(scale_a));
  FI_CHECK(scale_b.dim() == 1 && (scale_b.sym_size(0) == 1 || scale_b.sym_size(0) == N), op,
           "scale_b must have shape [1] (per tensor) or [N] = [", N, "] (per channel), got ", shape_str(scale_b));
  if (bias.has_value()) {
    check_dim(*bias, 1, op, "bias", "[N]");
    FI_CHECK(bias->scalar_type() == out_dtype, op, "bias must have dtype out_dtype (", out_dtype, "), got ",
             bias->scalar_type());
    check_same_device(*bias, a, op, "bias", "a");
    FI_CHECK(bias->sym_size(0) == N, op, "bias must have shape [N] = [", N, "], got ", shape_str(*bias));
  }
  FI_CHECK(azp.has_value() == azp_adj.has_value(), op,
           "azp and azp_adj go together: pass both (asymmetric a: azp from int8_quantize(..., symmetric=False), "
           "azp_adj = b.sum(1, dtype=torch.int32)) or neither");
  if (azp.has_value()) {
    check_dim(*azp, 1, op, "azp", "[M] or [1] int32");
    FI_CHECK(azp->scalar_type() == at::kInt, op, "azp must be int32, got ", azp->scalar_type());
    check_same_device(*azp, a, op, "azp", "a");
    FI_CHECK(azp->sym_size(0) == 1 || azp->sym_size(0) == M, op, "azp must have shape [1] or [M] = [", M, "], got ",
             shape_str(*azp));
    check_dim(*azp_adj, 1, op, "azp_adj", "[N] int32");
    FI_CHECK(azp_adj->scalar_type() == at::kInt, op, "azp_adj must be int32, got ", azp_adj->scalar_type());
    check_same_device(*azp_adj, a, op, "azp_adj", "a");
    FI_CHECK(azp_adj->sym_size(0) == N, op, "azp_adj must have shape [N] = [", N, "], got ", shape_str(*azp_adj));
  }
}

inline void check_int8_scaled_mm_layout(const char* op, const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& scale_a, const at::Tensor& scale_b,
                                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& azp_adj,
                                        const std::optional<at::Tensor>& azp) {
  check_contiguous(a, op, "a");
  FI_CHECK(b.is_contiguous(), op, "b must be [N, K] row-major contiguous (the weight in nn.Linear layout; for a "
           "transposed view call .contiguous()), got strides ", b.strides(), " for shape ", b.sizes());
  check_contiguous(scale_a, op, "scale_a");
  check_contiguous(scale_b, op, "scale_b");
  if (bias.has_value()) check_contiguous(*bias, op, "bias");
  if (azp.has_value()) check_contiguous(*azp, op, "azp");
  if (azp_adj.has_value()) check_contiguous(*azp_adj, op, "azp_adj");
}

}  // namespace fastinfer::binding
