#pragma once
// Shape / dtype / device rules of fp8_quantize and fp8_scaled_mm (docs/design.md "GEMM"), shared by the
// CPU and CUDA/sim impls, plus their layout checks.
#include <string>

#include "fastinfer/gemm/fp8.h"
#include "w8a8_contract.h"

namespace fastinfer::binding {

// The schemas of the gemm fp8 ops (schema.cpp registers them for every module).
inline void define_gemm_fp8_ops(StableLibrary& m) {
  // FP8 W8A8 (docs/design.md "GEMM"): dynamic e4m3 quantisation and the scaled e4m3 matmul.
  // A given scale: per tensor [1], per token [M], per group [M, K / group_size], per channel [K]
  // (mode='channel' takes only a given one).
  m.def("fp8_quantize(Tensor x, str mode='token', int group_size=128, Tensor? scale=None) -> (Tensor x_fp8, Tensor scale)");
  m.def("fp8_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, Tensor? bias=None, "
        "bool deterministic=False) -> Tensor");
}

enum class Fp8Mode { kTensor, kToken, kGroup, kChannel };

inline Fp8Mode parse_fp8_mode(const char* op, std::string_view mode) {
  if (mode == "tensor") return Fp8Mode::kTensor;
  if (mode == "token") return Fp8Mode::kToken;
  if (mode == "group") return Fp8Mode::kGroup;
  if (mode == "channel") return Fp8Mode::kChannel;
  FI_CHECK(false, op, "mode must be 'tensor', 'token', 'group' or 'channel', got '", std::string(mode), "'");
  return Fp8Mode::kToken;
}

inline Fp8QuantMode to_fp8_quant_mode(Fp8Mode mode) {
  switch (mode) {
    case Fp8Mode::kTensor: return Fp8QuantMode::kTensor;
    case Fp8Mode::kToken: return Fp8QuantMode::kToken;
    case Fp8Mode::kGroup: return Fp8QuantMode::kGroup;
    case Fp8Mode::kChannel: return Fp8QuantMode::kChannel;
  }
  return Fp8QuantMode::kToken;
}

inline Fp8Mode validate_fp8_quantize(const char* op, const Tensor& x, std::string_view mode_str,
                                     int64_t group_size, const std::optional<Tensor>& scale, bool allow_fp32) {
  const Fp8Mode mode = parse_fp8_mode(op, mode_str);
  check_quantize_input(op, x, allow_fp32);
  if (mode == Fp8Mode::kGroup) {
    FI_CHECK(group_size >= 8 && group_size <= 256 && (group_size & (group_size - 1)) == 0, op,
             "group_size must be a power of two in [8, 256] (128 for the blockwise GEMM), got ", group_size);
    FI_CHECK(x.size(1) % group_size == 0, op, "x must have K a multiple of group_size = ", group_size,
             " with mode='group', got shape ", shape_str(x));
  }
  FI_CHECK(mode != Fp8Mode::kChannel || scale.has_value(), op,
           "mode='channel' needs a given scale [K] (per-channel activation scales are static)");
  if (scale.has_value()) {
    if (mode == Fp8Mode::kTensor) {
      check_given_scale(op, *scale, x);
    } else {  // static per-token, per-channel or per-group scales, the shape of the computed ones
      FI_CHECK(scale->scalar_type() == kFloat, op, "scale must be float32, got ", scale->scalar_type());
      check_same_device(*scale, x, op, "scale", "x");
      const Shape want = mode == Fp8Mode::kToken     ? Shape{x.size(0)}
                         : mode == Fp8Mode::kChannel ? Shape{x.size(1)}
                                                     : Shape{x.size(0), x.size(1) / group_size};
      const char* layout = mode == Fp8Mode::kToken ? "[M]" : mode == Fp8Mode::kChannel ? "[K]" : "[M, K / group_size]";
      FI_CHECK(shape_of(*scale) == want, op, "scale must have shape ", layout, " = ", want, " for mode='",
               std::string(mode_str), "', got ", shape_str(*scale));
    }
  }
  return mode;
}

inline std::vector<int64_t> fp8_quantize_scale_shape(const Tensor& x, Fp8Mode mode, int64_t group_size) {
  switch (mode) {
    case Fp8Mode::kTensor: return {int64_t(1)};
    case Fp8Mode::kToken: return {x.size(0)};
    case Fp8Mode::kGroup: return {x.size(0), x.size(1) / group_size};
    case Fp8Mode::kChannel: return {x.size(1)};
  }
  return {};
}

// true: blockwise scales (scale_a 2-D), else per-tensor / per-token / per-channel.
inline bool validate_fp8_scaled_mm(const char* op, const Tensor& a, const Tensor& b, const Tensor& scale_a,
                                   const Tensor& scale_b, ScalarType out_dtype,
                                   const std::optional<Tensor>& bias, bool allow_fp32) {
  check_w8a8_operands(op, a, b, scale_a, scale_b, kFloat8_e4m3fn, "[M, K] float8_e4m3fn",
                      "[N, K] float8_e4m3fn (the weight in nn.Linear layout)", out_dtype, allow_fp32);
  const auto M = a.size(0), K = a.size(1), N = b.size(0);
  const bool blockwise = scale_a.dim() == 2;
  if (blockwise) {
    const auto kb = (K + 127) / 128, nb = (N + 127) / 128;
    FI_CHECK(scale_a.size(0) == M && scale_a.size(1) == kb, op,
             "scale_a (blockwise, 2-D) must have shape [M, ceil(K / 128)] = [", M, ", ", kb, "], got ",
             shape_str(scale_a));
    FI_CHECK(scale_b.dim() == 2 && scale_b.size(0) == nb && scale_b.size(1) == kb, op,
             "scale_b must have shape [ceil(N / 128), ceil(K / 128)] = [", nb, ", ", kb,
             "] when scale_a is blockwise, got ", shape_str(scale_b));
  } else {
    FI_CHECK(scale_a.dim() == 1 && (scale_a.size(0) == 1 || scale_a.size(0) == M), op,
             "scale_a must have shape [1] (per tensor) or [M] = [", M, "] (per token), or [M, ceil(K / 128)] "
             "(blockwise), got ", shape_str(scale_a));
    FI_CHECK(scale_b.dim() == 1 && (scale_b.size(0) == 1 || scale_b.size(0) == N), op,
             "scale_b must have shape [1] (per tensor) or [N] = [", N, "] (per channel) when scale_a is 1-D, got ",
             shape_str(scale_b));
  }
  check_gemm_bias(op, bias, out_dtype, a, N);
  return blockwise;
}

}  // namespace fastinfer::binding
