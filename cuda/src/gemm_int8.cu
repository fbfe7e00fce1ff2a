// INT8 launchers: dynamic int8 quantisation (fp16/bf16 in: per token symmetric / asymmetric, per
// tensor given or computed) and the scaled s8 GEMM: the mma.sync kernel ({small, medium, large}
// tiles x {fp16, bf16} out = 6 kernels), or on Hopper the CUTLASS sm_90a kernel (int8_gemm_sm90.cu).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/int8.h"
#include "fastinfer/gemm/int8_gemm.cuh"
#include "fastinfer/gemm/int8_quantize.cuh"
#include "fastinfer/gemm/w8a8_sm90.h"

#include <cstdlib>
#include <cstring>

namespace fastinfer {
namespace int8 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
cudaError_t launch_quantize(const Int8QuantizeParams& p, cudaStream_t stream) {
  if (p.mode == Int8QuantMode::kToken) {
    if (p.rows > 0x7fffffff) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(p.rows)), block(quant::kQuantThreads);
    return p.symmetric ? launch_kernel(quant::quantize_token_kernel<Int8Format<true>, T>, grid, block, 0, stream, p)
                       : launch_kernel(quant::quantize_token_kernel<Int8Format<false>, T>, grid, block, 0, stream, p);
  }
  return p.symmetric ? quant::launch_quantize_tensor<Int8Format<true>, T>(p, stream)
                     : quant::launch_quantize_tensor<Int8Format<false>, T>(p, stream);
}

template <typename Cfg, typename TOut>
cudaError_t launch_gemm_cfg(const Int8ScaledMmParams& p, cudaStream_t stream) {
  const int64_t gx = ceil_div(p.n, Cfg::kBlockN), gy = ceil_div(p.m, Cfg::kBlockM);
  if (gx > 0x7fffffff || gy > 65535) return cudaErrorInvalidValue;
  Int8ScaledMmParams q = p;  // the kernel reads a's row stride as given (see launch_mma_sync_cfg, fp8)
  if (q.lda == 0) q.lda = q.k;
  return launch_kernel(int8_scaled_mm_kernel<Cfg, TOut>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                       dim3(Cfg::kThreads), static_cast<size_t>(Cfg::kSmemBytes), stream, q);
}

// Tiles by M, as fp8: decode-sized M (<= 16) gets 16 x 32 tiles, mid-sized (<= 64) 64 x 128, else
// 128 x 128 -- unless that grid leaves SMs idle: 128 x 128 needs a full wave (>= one CTA per SM),
// else 64 x 128 is tried, which needs half a wave, else the 16 x 32 tiles (4-8x the CTAs; b is
// re-read per 16 rows, from L2). bench/model.py: Llama-3-8B o / down at M = 64 have 32 CTAs of
// 64 x 128 (a quarter of the SMs busy); at M = 256 64 CTAs of 128 x 128.
Int8GemmTiles pick_tiles(const Int8ScaledMmParams& p, int num_sms) {
  if (p.tiles != Int8GemmTiles::kAuto) return p.tiles;
  auto ctas = [&](int bm, int bn) { return ceil_div(p.m, bm) * ceil_div(p.n, bn); };
  if (p.m > 64 && ctas(128, 128) >= num_sms) return Int8GemmTiles::kLarge;
  if (p.m > 16 && 2 * ctas(64, 128) >= num_sms) return Int8GemmTiles::kMedium;
  return Int8GemmTiles::kSmall;
}

template <typename TOut>
cudaError_t launch_gemm(const Int8ScaledMmParams& p, int num_sms, cudaStream_t stream) {
  switch (pick_tiles(p, num_sms)) {
    case Int8GemmTiles::kLarge: return launch_gemm_cfg<Int8ConfigLarge, TOut>(p, stream);
    case Int8GemmTiles::kMedium: return launch_gemm_cfg<Int8ConfigMedium, TOut>(p, stream);
    case Int8GemmTiles::kSmall: return launch_gemm_cfg<Int8ConfigSmall, TOut>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Compute capability and SM count of the current device (9.0 and 132 under the emulator).
cudaError_t device_info(int& major, int& minor, int& num_sms) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
  return err;
}

}  // namespace
}  // namespace int8

W8a8GemmSm90Args int8_gemm_sm90_args(const Int8ScaledMmParams& p) {
  W8a8GemmSm90Args a = w8a8_gemm_sm90_args(p);
  a.azp = p.azp;
  a.azp_adj = p.azp_adj;
  a.azp_per_row = p.azp_per_row;
  return a;
}

Int8GemmBackend select_int8_gemm_backend(const Int8ScaledMmParams& p, const Sm90Target& target) {
  const W8a8GemmSm90Args args = int8_gemm_sm90_args(p);
  const bool sm90 = p.tiles == Int8GemmTiles::kAuto && w8a8_gemm_sm90_applies(target, args) &&
                    int8_gemm_sm90_workspace_bytes(args) == 0;
  return sm90 ? Int8GemmBackend::kCutlassSm90 : Int8GemmBackend::kMmaSync;
}

size_t int8_quantize_workspace_size(const Int8QuantizeParams& p) {
  if (p.mode != Int8QuantMode::kTensor || p.given_scale != nullptr) return 0;
  return static_cast<size_t>(quant::num_amax_partials(p.rows, p.cols)) * sizeof(float);
}

cudaError_t launch_int8_quantize(const Int8QuantizeParams& p, cudaStream_t stream) {
  if (p.rows < 0 || p.cols < 0 || p.cols % 8 != 0) return cudaErrorInvalidValue;
  if (p.x_row_stride != 0 && (p.x_row_stride < p.cols || p.x_row_stride % 8 != 0)) return cudaErrorInvalidValue;
  if (p.mode != Int8QuantMode::kToken && p.mode != Int8QuantMode::kTensor) return cudaErrorInvalidValue;
  if (p.given_scale != nullptr && p.mode != Int8QuantMode::kTensor) return cudaErrorInvalidValue;
  if (!p.symmetric && p.azp == nullptr) return cudaErrorInvalidValue;
  if (!p.symmetric && p.mode == Int8QuantMode::kTensor && (p.given_scale == nullptr || p.given_azp == nullptr))
    return cudaErrorInvalidValue;
  if (p.given_azp != nullptr && (p.symmetric || p.mode != Int8QuantMode::kTensor)) return cudaErrorInvalidValue;
  if ((p.rows == 0 || p.cols == 0) && p.mode == Int8QuantMode::kToken) return cudaSuccess;  // nothing to read
  if (p.x == nullptr && p.rows * p.cols > 0) return cudaErrorInvalidValue;
  if (p.scale == nullptr || (p.out == nullptr && p.rows * p.cols > 0)) return cudaErrorInvalidValue;
  if (!is_aligned(p.x, 16) || !is_aligned(p.out, 8)) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] { return int8::launch_quantize<T>(p, stream); });
}

cudaError_t launch_int8_scaled_mm(const Int8ScaledMmParams& p, cudaStream_t stream, const W8a8GemmOverrides& overrides) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.n % 16 != 0 || p.k % 16 != 0) return cudaErrorInvalidValue;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  // K == 0 is legal (out = bias, or 0): a and b are then empty and may be null.
  if (p.lda != 0 && (p.lda < p.k || p.lda % 16 != 0)) return cudaErrorInvalidValue;
  if ((p.k > 0 && (p.a == nullptr || p.b == nullptr)) || p.out == nullptr || p.scale_a == nullptr ||
      p.scale_b == nullptr || ((p.azp == nullptr) != (p.azp_adj == nullptr)))
    return cudaErrorInvalidValue;
  if (!is_aligned(p.a, 16) || !is_aligned(p.b, 16) || !is_aligned(p.out, 4) || (p.bias && !is_aligned(p.bias, 2)))
    return cudaErrorInvalidValue;
  int major = 0, minor = 0, num_sms = 0;
  cudaError_t err = int8::device_info(major, minor, num_sms);
  if (err != cudaSuccess) return err;
  if (major < 8) return cudaErrorNotSupported;  // s8 m16n8k32 mma: Ampere and later
  const Sm90Target target{major, minor, int8_gemm_sm90_available(), overrides.force_mma_sync};
  if (select_int8_gemm_backend(p, target) == Int8GemmBackend::kCutlassSm90)
    return launch_int8_gemm_sm90(int8_gemm_sm90_args(p), stream);
  return FASTINFER_DISPATCH_HALF(p.out_dtype, TOut, [&] { return int8::launch_gemm<TOut>(p, num_sms, stream); });
}

}  // namespace fastinfer
