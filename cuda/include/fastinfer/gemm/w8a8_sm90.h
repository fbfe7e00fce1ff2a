#pragma once
// W8A8 GEMMs with scaled outputs for Hopper (sm_90a): CUTLASS 3.x warp-specialised kernels (TMA
// loads, wgmma, persistent tile scheduler) with the scales, the bias and (int8) the zero-point
// correction fused into the epilogue. Torch-free C++ API; these are one backend of the ops
// `fp8_scaled_mm` and `int8_scaled_mm` (their launchers pick it with w8a8_gemm_sm90_applies).
//
//   fp8  (e4m3 x e4m3 -> fp32 acc):
//     out[m, n] = cast_out( scale_a[m or 0] * (scale_b[n or 0] * acc) + bias[n] )
//   int8 (s8 x s8 -> s32 acc, exact):
//     c = acc - azp[m or 0] * azp_adj[n]          (int32; 0 without azp)
//     out[m, n] = cast_out( fma(float(c), scale_a[m or 0] * scale_b[n or 0], bias[n] or 0) )
//   with acc = sum_k a[m, k] * b[n, k]. The int8 epilogue is the one of fastinfer/gemm/int8.h,
//   operation for operation, so it is bit-identical to the mma.sync kernel and the CPU
//   implementation (one exception: without bias, a zero c times a negative scale gives +0 here
//   and -0 there, fma(0, s, +0) vs 0 * s; quantisers never produce negative scales).
//
// fp8 accumulation is "fast" (the wgmma fp32 accumulator is not promoted to a separate fp32
// register sum every few k-blocks; see fp8_gemm_sm90.cu); int8 accumulation is exact int32.
//
// Availability: the kernels exist only when the library was built with sm_90a among its CUDA
// architectures (FASTINFER_CUDA_ARCHS) and CUTLASS headers were found. Otherwise, and always in
// the simt emulator build (FASTINFER_SIMT, where these functions are inline stubs), launch
// returns cudaErrorNotSupported and *_gemm_sm90_available() returns false. Callers must also
// check that the device is compute capability 9.0 (the sm_90a cubin runs on H100/H200/H20 only):
// w8a8_gemm_sm90_applies does that from the numbers the caller queried.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct W8a8GemmSm90Args {
  // Device pointers. a, b, out must be 16-byte aligned (TMA); bias, the scales and the zero-point
  // vectors may have any alignment (read element by element). Rows are contiguous along K (a, b)
  // or N (out).
  const void* a = nullptr;        // [m, k] fp8 e4m3 or int8, row stride lda (elements)
  const void* b = nullptr;        // [n, k] same dtype, row stride ldb (b is the weight as stored: out = a @ b^T)
  void* out = nullptr;            // [m, n] out_dtype, row stride ldd
  const void* bias = nullptr;     // [n] out_dtype, or nullptr (no bias)
  const float* scale_a = nullptr; // scale_a_per_row ? [m] : [1]   (device)
  const float* scale_b = nullptr; // scale_b_per_col ? [n] : [1]   (device)
  const int32_t* azp = nullptr;     // int8 only: azp_per_row ? [m] : [1] zero points of a, or nullptr (symmetric)
  const int32_t* azp_adj = nullptr; // int8 only: [n] sum_k b[n, k]; given exactly when azp is
  int64_t m = 0, n = 0, k = 0;    // each < 2^31; n and k multiples of 16 (TMA: 16-byte rows)
  int64_t lda = 0, ldb = 0, ldd = 0;  // row strides in elements; 0: contiguous (k, k, n); else multiples of 16, >= the row
  bool scale_a_per_row = false;   // per token: scale_a[m] (else scale_a[0])
  bool scale_b_per_col = false;   // per channel: scale_b[n] (else scale_b[0])
  bool azp_per_row = false;       // azp[m] (else azp[0])
  DType out_dtype = DType::kBFloat16;  // kBFloat16 or kFloat16 (bias has the same dtype)
  void* workspace = nullptr;      // device, >= *_gemm_sm90_workspace_bytes(args) bytes (may be null if that is 0)
  size_t workspace_bytes = 0;
};

// The fields Fp8ScaledMmParams and Int8ScaledMmParams share (operands, scales and their modes,
// bias, sizes, out_dtype: contiguous rows, no workspace); int8 adds its zero points.
template <class ScaledMmParams>
W8a8GemmSm90Args w8a8_gemm_sm90_args(const ScaledMmParams& p) {
  W8a8GemmSm90Args a{};
  a.a = p.a;
  a.b = p.b;
  a.out = p.out;
  a.bias = p.bias;
  a.scale_a = p.scale_a;
  a.scale_b = p.scale_b;
  a.m = p.m;
  a.n = p.n;
  a.k = p.k;
  a.lda = p.lda;
  a.scale_a_per_row = p.scale_a_per_row;
  a.scale_b_per_col = p.scale_b_per_col;
  a.out_dtype = p.out_dtype;
  return a;
}

// Which tile configuration the launchers pick for a problem (by m; the same for fp8 and int8:
// both read 1-byte operands, so a 128-element k-block is 128 bytes for either). Exposed for tests
// and benchmarks. The names give CTA tile M x N x K, the kernel schedule and the cluster shape.
enum class GemmSm90Config : int32_t {
  kM64 = 0,    // m <= 64:        64 x 64 x 128, ping-pong, cluster 1x4 (a multicast along n)
  kM128 = 1,   // 64 < m <= 128:  64 x 128 x 128, ping-pong, cluster 2x1 (b multicast along m)
  kLarge = 2,  // m > 128:        128 x 256 x 128, cooperative, cluster 2x1
};

inline GemmSm90Config gemm_sm90_config(int64_t m) {
  if (m <= 64) return GemmSm90Config::kM64;
  if (m <= 128) return GemmSm90Config::kM128;
  return GemmSm90Config::kLarge;
}

inline const char* gemm_sm90_config_name(GemmSm90Config config) {
  switch (config) {
    case GemmSm90Config::kM64: return "64x64x128_pingpong_c1x4";
    case GemmSm90Config::kM128: return "64x128x128_pingpong_c2x1";
    case GemmSm90Config::kLarge: return "128x256x128_cooperative_c2x1";
  }
  return "unknown";
}

// What a launcher knows about the current device and build when it picks a GEMM backend.
struct Sm90Target {
  int cc_major = 0, cc_minor = 0;  // of the current device
  bool kernels_built = false;      // *_gemm_sm90_available()
  bool mma_sync_forced = false;    // W8a8GemmOverrides::force_mma_sync
};

// Test overrides of the fp8 / int8 launchers (the bindings fill them; launchers never read the
// environment): force_mma_sync runs the mma.sync kernel where the sm_90a kernels would.
struct W8a8GemmOverrides {
  bool force_mma_sync = false;
};

// Whether the sm_90a kernels take a W8A8 GEMM (pure host code, no device call; the op-specific
// conditions -- fp8 blockwise scales, forced int8 tiles -- are the launcher's): a compute
// capability 9.0 device, a build with the kernels, not forced off, a non-empty problem with
// k > 0, n and k multiples of 16, and 16-byte aligned a, b and out (TMA). The scale modes are
// free: [1] or [M] x [1] or [N]. Launchers also require *_gemm_sm90_workspace_bytes(args) == 0
// (the persistent scheduler needs none; a configuration that did would run mma.sync until the
// launchers allocate one).
inline bool w8a8_gemm_sm90_applies(const Sm90Target& t, const W8a8GemmSm90Args& p) {
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (t.cc_major != 9 || t.cc_minor != 0 || !t.kernels_built || t.mma_sync_forced) return false;
  if (p.m <= 0 || p.n <= 0 || p.k <= 0 || p.n % 16 != 0 || p.k % 16 != 0) return false;
  return aligned16(p.a) && aligned16(p.b) && aligned16(p.out);
}

#if !defined(FASTINFER_SIMT)
// True when this library contains the sm_90a kernels (it does not check the current device).
bool fp8_gemm_sm90_available();
bool int8_gemm_sm90_available();

// Device workspace the launch needs for these arguments (0 for the configurations above today;
// callers should still allocate what this returns). Independent of the pointers; needs no device.
size_t fp8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args& args);
size_t int8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args& args);

// Launch on `stream` (a, b: fp8 e4m3 for launch_fp8_gemm_sm90, int8 for launch_int8_gemm_sm90). Returns
//   cudaSuccess                  (also for m == 0 or n == 0 with otherwise valid arguments: nothing to do),
//   cudaErrorInvalidValue        null a/b/out/scale pointer, m < 0, k <= 0, m/n/k >= 2^31, n or k or a
//                                row stride not a multiple of 16, a row stride shorter than its row,
//                                out_dtype not bf16/fp16, workspace smaller than *_workspace_bytes,
//                                azp without azp_adj or the other way round, azp given to fp8
//                                (all checked on the host, no device call),
//   cudaErrorMisalignedAddress   a, b or out not 16-byte aligned,
//   cudaErrorNotSupported        the library was built without sm_90a kernels,
//   or the CUDA error of the launch itself (e.g. cudaErrorNoKernelImageForDevice on a non-sm_90 GPU).
cudaError_t launch_fp8_gemm_sm90(const W8a8GemmSm90Args& args, cudaStream_t stream);
cudaError_t launch_int8_gemm_sm90(const W8a8GemmSm90Args& args, cudaStream_t stream);
#else
// The emulator build has no sm_90a code: the API exists so bindings compile unchanged.
inline bool fp8_gemm_sm90_available() { return false; }
inline bool int8_gemm_sm90_available() { return false; }
inline size_t fp8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args&) { return 0; }
inline size_t int8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args&) { return 0; }
inline cudaError_t launch_fp8_gemm_sm90(const W8a8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }
inline cudaError_t launch_int8_gemm_sm90(const W8a8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }
#endif

}  // namespace fastinfer
