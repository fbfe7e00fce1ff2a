// CPU implementations of fp8_quantize and fp8_scaled_mm (ATen, fp32 inside). Quantisation uses
// exactly the arithmetic of the kernels and of fastinfer.reference.fp8_quantize (fp32 amax,
// scale = max(amax, 1e-12) / 448, IEEE fp32 division, clamp, round-to-nearest-even cast), so all
// three agree bit for bit. The matmul dequantises a and b to fp32 through a 256-entry table (ATen's
// elementwise fp8 -> fp32 cast is ~10x slower and dominated the time at small M), folding the
// blockwise scales in, and calls ATen's fp32 GEMM; per-token / per-channel scales scale the output.
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <array>

#include "cpu_dense.h"
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

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// fp32 values of q [R, K] (contiguous e4m3); with `scale` [ceil(R / rows_per_block), ceil(K / 128)],
// element (r, k) is multiplied by scale[r / rows_per_block][k / 128] (one fp32 multiply).
at::Tensor dequantize_e4m3(const at::Tensor& q, const at::Tensor* scale, int64_t rows_per_block) {
  const int64_t R = q.size(0), K = q.size(1);
  auto out = at::empty({R, K}, q.options().dtype(at::kFloat));
  const auto& lut = e4m3_table();
  const uint8_t* src = reinterpret_cast<const uint8_t*>(q.data_ptr());
  float* dst = out.data_ptr<float>();
  const float* s = scale != nullptr ? scale->data_ptr<float>() : nullptr;
  const int64_t s_stride = scale != nullptr ? scale->size(1) : 0;
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* qr = src + r * K;
      float* dr = dst + r * K;
      if (s == nullptr) {
        for (int64_t k = 0; k < K; ++k) dr[k] = lut[qr[k]];
      } else {
        const float* sr = s + (r / rows_per_block) * s_stride;
        for (int64_t k = 0; k < K; ++k) dr[k] = lut[qr[k]] * sr[k / 128];
      }
    }
  });
  return out;
}

at::Tensor fp8_scaled_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                             bool deterministic) {
  const char* op = "fp8_scaled_mm";
  const bool blockwise = validate_fp8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_w8a8_layout(op, a, b, scale_a, scale_b, bias);
  // deterministic: the batch-invariant fp32 GEMM (cpu_dense.h) instead of ATen's, whose k-order
  // depends on M; the dequantisation and the epilogue are elementwise already.
  auto mm = [&](const at::Tensor& x, const at::Tensor& w) {
    return deterministic ? batch_invariant_mm_f32(x, w) : at::matmul(x, w.t());
  };
  at::Tensor out;
  if (blockwise) {
    const auto af = dequantize_e4m3(a, &scale_a, 1);
    const auto bf = dequantize_e4m3(b, &scale_b, 128);
    out = mm(af, bf);
  } else {
    out = mm(dequantize_e4m3(a, nullptr, 1), dequantize_e4m3(b, nullptr, 1));
    out.mul_(scale_a.view({-1, 1})).mul_(scale_b.view({1, -1}));
  }
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(out_dtype).contiguous();
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, CPU, m) {
  using namespace fastinfer::binding;
  m.impl("fp8_quantize", &fp8_quantize_cpu);
  m.impl("fp8_scaled_mm", &fp8_scaled_mm_cpu);
}
