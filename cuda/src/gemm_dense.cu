// Dense fp16 / bf16 GEMM launcher: {small, medium, large} configs by M x {fp16, bf16} = 6 kernels.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/dense_gemm.cuh"

namespace fastinfer {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename Cfg, typename T>
cudaError_t launch_cfg(const DenseMmParams& p, cudaStream_t stream) {
  const int64_t gx = ceil_div(p.n, Cfg::kBlockN), gy = ceil_div(p.m, Cfg::kBlockM);
  if (gx > 0x7fffffff || gy > 65535) return cudaErrorInvalidValue;
  return launch_kernel(dense::dense_mm_kernel<Cfg, T>, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
                       dim3(Cfg::kThreads), static_cast<size_t>(Cfg::kSmemBytes), stream, p);
}

}  // namespace

cudaError_t launch_dense_mm(const DenseMmParams& p, cudaStream_t stream) {
  if (p.m < 0 || p.n < 0 || p.k < 0 || p.k % 8 != 0) return cudaErrorInvalidValue;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if ((p.k > 0 && (p.a == nullptr || p.b == nullptr)) || p.out == nullptr) return cudaErrorInvalidValue;
  if (!is_aligned(p.a, 16) || !is_aligned(p.b, 16) || !is_aligned(p.out, p.n % 2 == 0 ? 4 : 2) ||
      (p.bias && !is_aligned(p.bias, 2)))
    return cudaErrorInvalidValue;
  int dev = 0, major = 0, num_sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (major < 8) return cudaErrorNotSupported;  // mma.m16n8k16 bf16 needs sm_80
  // The tile configuration changes with M (and the SM count), the result of a row does not
  // (gemm/dense.h). The 128-row tiles only where they still fill the SMs: M = 256 on a 4096-wide
  // layer is 64 of them (half the GPU idle) but 128 of the 64-row tiles.
  const int64_t large_ctas = ceil_div(p.n, dense::DenseConfigLarge::kBlockN) * ceil_div(p.m, dense::DenseConfigLarge::kBlockM);
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.m <= 16) return launch_cfg<dense::DenseConfigSmall, T>(p, stream);
    if (p.m <= 64 || large_ctas < num_sms) return launch_cfg<dense::DenseConfigMedium, T>(p, stream);
    return launch_cfg<dense::DenseConfigLarge, T>(p, stream);
  });
}

}  // namespace fastinfer
