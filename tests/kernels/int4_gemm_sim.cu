// The lop3/prmt wrappers of ptx.cuh (their simt twins under the emulator, the hardware under
// nvcc) against independent host formulas, then launch_int4_dequantize (bit-exact against a host
// dequantisation of the documented packed layout) and launch_int4_gemm (split-K 1 and several,
// zero points or symmetric, partial row/column tiles) against a double-precision host GEMM of the
// same dequantised weights. Prints a checksum of the GEMM outputs. Exits 0 on success.
//   GPU: nvcc -std=c++20 -arch=sm_90a --expt-relaxed-constexpr -Icuda/include tests/kernels/int4_gemm_sim.cu
#include "../../cuda/src/gemm_int4.cu"
#include "kernel_test_util.h"

#include <cmath>

using fastinfer::DType;
using fastinfer::Int4DequantizeParams;
using fastinfer::Int4GemmParams;

// ---- lop3 / prmt --------------------------------------------------------------------------------
constexpr int kBitCases = 64;

__global__ void bit_ops_kernel(const uint32_t* in, uint32_t* out) {
  const int i = threadIdx.x;
  const uint32_t a = in[3 * i], b = in[3 * i + 1], c = in[3 * i + 2];
  using fastinfer::ptx::lop3;
  using fastinfer::ptx::prmt;
  uint32_t* o = out + 12 * i;
  o[0] = lop3<0xEA>(a, b, c);
  o[1] = lop3<0x96>(a, b, c);
  o[2] = lop3<0xF8>(a, b, c);
  o[3] = lop3<0x80>(a, b, c);
  o[4] = lop3<0x00>(a, b, c);
  o[5] = lop3<0xFF>(a, b, c);
  o[6] = lop3<0x1B>(a, b, c);
  o[7] = prmt(a, b, c);            // arbitrary selectors, sign-replicating nibbles included
  o[8] = prmt(a, b, 0x3210u);      // identity on a
  o[9] = prmt(a, b, 0x7654u);      // b
  o[10] = prmt(a, b, 0x5050u);     // the zero-point pattern of the int4 dequantisation
  o[11] = prmt(a, b, c & 0x7777u);  // == __byte_perm
}

uint32_t host_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint8_t bytes[8] = {uint8_t(a), uint8_t(a >> 8), uint8_t(a >> 16), uint8_t(a >> 24),
                            uint8_t(b), uint8_t(b >> 8), uint8_t(b >> 16), uint8_t(b >> 24)};
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 0xF;
    const uint8_t v = bytes[s & 7];
    const uint8_t r = (s & 8) ? ((v & 0x80) ? 0xFF : 0x00) : v;
    d |= uint32_t(r) << (8 * i);
  }
  return d;
}

bool test_bit_ops() {
  std::mt19937 rng(7);
  std::vector<uint32_t> in(3 * kBitCases);
  for (auto& x : in) x = rng();
  in[0] = 0xF0F0F0F0u, in[1] = 0xCCCCCCCCu, in[2] = 0xAAAAAAAAu;  // canonical operands: lop3 == LUT bytes
  DeviceBuffer<uint32_t> din(in), dout(12 * kBitCases);
  CHECK_CUDA(fastinfer::launch_kernel(bit_ops_kernel, dim3(1), dim3(kBitCases), 0, nullptr, din.ptr, dout.ptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = dout.download();
  bool ok = true;
  for (int i = 0; i < kBitCases; ++i) {
    const uint32_t a = in[3 * i], b = in[3 * i + 1], c = in[3 * i + 2];
    const uint32_t exp[12] = {(a & b) | c, a ^ b ^ c, a | (b & c), a & b & c, 0u, 0xFFFFFFFFu,
                              0u /* LUT 0x1B: e6 below */,
                              host_prmt(a, b, c), a, b, host_prmt(a, b, 0x5050u), 0u /* e11 below */};
    uint32_t e6 = 0;  // LUT 0x1B evaluated bit by bit from the table
    for (int bit = 0; bit < 32; ++bit) {
      const int idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1);
      e6 |= uint32_t((0x1B >> idx) & 1) << bit;
    }
    uint32_t e11 = 0;  // __byte_perm semantics: selector low 3 bits only
    const uint64_t v = (uint64_t(b) << 32) | a;
    for (int j = 0; j < 4; ++j) e11 |= uint32_t((v >> (8 * ((c >> (4 * j)) & 7))) & 0xFF) << (8 * j);
    for (int k = 0; k < 12; ++k) {
      const uint32_t want = k == 6 ? e6 : (k == 11 ? e11 : exp[k]);
      if (out[12 * i + k] != want) {
        ok = false;
        EXPECT(false, "bit op %d case %d: got %08x want %08x", k, i, out[12 * i + k], want);
      }
    }
  }
  // Truth tables on the canonical operands.
  EXPECT((out[0] & 0xFF) == 0xEA && (out[1] & 0xFF) == 0x96 && (out[6] & 0xFF) == 0x1B, "lop3 LUT bytes");
  std::printf("lop3/prmt: %s\n", ok ? "ok" : "MISMATCH");
  return ok;
}

// ---- packed layout on the host ----------------------------------------------------------------
std::vector<uint32_t> host_pack(const std::vector<uint8_t>& q, int N, int K) {
  std::vector<uint32_t> packed(static_cast<size_t>(N) * K / 8, 0u);
  const int n_tiles = N / 16;
  for (int kt = 0; kt < K / 64; ++kt)
    for (int nt = 0; nt < n_tiles; ++nt)
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          const int g = lane / 4, t = lane % 4, k0 = 64 * kt + 16 * j, n0 = 16 * nt;
          const int nk[8][2] = {{n0 + g, k0 + 2 * t},         {n0 + g, k0 + 2 * t + 8},
                                {n0 + 8 + g, k0 + 2 * t},     {n0 + 8 + g, k0 + 2 * t + 8},
                                {n0 + g, k0 + 2 * t + 1},     {n0 + g, k0 + 2 * t + 9},
                                {n0 + 8 + g, k0 + 2 * t + 1}, {n0 + 8 + g, k0 + 2 * t + 9}};
          uint32_t w = 0;
          for (int i = 0; i < 8; ++i) w |= uint32_t(q[size_t(nk[i][0]) * K + nk[i][1]] & 0xF) << (4 * i);
          packed[(size_t(kt) * n_tiles + nt) * 128 + 4 * lane + j] = w;
        }
  return packed;
}

template <typename T>
bool run_case(DType dtype, int M, int N, int K, int G, bool zp, int splits, uint64_t seed, Checksum& cs) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  std::uniform_int_distribution<int> nib(0, 15);
  std::vector<uint8_t> q(size_t(N) * K), zeros(size_t(K / G) * N);
  for (auto& x : q) x = uint8_t(nib(rng));
  for (auto& x : zeros) x = uint8_t(nib(rng));
  std::vector<T> a(size_t(M) * K), scales(size_t(K / G) * N);
  for (auto& x : a) x = kt_from_float<T>(uni(rng));
  for (auto& x : scales) x = kt_from_float<T>(0.01f + 0.05f * std::fabs(uni(rng)));
  // Host dequantisation with the kernel's rounding: (q - z) * s rounded once to T.
  std::vector<T> w(size_t(N) * K);
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const int z = zp ? zeros[size_t(k / G) * N + n] : 8;
      w[size_t(n) * K + k] = kt_from_float<T>(float(int(q[size_t(n) * K + k]) - z) *
                                              kt_to_float(scales[size_t(k / G) * N + n]));
    }
  const auto packed = host_pack(q, N, K);
  DeviceBuffer<uint32_t> dpacked(packed);
  DeviceBuffer<T> da(a), dscales(scales), dout(size_t(M) * N), dw(size_t(N) * K);
  DeviceBuffer<uint8_t> dzeros(zeros);
  bool ok = true;

  Int4DequantizeParams dq;
  dq.packed = dpacked.ptr;
  dq.scales = dscales.ptr;
  dq.zeros = zp ? dzeros.ptr : nullptr;
  dq.w = dw.ptr;
  dq.n = N;
  dq.k = K;
  dq.group_size = G;
  dq.dtype = dtype;
  CHECK_CUDA(fastinfer::launch_int4_dequantize(dq, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto wd = dw.download();
  size_t bad = 0;
  for (size_t i = 0; i < w.size(); ++i) bad += std::memcmp(&wd[i], &w[i], sizeof(T)) != 0;
  EXPECT(bad == 0, "dequantize: %zu of %zu weights differ bitwise", bad, w.size());
  ok &= bad == 0;

  Int4GemmParams p;
  p.a = da.ptr;
  p.packed = dpacked.ptr;
  p.scales = dscales.ptr;
  p.zeros = zp ? dzeros.ptr : nullptr;
  p.out = dout.ptr;
  p.m = M;
  p.n = N;
  p.k = K;
  p.group_size = G;
  p.a_row_stride = K;
  p.out_row_stride = N;
  p.dtype = dtype;
  p.num_splits = splits;
  const size_t ws_bytes = fastinfer::int4_gemm_workspace_size(p);
  const size_t ncount = fastinfer::int4_gemm_num_counters(p);
  DeviceBuffer<float> ws(ws_bytes / 4 + 4);
  DeviceBuffer<int32_t> counters(ncount);
  p.workspace = ws.ptr;
  p.counters = counters.ptr;
  std::vector<T> poison(size_t(M) * N, kt_from_float<T>(NAN));
  dout.upload(poison);
  CHECK_CUDA(fastinfer::launch_int4_gemm(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto out = dout.download();
  const auto cnt = counters.download();
  for (size_t i = 0; i < ncount; ++i) EXPECT(cnt[i] == 0, "counter %zu left at %d", i, cnt[i]);
  double err2 = 0, ref2 = 0, max_err = 0, max_ref = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += double(kt_to_float(a[size_t(m) * K + k])) * kt_to_float(w[size_t(n) * K + k]);
      const double o = kt_to_float(out[size_t(m) * N + n]);
      if (!std::isfinite(o)) {
        ok = false;
        EXPECT(false, "out[%d][%d] not finite (unwritten?)", m, n);
        continue;
      }
      err2 += (o - ref) * (o - ref);
      ref2 += ref * ref;
      max_err = std::max(max_err, std::fabs(o - ref));
      max_ref = std::max(max_ref, std::fabs(ref));
    }
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-300));
  // One rounding of the fp32 sum to T: <= 2^-8 (bf16) / 2^-11 (fp16) relative, plus fp32 error.
  const double tol = std::is_same_v<T, __half> ? 1e-3 : 6e-3;
  const bool case_ok = rel <= tol && max_err <= 2 * tol * max_ref;
  EXPECT(case_ok, "gemm rel %.3e max_err %.3e", rel, max_err);
  ok &= case_ok;
  cs.add(out.data(), out.size() * sizeof(T));
  std::printf("int4 %s M=%d N=%d K=%d G=%d %s splits=%d: rel %.2e %s\n", fastinfer::dtype_name(dtype), M, N, K, G,
              zp ? "zp" : "sym", splits, rel, ok ? "ok" : "MISMATCH");
  return ok;
}

int main() {
  bool ok = test_bit_ops();
  Checksum cs;
  ok &= run_case<__nv_bfloat16>(DType::kBFloat16, 1, 144, 256, 128, false, 1, 1, cs);   // partial CTA columns
  ok &= run_case<__half>(DType::kFloat16, 3, 128, 192, 32, true, 3, 2, cs);            // split-K, two groups per unit
  ok &= run_case<__nv_bfloat16>(DType::kBFloat16, 33, 32, 128, 64, true, 2, 3, cs);    // BM 64, partial rows
  ok &= run_case<__half>(DType::kFloat16, 20, 48, 320, 64, false, 4, 4, cs);          // BM 32, uneven split units
  ok &= run_case<__nv_bfloat16>(DType::kBFloat16, 5, 272, 640, 32, true, 7, 5, cs);   // 7 requested -> 5 splits of 2 units
  // Split heuristic on an H100-sized GPU (132 SMs): ~2 CTAs per SM at decode sizes (M=1 4096x4096:
  // 9 requested, 8 after removing empty splits), never an empty split, none when the tiles alone
  // fill the GPU; M=256 (4 row blocks of 64) still gets 3 (capped by K / (16 * 64) = 4).
  auto splits_for = [](int64_t m, int n, int k) {
    Int4GemmParams q;
    q.m = m;
    q.n = n;
    q.k = k;
    q.group_size = 128;
    return fastinfer::int4_gemm_num_splits(q, 132);
  };
  EXPECT(splits_for(1, 4096, 4096) == 8, "M=1 4096x4096: %d splits", splits_for(1, 4096, 4096));
  EXPECT(splits_for(64, 4096, 4096) == 4, "M=64 4096x4096: %d splits", splits_for(64, 4096, 4096));
  EXPECT(splits_for(1, 57344, 8192) == 1, "M=1 57344x8192: %d splits", splits_for(1, 57344, 8192));
  EXPECT(splits_for(256, 4096, 4096) == 3, "M=256: %d splits", splits_for(256, 4096, 4096));
  for (int k : {64, 128, 192, 4096, 14336})
    for (int64_t m : {1, 3, 16, 40, 64})
      for (int n : {16, 4096}) {
        const int s = splits_for(m, n, k), units = k / 64;
        const int ups = (units + s - 1) / s;
        EXPECT(s >= 1 && s <= units && (s - 1) * ups < units, "splits %d for M=%lld N=%d K=%d", s,
                  static_cast<long long>(m), n, k);
      }
  // Invalid parameters are refused, not launched.
  Int4GemmParams bad;
  bad.m = 1;
  bad.n = 24;  // not a multiple of 16
  bad.k = 64;
  EXPECT(fastinfer::launch_int4_gemm(bad, nullptr) == cudaErrorInvalidValue, "bad n accepted");
  std::printf("checksum 0x%016llx\n", static_cast<unsigned long long>(cs.h));
  std::printf("int4_gemm: %s\n", ok && g_failures == 0 ? "OK" : "FAILED");
  return ok && g_failures == 0 ? 0 : 1;
}
