#pragma once
// Checks of dense_mm (the batch-invariant fp16 / bf16 / fp32 GEMM), shared by the CPU and CUDA / sim
// impls: a [M, K], b [N, K] (nn.Linear weight layout), one activation dtype, bias [N]; any N, K a
// multiple of 8 (the CUDA kernel's 16-byte chunks; one contract for every backend).
#include "w8a8_contract.h"

namespace fastinfer::binding {

// The schemas of the gemm dense ops (schema.cpp registers them for every module).
inline void define_gemm_dense_ops(StableLibrary& m) {
  // Dense fp16 / bf16 (fp32 on CPU) GEMM, b [N, K] in nn.Linear layout, fp32 accumulation: batch
  // invariant (a row's bits never depend on M), the float linears of the deterministic mode.
  m.def("dense_mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
}

inline void validate_dense_mm(const char* op, const Tensor& a, const Tensor& b,
                              const std::optional<Tensor>& bias, bool allow_fp32) {
  check_dim(a, 2, op, "a", "[M, K]");
  check_dim(b, 2, op, "b", "[N, K] (the weight in nn.Linear layout)");
  check_activation_dtype(a, allow_fp32, op, "a");
  check_same_dtype(b, a, op, "b", "a");
  check_same_device(b, a, op, "b", "a");
  const auto K = a.size(1);
  FI_CHECK(b.size(1) == K, op, "b must have shape [N, K] with K = ", K, " (a.size(1)), got ", shape_str(b),
           " (pass the weight as [out_features, in_features])");
  FI_CHECK(K % 8 == 0, op, "a must have K a multiple of 8 (the kernel moves 16-byte chunks), got shape ",
           shape_str(a), " (pad K with zeros)");
  check_gemm_bias(op, bias, a.scalar_type(), a, b.size(0));
}

// The layout every real impl reads: contiguous a, b (nn.Linear weight) and bias.
inline void check_dense_mm_layout(const char* op, const Tensor& a, const Tensor& b,
                                  const std::optional<Tensor>& bias) {
  check_contiguous(a, op, "a");
  FI_CHECK(b.is_contiguous(), op, "b must be [N, K] row-major contiguous (the weight in nn.Linear layout; for a "
           "transposed view call .contiguous()), got strides ", strides_of(b), " for shape ", shape_of(b));
  if (bias.has_value()) check_contiguous(*bias, op, "bias");
}

}  // namespace fastinfer::binding
