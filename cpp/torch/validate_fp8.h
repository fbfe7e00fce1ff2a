#pragma once
// Shape / dtype / device rules of fp8_quantize and fp8_scaled_mm (DESIGN.md "GEMM"), shared by the
// Meta, CPU and CUDA/sim impls (symbolic sizes), plus the layout checks the real impls add.
#include <string>

#include "validate.h"

namespace fastinfer::binding {

enum class Fp8Mode { kTensor, kToken, kGroup };

inline Fp8Mode parse_fp8_mode(const char* op, c10::string_view mode) {
  if (mode == "tensor") return Fp8Mode::kTensor;
  if (mode == "token") return Fp8Mode::kToken;
  if (mode == "group") return Fp8Mode::kGroup;
  FI_CHECK(false, op, "mode must be 'tensor', 'token' or 'group', got '", std::string(mode), "'");
  return Fp8Mode::kToken;
}

inline Fp8Mode validate_fp8_quantize(const char* op, const at::Tensor& x, c10::string_view mode_str,
                                     int64_t group_size, const std::optional<at::Tensor>& scale, bool allow_fp32) {
  const Fp8Mode mode = parse_fp8_mode(op, mode_str);
  check_dim(x, 2, op, "x", "[M, K]");
  check_activation_dtype(x, allow_fp32, op, "x");
  FI_CHECK(x.sym_size(1) % 8 == 0, op, "x must have K (its last dim) a multiple of 8 (16-byte vectors), got shape ",
           shape_str(x), " (pad K)");
  if (mode == Fp8Mode::kGroup) {
    FI_CHECK(group_size >= 8 && group_size <= 256 && (group_size & (group_size - 1)) == 0, op,
             "group_size must be a power of two in [8, 256] (128 for the blockwise GEMM), got ", group_size);
    FI_CHECK(x.sym_size(1) % group_size == 0, op, "x must have K a multiple of group_size = ", group_size,
             " with mode='group', got shape ", shape_str(x));
  }
  if (scale.has_value()) {
    FI_CHECK(mode == Fp8Mode::kTensor, op,
             "scale must be None unless mode='tensor' (token and group scales are always computed)");
    FI_CHECK(scale->scalar_type() == at::kFloat, op, "scale must be float32, got ", scale->scalar_type());
    check_same_device(*scale, x, op, "scale", "x");
    FI_CHECK(scale->sym_numel() == 1, op, "scale must have exactly 1 element (a per-tensor scale), got shape ",
             shape_str(*scale));
  }
  return mode;
}

inline std::vector<c10::SymInt> fp8_quantize_scale_shape(const at::Tensor& x, Fp8Mode mode, int64_t group_size) {
  switch (mode) {
    case Fp8Mode::kTensor: return {c10::SymInt(1)};
    case Fp8Mode::kToken: return {x.sym_size(0)};
    case Fp8Mode::kGroup: return {x.sym_size(0), x.sym_size(1) / group_size};
  }
  return {};
}

// true: blockwise scales (scale_a 2-D), else per-tensor / per-token / per-channel.
inline bool validate_fp8_scaled_mm(const char* op, const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                   const at::Tensor& scale_b, at::ScalarType out_dtype,
                                   const std::optional<at::Tensor>& bias, bool allow_fp32) {
  check_dim(a, 2, op, "a", "[M, K] float8_e4m3fn");
  check_dim(b, 2, op, "b", "[N, K] float8_e4m3fn (the weight in nn.Linear layout)");
  check_dtype_in(a, {at::kFloat8_e4m3fn}, op, "a");
  check_dtype_in(b, {at::kFloat8_e4m3fn}, op, "b");
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
  const bool blockwise = scale_a.dim() == 2;
  if (blockwise) {
    const auto kb = (K + 127) / 128, nb = (N + 127) / 128;
    FI_CHECK(scale_a.sym_size(0) == M && scale_a.sym_size(1) == kb, op,
             "scale_a (blockwise, 2-D) must have shape [M, ceil(K / 128)] = [", M, ", ", kb, "], got ",
             shape_str(scale_a));
    FI_CHECK(scale_b.dim() == 2 && scale_b.sym_size(0) == nb && scale_b.sym_size(1) == kb, op,
             "scale_b must have shape [ceil(N / 128), ceil(K / 128)] = [", nb, ", ", kb,
             "] when scale_a is blockwise, got ", shape_str(scale_b));
  } else {
    FI_CHECK(scale_a.dim() == 1 && (scale_a.sym_size(0) == 1 || scale_a.sym_size(0) == M), op,
             "scale_a must have shape [1] (per tensor) or [M] = [", M, "] (per token), or [M, ceil(K / 128)] "
             "(blockwise), got ", shape_str(scale_a));
    FI_CHECK(scale_b.dim() == 1 && (scale_b.sym_size(0) == 1 || scale_b.sym_size(0) == N), op,
             "scale_b must have shape [1] (per tensor) or [N] = [", N, "] (per channel) when scale_a is 1-D, got ",
             shape_str(scale_b));
  }
  if (bias.has_value()) {
    check_dim(*bias, 1, op, "bias", "[N]");
    FI_CHECK(bias->scalar_type() == out_dtype, op, "bias must have dtype out_dtype (", out_dtype, "), got ",
             bias->scalar_type());
    check_same_device(*bias, a, op, "bias", "a");
    FI_CHECK(bias->sym_size(0) == N, op, "bias must have shape [N] = [", N, "], got ", shape_str(*bias));
  }
  return blockwise;
}

inline void check_fp8_scaled_mm_layout(const char* op, const at::Tensor& a, const at::Tensor& b,
                                       const at::Tensor& scale_a, const at::Tensor& scale_b,
                                       const std::optional<at::Tensor>& bias) {
  check_contiguous(a, op, "a");
  FI_CHECK(b.is_contiguous(), op, "b must be [N, K] row-major contiguous (the weight in nn.Linear layout; for a "
           "transposed view call .contiguous()), got strides ", b.strides(), " for shape ", b.sizes());
  check_contiguous(scale_a, op, "scale_a");
  check_contiguous(scale_b, op, "scale_b");
  if (bias.has_value()) check_contiguous(*bias, op, "bias");
}

}  // namespace fastinfer::binding
