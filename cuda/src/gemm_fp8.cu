// FP8 launchers: dynamic e4m3 quantisation (fp16/bf16 in: 2 x {group sizes 8..256, token, tensor
// (reduction + quantise)}) and the scaled e4m3 mma.sync GEMM ({small, medium, large} configs x
// {fp16, bf16} out x tensor/channel scales + {small, medium} x {fp16, bf16} blockwise = 10 kernels).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/fp8.h"
#include "fastinfer/gemm/fp8_gemm.cuh"
#include "fastinfer/gemm/fp8_quantize.cuh"
#include "fastinfer/gemm/w8a8_sm90.h"

#include <cstdlib>
#include <cstring>

namespace fastinfer {
namespace fp8 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, int kLanes>
cudaError_t launch_group(const Fp8QuantizeParams& p, cudaStream_t stream) {
  const int64_t blocks = ceil_div(p.rows * group_lanes<kLanes>(p.cols), quant::kQuantThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return launch_kernel(fp8_quantize_group_kernel<T, kLanes>, dim3(static_cast<unsigned>(blocks)),
                       dim3(quant::kQuantThreads), 0, stream, p);
}

template <typename T>
cudaError_t launch_quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  const int64_t flat_blocks = quant::flat_blocks(p.rows, p.cols);
  if (flat_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 block(quant::kQuantThreads);
  if (p.given_scale != nullptr && p.mode != Fp8QuantMode::kTensor)
    return launch_kernel(fp8_quantize_given_kernel<T>, dim3(static_cast<unsigned>(flat_blocks)), block, 0, stream, p);
  switch (p.mode) {
    case Fp8QuantMode::kChannel: return cudaErrorInvalidValue;  // given scales only
    case Fp8QuantMode::kGroup:
      switch (p.group_size) {
        case 8: return launch_group<T, 1>(p, stream);
        case 16: return launch_group<T, 2>(p, stream);
        case 32: return launch_group<T, 4>(p, stream);
        case 64: return launch_group<T, 8>(p, stream);
        case 128: return launch_group<T, 16>(p, stream);
        case 256: return launch_group<T, 32>(p, stream);
        default: return cudaErrorInvalidValue;
      }
    case Fp8QuantMode::kToken:
      if (p.rows > 0x7fffffff) return cudaErrorInvalidValue;
      return launch_kernel(quant::quantize_token_kernel<E4m3Format, T>, dim3(static_cast<unsigned>(p.rows)), block, 0,
                           stream, p);
    case Fp8QuantMode::kTensor:
      return quant::launch_quantize_tensor<E4m3Format, T>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// ---- GEMM dispatch ---------------------------------------------------------------------------
// THE dispatch point between fp8 GEMM kernel families: the CUTLASS 3.x sm_90a kernels (TMA +
// wgmma, fastinfer/gemm/w8a8_sm90.h) on Hopper wherever w8a8_gemm_sm90_applies (shared with int8)
// and the scales are not blockwise; the mma.sync kernel below otherwise (and on sm_89).
// mma.sync.m16n8k32 e4m3 is native on Ada (sm_89) only; on Hopper ptxas emulates it (conversion
// to f16 + f16 mma: NVIDIA/cutlass#1986, and our sm_90a builds use ~2x the registers of sm_89),
// so on sm_90 the wgmma kernels take every shape they support and this kernel is the fallback.
enum class Fp8GemmBackend { kMmaSyncSm89, kCutlassSm90 };

Fp8GemmBackend select_fp8_gemm_backend(const Fp8ScaledMmParams& p, int cc_major, int cc_minor, bool force_mma_sync) {
  const Sm90Target target{cc_major, cc_minor, fp8_gemm_sm90_available(), force_mma_sync};
  const W8a8GemmSm90Args args = w8a8_gemm_sm90_args(p);
  // deterministic: the wgmma kernels choose tiles by M; the mma.sync kernel's k-order is fixed by K
  const bool sm90 = !p.deterministic && p.scale_mode == Fp8ScaleMode::kTensorOrChannel &&
                    w8a8_gemm_sm90_applies(target, args) && fp8_gemm_sm90_workspace_bytes(args) == 0;
  return sm90 ? Fp8GemmBackend::kCutlassSm90 : Fp8GemmBackend::kMmaSyncSm89;
}

template <typename Cfg, typename TOut, bool kBlockwise>
cudaError_t launch_mma_sync_cfg(const Fp8ScaledMmParams& p, cudaStream_t stream) {
  const int64_t gx = ceil_div(p.n, Cfg::kBlockN), gy = ceil_div(p.m, Cfg::kBlockM);
  if (gx > 0x7fffffff || gy > 65535) return cudaErrorInvalidValue;
  // e4m3 mma: the code the driver loaded must come from an sm_89+ build (common/launch.cuh)
  if (cudaError_t err = require_kernel_arch<fp8_scaled_mm_kernel<Cfg, TOut, kBlockwise>>(89); err != cudaSuccess)
    return err;
  // The kernel reads a's row stride as given: a literal stride keeps the 128 x 128 tile within 255
  // registers on sm_90a (a select of lda or k cost 40 bytes of spills).
  Fp8ScaledMmParams q = p;
  if (q.lda == 0) q.lda = q.k;
  return launch_kernel(fp8_scaled_mm_kernel<Cfg, TOut, kBlockwise>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                       dim3(Cfg::kThreads), static_cast<size_t>(Cfg::kSmemBytes), stream, q);
}

template <typename TOut, bool kBlockwise>
cudaError_t launch_mma_sync(const Fp8ScaledMmParams& p, cudaStream_t stream) {
  // M buckets: decode-sized M gets 16 x 32 tiles (more CTAs along N); mid-sized M 64 x 128 tiles.
  // Blockwise keeps a second set of fp32 partial accumulators: with 128 x 128 tiles that exceeds 255
  // registers on sm_90a (spills), so blockwise uses the 64 x 128 tiles for every M > 16.
  if (p.m <= 16) return launch_mma_sync_cfg<Fp8ConfigSmall, TOut, kBlockwise>(p, stream);
  if constexpr (kBlockwise) {
    return launch_mma_sync_cfg<Fp8ConfigMedium, TOut, kBlockwise>(p, stream);
  } else {
    if (p.m <= 64) return launch_mma_sync_cfg<Fp8ConfigMedium, TOut, kBlockwise>(p, stream);
    return launch_mma_sync_cfg<Fp8ConfigLarge, TOut, kBlockwise>(p, stream);
  }
}

// Compute capability of the current device (9.0 under the emulator).
cudaError_t device_cc(int& major, int& minor) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return err;
}

}  // namespace
}  // namespace fp8

size_t fp8_quantize_workspace_size(const Fp8QuantizeParams& p) {
  if (p.mode != Fp8QuantMode::kTensor || p.given_scale != nullptr) return 0;
  return static_cast<size_t>(quant::num_amax_partials(p.rows, p.cols)) * sizeof(float);
}

cudaError_t launch_fp8_quantize(const Fp8QuantizeParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0 || p.cols % 8 != 0) return cudaErrorInvalidValue;
  if (p.x_row_stride != 0 && (p.x_row_stride < p.cols || p.x_row_stride % 8 != 0)) return cudaErrorInvalidValue;
  if (p.mode == Fp8QuantMode::kGroup &&
      (p.group_size < 8 || p.group_size > 256 || (p.group_size & (p.group_size - 1)) != 0))
    return cudaErrorInvalidValue;
  if (p.mode == Fp8QuantMode::kChannel && p.given_scale == nullptr) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) {
    // Nothing to read; per-tensor still defines its scale (the given one, or max(0, 1e-12) / 448).
    if (p.mode != Fp8QuantMode::kTensor) return cudaSuccess;
  }
  if (p.x == nullptr && p.rows * p.cols > 0) return cudaErrorInvalidValue;
  if (p.scale == nullptr || (p.out == nullptr && p.rows * p.cols > 0)) return cudaErrorInvalidValue;
  if (!is_aligned(p.x, 16) || !is_aligned(p.out, 8)) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] { return fp8::launch_quantize<T>(p, stream); });
}

cudaError_t launch_fp8_scaled_mm(const Fp8ScaledMmParams& p, cudaStream_t stream, const W8a8GemmOverrides& overrides) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.n % 16 != 0 || p.k % 16 != 0) return cudaErrorInvalidValue;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  // K == 0 is legal (out = bias, or 0): a and b are then empty and may be null.
  if (p.lda != 0 && (p.lda < p.k || p.lda % 16 != 0)) return cudaErrorInvalidValue;
  if ((p.k > 0 && (p.a == nullptr || p.b == nullptr)) || p.out == nullptr || p.scale_a == nullptr ||
      (p.scale_b == nullptr))
    return cudaErrorInvalidValue;
  if (!is_aligned(p.a, 16) || !is_aligned(p.b, 16) || !is_aligned(p.out, 4) || (p.bias && !is_aligned(p.bias, 2)))
    return cudaErrorInvalidValue;
  int major = 0, minor = 0;
  cudaError_t err = fp8::device_cc(major, minor);
  if (err != cudaSuccess) return err;
  if (major * 10 + minor < 89) return cudaErrorNotSupported;  // no e4m3 mma before Ada (sm_89)
  switch (fp8::select_fp8_gemm_backend(p, major, minor, overrides.force_mma_sync)) {
    case fp8::Fp8GemmBackend::kCutlassSm90:
      return launch_fp8_gemm_sm90(w8a8_gemm_sm90_args(p), stream);
    case fp8::Fp8GemmBackend::kMmaSyncSm89:
      return FASTINFER_DISPATCH_HALF(p.out_dtype, TOut, [&] {
        return p.scale_mode == Fp8ScaleMode::kBlockwise ? fp8::launch_mma_sync<TOut, true>(p, stream)
                                                        : fp8::launch_mma_sync<TOut, false>(p, stream);
      });
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastinfer
