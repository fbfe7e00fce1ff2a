#pragma once
// RMSNorm launchers (torch-free C++ API).
//   rms_norm:            out = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset)   (fp32 inside;
//                        no weight: ones; weight_offset 1 for zero-centred weights, Gemma / Qwen3.5)
//   gated rms_norm:      the same times silu(gate)  (with a gate: Gated DeltaNet's output norm)
//   fused_add_rms_norm:  residual <- x + residual;  x <- rms_norm(residual)   (in place)
//   rms_norm_quant:      codes = quantise(round(rms_norm(x)))  (e4m3 or int8; with a residual:
//                        residual <- x + residual first and the residual normalised; x not written)
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

// The codes of rms_norm_quant: e4m3 (gemm/fp8.h's rule) or symmetric int8 (gemm/int8.h's).
enum class NormQuantFormat : int32_t { kE4m3 = 0, kInt8 = 1 };

// The norm rounded to dtype, exactly as rms_norm / fused_add_rms_norm store it, then quantised as
// fp8_quantize / int8_quantize do: per tensor with given_scale, else per row (token) with scale
// max(amax, 1e-12) / 448 (e4m3) or / 127 (int8).
struct RmsNormQuantParams {
  void* out = nullptr;                 // [num_rows, hidden] codes (1 byte each), contiguous
  float* scale = nullptr;              // [num_rows] dynamic scales, or [1]: a copy of given_scale
  const float* given_scale = nullptr;  // [1] static per-tensor scale (device), or null: per-token
  const void* x = nullptr;             // [num_rows, hidden], row stride x_row_stride
  void* residual = nullptr;            // [num_rows, hidden], row stride residual_row_stride, or null
  const void* weight = nullptr;        // [hidden], or null: no weight (ones)
  int64_t num_rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;            // elements
  int64_t residual_row_stride = 0;     // elements
  float eps = 1e-6f;
  float weight_offset = 0.f;
  DType dtype = DType::kBFloat16;      // of x, residual and weight: float16 or bfloat16
  NormQuantFormat format = NormQuantFormat::kE4m3;
};

cudaError_t launch_rms_norm(const RmsNormParams& params, cudaStream_t stream);
cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& params, cudaStream_t stream);
cudaError_t launch_rms_norm_quant(const RmsNormQuantParams& params, cudaStream_t stream);

}  // namespace fastinfer
