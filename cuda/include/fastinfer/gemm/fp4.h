#pragma once
// FP4 W4A16 GEMM (torch-free C++ API): out[M, N] = a[M, K] @ W^T / global_scale, W[n][k] =
// e2m1(code[n][k]) * s, s the group scale (bits scales[k / G][n]) converted to the activation dtype
// T: NVFP4 e4m3 (G = 16; exact in fp16 and bf16) or MXFP4 e8m0 2^(e - 127) (G = 32; exact in bf16,
// rounded to fp16 outside its range; 255, the MX NaN, decodes to NaN). e2m1 * s is rounded to T
// (exact for NVFP4: at most 6 significant bits), the products accumulated in fp32, the sum
// divided by *global_scale (NVFP4; 1 when global_scale == nullptr) in fp32 and rounded once.
//
// Packed weight layout: int4_pack's (gemm/int4.h) with the 4-bit e2m1 codes as the nibbles (code
// bits s e1 e0 m: sign in bit 3). So a unit is 64 (k) x 16 (n), word 4 * lane + j holds the codes a
// lane turns into the two mma.m16n8k16 B fragments of k16 step j, and (word >> 4 i) holds in bits
// 0..3 and 16..19 the two codes of b register i. With NVFP4 each k16 step is one scale group.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"
#include "fastinfer/gemm/int4.h"

namespace fastinfer {

enum class Fp4Format : int32_t {
  kNvfp4 = 0,  // e4m3 scale per 16 input features, optional fp32 global divisor
  kMxfp4 = 1,  // e8m0 scale per 32 input features
};

constexpr int32_t fp4_group_size(Fp4Format f) { return f == Fp4Format::kNvfp4 ? 16 : 32; }

struct Fp4GemmParams {
  const void* a = nullptr;              // [M, K] row-major (row stride a_row_stride elements), fp16/bf16
  const uint32_t* packed = nullptr;     // [K / 64, 8 N] words (layout above)
  const uint8_t* scales = nullptr;      // [K / G, N] scale bits
  const float* global_scale = nullptr;  // [1] (NVFP4) or nullptr
  void* out = nullptr;                  // [M, N] (row stride out_row_stride elements), the dtype of a

  int64_t m = 0;
  int32_t n = 0;                        // multiple of 16
  int32_t k = 0;                        // multiple of 64
  int64_t a_row_stride = 0;             // multiple of 8, a 16-byte aligned
  int64_t out_row_stride = 0;           // even

  // Split-K exactly as int4_gemm's (same counts, same workspace and counters; gemm/int4.h).
  int32_t num_splits = 1;
  void* workspace = nullptr;            // fp4_gemm_workspace_size(params) bytes (num_splits > 1)
  int32_t* counters = nullptr;          // fp4_gemm_num_counters(params) int32, ZERO on entry; left zero
  Fp4Format format = Fp4Format::kNvfp4;
  DType dtype = DType::kBFloat16;       // a, out: float16 or bfloat16
};

// int4_gemm's split-K rule for the same (M, N, K) (the 4-bit weight streams are the same size).
int32_t fp4_gemm_num_splits(const Fp4GemmParams& params, int32_t num_sms);
// Batch-invariant split count: int4_gemm_deterministic_num_splits(N, K).
int32_t fp4_gemm_deterministic_num_splits(int32_t n, int32_t k);
size_t fp4_gemm_workspace_size(const Fp4GemmParams& params);
size_t fp4_gemm_num_counters(const Fp4GemmParams& params);
cudaError_t launch_fp4_gemm(const Fp4GemmParams& params, cudaStream_t stream);

}  // namespace fastinfer
