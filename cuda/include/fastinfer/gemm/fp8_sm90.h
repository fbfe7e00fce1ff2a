#pragma once
// FP8 (e4m3) GEMM with scaled outputs for Hopper (sm_90a): CUTLASS 3.x warp-specialised kernels
// (TMA loads, wgmma, persistent tile scheduler) with the scales and the bias fused into the
// epilogue. Torch-free C++ API; this is one backend of the op `fp8_scaled_mm` (per-tensor and
// per-token x per-channel scales; the blockwise mode is handled elsewhere).
//
//   out[m, n] = cast_out( scale_a[m or 0] * scale_b[n or 0] * sum_k a[m, k] * b[n, k] + bias[n] )
//
// Accumulation is fp32 in the tensor cores ("fast accumulation": the wgmma fp32 accumulator is
// not promoted to a separate fp32 register sum every few k-blocks; see fp8_gemm_sm90.cu). The
// scales and the bias are applied in fp32; the result is rounded once to out_dtype.
//
// Availability: the kernels exist only when the library was built with sm_90a among its CUDA
// architectures (FASTINFER_CUDA_ARCHS) and CUTLASS headers were found. Otherwise, and always in
// the simt emulator build (FASTINFER_SIMT, where these functions are inline stubs), launch
// returns cudaErrorNotSupported and fp8_gemm_sm90_available() returns false. Callers must also
// check that the device is compute capability 9.0 (the sm_90a cubin runs on H100/H200/H20 only).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct Fp8GemmSm90Args {
  // Device pointers. a, b, out must be 16-byte aligned (TMA); bias and the scales may have any
  // alignment (read element by element). Rows are contiguous along K (a, b) or N (out).
  const void* a = nullptr;        // [m, k] fp8 e4m3, row stride lda (elements)
  const void* b = nullptr;        // [n, k] fp8 e4m3, row stride ldb (b is the weight as stored: out = a @ b^T)
  void* out = nullptr;            // [m, n] out_dtype, row stride ldd
  const void* bias = nullptr;     // [n] out_dtype, or nullptr (no bias)
  const float* scale_a = nullptr; // per_token_channel ? [m] : [1]   (device)
  const float* scale_b = nullptr; // per_token_channel ? [n] : [1]   (device)
  int64_t m = 0, n = 0, k = 0;    // each < 2^31; n and k multiples of 16 (TMA: 16-byte rows)
  int64_t lda = 0, ldb = 0, ldd = 0;  // row strides in elements; 0: contiguous (k, k, n); else multiples of 16, >= the row
  bool per_token_channel = false; // false: per-tensor scale_a[0], scale_b[0]; true: scale_a[m], scale_b[n]
  DType out_dtype = DType::kBFloat16;  // kBFloat16 or kFloat16 (bias has the same dtype)
  void* workspace = nullptr;      // device, >= fp8_gemm_sm90_workspace_bytes(args) bytes (may be null if that is 0)
  size_t workspace_bytes = 0;
};

// Which tile configuration launch_fp8_gemm_sm90 picks for a problem (by m; exposed for tests and
// benchmarks). The names give CTA tile M x N x K, the kernel schedule and the cluster shape.
enum class Fp8GemmSm90Config : int32_t {
  kM64 = 0,    // m <= 64:        64 x 64 x 128, ping-pong, cluster 1x4 (a multicast along n)
  kM128 = 1,   // 64 < m <= 128:  64 x 128 x 128, ping-pong, cluster 2x1 (b multicast along m)
  kLarge = 2,  // m > 128:        128 x 256 x 128, cooperative, cluster 2x1
};

inline Fp8GemmSm90Config fp8_gemm_sm90_config(int64_t m) {
  if (m <= 64) return Fp8GemmSm90Config::kM64;
  if (m <= 128) return Fp8GemmSm90Config::kM128;
  return Fp8GemmSm90Config::kLarge;
}

inline const char* fp8_gemm_sm90_config_name(Fp8GemmSm90Config config) {
  switch (config) {
    case Fp8GemmSm90Config::kM64: return "64x64x128_pingpong_c1x4";
    case Fp8GemmSm90Config::kM128: return "64x128x128_pingpong_c2x1";
    case Fp8GemmSm90Config::kLarge: return "128x256x128_cooperative_c2x1";
  }
  return "unknown";
}

#if !defined(FASTINFER_SIMT)
// True when this library contains the sm_90a kernels (it does not check the current device).
bool fp8_gemm_sm90_available();

// Device workspace the launch needs for these arguments (0 for the configurations above today;
// callers should still allocate what this returns). Independent of the pointers; needs no device.
size_t fp8_gemm_sm90_workspace_bytes(const Fp8GemmSm90Args& args);

// Launches on `stream`. Returns
//   cudaSuccess                  (also for m == 0 or n == 0 with otherwise valid arguments: nothing to do),
//   cudaErrorInvalidValue        null a/b/out/scale pointer, m < 0, k <= 0, m/n/k >= 2^31, n or k or a
//                                row stride not a multiple of 16, a row stride shorter than its row,
//                                out_dtype not bf16/fp16, workspace smaller than
//                                fp8_gemm_sm90_workspace_bytes (all checked on the host, no device call),
//   cudaErrorMisalignedAddress   a, b or out not 16-byte aligned,
//   cudaErrorNotSupported        the library was built without sm_90a kernels,
//   or the CUDA error of the launch itself (e.g. cudaErrorNoKernelImageForDevice on a non-sm_90 GPU).
cudaError_t launch_fp8_gemm_sm90(const Fp8GemmSm90Args& args, cudaStream_t stream);
#else
// The emulator build has no sm_90a code: the API exists so bindings compile unchanged.
inline bool fp8_gemm_sm90_available() { return false; }
inline size_t fp8_gemm_sm90_workspace_bytes(const Fp8GemmSm90Args&) { return 0; }
inline cudaError_t launch_fp8_gemm_sm90(const Fp8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }
#endif

}  // namespace fastinfer
