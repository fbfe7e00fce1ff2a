// CPU implementations of fp8_quantize and fp8_scaled_mm (fp32 inside). Quantisation uses
// exactly the arithmetic of the kernels and of fastinfer.reference.fp8_quantize (fp32 amax,
// scale = max(amax, 1e-12) / 448, IEEE fp32 division, clamp, round-to-nearest-even cast), so all
// three agree bit for bit. The matmul dequantises a and b to fp32 through a 256-entry table (ATen's
// elementwise fp8 -> fp32 cast is ~10x slower and dominated the time at small M), folding the
// blockwise scales in, and calls ATen's fp32 GEMM; per-token / per-channel scales scale the output.

#include <algorithm>
#include <array>
#include <cmath>

#include "cpu_simd.h"
#include "gemm_dense/batch_invariant_mm.h"
#include "gemm_fp8/contract.h"
#include "gemm_fp8/e4m3_cpu.h"

namespace fastinfer::binding {
namespace {

std::tuple<Tensor, Tensor> fp8_quantize_cpu(const Tensor& x, std::string_view mode_str, int64_t group_size,
                                            const std::optional<Tensor>& scale) {
  const char* op = "fp8_quantize";
  const Fp8Mode mode = validate_fp8_quantize(op, x, mode_str, group_size, scale, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  check_quantize_layout(op, x);  // the kernels' layout rule, kept here so code moves between backends unchanged
  const int64_t M = x.size(0), K = x.size(1);
  const auto xf_t = contiguous_as(x, kFloat);
  const float* xf = xf_t.const_data_ptr<float>();
  auto q_t = empty_on(x, {M, K}, kFloat8_e4m3fn);
  Float8_e4m3fn* q = q_t.mutable_data_ptr<Float8_e4m3fn>();
  Tensor s_t;
  switch (mode) {
    case Fp8Mode::kTensor: {
      if (scale.has_value()) check_on_cpu(*scale, op, "scale");
      const float amax = M * K > 0 ? cpu::abs_max(xf, M * K) : 0.0f;
      const float s = scale.has_value() ? scalar_value(*scale) : scale_from_amax(amax);
      s_t = full_on(x, {1}, s, kFloat);
      for (int64_t i = 0; i < M * K; ++i) q[i] = to_e4m3(xf[i], s);
      break;
    }
    case Fp8Mode::kChannel: {  // given scales only (validated)
      check_on_cpu(*scale, op, "scale");
      s_t = torch::stable::contiguous(torch::stable::clone(*scale));
      const float* sp = s_t.const_data_ptr<float>();
      torch::stable::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t k = 0; k < K; ++k) q[r * K + k] = to_e4m3(xf[r * K + k], sp[k]);
      });
      break;
    }
    case Fp8Mode::kToken:
    case Fp8Mode::kGroup: {
      const int64_t g = mode == Fp8Mode::kToken ? std::max<int64_t>(K, 1) : group_size;
      const int64_t groups = mode == Fp8Mode::kToken ? 1 : K / group_size;
      if (scale.has_value()) {  // given (static) scales: copied, then used as they are
        check_on_cpu(*scale, op, "scale");
        s_t = torch::stable::contiguous(torch::stable::clone(*scale));
      } else {
        s_t = mode == Fp8Mode::kToken ? empty_on(x, {M}, kFloat) : empty_on(x, {M, groups}, kFloat);
      }
      float* sp = s_t.mutable_data_ptr<float>();
      const bool given = scale.has_value();
      torch::stable::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t c = 0; c < groups; ++c) {
            const int64_t k0 = c * g, n = std::min(g, K - k0);
            const float s = given ? sp[r * groups + c] : scale_from_amax(n > 0 ? cpu::abs_max(xf + r * K + k0, n) : 0.0f);
            sp[r * groups + c] = s;
            for (int64_t k = k0; k < k0 + n; ++k) q[r * K + k] = to_e4m3(xf[r * K + k], s);
          }
      });
      break;
    }
  }
  return {q_t, s_t};
}

// fp32 values of q [R, K] (contiguous e4m3); with `scale` [ceil(R / rows_per_block), ceil(K / 128)],
// element (r, k) is multiplied by scale[r / rows_per_block][k / 128] (one fp32 multiply).
Tensor dequantize_e4m3(const Tensor& q, const Tensor* scale, int64_t rows_per_block) {
  const int64_t R = q.size(0), K = q.size(1);
  auto out = empty_on(q, {R, K}, kFloat);
  const auto& lut = e4m3_table();
  const uint8_t* src = static_cast<const uint8_t*>(q.const_data_ptr());
  float* dst = out.mutable_data_ptr<float>();
  const float* s = scale != nullptr ? scale->const_data_ptr<float>() : nullptr;
  const int64_t s_stride = scale != nullptr ? scale->size(1) : 0;
  torch::stable::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
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

Tensor fp8_scaled_mm_cpu(const Tensor& a, const Tensor& b, const Tensor& scale_a,
                             const Tensor& scale_b, ScalarType out_dtype, const std::optional<Tensor>& bias,
                             bool deterministic) {
  const char* op = "fp8_scaled_mm";
  const bool blockwise = validate_fp8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_w8a8_layout(op, a, b, scale_a, scale_b, bias);
  const Tensor a_rows = torch::stable::contiguous(a);  // strided rows of a: a dense copy (1 byte per element)
  // deterministic: the batch-invariant fp32 GEMM (gemm_dense/batch_invariant_mm.h) instead of ATen's, whose k-order
  // depends on M; the dequantisation and the epilogue are elementwise already.
  auto mm = [&](const Tensor& x, const Tensor& w) {
    return deterministic ? batch_invariant_mm_f32(x, w) : matmul_nt(x, w);
  };
  Tensor out;
  if (blockwise) {
    const auto af = dequantize_e4m3(a_rows, &scale_a, 1);
    const auto bf = dequantize_e4m3(b, &scale_b, 128);
    out = torch::stable::contiguous(mm(af, bf));
  } else {
    out = torch::stable::contiguous(mm(dequantize_e4m3(a_rows, nullptr, 1), dequantize_e4m3(b, nullptr, 1)));
    const int64_t M = out.size(0), N = out.size(1);
    const float* sa = scale_a.const_data_ptr<float>();
    const float* sb = scale_b.const_data_ptr<float>();
    const bool sa_rows = scale_a.numel() > 1, sb_cols = scale_b.numel() > 1;
    float* o = out.mutable_data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) o[m * N + n] = o[m * N + n] * sa[sa_rows ? m : 0] * sb[sb_cols ? n : 0];
  }
  if (bias.has_value()) add_bias_f32(out, *bias);
  return contiguous_as(out, out_dtype);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("fp8_quantize", TORCH_BOX(&fp8_quantize_cpu));
  m.impl("fp8_scaled_mm", TORCH_BOX(&fp8_scaled_mm_cpu));
}
