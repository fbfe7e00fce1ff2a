#pragma once
// Shape / dtype / device rules of int8_quantize and int8_scaled_mm (docs/design.md "GEMM"), shared by
// the CPU and CUDA/sim impls, plus their layout checks.
#include <string>

#include "w8a8_contract.h"

namespace fastinfer::binding {

// The schemas of the gemm int8 ops (schema.cpp registers them for every module).
inline void define_gemm_int8_ops(StableLibrary& m) {
  // INT8 W8A8 (docs/design.md "GEMM"): dynamic int8 quantisation (zero points when symmetric=False; azp is
  // an empty [0] tensor otherwise) and the scaled int8 matmul (int32 accumulation).
  m.def("int8_quantize(Tensor x, str mode='token', Tensor? scale=None, bool symmetric=True, Tensor? azp=None) -> "
        "(Tensor x_int8, Tensor scale, Tensor azp)");
  m.def("int8_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, Tensor? bias=None, "
        "Tensor? azp_adj=None, Tensor? azp=None, bool deterministic=False) -> Tensor");
}

enum class Int8Mode { kTensor, kToken };

// Static asymmetric (vLLM's static_scaled_int8_quant with azp): mode='tensor', symmetric=False, a
// given scale and a given zero point azp (int32, 1 element); the codes are clamp(rne(x / scale) +
// azp, -128, 127) and the returned azp is the given one.
inline Int8Mode validate_int8_quantize(const char* op, const Tensor& x, std::string_view mode,
                                       const std::optional<Tensor>& scale, bool symmetric,
                                       const std::optional<Tensor>& azp, bool allow_fp32) {
  FI_CHECK(mode == "tensor" || mode == "token", op, "mode must be 'tensor' or 'token', got '", std::string(mode), "'");
  const Int8Mode m = mode == "tensor" ? Int8Mode::kTensor : Int8Mode::kToken;
  check_quantize_input(op, x, allow_fp32);
  const bool static_asymmetric = m == Int8Mode::kTensor && !symmetric;
  FI_CHECK(symmetric || m == Int8Mode::kToken || (scale.has_value() && azp.has_value()), op,
           "symmetric=False with mode='tensor' needs a given scale and azp (static asymmetric); dynamic zero points "
           "need mode='token'");
  if (scale.has_value()) {
    FI_CHECK(m == Int8Mode::kTensor, op, "scale must be None unless mode='tensor' (token scales are always computed)");
    check_given_scale(op, *scale, x);
  }
  if (azp.has_value()) {
    FI_CHECK(static_asymmetric, op,
             "azp must be None unless mode='tensor', symmetric=False and a scale is given (static asymmetric)");
    FI_CHECK(azp->scalar_type() == kInt && azp->numel() == 1, op,
             "azp must be int32 with exactly 1 element (a per-tensor zero point), got ", azp->scalar_type(), " ",
             shape_str(*azp));
    check_same_device(*azp, x, op, "azp", "x");
  }
  return m;
}

// Outputs: (x_int8 [M, K], scale [1] or [M], azp int32 [M] when asymmetric else empty [0]).
inline std::vector<int64_t> int8_quantize_scale_shape(const Tensor& x, Int8Mode mode) {
  return mode == Int8Mode::kTensor ? std::vector<int64_t>{int64_t(1)} : std::vector<int64_t>{x.size(0)};
}

inline void validate_int8_scaled_mm(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a,
                                    const Tensor& scale_b, ScalarType out_dtype,
                                    const std::optional<Tensor>& bias, const std::optional<Tensor>& azp_adj,
                                    const std::optional<Tensor>& azp, bool allow_fp32) {
  check_w8a8_operands(op, a, b, scale_a, scale_b, kChar, "[M, K] int8",
                      "[N, K] int8 (the weight in nn.Linear layout)", out_dtype, allow_fp32);
  const auto M = a.size(0), N = b.size(0);
  FI_CHECK(scale_a.dim() == 1 && (scale_a.size(0) == 1 || scale_a.size(0) == M), op,
           "scale_a must have shape [1] (per tensor) or [M] = [", M, "] (per token), got ", shape_str(scale_a));
  FI_CHECK(scale_b.dim() == 1 && (scale_b.size(0) == 1 || scale_b.size(0) == N), op,
           "scale_b must have shape [1] (per tensor) or [N] = [", N, "] (per channel), got ", shape_str(scale_b));
  check_gemm_bias(op, bias, out_dtype, a, N);
  FI_CHECK(azp.has_value() == azp_adj.has_value(), op,
           "azp and azp_adj go together: pass both (asymmetric a: azp from int8_quantize(..., symmetric=False), "
           "azp_adj = b.sum(1, dtype=torch.int32)) or neither");
  if (azp.has_value()) {
    check_dim(*azp, 1, op, "azp", "[M] or [1] int32");
    FI_CHECK(azp->scalar_type() == kInt, op, "azp must be int32, got ", azp->scalar_type());
    check_same_device(*azp, a, op, "azp", "a");
    FI_CHECK(azp->size(0) == 1 || azp->size(0) == M, op, "azp must have shape [1] or [M] = [", M, "], got ",
             shape_str(*azp));
    check_dim(*azp_adj, 1, op, "azp_adj", "[N] int32");
    FI_CHECK(azp_adj->scalar_type() == kInt, op, "azp_adj must be int32, got ", azp_adj->scalar_type());
    check_same_device(*azp_adj, a, op, "azp_adj", "a");
    FI_CHECK(azp_adj->size(0) == N, op, "azp_adj must have shape [N] = [", N, "], got ", shape_str(*azp_adj));
  }
}

inline void check_int8_scaled_mm_layout(const char* op, const Tensor& a, const Tensor& b,
                                        const Tensor& scale_a, const Tensor& scale_b,
                                        const std::optional<Tensor>& bias, const std::optional<Tensor>& azp_adj,
                                        const std::optional<Tensor>& azp) {
  check_w8a8_layout(op, a, b, scale_a, scale_b, bias);
  if (azp.has_value()) check_contiguous(*azp, op, "azp");
  if (azp_adj.has_value()) check_contiguous(*azp_adj, op, "azp_adj");
}

}  // namespace fastinfer::binding
