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

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_simd.h"
#include "gemm_int8/contract.h"
#include "gemm_int8/int8_cpu.h"

namespace fastinfer::binding {
namespace {

constexpr double kMinRange = 1e-12;
constexpr int64_t kExactChunk = 1024;  // 1024 * 128 * 128 = 2^24
constexpr int64_t kDotRows = 4;        // M up to this: direct dot products

float clamp(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }
// The code of v = x / scale with zero point z (asymmetric): NaN -> 0, else clamp(rne(v) + z).
int8_t asymmetric_code(float v, float z) {
  return v != v ? 0 : static_cast<int8_t>(clamp(std::nearbyint(clamp(v, -256.0f, 256.0f)) + z, -128.0f, 127.0f));
}

std::tuple<Tensor, Tensor, Tensor> int8_quantize_cpu(const Tensor& x, std::string_view mode_str,
                                                     const std::optional<Tensor>& scale, bool symmetric,
                                                     const std::optional<Tensor>& given_azp) {
  const char* op = "int8_quantize";
  const Int8Mode mode = validate_int8_quantize(op, x, mode_str, scale, symmetric, given_azp, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  check_quantize_layout(op, x);
  const int64_t M = x.size(0), K = x.size(1);
  const auto xf_t = contiguous_as(x, kFloat);
  const float* xf = xf_t.const_data_ptr<float>();
  auto q_t = empty_on(x, {M, K}, kChar);
  int8_t* q = q_t.mutable_data_ptr<int8_t>();
  const float min_range = static_cast<float>(kMinRange);
  // fp32 throughout: IEEE division, clamp, round half to even (std::nearbyint), as the kernels.
  if (mode == Int8Mode::kTensor) {
    if (scale.has_value()) check_on_cpu(*scale, op, "scale");
    const float amax = M * K > 0 ? cpu::abs_max(xf, M * K) : 0.0f;
    const float s = scale.has_value() ? scalar_value(*scale) : int8_scale_from_amax(amax);
    if (!symmetric) {  // static asymmetric: the given scale and zero point
      check_on_cpu(*given_azp, op, "azp");
      const int32_t z = host_indices(*given_azp)[0];
      for (int64_t i = 0; i < M * K; ++i) q[i] = asymmetric_code(xf[i] / s, static_cast<float>(z));
      return {q_t, full_on(x, {1}, s, kFloat), full_on(x, {1}, z, kInt)};
    }
    for (int64_t i = 0; i < M * K; ++i) q[i] = int8_symmetric_code(xf[i] / s);
    return {q_t, full_on(x, {1}, s, kFloat), empty_on(x, {0}, kInt)};
  }
  auto s_t = empty_on(x, {M}, kFloat);
  float* sp = s_t.mutable_data_ptr<float>();
  Tensor azp_t = symmetric ? empty_on(x, {0}, kInt) : empty_on(x, {M}, kInt);
  int32_t* zp = symmetric ? nullptr : azp_t.mutable_data_ptr<int32_t>();
  torch::stable::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xf + r * K;
      int8_t* qr = q + r * K;
      if (symmetric) {
        const float s = int8_scale_from_amax(K > 0 ? cpu::abs_max(xr, K) : 0.0f);
        sp[r] = s;
        for (int64_t k = 0; k < K; ++k) qr[k] = int8_symmetric_code(xr[k] / s);
      } else {
        const float hi = K > 0 ? std::max(cpu::max_over(xr, K, [](float v) { return v; }), 0.0f) : 0.0f;
        const float lo = K > 0 ? std::max(cpu::max_over(xr, K, [](float v) { return -v; }), 0.0f) : 0.0f;
        const float s = std::max(hi + lo, min_range) / 255.0f;  // NaN stays NaN (std::max's first operand)
        const float z = s != s ? 0.0f : clamp(std::nearbyint(lo / s) - 128.0f, -128.0f, 127.0f);
        sp[r] = s;
        zp[r] = static_cast<int32_t>(z);
        for (int64_t k = 0; k < K; ++k) qr[k] = asymmetric_code(xr[k] / s, z);
      }
    }
  });
  return {q_t, s_t, azp_t};
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
Tensor int8_mm_exact(const Tensor& a, const Tensor& b) {
  const int64_t M = a.size(0), N = b.size(0), K = a.size(1);
  if (K == 0) return zeros_on(a, {M, N}, kInt);
  if (M <= kDotRows) {
    auto acc = empty_on(a, {M, N}, kInt);
    const int8_t* pa = a.mutable_data_ptr<int8_t>();
    const int8_t* pb = b.mutable_data_ptr<int8_t>();
    int32_t* pc = acc.mutable_data_ptr<int32_t>();
    torch::stable::parallel_for(0, N, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t n0, int64_t n1) {
      int8_dot_rows(pa, pb, pc, M, N, K, n0, n1);
    });
    return acc;
  }
  const auto af = to_dtype_of(a, kFloat), bf = to_dtype_of(b, kFloat);
  auto acc = zeros_on(a, {M, N}, kInt);
  int32_t* pc = acc.mutable_data_ptr<int32_t>();
  for (int64_t k0 = 0; k0 < K; k0 += kExactChunk) {
    const int64_t kc = std::min(kExactChunk, K - k0);
    const auto part = torch::stable::contiguous(
        matmul_nt(slice(af, 1, k0, kc), slice(bf, 1, k0, kc)));
    const float* pp = part.const_data_ptr<float>();
    for (int64_t i = 0; i < M * N; ++i)  // exact integers < 2^24, summed modulo 2^32 as the kernels
      pc[i] = static_cast<int32_t>(static_cast<uint32_t>(pc[i]) + static_cast<uint32_t>(static_cast<int32_t>(pp[i])));
  }
  return acc;
}

template <typename TOut>
void epilogue(const int32_t* acc, TOut* out, int64_t M, int64_t N, const float* sa, bool sa_rows, const float* sb,
              bool sb_cols, const TOut* bias, const int32_t* azp, bool azp_rows, const int32_t* adj) {
  torch::stable::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
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

Tensor int8_scaled_mm_cpu(const Tensor& a, const Tensor& b, const Tensor& scale_a,
                              const Tensor& scale_b, ScalarType out_dtype, const std::optional<Tensor>& bias,
                              const std::optional<Tensor>& azp_adj, const std::optional<Tensor>& azp,
                              bool /*deterministic*/) {
  const char* op = "int8_scaled_mm";
  validate_int8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_int8_scaled_mm_layout(op, a, b, scale_a, scale_b, bias, azp_adj, azp);
  const int64_t M = a.size(0), N = b.size(0);
  auto out = empty_on(a, {M, N}, out_dtype);
  if (out.numel() == 0) return out;
  const auto acc = int8_mm_exact(torch::stable::contiguous(a), b);  // strided rows of a: a dense copy
  const bool sa_rows = scale_a.size(0) == M && M > 1, sb_cols = scale_b.size(0) == N;
  const int32_t* z = azp.has_value() ? azp->mutable_data_ptr<int32_t>() : nullptr;
  const int32_t* adj = azp_adj.has_value() ? azp_adj->mutable_data_ptr<int32_t>() : nullptr;
  const bool z_rows = azp.has_value() && azp->size(0) == M && M > 1;
  FASTINFER_DISPATCH_FLOAT_TYPES(out_dtype, "int8_scaled_mm_cpu", [&] {
    epilogue<scalar_t>(acc.mutable_data_ptr<int32_t>(), out.mutable_data_ptr<scalar_t>(), M, N, scale_a.mutable_data_ptr<float>(), sa_rows,
                       scale_b.mutable_data_ptr<float>(), sb_cols, bias.has_value() ? bias->mutable_data_ptr<scalar_t>() : nullptr, z,
                       z_rows, adj);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("int8_quantize", TORCH_BOX(&int8_quantize_cpu));
  m.impl("int8_scaled_mm", TORCH_BOX(&int8_scaled_mm_cpu));
}
