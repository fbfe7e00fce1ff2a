// RMSNorm launchers and their instantiations (fp16/bf16 x {16-byte vectors, scalar} x {gated, not}).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/norm/rms_norm.cuh"

namespace fastinfer {

cudaError_t launch_rms_norm(const RmsNormParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.hidden <= 0 || p.num_rows > 0x7fffffff) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const bool gated = p.gate != nullptr;
    const bool vectorizable = p.hidden % kVec == 0 && p.x_row_stride % kVec == 0 &&
                              p.out_row_stride % kVec == 0 && is_aligned(p.x, 16) &&
                              is_aligned(p.out, 16) && is_aligned(p.weight, 16) &&
                              (!gated || (p.gate_row_stride % kVec == 0 && is_aligned(p.gate, 16)));
    return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
      const dim3 grid(static_cast<unsigned>(p.num_rows));
      const dim3 block(norm::threads_for_row(p.hidden / VEC, gated ? norm::kMaxGatedThreads : norm::kMaxThreads));
      return gated ? launch_kernel(norm::rms_norm_kernel<T, VEC, true>, grid, block, 0, stream, p)
                   : launch_kernel(norm::rms_norm_kernel<T, VEC, false>, grid, block, 0, stream, p);
    });
  });
}

cudaError_t launch_fused_add_rms_norm(const FusedAddRmsNormParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.hidden <= 0 || p.num_rows > 0x7fffffff) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorizable = p.hidden % kVec == 0 && p.x_row_stride % kVec == 0 &&
                              p.residual_row_stride % kVec == 0 && is_aligned(p.x, 16) &&
                              is_aligned(p.residual, 16) && is_aligned(p.weight, 16);
    return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
      return launch_kernel(norm::fused_add_rms_norm_kernel<T, VEC>,
                           dim3(static_cast<unsigned>(p.num_rows)),
                           dim3(norm::threads_for_row(p.hidden / VEC)), 0, stream, p);
    });
  });
}

}  // namespace fastinfer
