#pragma once
// The CPU batch-invariant GEMM (gemm_dense/cpu.cpp), shared by dense_mm and the deterministic mode of
// fp8_scaled_mm: a row's result is bitwise independent of M and of the other rows.
#include "common.h"

namespace fastinfer::binding {

// out[M, N] = a[M, K] @ b[N, K]^T in float32 (a, b contiguous float32 / float16 / bfloat16, any mix).
// Each element is the same fixed sequence of fp32 fma (8 lanes over k = l, l + 8, ..., then a
// pairwise sum of the lanes), whatever M, the element's row or column, or the thread count.
Tensor batch_invariant_mm_f32(const Tensor& a, const Tensor& b);

}  // namespace fastinfer::binding
