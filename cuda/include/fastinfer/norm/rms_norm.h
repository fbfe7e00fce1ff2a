#pragma once
// RMSNorm launchers (torch-free C++ API).
//   rms_norm:            out = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)   (fp32 inside;
//                        no weight: ones; weight_offset 1 for zero-centred weights, Gemma / Qwen3.5)
//   gated rms_norm:      the same times silu(gate)  (with a gate: Gated DeltaNet's output norm)
//   fused_add_rms_norm:  residual <- x + residual;  x <- rms_norm(residual)   (in place)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct RmsNormParams {
  void* out = nullptr;           // [num_rows, hidden], row stride out_row_stride
  const void* x = nullptr;       // [num_rows, hidden], row stride x_row_stride
  const void* weight = nullptr;  // [hidden], or null: no weight (ones)
  const void* gate = nullptr;    // [num_rows, hidden], row stride gate_row_stride, or null: no gate
  int64_t num_rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;      // elements
  int64_t out_row_stride = 0;    // elements
  int64_t gate_row_stride = 0;   // elements
  float eps = 1e-6f;
  float weight_offset = 0.f;     // added to the weight in fp32 (0 without a weight)
  DType dtype = DType::kBFloat16;  // of x, weight and out: float16 or bfloat16
};

struct FusedAddRmsNormParams {
  void* x = nullptr;             // [num_rows, hidden] in: the layer output; out: normalised
  void* residual = nullptr;      // [num_rows, hidden] in: residual stream; out: x + residual
  const void* weight = nullptr;  // [hidden], or null: no weight (ones)
  int64_t num_rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t residual_row_stride = 0;
  float eps = 1e-6f;
  float weight_offset = 0.f;
  DType dtype = DType::kBFloat16;
};

cudaError_t launch_rms_norm(const RmsNormParams& params, cudaStream_t stream);
cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& params, cudaStream_t stream);

}  // namespace fastinfer
