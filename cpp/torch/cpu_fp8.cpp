// CPU implementations of fp8_quantize and fp8_scaled_mm (ATen, fp32 inside). Quantisation uses
// exactly the arithmetic of the kernels and of fastinfer.reference.fp8_quantize (fp32 amax,
// scale = max(amax, 1e-12) / 448, IEEE fp32 division, clamp, round-to-nearest-even cast), so all
// three agree bit for bit. The matmul dequantises to fp32 and calls ATen's GEMM (one pass over b).
#include <torch/library.h>

#include "validate_fp8.h"

namespace fastinfer::binding {
namespace {

constexpr double kE4m3Max = 448.0;
constexpr double kMinAmax = 1e-12;

at::Tensor scale_from_amax(const at::Tensor& amax) { return amax.clamp_min(kMinAmax) / kE4m3Max; }

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, c10::string_view mode_str, int64_t group_size,
                                                    const std::optional<at::Tensor>& scale) {
  const char* op = "fp8_quantize";
  const Fp8Mode mode = validate_fp8_quantize(op, x, mode_str, group_size, scale, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  check_contiguous(x, op, "x");  // the kernels' layout rule, kept here so code moves between backends unchanged
  const int64_t M = x.size(0), K = x.size(1);
  const auto xf = x.to(at::kFloat).contiguous();
  at::Tensor s, q;
  switch (mode) {
    case Fp8Mode::kTensor: {
      if (scale.has_value()) {
        check_on_cpu(*scale, op, "scale");
        s = scale->reshape({1}).clone();
      } else {
        const auto amax = xf.numel() > 0 ? xf.abs().amax() : at::zeros({}, xf.options());
        s = scale_from_amax(amax).reshape({1});
      }
      q = xf / s;
      break;
    }
    case Fp8Mode::kToken: {
      s = K > 0 ? scale_from_amax(xf.abs().amax(1)) : scale_from_amax(at::zeros({M}, xf.options()));
      q = xf / s.unsqueeze(1);
      break;
    }
    case Fp8Mode::kGroup: {
      const auto xg = xf.view({M, K / group_size, group_size});
      s = scale_from_amax(xg.abs().amax(2));
      q = (xg / s.unsqueeze(2)).view({M, K});
      break;
    }
  }
  return {q.clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn).contiguous(), s.contiguous()};
}

at::Tensor fp8_scaled_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias) {
  const char* op = "fp8_scaled_mm";
  const bool blockwise = validate_fp8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_fp8_scaled_mm_layout(op, a, b, scale_a, scale_b, bias);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  auto af = a.to(at::kFloat);
  auto bf = b.to(at::kFloat);
  at::Tensor out;
  if (blockwise) {
    // Expand the 128-blocks of scales to elements (cut at the ragged edges) and scale the operands.
    af.mul_(scale_a.repeat_interleave(128, 1).narrow(1, 0, K));
    bf.mul_(scale_b.repeat_interleave(128, 0).narrow(0, 0, N).repeat_interleave(128, 1).narrow(1, 0, K));
    out = at::matmul(af, bf.t());
  } else {
    out = at::matmul(af, bf.t());
    out.mul_(scale_a.view({-1, 1})).mul_(scale_b.view({1, -1}));
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  (void)M;
  return out.to(out_dtype).contiguous();
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, CPU, m) {
  using namespace fastinfer::binding;
  m.impl("fp8_quantize", &fp8_quantize_cpu);
  m.impl("fp8_scaled_mm", &fp8_scaled_mm_cpu);
}
