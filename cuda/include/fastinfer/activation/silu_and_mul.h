#pragma once
// Gated activation launcher (torch-free C++ API): out[r, i] = silu(x[r, i]) * x[r, F + i].
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct SiluAndMulParams {
  void* out = nullptr;      // [num_rows, F], row stride out_row_stride
  const void* x = nullptr;  // [num_rows, 2F], row stride x_row_stride: gate then up
  int64_t num_rows = 0;
  int64_t width = 0;        // F
  int64_t x_row_stride = 0;
  int64_t out_row_stride = 0;
  DType dtype = DType::kBFloat16;  // float16 or bfloat16
};

cudaError_t launch_silu_and_mul(const SiluAndMulParams& params, cudaStream_t stream);

}  // namespace fastinfer
