#pragma once
// RMSNorm launchers (torch-free C++ API).
//   rms_norm:            out = x * rsqrt(mean(x^2) + eps) * weight            (fp32 inside; no weight: ones)
//   fused_add_rms_norm:  residual <- x + residual;  x <- rms_norm(residual)   (in place)
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct RmsNormParams {
  void* out = nullptr;           // [num_rows, hidden], row stride out_row_stride
  const void* x = nullptr;       // [num_rows, hidden], row stride x_row_stride
  const void* weight = nullptr;  // [hidden], or null: no weight (ones)
  int64_t num_rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;      // elements
  int64_t out_row_stride = 0;    // elements
  float eps = 1e-6f;
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
  DType dtype = DType::kBFloat16;
};

cudaError_t launch_rms_norm(const RmsNormParams& params, cudaStream_t stream);
cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& params, cudaStream_t stream);

}  // namespace fastinfer
