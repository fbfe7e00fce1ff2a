// Calls fastinfer's RMSNorm and SiLU-and-mul launchers from plain C++ (no torch, no Python) and
// checks them against a host computation. Runs on the GPU (linked with fastinfer::kernels) or on
// the CPU through the simt emulator (linked with fastinfer::kernels_simt): the code is the same.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fastinfer/fastinfer.h"

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define CHECK(call)                                                                      \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(err_));          \
      return 2;                                                                          \
    }                                                                                    \
  } while (0)

}  // namespace

int main() {
  const int64_t rows = 7, hidden = 200;  // odd sizes on purpose
  std::vector<uint16_t> x(rows * hidden), w(hidden), out(rows * hidden);
  for (int64_t i = 0; i < rows * hidden; ++i) x[i] = to_bf16(std::sin(0.37f * static_cast<float>(i)) * 3.0f);
  for (int64_t i = 0; i < hidden; ++i) w[i] = to_bf16(0.5f + 0.01f * static_cast<float>(i % 17));

  void *d_x, *d_w, *d_out, *d_act;
  const size_t bytes = rows * hidden * sizeof(uint16_t);
  CHECK(cudaMalloc(&d_x, bytes));
  CHECK(cudaMalloc(&d_w, hidden * sizeof(uint16_t)));
  CHECK(cudaMalloc(&d_out, bytes));
  CHECK(cudaMalloc(&d_act, bytes / 2));
  CHECK(cudaMemcpy(d_x, x.data(), bytes, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w, w.data(), hidden * sizeof(uint16_t), cudaMemcpyHostToDevice));

  fastinfer::RmsNormParams p;
  p.out = d_out;
  p.x = d_x;
  p.weight = d_w;
  p.num_rows = rows;
  p.hidden = hidden;
  p.x_row_stride = hidden;
  p.out_row_stride = hidden;
  p.eps = 1e-6f;
  p.dtype = fastinfer::DType::kBFloat16;
  CHECK(fastinfer::launch_rms_norm(p, nullptr));

  fastinfer::GatedActivationParams s;  // treats each row of x as [gate | up], F = hidden / 2
  s.out = d_act;
  s.x = d_x;
  s.num_rows = rows;
  s.width = hidden / 2;
  s.x_row_stride = hidden;
  s.out_row_stride = hidden / 2;
  s.dtype = fastinfer::DType::kBFloat16;
  CHECK(fastinfer::launch_silu_and_mul(s, nullptr));
  CHECK(cudaDeviceSynchronize());

  std::vector<uint16_t> act(rows * hidden / 2);
  CHECK(cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(act.data(), d_act, bytes / 2, cudaMemcpyDeviceToHost));

  double max_err_norm = 0, max_err_act = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < hidden; ++i) ss += std::pow(from_bf16(x[r * hidden + i]), 2);
    const double inv = 1.0 / std::sqrt(ss / hidden + 1e-6);
    for (int64_t i = 0; i < hidden; ++i) {
      const double ref = from_bf16(x[r * hidden + i]) * inv * from_bf16(w[i]);
      max_err_norm = std::fmax(max_err_norm, std::fabs(ref - from_bf16(out[r * hidden + i])));
    }
    for (int64_t i = 0; i < hidden / 2; ++i) {
      const double g = from_bf16(x[r * hidden + i]), u = from_bf16(x[r * hidden + hidden / 2 + i]);
      const double ref = g / (1 + std::exp(-g)) * u;
      max_err_act = std::fmax(max_err_act, std::fabs(ref - from_bf16(act[r * hidden / 2 + i])));
    }
  }
  CHECK(cudaFree(d_x));
  CHECK(cudaFree(d_w));
  CHECK(cudaFree(d_out));
  CHECK(cudaFree(d_act));
  // bf16 keeps 8 significant bits: outputs of magnitude < 8 are within 2^-5 after one rounding.
  const bool ok = max_err_norm < 0.04 && max_err_act < 0.04;
  std::printf("rms_norm max abs error %.5f, silu_and_mul max abs error %.5f: %s\n", max_err_norm, max_err_act,
              ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
