// Warp-level GEMM C[M,N] = A[M,K] * B[K,N] with cp.async (2-stage pipeline) -> dynamic shared
// memory -> ldmatrix -> mma.sync, for bf16 (B as [N,K], ldmatrix_x2), f16 (B as [K,N],
// ldmatrix_x2_trans) and e4m3 (B as [N,K], 8-bit K pairs loaded as b16). A shuffle reduction and a
// ballot verify on the device; the program exits 0 only if C equals a host matmul exactly.
#include <fastinfer/common/ptx.cuh>
#include <fastinfer/common/smem.cuh>

#include <cstring>
#include <vector>

#include "common.cuh"

using namespace fastinfer;

constexpr int M = 32, N = 16, K = 64;  // 2 warps (16 rows each) x 2 n-tiles x 4 k-steps
constexpr int KT = 16;                 // k elements per stage (per mma for 16-bit types)

// KIND 0: bf16, B stored [N][K]; 1: f16, B stored [K][N]; 2: e4m3 (K bytes), B stored [N][K]
template <int KIND>
__global__ void warp_gemm(const uint8_t* A, const uint8_t* B, float* C, const float* Cref, int* ok_warps) {
  constexpr int ES = KIND == 2 ? 1 : 2;            // element size
  constexpr int KS = KIND == 2 ? 32 : 16;          // k per mma
  constexpr int ROWB = KS * ES;                    // bytes per smem row chunk = 32
  constexpr int A_STAGE = M * ROWB;                // 1024 bytes
  constexpr int B_STAGE = KIND == 1 ? KS * N * ES : N * ROWB;  // 512 bytes
  uint8_t* smem = dynamic_smem<uint8_t>();
  uint8_t* sA[2] = {smem, smem + A_STAGE};
  uint8_t* sB[2] = {smem + 2 * A_STAGE, smem + 2 * A_STAGE + B_STAGE};
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int steps = K / KS;

  auto load_stage = [&](int stage, int ks) {
    // A tile: M rows x ROWB bytes = 64 chunks of 16 bytes; 64 threads -> one chunk each
    for (int c = tid; c < M * ROWB / 16; c += blockDim.x) {
      int row = c / (ROWB / 16), col = c % (ROWB / 16);
      ptx::cp_async_cg_16(sA[stage] + row * ROWB + col * 16, A + (size_t)row * K * ES + ks * ROWB + col * 16);
    }
    if (KIND == 1) {  // B [K][N]: rows k = ks*16 .. +15, N*2 = 32 bytes each
      for (int c = tid; c < KS * N * ES / 16; c += blockDim.x) {
        int row = c / (N * ES / 16), col = c % (N * ES / 16);
        ptx::cp_async_cg_16(sB[stage] + row * N * ES + col * 16, B + ((size_t)(ks * KS + row) * N) * ES + col * 16);
      }
    } else {  // B [N][K]: rows n, ROWB bytes of k each
      for (int c = tid; c < N * ROWB / 16; c += blockDim.x) {
        int row = c / (ROWB / 16), col = c % (ROWB / 16);
        ptx::cp_async_cg_16(sB[stage] + row * ROWB + col * 16, B + (size_t)row * K * ES + ks * ROWB + col * 16);
      }
    }
    ptx::cp_async_commit();
  };

  float acc[2][4] = {};
  load_stage(0, 0);
  for (int ks = 0; ks < steps; ++ks) {
    if (ks + 1 < steps) {
      load_stage((ks + 1) & 1, ks + 1);
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    const uint8_t* a_s = sA[ks & 1];
    const uint8_t* b_s = sB[ks & 1];
    uint32_t a[4];
    {
      const int mat = lane / 8, r = lane % 8;
      const int row = warp * 16 + r + 8 * (mat % 2), colb = 16 * (mat / 2);
      ptx::ldmatrix_x4(a, a_s + row * ROWB + colb);
    }
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t b[2];
      if (KIND == 1) {
        const int l = lane % 16;  // lanes 0-7: k rows 0-7, 8-15: k rows 8-15
        ptx::ldmatrix_x2_trans(b, b_s + l * N * ES + nt * 8 * ES);
      } else {
        const int l = lane % 16, n = nt * 8 + l % 8, colb = 16 * (l / 8);
        ptx::ldmatrix_x2(b, b_s + n * ROWB + colb);
      }
      if (KIND == 0) ptx::mma_m16n8k16_bf16(acc[nt], a, b, acc[nt]);
      else if (KIND == 1) ptx::mma_m16n8k16_f16(acc[nt], a, b, acc[nt]);
      else ptx::mma_m16n8k32_e4m3(acc[nt], a, b, acc[nt]);
    }
    __syncthreads();  // the next iteration's cp.async overwrites this stage
  }
  // store C and check against the reference on the device
  const int g = lane / 4, t = lane % 4;
  int bad = 0;
  float local = 0.f;
  for (int nt = 0; nt < 2; ++nt)
    for (int i = 0; i < 4; ++i) {
      const int m = warp * 16 + g + 8 * (i / 2), n = nt * 8 + 2 * t + (i % 2);
      C[m * N + n] = acc[nt][i];
      bad += acc[nt][i] != Cref[m * N + n];
      local += acc[nt][i];
    }
  for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(0xffffffffu, local, o);
  const unsigned good = __ballot_sync(0xffffffffu, bad == 0);
  if (lane == 0) ok_warps[warp] = good == 0xffffffffu ? (int)local : -1000000;
}

template <typename T>
static uint16_t bits16(T v) {
  uint16_t u;
  std::memcpy(&u, static_cast<const void*>(&v), 2);
  return u;
}

template <int KIND>
static int run() {
  const int ES = KIND == 2 ? 1 : 2;
  std::vector<float> a(M * K), b(K * N), c(M * N, 0.f);
  for (int i = 0; i < M * K; ++i) a[i] = (float)((i * 7 + i / 9) % 7 - 2);
  for (int i = 0; i < K * N; ++i) b[i] = (float)((i * 5 + 1) % 5 - 2) * (KIND == 2 ? 0.5f : 1.f);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n)
      for (int k = 0; k < K; ++k) c[m * N + n] += a[m * K + k] * b[k * N + n];
  std::vector<uint8_t> ha(M * K * ES), hb(K * N * ES);
  auto enc = [&](float x, uint8_t* dst) {
    if (KIND == 0) { uint16_t u = bits16(__float2bfloat16(x)); std::memcpy(dst, &u, 2); }
    else if (KIND == 1) { uint16_t u = bits16(__float2half(x)); std::memcpy(dst, &u, 2); }
    else { __nv_fp8_e4m3 v(x); std::memcpy(dst, &v, 1); }
  };
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) enc(a[m * K + k], &ha[(m * K + k) * ES]);
  for (int k = 0; k < K; ++k)
    for (int n = 0; n < N; ++n) enc(b[k * N + n], KIND == 1 ? &hb[(k * N + n) * ES] : &hb[(n * K + k) * ES]);
  uint8_t *dA = dalloc<uint8_t>(ha.size()), *dB = dalloc<uint8_t>(hb.size());
  float *dC = dalloc<float>(M * N), *dRef = dalloc<float>(M * N);
  int* ok = dalloc<int>(2);
  CHECK_CUDA(cudaMemcpy(dA, ha.data(), ha.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dB, hb.data(), hb.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dRef, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
  const size_t smem = 2 * (M * 32) + 2 * 512;
  CHECK_CUDA(launch_kernel(warp_gemm<KIND>, dim3(1), dim3(64), smem, nullptr, dA, dB, dC, dRef, ok));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> hc(M * N);
  CHECK_CUDA(cudaMemcpy(hc.data(), dC, hc.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int i = 0; i < M * N; ++i) bad += hc[i] != c[i];
  float s0 = 0, s1 = 0;
  for (int i = 0; i < M * N; ++i) (i / N < 16 ? s0 : s1) += c[i];
  const char* names[3] = {"bf16", "f16", "e4m3"};
  const bool pass = bad == 0 && ok[0] == (int)s0 && ok[1] == (int)s1;
  std::printf("warp_gemm %s: %d mismatches, device check %d/%d vs %d/%d: %s\n", names[KIND], bad, ok[0], ok[1], (int)s0,
              (int)s1, pass ? "OK" : "FAIL");
  cudaFree(dA); cudaFree(dB); cudaFree(dC); cudaFree(dRef); cudaFree(ok);
  return pass ? 0 : 1;
}

int main() {
  int fails = run<0>() + run<1>() + run<2>();
  return fails ? 1 : 0;
}
