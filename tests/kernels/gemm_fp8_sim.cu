// launch_fp8_scaled_mm / launch_fp8_quantize through the C++ API (no torch):
//  - the launchers' argument checks (K or N not a multiple of 16, null pointers, bad group size, a
//    given scale outside per-tensor mode, a missing workspace) return cudaErrorInvalidValue, and
//    empty problems succeed without launching;
//  - the GEMM on exactly representable inputs (small-integer e4m3 codes, power-of-two scales,
//    integer bias: every fp32 partial sum is exact), so the output must equal the host result
//    rounded once, bit for bit: per-token x per-channel with bias (medium tiles) and blockwise
//    (small tiles; ragged N and K blocks);
//  - per-token quantisation against a host implementation of the same arithmetic, bit for bit.
// Also builds with nvcc for a GPU (sm_89+): nvcc -std=c++20 -arch=sm_90a -Icuda/include tests/kernels/gemm_fp8_sim.cu
// cuda/src/fp8_gemm_sm90.cu (the latter compiles to its stubs without -DFASTINFER_SM90A_KERNELS)
#include "../../cuda/src/gemm_fp8.cu"
#include "kernel_test_util.h"

#include <cmath>

using fastinfer::DType;
using fastinfer::Fp8QuantizeParams;
using fastinfer::Fp8QuantMode;
using fastinfer::Fp8ScaledMmParams;
using fastinfer::Fp8ScaleMode;

static uint8_t e4m3_bits(float x) {
  __nv_fp8_e4m3 v(x);
  uint8_t b;
  std::memcpy(&b, &v, 1);
  return b;
}

static void check_errors() {
  DeviceBuffer<uint8_t> a(64 * 64), b(64 * 64);
  DeviceBuffer<__nv_bfloat16> out(64 * 64);
  DeviceBuffer<float> s(64);
  Fp8ScaledMmParams p;
  p.a = a.ptr;
  p.b = b.ptr;
  p.out = out.ptr;
  p.scale_a = s.ptr;
  p.scale_b = s.ptr;
  p.m = 4;
  p.n = 32;
  p.k = 40;  // not a multiple of 16
  EXPECT(launch_fp8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "K %% 16 != 0 accepted");
  p.k = 64;
  p.n = 24;
  EXPECT(launch_fp8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "N %% 16 != 0 accepted");
  p.n = 32;
  p.scale_b = nullptr;
  EXPECT(launch_fp8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "null scale_b accepted");
  p.scale_b = s.ptr;
  p.out_dtype = DType::kFloat32;
  EXPECT(launch_fp8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "float32 out accepted");
  p.out_dtype = DType::kBFloat16;
  p.m = 0;
  EXPECT(launch_fp8_scaled_mm(p, nullptr) == cudaSuccess, "M = 0 must be a no-op");

  DeviceBuffer<__nv_bfloat16> x(4 * 192);
  Fp8QuantizeParams q;
  q.x = x.ptr;
  q.out = a.ptr;
  q.scale = s.ptr;
  q.rows = 4;
  q.cols = 192;
  q.mode = Fp8QuantMode::kGroup;
  q.group_size = 96;  // not a power of two
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaErrorInvalidValue, "group_size 96 accepted");
  q.group_size = 128;  // does not divide 192: a shorter last group (fused_moe's a), accepted by the launcher
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaSuccess, "K %% group_size != 0 refused");
  q.mode = Fp8QuantMode::kChannel;  // per-channel scales are given only
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaErrorInvalidValue, "per-channel mode without a given scale accepted");
  q.mode = Fp8QuantMode::kToken;
  q.x_row_stride = 196;  // rows not 16-byte aligned
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaErrorInvalidValue, "row stride %% 8 != 0 accepted");
  q.x_row_stride = 0;
  q.mode = Fp8QuantMode::kTensor;
  EXPECT(fastinfer::fp8_quantize_workspace_size(q) > 0, "per-tensor without a scale needs a workspace");
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaErrorInvalidValue, "missing workspace accepted");
  q.cols = 190;
  q.mode = Fp8QuantMode::kToken;
  EXPECT(launch_fp8_quantize(q, nullptr) == cudaErrorInvalidValue, "K %% 8 != 0 accepted");
}

// out = (a * sa) (b * sb)^T + bias with exact arithmetic; blockwise when `blockwise`.
static void gemm_case(int M, int N, int K, bool blockwise, bool bias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto small_int = [&] { return static_cast<float>(static_cast<int>(rng() % 17) - 8); };  // -8..8: exact in e4m3
  auto pow2 = [&] { return std::ldexp(1.0f, static_cast<int>(rng() % 5) - 6); };
  std::vector<float> af(M * K), bf(N * K);
  std::vector<uint8_t> ab(M * K), bb(N * K);
  for (int i = 0; i < M * K; ++i) ab[i] = e4m3_bits(af[i] = small_int());
  for (int i = 0; i < N * K; ++i) bb[i] = e4m3_bits(bf[i] = small_int());
  const int kb = (K + 127) / 128, nb = (N + 127) / 128;
  std::vector<float> sa(blockwise ? M * kb : M), sb(blockwise ? nb * kb : N), bv(N);
  for (auto& v : sa) v = pow2();
  for (auto& v : sb) v = pow2();
  std::vector<__nv_bfloat16> bias_h(N);
  for (int n = 0; n < N; ++n) bias_h[n] = __float2bfloat16_rn(bv[n] = bias ? small_int() : 0.f);

  DeviceBuffer<uint8_t> d_a(ab), d_b(bb);
  DeviceBuffer<float> d_sa(sa), d_sb(sb);
  DeviceBuffer<__nv_bfloat16> d_bias(bias_h), d_out(static_cast<size_t>(M) * N);
  Fp8ScaledMmParams p;
  p.a = d_a.ptr;
  p.b = d_b.ptr;
  p.out = d_out.ptr;
  p.scale_a = d_sa.ptr;
  p.scale_b = d_sb.ptr;
  p.bias = bias ? d_bias.ptr : nullptr;
  p.m = M;
  p.n = N;
  p.k = K;
  p.scale_mode = blockwise ? Fp8ScaleMode::kBlockwise : Fp8ScaleMode::kTensorOrChannel;
  p.scale_a_per_row = true;
  p.scale_b_per_col = true;
  p.out_dtype = DType::kBFloat16;
  CHECK_CUDA(launch_fp8_scaled_mm(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = d_out.download();
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) {
        const double s = blockwise ? static_cast<double>(sa[m * kb + k / 128]) * sb[(n / 128) * kb + k / 128]
                                   : static_cast<double>(sa[m]) * sb[n];
        acc += static_cast<double>(af[m * K + k]) * bf[n * K + k] * s;
      }
      acc += bv[n];
      const float want = __bfloat162float(__float2bfloat16_rn(static_cast<float>(acc)));
      const float got = __bfloat162float(out[static_cast<size_t>(m) * N + n]);
      if (got != want) {
        EXPECT(bad > 3, "gemm M=%d N=%d K=%d blockwise=%d: out[%d][%d] = %g, want %g", M, N, K, blockwise, m, n, got,
                  want);
        ++bad;
      }
    }
  std::printf("gemm M=%d N=%d K=%d blockwise=%d bias=%d: %d mismatches\n", M, N, K, blockwise, bias, bad);
  if (bad) ++g_failures;
}

static void quantize_case(int M, int K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<__nv_bfloat16> x(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m) {
    const float mag = std::exp(2.0f * nd(rng));
    for (int k = 0; k < K; ++k) x[static_cast<size_t>(m) * K + k] = __float2bfloat16_rn(nd(rng) * mag);
  }
  DeviceBuffer<__nv_bfloat16> d_x(x);
  DeviceBuffer<uint8_t> d_q(static_cast<size_t>(M) * K);
  DeviceBuffer<float> d_s(M);
  Fp8QuantizeParams p;
  p.x = d_x.ptr;
  p.out = d_q.ptr;
  p.scale = d_s.ptr;
  p.rows = M;
  p.cols = K;
  p.mode = Fp8QuantMode::kToken;
  p.dtype = DType::kBFloat16;
  CHECK_CUDA(launch_fp8_quantize(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto q = d_q.download();
  const auto s = d_s.download();
  int bad = 0;
  for (int m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(__bfloat162float(x[static_cast<size_t>(m) * K + k])));
    const float scale = std::fmax(amax, 1e-12f) / 448.0f;
    if (s[m] != scale) ++bad;
    for (int k = 0; k < K; ++k) {
      const float v = std::fmin(std::fmax(__bfloat162float(x[static_cast<size_t>(m) * K + k]) / scale, -448.f), 448.f);
      if (q[static_cast<size_t>(m) * K + k] != e4m3_bits(v)) ++bad;
    }
  }
  std::printf("quantize token M=%d K=%d: %d mismatches\n", M, K, bad);
  if (bad) ++g_failures;
}

int main() {
  check_errors();
  gemm_case(20, 32, 160, /*blockwise=*/false, /*bias=*/true, 1);  // medium tiles, M and K tails
  gemm_case(5, 144, 272, /*blockwise=*/true, /*bias=*/false, 2);  // small tiles, ragged N / K scale blocks
  quantize_case(3, 200, 3);
  std::printf("%s\n", g_failures ? "FAIL" : "OK");
  return g_failures ? 1 : 0;
}
