#pragma once
// FP8 (W8A8) launchers (torch-free C++ API): dynamic e4m3 quantisation and the scaled e4m3 GEMM.
//
// e4m3 here is OCP "e4m3fn" (no infinities, max finite 448). Quantisation is saturating:
//   q = e4m3_rne(clamp(fp32(x) / scale, -448, 448)),  scale = max(amax, 1e-12) / 448  (fp32 math),
// the quotient being an IEEE fp32 division (bit-exact with torch's
// `(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`). NaN propagates as in torch: a NaN
// in the unit gives a NaN amax and scale, a NaN quotient stays NaN through the clamp (e4m3 NaN).
//
// Scaled matmul: out[m][n] = sum_k (a[m][k] * sa) * (b[n][k] * sb) (+ bias[n]), fp32 accumulation,
// a single rounding to the output dtype. a is [M, K] and b is [N, K], both row-major e4m3 (b is the
// weight in nn.Linear layout, i.e. the "col" operand of the tensor-core mma).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"
#include "fastinfer/gemm/w8a8_sm90.h"

namespace fastinfer {

enum class Fp8QuantMode : int32_t {
  kTensor = 0,  // one scale for the whole tensor (given, or computed by a reduction pass first)
  kToken = 1,   // one scale per row: scale [M]
  kGroup = 2,   // one scale per group of group_size consecutive elements of a row: scale [M, K / group_size]
  kChannel = 3, // one given scale per column: scale [K] (given_scale only)
};

struct Fp8QuantizeParams {
  const void* x = nullptr;   // [M, K], rows x_row_stride apart, dtype
  void* out = nullptr;       // [M, K], contiguous, e4m3
  float* scale = nullptr;    // output scales (device): [1], [M] or [M, K / group_size]
  // A given scale (device) of the mode's shape: [1], [M], [K] or [M, K / group_size]. When non-null
  // the data is quantised with it in one pass and it is copied to `scale`; when null the scales come
  // from the amax (kTensor: a reduction pass first, 2 kernels). kChannel needs one.
  const float* given_scale = nullptr;
  int64_t rows = 0;          // M
  int64_t cols = 0;          // K: a multiple of 8 (16-byte vectors)
  int64_t x_row_stride = 0;  // elements between rows of x: >= K, a multiple of 8; 0: K (contiguous)
  int32_t group_size = 128;  // kGroup: a power of two in [8, 256] dividing K
  Fp8QuantMode mode = Fp8QuantMode::kToken;
  DType dtype = DType::kBFloat16;  // of x: float16 or bfloat16
  void* workspace = nullptr;       // fp8_quantize_workspace_size(params) bytes (kTensor without a given scale)
};

size_t fp8_quantize_workspace_size(const Fp8QuantizeParams& params);
cudaError_t launch_fp8_quantize(const Fp8QuantizeParams& params, cudaStream_t stream);

enum class Fp8ScaleMode : int32_t {
  kTensorOrChannel = 0,  // scale_a: [1] or [M] (per token); scale_b: [1] or [N] (per channel); epilogue
  kBlockwise = 1,        // scale_a: [M, ceil(K/128)], scale_b: [ceil(N/128), ceil(K/128)]; main loop
};

struct Fp8ScaledMmParams {
  const void* a = nullptr;       // [M, K] e4m3, rows lda bytes apart, 16-byte aligned
  const void* b = nullptr;       // [N, K] e4m3, row-major, 16-byte aligned
  void* out = nullptr;           // [M, N] out_dtype, row-major, 4-byte aligned
  const float* scale_a = nullptr;
  const float* scale_b = nullptr;
  const void* bias = nullptr;    // [N] out_dtype, or nullptr
  int64_t m = 0;
  int64_t n = 0;                 // a multiple of 16 (even: packed 2-element stores)
  int64_t k = 0;                 // a multiple of 16 (16-byte cp.async chunks)
  int64_t lda = 0;               // row stride of a in elements: 0 for k, else a multiple of 16 >= k
  Fp8ScaleMode scale_mode = Fp8ScaleMode::kTensorOrChannel;
  bool scale_a_per_row = false;  // kTensorOrChannel: scale_a has M entries (else 1)
  bool scale_b_per_col = false;  // kTensorOrChannel: scale_b has N entries (else 1)
  DType out_dtype = DType::kBFloat16;  // float16 or bfloat16
  // Batch invariance: always the mma.sync kernel, whose k-order (k-tiles of 128 in order, no
  // split-K, any tile configuration) depends on K alone, so a row's bits do not depend on M. The
  // CUTLASS sm90 kernels pick tile shapes (and so their wgmma k-grouping) by M: never used then.
  bool deterministic = false;
};

// Needs sm_89+ (e4m3 tensor-core mma): returns cudaErrorNotSupported on an older device.
cudaError_t launch_fp8_scaled_mm(const Fp8ScaledMmParams& params, cudaStream_t stream,
                                 const W8a8GemmOverrides& overrides = {});

}  // namespace fastinfer
