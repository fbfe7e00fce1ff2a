#pragma once
// The rules fp8 and int8 W8A8 share (gemm_fp8/contract.h, gemm_int8/contract.h): the quantize input and its
// given per-tensor scale, the scaled-mm operands a [M, K] / b [N, K] of one 8-bit dtype, out_dtype,
// float32 scales, the bias, and the layout the real impls need. Messages name the op's own dtype.
#include "elementwise/contract.h"

namespace fastinfer::binding {

// x of a *_quantize op: [M, K] activations, K a multiple of 8 (the kernels read 16-byte vectors).
inline void check_quantize_input(const char* op, const Tensor& x, bool allow_fp32) {
  check_dim(x, 2, op, "x", "[M, K]");
  check_activation_dtype(x, allow_fp32, op, "x");
  FI_CHECK(x.size(1) % 8 == 0, op, "x must have K (its last dim) a multiple of 8 (16-byte vectors), got shape ",
           shape_str(x), " (pad K)");
}

// The layout of x of a *_quantize op, the same on every backend: rows (check_rows) whose stride is a
// multiple of 8 elements, so that every row starts 16-byte aligned for the kernels' vectors (a
// column slice of a wider buffer is read in place). Returns the row stride.
inline int64_t check_quantize_layout(const char* op, const Tensor& x) {
  const int64_t stride = check_rows(x, op, "x");
  if (x.numel() == 0) return 0;  // nothing is read: contiguous for the kernels
  FI_CHECK(x.size(0) <= 1 || stride % 8 == 0, op,
           "x must have a row stride that is a multiple of 8 elements (each row is read in 16-byte vectors), got "
           "strides ", strides_of(x), " for shape ", shape_of(x), " (call .contiguous())");
  return stride;
}

// The caller-given per-tensor scale of a *_quantize op (the caller checked the mode allows one).
inline void check_given_scale(const char* op, const Tensor& scale, const Tensor& x) {
  FI_CHECK(scale.scalar_type() == kFloat, op, "scale must be float32, got ", scale.scalar_type());
  check_same_device(scale, x, op, "scale", "x");
  FI_CHECK(scale.numel() == 1, op, "scale must have exactly 1 element (a per-tensor scale), got shape ",
           shape_str(scale));
}

// a [M, K] and b [N, K] of dtype `elem` (a_layout / b_layout name it), K and N multiples of 16,
// out_dtype half or bfloat16 (or float32 on CPU), float32 scales on a's device. Shapes of the
// scales are the caller's: they differ by op.
inline void check_w8a8_operands(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a,
                                const Tensor& scale_b, ScalarType elem, const char* a_layout,
                                const char* b_layout, ScalarType out_dtype, bool allow_fp32) {
  check_dim(a, 2, op, "a", a_layout);
  check_dim(b, 2, op, "b", b_layout);
  check_dtype_in(a, {elem}, op, "a");
  check_dtype_in(b, {elem}, op, "b");
  check_same_device(b, a, op, "b", "a");
  const auto K = a.size(1);
  FI_CHECK(b.size(1) == K, op, "b must have shape [N, K] with K = ", K, " (a.size(1)), got ", shape_str(b),
           " (pass the weight as [out_features, in_features])");
  FI_CHECK(K % 16 == 0, op, "a must have K a multiple of 16 (the kernels move 16-byte chunks), got shape ",
           shape_str(a));
  FI_CHECK(b.size(0) % 16 == 0, op, "b must have N a multiple of 16, got shape ", shape_str(b));
  const bool ok_out = out_dtype == kHalf || out_dtype == kBFloat16 || (allow_fp32 && out_dtype == kFloat);
  FI_CHECK(ok_out, op, "out_dtype must be torch.bfloat16 or torch.float16", allow_fp32 ? " (or torch.float32 on CPU)" : "",
           ", got ", out_dtype);
  for (const auto& [t, name] : {std::pair{&scale_a, "scale_a"}, {&scale_b, "scale_b"}}) {
    FI_CHECK(t->scalar_type() == kFloat, op, name, " must be float32, got ", t->scalar_type());
    check_same_device(*t, a, op, name, "a");
  }
}

// bias [N] of dtype out_dtype on a's device.
inline void check_gemm_bias(const char* op, const std::optional<Tensor>& bias, ScalarType out_dtype,
                            const Tensor& a, const int64_t& N) {
  if (!bias.has_value()) return;
  check_dim(*bias, 1, op, "bias", "[N]");
  FI_CHECK(bias->scalar_type() == out_dtype, op, "bias must have dtype out_dtype (", out_dtype, "), got ",
           bias->scalar_type());
  check_same_device(*bias, a, op, "bias", "a");
  FI_CHECK(bias->size(0) == N, op, "bias must have shape [N] = [", N, "], got ", shape_str(*bias));
}

// The layout the CUDA/sim kernels read: b as the nn.Linear weight, scales and bias contiguous; a
// may have strided rows (a column slice of a wider buffer, as cuBLASLt's and CUTLASS's lda): its
// row stride a multiple of 16 bytes, what the kernels' 16-byte row chunks (cp.async, TMA) need.
inline void check_w8a8_layout(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a,
                              const Tensor& scale_b, const std::optional<Tensor>& bias) {
  const int64_t lda = check_rows(a, op, "a");
  FI_CHECK(a.size(0) <= 1 || a.numel() == 0 || lda % 16 == 0, op,
           "a must have a row stride that is a multiple of 16 elements (the kernels move 16-byte row chunks), got "
           "strides ", strides_of(a), " for shape ", shape_of(a), " (call .contiguous())");
  FI_CHECK(b.is_contiguous(), op, "b must be [N, K] row-major contiguous (the weight in nn.Linear layout; for a "
           "transposed view call .contiguous()), got strides ", strides_of(b), " for shape ", shape_of(b));
  check_contiguous(scale_a, op, "scale_a");
  check_contiguous(scale_b, op, "scale_b");
  if (bias.has_value()) check_contiguous(*bias, op, "bias");
}

}  // namespace fastinfer::binding
