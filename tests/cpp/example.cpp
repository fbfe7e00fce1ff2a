// Calls fastinfer's RMSNorm, SiLU-and-mul and mixture-of-experts launchers (routing, then the
// fused expert MLPs with their workspace) from plain C++ (no torch, no Python) and checks them
// against a host computation. Runs on the GPU (linked with fastinfer::kernels) or on
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

  // Mixture of experts on the same x: E experts of intermediate size I, k per token, routed by
  // moe_topk from fp32 logits, then fused_moe (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]).
  const int64_t E = 4, I = 24, k = 2;
  std::vector<float> logits(rows * E);
  for (int64_t i = 0; i < rows * E; ++i) logits[i] = std::cos(1.3f * static_cast<float>(i));
  std::vector<uint16_t> w13(E * 2 * I * hidden), w2(E * hidden * I), moe_out(rows * hidden);
  for (size_t i = 0; i < w13.size(); ++i) w13[i] = to_bf16(0.07f * std::sin(0.11f * static_cast<float>(i)));
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = to_bf16(0.2f * std::cos(0.07f * static_cast<float>(i)));
  void *d_logits, *d_topk_w, *d_topk_ids, *d_w13, *d_w2, *d_moe_out, *d_workspace;
  CHECK(cudaMalloc(&d_logits, logits.size() * sizeof(float)));
  CHECK(cudaMalloc(&d_topk_w, rows * k * sizeof(float)));
  CHECK(cudaMalloc(&d_topk_ids, rows * k * sizeof(int32_t)));
  CHECK(cudaMalloc(&d_w13, w13.size() * sizeof(uint16_t)));
  CHECK(cudaMalloc(&d_w2, w2.size() * sizeof(uint16_t)));
  CHECK(cudaMalloc(&d_moe_out, bytes));
  CHECK(cudaMemcpy(d_logits, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w13, w13.data(), w13.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_w2, w2.data(), w2.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));

  fastinfer::MoeTopkParams route;
  route.router_logits = d_logits;
  route.topk_weights = static_cast<float*>(d_topk_w);
  route.topk_ids = static_cast<int32_t*>(d_topk_ids);
  route.num_tokens = rows;
  route.num_experts = E;
  route.top_k = k;
  route.renormalize = true;
  route.logits_dtype = fastinfer::DType::kFloat32;
  CHECK(fastinfer::launch_moe_topk(route, nullptr));

  fastinfer::FusedMoeParams m;
  m.x = d_x;
  m.w13 = d_w13;
  m.w2 = d_w2;
  m.topk_weights = route.topk_weights;
  m.topk_ids = route.topk_ids;
  m.out = d_moe_out;
  m.num_tokens = rows;
  m.hidden = hidden;
  m.intermediate = I;
  m.num_experts = E;
  m.top_k = k;
  m.dtype = fastinfer::DType::kBFloat16;
  CHECK(cudaMalloc(&d_workspace, fastinfer::fused_moe_workspace_size(m)));
  m.workspace = d_workspace;
  CHECK(fastinfer::launch_fused_moe(m, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> topk_w(rows * k);
  std::vector<int32_t> topk_ids(rows * k);
  CHECK(cudaMemcpy(topk_w.data(), d_topk_w, topk_w.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(topk_ids.data(), d_topk_ids, topk_ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(moe_out.data(), d_moe_out, bytes, cudaMemcpyDeviceToHost));

  double max_err_moe = 0, max_ref_moe = 0;
  for (int64_t t = 0; t < rows; ++t) {
    std::vector<double> ref(hidden, 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = topk_ids[t * k + j];
      std::vector<double> a(I);
      for (int64_t i = 0; i < I; ++i) {
        double gate = 0, up = 0;
        for (int64_t c = 0; c < hidden; ++c) {
          gate += from_bf16(x[t * hidden + c]) * from_bf16(w13[(e * 2 * I + i) * hidden + c]);
          up += from_bf16(x[t * hidden + c]) * from_bf16(w13[(e * 2 * I + I + i) * hidden + c]);
        }
        a[i] = gate / (1 + std::exp(-gate)) * up;
      }
      for (int64_t c = 0; c < hidden; ++c) {
        double y = 0;
        for (int64_t i = 0; i < I; ++i) y += a[i] * from_bf16(w2[(e * hidden + c) * I + i]);
        ref[c] += topk_w[t * k + j] * y;
      }
    }
    for (int64_t c = 0; c < hidden; ++c) {
      max_err_moe = std::fmax(max_err_moe, std::fabs(ref[c] - from_bf16(moe_out[t * hidden + c])));
      max_ref_moe = std::fmax(max_ref_moe, std::fabs(ref[c]));
    }
  }
  for (void* ptr : {d_x, d_w, d_out, d_act, d_logits, d_topk_w, d_topk_ids, d_w13, d_w2, d_moe_out, d_workspace})
    CHECK(cudaFree(ptr));
  // bf16 keeps 8 significant bits: outputs of magnitude < 8 are within 2^-5 after one rounding; the
  // MoE output also rounds its activations to bf16 between the GEMMs (a few 2^-8 relative).
  const bool ok = max_err_norm < 0.04 && max_err_act < 0.04 && max_ref_moe > 0.1 && max_err_moe < 0.02 * max_ref_moe;
  std::printf("rms_norm max abs error %.5f, silu_and_mul max abs error %.5f, fused_moe max abs error %.5f "
              "(outputs up to %.3f): %s\n", max_err_norm, max_err_act, max_err_moe, max_ref_moe, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
