// launch_int8_scaled_mm / launch_int8_quantize through the C++ API (no torch):
//  - the launchers' argument checks return cudaErrorInvalidValue, empty problems succeed;
//  - the GEMM against a host implementation of gemm/int8.h's arithmetic (exact int32 sums, the same
//    fp32 epilogue), bit for bit: every tile config (forced, and the automatic choice), M / N / K
//    tails, per-token x per-channel scales, bias, and the asymmetric correction (azp, azp_adj);
//  - per-token quantisation (symmetric and asymmetric) and per-tensor against the host arithmetic.
// Also builds with nvcc for a GPU (sm_80+): nvcc -std=c++20 -arch=sm_80 -Icuda/include tests/kernels/gemm_int8_sim.cu
// cuda/src/int8_gemm_sm90.cu (the latter compiles to its stubs without -DFASTINFER_SM90A_KERNELS)
#include "../../cuda/src/gemm_int8.cu"
#include "kernel_test_util.h"

#include <cmath>

using fastinfer::DType;
using fastinfer::Int8QuantizeParams;
using fastinfer::Int8QuantMode;
using fastinfer::Int8ScaledMmParams;

static void check_errors() {
  DeviceBuffer<int8_t> a(64 * 64), b(64 * 64);
  DeviceBuffer<__nv_bfloat16> out(64 * 64);
  DeviceBuffer<float> s(64);
  DeviceBuffer<int32_t> z(64);
  Int8ScaledMmParams p;
  p.a = a.ptr;
  p.b = b.ptr;
  p.out = out.ptr;
  p.scale_a = s.ptr;
  p.scale_b = s.ptr;
  p.m = 4;
  p.n = 32;
  p.k = 40;
  EXPECT(launch_int8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "K %% 16 != 0 accepted");
  p.k = 64;
  p.n = 24;
  EXPECT(launch_int8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "N %% 16 != 0 accepted");
  p.n = 32;
  p.azp = z.ptr;  // without azp_adj
  EXPECT(launch_int8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "azp without azp_adj accepted");
  p.azp = nullptr;
  p.out_dtype = DType::kFloat32;
  EXPECT(launch_int8_scaled_mm(p, nullptr) == cudaErrorInvalidValue, "float32 out accepted");
  p.out_dtype = DType::kBFloat16;
  p.m = 0;
  EXPECT(launch_int8_scaled_mm(p, nullptr) == cudaSuccess, "M = 0 must be a no-op");

  DeviceBuffer<__nv_bfloat16> x(4 * 192);
  Int8QuantizeParams q;
  q.x = x.ptr;
  q.out = a.ptr;
  q.scale = s.ptr;
  q.rows = 4;
  q.cols = 190;
  EXPECT(launch_int8_quantize(q, nullptr) == cudaErrorInvalidValue, "K %% 8 != 0 accepted");
  q.cols = 192;
  q.symmetric = false;  // without azp
  EXPECT(launch_int8_quantize(q, nullptr) == cudaErrorInvalidValue, "asymmetric without azp accepted");
  q.azp = z.ptr;
  q.mode = Int8QuantMode::kTensor;
  EXPECT(launch_int8_quantize(q, nullptr) == cudaErrorInvalidValue, "asymmetric per-tensor without a given scale and azp accepted");
  q.symmetric = true;
  EXPECT(fastinfer::int8_quantize_workspace_size(q) > 0, "per-tensor without a scale needs a workspace");
  EXPECT(launch_int8_quantize(q, nullptr) == cudaErrorInvalidValue, "missing workspace accepted");
  q.mode = Int8QuantMode::kToken;
  q.given_scale = s.ptr;
  EXPECT(launch_int8_quantize(q, nullptr) == cudaErrorInvalidValue, "given scale with per-token mode accepted");
}

static void gemm_case(int M, int N, int K, bool bias, bool asym, uint64_t seed,
                      fastinfer::Int8GemmTiles tiles = fastinfer::Int8GemmTiles::kAuto) {
  std::mt19937_64 rng(seed);
  std::vector<int8_t> a(static_cast<size_t>(M) * K), b(static_cast<size_t>(N) * K);
  for (auto& v : a) v = static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);  // the full range, -128 too
  for (auto& v : b) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> sa(M), sb(N);
  for (auto& v : sa) v = 1e-3f * (1.f + static_cast<float>(rng() % 1000) / 250.f);
  for (auto& v : sb) v = 1e-3f * (1.f + static_cast<float>(rng() % 1000) / 250.f);
  std::vector<int32_t> azp(M), adj(N, 0);
  for (auto& v : azp) v = static_cast<int32_t>(rng() % 256) - 128;
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) adj[n] += b[static_cast<size_t>(n) * K + k];
  std::vector<__nv_bfloat16> bias_h(N);
  for (auto& v : bias_h) v = __float2bfloat16_rn(static_cast<float>(static_cast<int>(rng() % 200) - 100) / 16.f);

  DeviceBuffer<int8_t> d_a(a), d_b(b);
  DeviceBuffer<float> d_sa(sa), d_sb(sb);
  DeviceBuffer<int32_t> d_azp(azp), d_adj(adj);
  DeviceBuffer<__nv_bfloat16> d_bias(bias_h), d_out(static_cast<size_t>(M) * N);
  std::vector<__nv_bfloat16> poison(static_cast<size_t>(M) * N, __float2bfloat16_rn(NAN));
  d_out.upload(poison);
  Int8ScaledMmParams p;
  p.a = d_a.ptr;
  p.b = d_b.ptr;
  p.out = d_out.ptr;
  p.scale_a = d_sa.ptr;
  p.scale_b = d_sb.ptr;
  p.bias = bias ? d_bias.ptr : nullptr;
  p.azp = asym ? d_azp.ptr : nullptr;
  p.azp_adj = asym ? d_adj.ptr : nullptr;
  p.azp_per_row = true;
  p.m = M;
  p.n = N;
  p.k = K;
  p.scale_a_per_row = true;
  p.scale_b_per_col = true;
  p.out_dtype = DType::kBFloat16;
  p.tiles = tiles;
  CHECK_CUDA(launch_int8_scaled_mm(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = d_out.download();
  Checksum cs;
  cs.add(out.data(), out.size() * sizeof(out[0]));
  int bad = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      int32_t acc = 0;
      for (int k = 0; k < K; ++k) acc += a[static_cast<size_t>(m) * K + k] * b[static_cast<size_t>(n) * K + k];
      if (asym) acc -= azp[m] * adj[n];
      const float s = sa[m] * sb[n];
      const float v = bias ? std::fmaf(static_cast<float>(acc), s, __bfloat162float(bias_h[n])) : static_cast<float>(acc) * s;
      const uint16_t want = std::bit_cast<uint16_t>(__float2bfloat16_rn(v));
      const uint16_t got = std::bit_cast<uint16_t>(out[static_cast<size_t>(m) * N + n]);
      if (got != want) {
        EXPECT(bad > 3, "gemm M=%d N=%d K=%d: out[%d][%d] = %g, want %g", M, N, K, m, n,
               __bfloat162float(out[static_cast<size_t>(m) * N + n]), v);
        ++bad;
      }
    }
  std::printf("gemm M=%d N=%d K=%d bias=%d azp=%d tiles=%d: %d mismatches, checksum %016llx\n", M, N, K, bias, asym,
              static_cast<int>(tiles), bad, static_cast<unsigned long long>(cs.h));
  if (bad) ++g_failures;
}

// Host version of gemm/int8.h's quantisation.
static int8_t host_code(float x, float scale, int32_t azp, bool sym) {
  const float v = x / scale;
  if (sym) return static_cast<int8_t>(std::nearbyint(std::fmin(std::fmax(v, -127.f), 127.f)));
  const int q = static_cast<int>(std::nearbyint(v)) + azp;
  return static_cast<int8_t>(q < -128 ? -128 : (q > 127 ? 127 : q));
}

static void quantize_case(int M, int K, bool sym, bool tensor, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<__nv_bfloat16> x(static_cast<size_t>(M) * K);
  for (int m = 0; m < M; ++m) {
    const float mag = std::exp(2.0f * nd(rng)), shift = sym ? 0.f : 2.f * nd(rng);
    for (int k = 0; k < K; ++k) x[static_cast<size_t>(m) * K + k] = __float2bfloat16_rn((nd(rng) + shift) * mag);
  }
  DeviceBuffer<__nv_bfloat16> d_x(x);
  DeviceBuffer<int8_t> d_q(static_cast<size_t>(M) * K);
  DeviceBuffer<float> d_s(M), d_ws(512);
  DeviceBuffer<int32_t> d_z(M);
  Int8QuantizeParams p;
  p.x = d_x.ptr;
  p.out = d_q.ptr;
  p.scale = d_s.ptr;
  p.azp = d_z.ptr;
  p.rows = M;
  p.cols = K;
  p.mode = tensor ? Int8QuantMode::kTensor : Int8QuantMode::kToken;
  p.symmetric = sym;
  p.dtype = DType::kBFloat16;
  p.workspace = d_ws.ptr;
  CHECK_CUDA(launch_int8_quantize(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto q = d_q.download();
  const auto s = d_s.download();
  const auto z = d_z.download();
  float t_amax = 0.f;
  for (const auto& v : x) t_amax = std::fmax(t_amax, std::fabs(__bfloat162float(v)));
  int bad = 0;
  for (int m = 0; m < M; ++m) {
    float hi = 0.f, lo = 0.f;
    for (int k = 0; k < K; ++k) {
      const float v = __bfloat162float(x[static_cast<size_t>(m) * K + k]);
      hi = std::fmax(hi, v);
      lo = std::fmax(lo, -v);
    }
    float scale = std::fmax(std::fmax(hi, lo), 1e-12f) / 127.f;
    int32_t azp = 0;
    if (tensor) scale = std::fmax(t_amax, 1e-12f) / 127.f;
    if (!sym) {
      scale = std::fmax(hi + lo, 1e-12f) / 255.f;
      azp = std::min(127, std::max(-128, static_cast<int>(std::nearbyint(lo / scale)) - 128));
      if (z[m] != azp) ++bad;
    }
    if (s[tensor ? 0 : m] != scale) ++bad;
    for (int k = 0; k < K; ++k)
      if (q[static_cast<size_t>(m) * K + k] != host_code(__bfloat162float(x[static_cast<size_t>(m) * K + k]), scale, azp, sym))
        ++bad;
  }
  std::printf("quantize %s %s M=%d K=%d: %d mismatches\n", tensor ? "tensor" : "token", sym ? "sym" : "asym", M, K, bad);
  if (bad) ++g_failures;
}

int main() {
  check_errors();
  using fastinfer::Int8GemmTiles;
  gemm_case(5, 48, 80, /*bias=*/true, /*asym=*/false, 1);     // small tiles (auto), N and K tails
  gemm_case(20, 144, 272, /*bias=*/false, /*asym=*/true, 2, Int8GemmTiles::kMedium);  // M tail, azp correction
  gemm_case(100, 160, 400, /*bias=*/true, /*asym=*/true, 3, Int8GemmTiles::kLarge);   // every tail
  gemm_case(70, 96, 144, /*bias=*/false, /*asym=*/false, 4);  // auto: few CTAs -> small tiles for M > 64
  quantize_case(3, 200, /*sym=*/true, /*tensor=*/false, 4);
  quantize_case(5, 264, /*sym=*/false, /*tensor=*/false, 5);
  quantize_case(7, 72, /*sym=*/true, /*tensor=*/true, 6);
  std::printf("%s\n", g_failures ? "FAIL" : "OK");
  return g_failures ? 1 : 0;
}
