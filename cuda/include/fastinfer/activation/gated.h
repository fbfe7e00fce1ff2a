#pragma once
// Gated activation launchers (torch-free C++ API): out[r, i] = act(x[r, i]) * x[r, F + i], the
// gate then the up half of a fused projection. act: silu (SwiGLU, Llama) or the tanh
// approximation of gelu (GeGLU, Gemma: gelu(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a + 0.044715 a^3))),
// torch.nn.functional.gelu(approximate="tanh")).
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
cudaError_t launch_gelu_tanh_and_mul(const GatedActivationParams& params, cudaStream_t stream);

}  // namespace fastinfer
