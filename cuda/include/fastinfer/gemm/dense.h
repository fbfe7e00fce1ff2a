#pragma once
// Dense fp16 / bf16 GEMM (torch-free C++ API): out[M, N] = a[M, K] @ b[N, K]^T (+ bias[N]), b in
// nn.Linear weight layout, fp32 accumulation, out rounded once to the dtype of a.
//
// Batch invariance: a row's result is bitwise independent of M and of the other rows. There is no
// split-K; every tile configuration (chosen by M) accumulates each output element with the same
// sequence of mma.m16n8k16 steps, k = 0, 16, 32, ... in order, into an fp32 accumulator that
// starts at 0, then adds bias[n] in fp32 and rounds once. The k-order depends only on K.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct DenseMmParams {
  const void* a = nullptr;     // [M, K] row-major (row stride K), 16-byte aligned
  const void* b = nullptr;     // [N, K] row-major (row stride K), 16-byte aligned
  const void* bias = nullptr;  // [N] the dtype, or nullptr
  void* out = nullptr;         // [M, N] row-major, 4-byte aligned when N is even (else 2)
  int64_t m = 0;
  int64_t n = 0;               // any (even: 2-element stores; odd: 1-element stores)
  int64_t k = 0;               // a multiple of 8 (16-byte cp.async chunks)
  DType dtype = DType::kBFloat16;  // a, b, bias, out: float16 or bfloat16
};

// mma.sync.m16n8k16 (sm_80+): returns cudaErrorNotSupported on an older device.
cudaError_t launch_dense_mm(const DenseMmParams& params, cudaStream_t stream);

}  // namespace fastinfer
