#pragma once
// INT8 (W8A8) launchers (torch-free C++ API): dynamic int8 quantisation and the scaled int8 GEMM.
//
// Quantisation (fp32 math, IEEE division, round to nearest even; bit-exact with
// fastinfer.reference.gemm_int8.int8_quantize and the CPU implementation):
//   symmetric:  scale = max(amax, 1e-12) / 127,  q = rne(clamp(x / scale, -127, 127))
//   asymmetric (per token): lo = max(-min(x), 0), hi = max(max(x), 0) (the range always holds 0),
//               scale = max(hi + lo, 1e-12) / 255,  azp = clamp(rne(lo / scale) - 128, -128, 127) (int32),
//               q = clamp(rne(x / scale) + azp, -128, 127),  so x ~= (q - azp) * scale.
// NaN: a NaN in the unit gives a NaN amax / range and scale (as torch's amax); a NaN x / scale has
// code 0 (int8 has no NaN, the scale carries it) and a NaN row's zero point is 0.
//
// Scaled matmul: acc[m][n] = sum_k a[m][k] * b[n][k] in int32 (exact), then
//   c = acc - azp[m] * azp_adj[n]                   (int32; only when azp is given)
//   out = bias ? fma(float(c), sa[m] * sb[n], bias[n]) : float(c) * (sa[m] * sb[n])   (fp32)
// rounded once to out_dtype. azp_adj[n] = sum_k b[n][k] (the correction for an asymmetric a).
// a is [M, K] and b is [N, K], both row-major int8 (b is the weight in nn.Linear layout).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"
#include "fastinfer/gemm/w8a8_sm90.h"

namespace fastinfer {

enum class Int8QuantMode : int32_t {
  kTensor = 0,  // one scale (given, or computed by a reduction pass first); symmetric only
  kToken = 1,   // one scale (and zero point when asymmetric) per row
};

struct Int8QuantizeParams {
  const void* x = nullptr;    // [M, K], rows x_row_stride apart, dtype
  void* out = nullptr;        // [M, K], contiguous, int8
  float* scale = nullptr;     // output scales (device): [1] or [M]
  int32_t* azp = nullptr;     // asymmetric: output zero points [M] (device)
  const float* given_scale = nullptr;  // kTensor only: quantise with this scale (1 element), copied to `scale`
  const int32_t* given_azp = nullptr;  // kTensor, asymmetric: the zero point (1 element) with given_scale, copied to `azp`
  int64_t rows = 0;           // M
  int64_t cols = 0;           // K: a multiple of 8 (16-byte vectors)
  int64_t x_row_stride = 0;   // elements between rows of x: >= K, a multiple of 8; 0: K (contiguous)
  Int8QuantMode mode = Int8QuantMode::kToken;
  bool symmetric = true;      // false: kToken, or kTensor with given_scale and given_azp
  DType dtype = DType::kBFloat16;  // of x: float16 or bfloat16
  void* workspace = nullptr;  // int8_quantize_workspace_size(params) bytes (kTensor without a given scale)
};

size_t int8_quantize_workspace_size(const Int8QuantizeParams& params);
cudaError_t launch_int8_quantize(const Int8QuantizeParams& params, cudaStream_t stream);

// Tile configuration of the GEMM (gemm/int8_gemm.cuh). kAuto: by M and the SM count (launcher);
// the others force one (tests, tuning).
enum class Int8GemmTiles : int32_t { kAuto = 0, kSmall = 1, kMedium = 2, kLarge = 3 };

struct Int8ScaledMmParams {
  const void* a = nullptr;          // [M, K] int8, rows lda apart, 16-byte aligned
  const void* b = nullptr;          // [N, K] int8, row-major, 16-byte aligned
  void* out = nullptr;              // [M, N] out_dtype, row-major, 4-byte aligned
  const float* scale_a = nullptr;   // [1] or [M]
  const float* scale_b = nullptr;   // [1] or [N]
  const void* bias = nullptr;       // [N] out_dtype, or nullptr
  const int32_t* azp = nullptr;     // [1] or [M] zero points of a, or nullptr (symmetric a)
  const int32_t* azp_adj = nullptr; // [N] sum_k b[n][k]; required with azp
  int64_t m = 0;
  int64_t n = 0;                    // a multiple of 16
  int64_t k = 0;                    // a multiple of 16 (16-byte cp.async chunks)
  int64_t lda = 0;                  // row stride of a in elements: 0 for k, else a multiple of 16 >= k
  bool scale_a_per_row = false;     // scale_a has M entries (else 1)
  bool scale_b_per_col = false;     // scale_b has N entries (else 1)
  bool azp_per_row = false;         // azp has M entries (else 1)
  DType out_dtype = DType::kBFloat16;  // float16 or bfloat16
  Int8GemmTiles tiles = Int8GemmTiles::kAuto;
  // Batch invariance. The mma.sync kernel never splits K and its int32 sums are exact, so every
  // tile configuration gives a row the same bits: it holds with or without the flag. A backend
  // that rounds partial sums or splits K by M (e.g. an sm90 path) must pick its split-K count and
  // k-order from (N, K) alone when it is set, or leave the shape to the mma.sync kernel.
  bool deterministic = false;
};

// The kernel family launch_int8_scaled_mm runs: the CUTLASS sm_90a kernel (TMA + wgmma,
// fastinfer/gemm/w8a8_sm90.h) where w8a8_gemm_sm90_applies (a 9.0 device, a build with the
// kernels, W8a8GemmOverrides::force_mma_sync not set, 16-byte aligned a/b/out, k > 0) with tiles == kAuto and
// no workspace; every scale mode, bias and azp included. Else the mma.sync kernel (sm_80+; also
// what forced tiles select). Pure host code (no device call): the launcher queries `target`.
enum class Int8GemmBackend : int32_t { kMmaSync = 0, kCutlassSm90 = 1 };
Int8GemmBackend select_int8_gemm_backend(const Int8ScaledMmParams& params, const Sm90Target& target);

// The W8a8GemmSm90Args of a scaled mm (w8a8_gemm_sm90_args plus the zero points).
W8a8GemmSm90Args int8_gemm_sm90_args(const Int8ScaledMmParams& params);

// Returns cudaErrorNotSupported on a device older than sm_80 (no s8 mma.sync).
cudaError_t launch_int8_scaled_mm(const Int8ScaledMmParams& params, cudaStream_t stream,
                                  const W8a8GemmOverrides& overrides = {});

}  // namespace fastinfer
