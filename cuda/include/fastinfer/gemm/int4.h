#pragma once
// W4A16 GEMM (torch-free C++ API): out[M, N] = a[M, K] @ W^T with W[N, K] = (q - z) * s, q the
// 4-bit weights, s = scales[k / G][n] (the activation dtype), z = zeros[k / G][n] (uint8 0..15)
// or 8 for every weight when zeros == nullptr (symmetric). The dequantised weight is rounded to
// the activation dtype (exactly: (q - z) is a small integer, so (q - z) * s is one rounding) and
// the products are accumulated in fp32; out is rounded once at the end.
//
// Packed weight layout (what int4_pack produces): W is cut into units of 64 (k) x 16 (n); unit
// (kt, nt) covers k in [64 kt, 64 kt + 64), n in [16 nt, 16 nt + 16) and is 128 uint32 words
// stored at word offset (kt * (N / 16) + nt) * 128, so the packed tensor is int32 [K / 64, 8 N].
// Word 4 * lane + j of a unit (lane = 4 g + t, g = 0..7, t = 0..3, j = 0..3 the k16 step) holds
// the 8 nibbles a warp lane feeds to two mma.m16n8k16 B fragments (n8 tiles 0 and 1) of step j,
// with k0 = 64 kt + 16 j, n0 = 16 nt (nibble i at bits 4i..4i+3):
//   nibble 0: W[n0 + g][k0 + 2t]      nibble 4: W[n0 + g][k0 + 2t + 1]
//   nibble 1: W[n0 + g][k0 + 2t + 8]  nibble 5: W[n0 + g][k0 + 2t + 9]
//   nibble 2: W[n0 + 8 + g][k0 + 2t]      nibble 6: W[n0 + 8 + g][k0 + 2t + 1]
//   nibble 3: W[n0 + 8 + g][k0 + 2t + 8]  nibble 7: W[n0 + 8 + g][k0 + 2t + 9]
// so (word >> 4i) & 0x000F000F holds the two halves of one b register, ready for the
// lop3 magic-number conversion (fp16: 0x6400 = 1024 + q, bf16: 0x4300 = 128 + q).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

// Minimum tile of the packed layout: N % 16 == 0 and K % 64 == 0.
constexpr int32_t kInt4TileN = 16;
constexpr int32_t kInt4TileK = 64;

struct Int4GemmParams {
  const void* a = nullptr;          // [M, K] row-major (row stride a_row_stride elements), fp16/bf16
  const uint32_t* packed = nullptr;  // int4_pack layout, [K / 64, 8 N] words
  const void* scales = nullptr;     // [K / G, N], the dtype of a
  const uint8_t* zeros = nullptr;   // [K / G, N] 0..15, or nullptr (symmetric: z = 8)
  void* out = nullptr;              // [M, N] (row stride out_row_stride elements), the dtype of a

  int64_t m = 0;
  int32_t n = 0;                    // multiple of 16
  int32_t k = 0;                    // multiple of 64 and of group_size
  int32_t group_size = 128;         // multiple of 16 dividing K (16, 32, 64, 128, ..., K)
  int64_t a_row_stride = 0;         // multiple of 8, a 16-byte aligned
  int64_t out_row_stride = 0;       // even

  // Split-K: num_splits CTAs share each output tile, each reducing a contiguous range of k64
  // units into fp32 partials in `workspace`; the last CTA of a tile to finish (counted in
  // `counters`) sums the partials in split order (deterministic) and writes out.
  int32_t num_splits = 1;           // >= 1; resolve 0 with int4_gemm_num_splits first
  void* workspace = nullptr;        // int4_gemm_workspace_size(params) bytes (num_splits > 1)
  int32_t* counters = nullptr;      // int4_gemm_num_counters(params) int32, ZERO on entry; left zero
  DType dtype = DType::kBFloat16;   // a, scales, out: float16 or bfloat16
};

// Rows of a CTA tile for a given M (16, 32 or 64) and the number of output tiles.
int32_t int4_gemm_block_m(int64_t m);
// Split count that fills num_sms for the shape (1 when the tiles alone fill the GPU); bounded so
// that the fp32 partials stay small next to the weight bytes. A heuristic; not measured on a GPU.
int32_t int4_gemm_num_splits(const Int4GemmParams& params, int32_t num_sms);
// Batch-invariant split count (deterministic mode): a function of (N, K) only, never of M or the
// SM count, so a row's k-order (the units of each split, then the partials summed in split order)
// is the same for every M. Aims at kInt4DeterministicCtas CTAs for one row block, capped at
// K / 256 (at least 4 units of 64 per split) and 64. A first guess, not measured on a GPU.
constexpr int32_t kInt4DeterministicCtas = 256;
int32_t int4_gemm_deterministic_num_splits(int32_t n, int32_t k);
size_t int4_gemm_workspace_size(const Int4GemmParams& params);
size_t int4_gemm_num_counters(const Int4GemmParams& params);
cudaError_t launch_int4_gemm(const Int4GemmParams& params, cudaStream_t stream);

// Dequantises the packed weight to w[N, K] (row stride K) in the activation dtype, with exactly
// the rounding of the GEMM: the large-M path of int4_gemm is this plus a dense matmul.
struct Int4DequantizeParams {
  const uint32_t* packed = nullptr;
  const void* scales = nullptr;
  const uint8_t* zeros = nullptr;
  void* w = nullptr;                // [N, K]
  int32_t n = 0;
  int32_t k = 0;
  int32_t group_size = 128;
  DType dtype = DType::kBFloat16;
};

cudaError_t launch_int4_dequantize(const Int4DequantizeParams& params, cudaStream_t stream);

}  // namespace fastinfer
