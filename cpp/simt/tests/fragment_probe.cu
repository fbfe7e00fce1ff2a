// Fragment-ownership probe for ldmatrix and mma.sync. Builds with nvcc (real GPU) and with the simt
// runner (`python -m fastinfer.simt run cpp/simt/tests/fragment_probe.cu`); prints a stable text
// table to stdout so the two outputs can be diffed, and checks the PTX ISA layouts documented in
// fastinfer/common/ptx.cuh (exit 1 on any mismatch).
//
//   ldmatrix lines: lane L, register i -> (matrix, row, col) of its low and high 16-bit halves.
//   mma lines: experiment "B one-hot": A holds a distinct code per (lane, slot), B is zero except one
//   element = 1 in (lane Lb, slot sb); every non-zero D element is printed as D[lane.reg]=A(lane.slot).
#include <fastinfer/common/launch.cuh>
#include <fastinfer/common/ptx.cuh>

#include <cstdio>
#include <cstring>
#include <vector>

#include "check.h"

using namespace fastinfer;


__global__ void probe_ldmatrix(uint32_t* out) {  // out[6][32][4]
  __shared__ __align__(16) uint16_t s[256];
  const int l = threadIdx.x;
  for (int i = l; i < 256; i += 32) s[i] = static_cast<uint16_t>(i);  // code = matrix*64 + row*8 + col
  __syncthreads();
  const void* addr = s + l * 8;  // lane l: row l%8 of matrix l/8
  uint32_t r[6][4] = {};
  ptx::ldmatrix_x1(r[0], addr);
  ptx::ldmatrix_x2(r[1], addr);
  ptx::ldmatrix_x4(r[2], addr);
  ptx::ldmatrix_x1_trans(r[3], addr);
  ptx::ldmatrix_x2_trans(r[4], addr);
  ptx::ldmatrix_x4_trans(r[5], addr);
  for (int v = 0; v < 6; ++v)
    for (int i = 0; i < 4; ++i) out[(v * 32 + l) * 4 + i] = r[v][i];
}

__device__ uint32_t half_bits(float x, bool bf16) {
  uint16_t u;
  if (bf16) {
    __nv_bfloat16 h = __float2bfloat16(x);
    memcpy(&u, &h, 2);
  } else {
    __half h = __float2half(x);
    memcpy(&u, &h, 2);
  }
  return u;
}

// kind 0 f16, 1 bf16: runs 0..127 B one-hot, run 128: A = B = 0, C = code -> D.
// kind 2 e4m3: runs p*256 + q, pass p = 0 (A byte codes the lane) / 1 (codes the slot).
template <int KIND>
__global__ void probe_mma(float* out, int runs) {
  const int l = threadIdx.x;
  for (int q = 0; q < runs; ++q) {
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
    if (KIND < 2) {
      if (q < 128) {
        for (int s = 0; s < 8; ++s) a[s / 2] |= half_bits(static_cast<float>(l * 8 + s + 1), KIND == 1) << (16 * (s % 2));
        if (l == q / 4) b[(q % 4) / 2] = half_bits(1.0f, KIND == 1) << (16 * (q % 2));
      } else {
        for (int i = 0; i < 4; ++i) c[i] = static_cast<float>(l * 4 + i);
      }
      if (KIND == 0) ptx::mma_m16n8k16_f16(d, a, b, c);
      else ptx::mma_m16n8k16_bf16(d, a, b, c);
    } else {
      const int p = q / 256, qq = q % 256;
      for (int s = 0; s < 16; ++s) a[s / 4] |= static_cast<uint32_t>(0x38 + (p == 0 ? l : s)) << (8 * (s % 4));
      if (l == qq / 8) b[(qq % 8) / 4] = 0x38u << (8 * (qq % 4));
      ptx::mma_m16n8k32_e4m3(d, a, b, c);
    }
    for (int i = 0; i < 4; ++i) out[(q * 32 + l) * 4 + i] = d[i];
  }
}

// s8 (mma.m16n8k32.s8.s8.s32): runs p*256 + q as for e4m3, with signed codes: pass 0 A byte =
// -(lane + 1), B one-hot +1; pass 1 A byte = slot + 1, B one-hot -1 (D = the A code times the one,
// so both operands' signs are checked); run 512: A = B = 0, C = -(code + 1) -> D.
__global__ void probe_mma_s8(int32_t* out) {
  const int l = threadIdx.x;
  for (int q = 0; q < 513; ++q) {
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    int32_t c[4] = {0, 0, 0, 0}, d[4];
    if (q < 512) {
      const int p = q / 256, qq = q % 256;
      for (int s = 0; s < 16; ++s)
        a[s / 4] |= (static_cast<uint32_t>(p == 0 ? -(l + 1) : s + 1) & 0xffu) << (8 * (s % 4));
      if (l == qq / 8) b[(qq % 8) / 4] = (p == 0 ? 0x01u : 0xffu) << (8 * (qq % 4));
    } else {
      for (int i = 0; i < 4; ++i) c[i] = -(l * 4 + i) - 1;
    }
    ptx::mma_m16n8k32_s8(d, a, b, c);
    for (int i = 0; i < 4; ++i) out[(q * 32 + l) * 4 + i] = d[i];
  }
}

static int failures = 0;
static void expect(bool ok, const char* what, int a, int b, int c) {
  if (!ok && failures++ < 20) std::printf("LAYOUT MISMATCH: %s (%d %d %d)\n", what, a, b, c);
}

int main() {
  std::printf("# fastinfer fragment probe v1\n");
  // ---- ldmatrix ----
  uint32_t* d_ld;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_ld), 6 * 32 * 4 * 4));
  CHECK_CUDA(launch_kernel(probe_ldmatrix, dim3(1), dim3(32), 0, nullptr, d_ld));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint32_t> ld(6 * 32 * 4);
  CHECK_CUDA(cudaMemcpy(ld.data(), d_ld, ld.size() * 4, cudaMemcpyDeviceToHost));
  const char* names[6] = {"x1", "x2", "x4", "x1.trans", "x2.trans", "x4.trans"};
  const int nums[6] = {1, 2, 4, 1, 2, 4};
  for (int v = 0; v < 6; ++v) {
    for (int l = 0; l < 32; ++l) {
      std::printf("ldmatrix.%s lane %2d:", names[v], l);
      for (int i = 0; i < nums[v]; ++i) {
        uint32_t r = ld[(v * 32 + l) * 4 + i];
        int lo = r & 0xffff, hi = r >> 16;
        std::printf(" r%d=m%d[%d][%d],m%d[%d][%d]", i, lo / 64, lo / 8 % 8, lo % 8, hi / 64, hi / 8 % 8, hi % 8);
        bool trans = v >= 3;
        int elo = trans ? i * 64 + (2 * (l % 4)) * 8 + l / 4 : i * 64 + (l / 4) * 8 + 2 * (l % 4);
        int ehi = trans ? elo + 8 : elo + 1;
        expect(lo == elo && hi == ehi, names[v], l, i, lo);
      }
      std::printf("\n");
    }
  }
  // ---- mma f16 / bf16 ----
  float* d_mma;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_mma), 512 * 32 * 4 * 4));
  std::vector<float> mo(512 * 32 * 4);
  for (int kind = 0; kind < 2; ++kind) {
    const char* kname = kind == 0 ? "mma.m16n8k16.f16" : "mma.m16n8k16.bf16";
    if (kind == 0) CHECK_CUDA(launch_kernel(probe_mma<0>, dim3(1), dim3(32), 0, nullptr, d_mma, 129));
    else CHECK_CUDA(launch_kernel(probe_mma<1>, dim3(1), dim3(32), 0, nullptr, d_mma, 129));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(mo.data(), d_mma, 129 * 32 * 4 * 4, cudaMemcpyDeviceToHost));
    for (int q = 0; q < 128; ++q) {
      const int lb = q / 4, sb = q % 4;
      std::printf("%s B(L%d.h%d):", kname, lb, sb);
      const int kb = 2 * (lb % 4) + (sb % 2) + 8 * (sb / 2), nb = lb / 4;
      int nz = 0;
      for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
          float x = mo[(q * 32 + l) * 4 + i];
          if (x == 0.f) continue;
          ++nz;
          int code = static_cast<int>(x) - 1;
          std::printf(" D[L%d.d%d]=A(L%d.h%d)", l, i, code / 8, code % 8);
          const int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + (i % 2);
          const int al = (m % 8) * 4 + (kb % 8) / 2, as = 2 * ((m >= 8) + 2 * (kb >= 8)) + kb % 2;
          expect(n == nb && code == al * 8 + as, kname, q, l, i);
        }
      expect(nz == 16, "mma nonzero count", q, nz, 0);
      std::printf("\n");
    }
    bool ident = true;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) ident = ident && mo[(128 * 32 + l) * 4 + i] == static_cast<float>(l * 4 + i);
    std::printf("%s C->D identity: %s\n", kname, ident ? "yes" : "no");
    expect(ident, "C->D", kind, 0, 0);
  }
  // ---- mma e4m3 ----
  {
    const char* kname = "mma.m16n8k32.e4m3";
    float vals[32];
    for (int i = 0; i < 32; ++i) {
      __nv_fp8_e4m3 v;
      v.__x = static_cast<__nv_fp8_storage_t>(0x38 + i);
      vals[i] = static_cast<float>(v);
    }
    auto decode = [&](float x) {
      for (int i = 0; i < 32; ++i)
        if (vals[i] == x) return i;
      return -1;
    };
    CHECK_CUDA(launch_kernel(probe_mma<2>, dim3(1), dim3(32), 0, nullptr, d_mma, 512));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(mo.data(), d_mma, 512 * 32 * 4 * 4, cudaMemcpyDeviceToHost));
    for (int q = 0; q < 256; ++q) {
      const int lb = q / 8, sb = q % 8;
      std::printf("%s B(L%d.b%d):", kname, lb, sb);
      const int kb = 4 * (lb % 4) + (sb % 4) + 16 * (sb / 4), nb = lb / 4;
      int nz = 0;
      for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
          float x0 = mo[(q * 32 + l) * 4 + i], x1 = mo[((256 + q) * 32 + l) * 4 + i];
          if (x0 == 0.f && x1 == 0.f) continue;
          ++nz;
          int al = decode(x0), as = decode(x1);
          std::printf(" D[L%d.d%d]=A(L%d.b%d)", l, i, al, as);
          const int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + (i % 2);
          const int el = (m % 8) * 4 + (kb % 16) / 4, es = 4 * ((m >= 8) + 2 * (kb >= 16)) + kb % 4;
          expect(n == nb && al == el && as == es, kname, q, l, i);
        }
      expect(nz == 16, "mma nonzero count", q, nz, 1);
      std::printf("\n");
    }
  }
  // ---- mma s8 ----
  {
    const char* kname = "mma.m16n8k32.s8";
    int32_t* d_s8;
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_s8), 513 * 32 * 4 * 4));
    std::vector<int32_t> so(513 * 32 * 4);
    CHECK_CUDA(launch_kernel(probe_mma_s8, dim3(1), dim3(32), 0, nullptr, d_s8));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(so.data(), d_s8, 513 * 32 * 4 * 4, cudaMemcpyDeviceToHost));
    cudaFree(d_s8);
    for (int q = 0; q < 256; ++q) {
      const int lb = q / 8, sb = q % 8;
      std::printf("%s B(L%d.b%d):", kname, lb, sb);
      const int kb = 4 * (lb % 4) + (sb % 4) + 16 * (sb / 4), nb = lb / 4;
      int nz = 0;
      for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) {
          const int32_t x0 = so[(q * 32 + l) * 4 + i], x1 = so[((256 + q) * 32 + l) * 4 + i];
          if (x0 == 0 && x1 == 0) continue;
          ++nz;
          const int al = -x0 - 1, as = -x1 - 1;
          std::printf(" D[L%d.d%d]=A(L%d.b%d)", l, i, al, as);
          const int m = l / 4 + 8 * (i / 2), n = 2 * (l % 4) + (i % 2);
          const int el = (m % 8) * 4 + (kb % 16) / 4, es = 4 * ((m >= 8) + 2 * (kb >= 16)) + kb % 4;
          expect(n == nb && al == el && as == es, kname, q, l, i);
        }
      expect(nz == 16, "mma nonzero count", q, nz, 3);
      std::printf("\n");
    }
    bool ident = true;
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i) ident = ident && so[(512 * 32 + l) * 4 + i] == -(l * 4 + i) - 1;
    std::printf("%s C->D identity: %s\n", kname, ident ? "yes" : "no");
    expect(ident, "s8 C->D", 3, 0, 0);
  }
  cudaFree(d_ld);
  cudaFree(d_mma);
  std::printf("documented-layout check: %s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
