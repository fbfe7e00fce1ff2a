#pragma once
// Activation launchers (torch-free C++ API).
// Gated: out[r, i] = act(x[r, i]) * x[r, F + i], the gate then the up half of a fused projection.
// act: silu (SwiGLU, Llama), gelu (erf: a / 2 * (1 + erf(a / sqrt 2)), torch.nn.functional.gelu)
// or gelu's tanh approximation (GeGLU, Gemma: gelu(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a +
// 0.044715 a^3))), torch.nn.functional.gelu(approximate="tanh")).
// Plain: out[r, i] = act(x[r, i]) for transformers' gelu_new, gelu_fast and quick_gelu
// (python/fastinfer/reference/elementwise.py writes each out).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct GatedActivationParams {
  void* out = nullptr;      // [num_rows, F], row stride out_row_stride
  const void* x = nullptr;  // [num_rows, 2F], row stride x_row_stride: gate then up
  int64_t num_rows = 0;
  int64_t width = 0;        // F
  int64_t x_row_stride = 0;
  int64_t out_row_stride = 0;
  DType dtype = DType::kBFloat16;  // float16 or bfloat16
};

cudaError_t launch_silu_and_mul(const GatedActivationParams& params, cudaStream_t stream);
cudaError_t launch_gelu_and_mul(const GatedActivationParams& params, cudaStream_t stream);
cudaError_t launch_gelu_tanh_and_mul(const GatedActivationParams& params, cudaStream_t stream);

enum class Activation { kGeluNew, kGeluFast, kQuickGelu };

struct ActivationParams {
  void* out = nullptr;      // [num_rows, width], row stride out_row_stride
  const void* x = nullptr;  // [num_rows, width], row stride x_row_stride
  int64_t num_rows = 0;
  int64_t width = 0;
  int64_t x_row_stride = 0;
  int64_t out_row_stride = 0;
  Activation activation = Activation::kGeluNew;
  DType dtype = DType::kBFloat16;  // float16 or bfloat16
};

cudaError_t launch_activation(const ActivationParams& params, cudaStream_t stream);

}  // namespace fastinfer
