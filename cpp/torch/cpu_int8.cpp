// CPU implementations of int8_quantize and int8_scaled_mm. Quantisation uses exactly the
// arithmetic of the kernels and of fastinfer.reference.gemm_int8 (gemm/int8.h: fp32 amax or range,
// IEEE fp32 division, clamp, round half to even), so all three agree bit for bit.
// The matmul's int32 accumulators are exact: for M <= kDotRows direct int8 dot products in int32
// (decode: the weight is read once, one byte per element, no conversion), else fp32 GEMMs over K
// chunks of kExactChunk (|a|, |b| <= 128, so a chunk's partial sums stay integers below 2^24, which
// fp32 holds exactly in any summation order), summed in int32. On CPUs without VNNI/AMX this is
// several times faster than torch._int_mm (bench/gemm_int8.py); the epilogue is the kernels' (one
// fma with the bias). Exact accumulators and an elementwise epilogue make every path batch
// invariant (a row's bits never depend on M), so deterministic=True changes nothing here.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_simd.h"
#include "validate_int8.h"

namespace fastinfer::binding {
namespace {

constexpr double kMinRange = 1e-12;
constexpr int64_t kExactChunk = 1024;  // 1024 * 128 * 128 = 2^24
constexpr int64_t kDotRows = 4;        // M up to this: direct dot products

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_quantize_cpu(const at::Tensor& x, c10::string_view mode_str,
                                                                 const std::optional<at::Tensor>& scale, bool symmetric) {
  const char* op = "int8_quantize";
  const Int8Mode mode = validate_int8_quantize(op, x, mode_str, scale, symmetric, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  check_contiguous(x, op, "x");
  const int64_t M = x.size(0), K = x.size(1);
  const auto xf = x.to(at::kFloat).contiguous();
  at::Tensor s, q, azp = at::empty({0}, x.options().dtype(at::kInt));
  if (mode == Int8Mode::kTensor) {
    if (scale.has_value()) {
      check_on_cpu(*scale, op, "scale");
      s = scale->reshape({1}).clone();
    } else {
      const auto amax = xf.numel() > 0 ? xf.abs().amax() : at::zeros({}, xf.options());
      s = (amax.clamp_min(kMinRange) / 127.0).reshape({1});
    }
    q = (xf / s).clamp(-127, 127).round();
  } else if (symmetric) {
    const auto amax = K > 0 ? xf.abs().amax(1) : at::zeros({M}, xf.options());
    s = amax.clamp_min(kMinRange) / 127.0;
    q = (xf / s.unsqueeze(1)).clamp(-127, 127).round();
  } else {
    const auto hi = K > 0 ? xf.amax(1).clamp_min(0) : at::zeros({M}, xf.options());
    const auto lo = K > 0 ? (-xf).amax(1).clamp_min(0) : at::zeros({M}, xf.options());
    s = (hi + lo).clamp_min(kMinRange) / 255.0;
    const auto z = ((lo / s).round() - 128).clamp(-128, 127);
    q = ((xf / s.unsqueeze(1)).clamp(-256, 256).round() + z.unsqueeze(1)).clamp(-128, 127);
    azp = z.to(at::kInt);
  }
  return {q.to(at::kChar).contiguous(), s.contiguous(), azp};
}

// acc[m][n] = sum_k a[m][k] * b[n][k] for rows n in [n0, n1) of b, M <= kDotRows rows of a. The
// products summed in uint32 (int32 modulo 2^32: no overflow UB, the kernels' wrap-around); the
// inner loop vectorises (int16 products, pairwise int32 sums).
FASTINFER_CPU_CLONES void int8_dot_rows(const int8_t* a, const int8_t* b, int32_t* acc, int64_t M, int64_t N,
                                        int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* bn = b + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* am = a + m * K;
      uint32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) sum += static_cast<uint32_t>(static_cast<int32_t>(am[k]) * bn[k]);
      acc[m * N + n] = static_cast<int32_t>(sum);
    }
  }
}

// Exact int32 a @ b^T (a [M, K], b [N, K] int8, contiguous).
at::Tensor int8_mm_exact(const at::Tensor& a, const at::Tensor& b) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (K == 0) return at::zeros({M, N}, a.options().dtype(at::kInt));
  if (M <= kDotRows) {
    auto acc = at::empty({M, N}, a.options().dtype(at::kInt));
    const int8_t* pa = a.data_ptr<int8_t>();
    const int8_t* pb = b.data_ptr<int8_t>();
    int32_t* pc = acc.data_ptr<int32_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t n0, int64_t n1) {
      int8_dot_rows(pa, pb, pc, M, N, K, n0, n1);
    });
    return acc;
  }
  const auto af = a.to(at::kFloat), bf = b.to(at::kFloat);
  at::Tensor acc;
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t kc = std::min(kExactChunk, K - k0);
    const auto part = at::mm(af.narrow(1, k0, kc), bf.narrow(1, k0, kc).t()).to(at::kInt);
    acc = acc.defined() ? acc.add_(part) : part;
  }
  return acc;
}

template <typename TOut>
void epilogue(const int32_t* acc, TOut* out, int64_t M, int64_t N, const float* sa, bool sa_rows, const float* sb,
              bool sb_cols, const TOut* bias, const int32_t* azp, bool azp_rows, const int32_t* adj) {
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float sam = sa[sa_rows ? m : 0];
      const uint32_t zm = azp != nullptr ? static_cast<uint32_t>(azp[azp_rows ? m : 0]) : 0u;
      for (int64_t n = 0; n < N; ++n) {
        uint32_t c = static_cast<uint32_t>(acc[m * N + n]);  // int32 arithmetic modulo 2^32, as the kernel
        if (azp != nullptr) c -= zm * static_cast<uint32_t>(adj[n]);
        const float cf = static_cast<float>(static_cast<int32_t>(c));
        const float s = sam * sb[sb_cols ? n : 0];
        out[m * N + n] = static_cast<TOut>(bias != nullptr ? std::fmaf(cf, s, static_cast<float>(bias[n])) : cf * s);
      }
    }
  });
}

at::Tensor int8_scaled_mm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                              const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& azp_adj, const std::optional<at::Tensor>& azp,
                              bool /*deterministic*/) {
  const char* op = "int8_scaled_mm";
  validate_int8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_int8_scaled_mm_layout(op, a, b, scale_a, scale_b, bias, azp_adj, azp);
  const int64_t M = a.size(0), N = b.size(0);
  auto out = at::empty({M, N}, a.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  const auto acc = int8_mm_exact(a, b).contiguous();
  const bool sa_rows = scale_a.size(0) == M && M > 1, sb_cols = scale_b.size(0) == N;
  const int32_t* z = azp.has_value() ? azp->data_ptr<int32_t>() : nullptr;
  const int32_t* adj = azp_adj.has_value() ? azp_adj->data_ptr<int32_t>() : nullptr;
  const bool z_rows = azp.has_value() && azp->size(0) == M && M > 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_dtype, "int8_scaled_mm_cpu", [&] {
    epilogue<scalar_t>(acc.data_ptr<int32_t>(), out.data_ptr<scalar_t>(), M, N, scale_a.data_ptr<float>(), sa_rows,
                       scale_b.data_ptr<float>(), sb_cols, bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, z,
                       z_rows, adj);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, CPU, m) {
  using namespace fastinfer::binding;
  m.impl("int8_quantize", &int8_quantize_cpu);
  m.impl("int8_scaled_mm", &int8_scaled_mm_cpu);
}
