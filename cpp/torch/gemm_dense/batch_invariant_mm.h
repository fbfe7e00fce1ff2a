#pragma once
// The CPU batch-invariant GEMM (gemm_dense/cpu.cpp), shared by dense_mm and the deterministic mode of
// fp8_scaled_mm: a row's result is bitwise independent of M and of the other rows.
#include "common.h"

namespace fastinfer::binding {

// out[M, N] = a[M, K] @ b[N, K]^T in float32 (a, b contiguous float32 / float16 / bfloat16, any mix).
// Each element is the same fixed sequence of fp32 fma (8 lanes over k = l, l + 8, ..., then a
// pairwise sum of the lanes), whatever M, the element's row or column, or the thread count.
Tensor batch_invariant_mm_f32(const Tensor& a, const Tensor& b);

// The same product on raw rows (fused_moe's per-expert GEMMs over gathered rows): out [M, N]
// (row stride N) = a @ b^T, a fp32 [M, batch_invariant_padded_k(K)] with zeros past K, b [N, K]
// contiguous float32 / float16 / bfloat16 of dtype b_type. Bitwise the same per element.
int64_t batch_invariant_padded_k(int64_t K);
void batch_invariant_mm_f32_rows(const float* a, int64_t M, const void* b, ScalarType b_type, int64_t N, int64_t K,
                                 float* out);

}  // namespace fastinfer::binding
