// RMSNorm launchers and their instantiations (fp16/bf16 x {16-byte vectors, scalar} x {gated, not};
// the quantising norm x {e4m3, int8} x {residual add, not}).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/norm/rms_norm.cuh"
#include "fastinfer/norm/rms_norm_quant.cuh"

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

// The vector width is chosen as the unfused norm chooses it for the same x (and residual, weight),
// and the threads per row are its own, so each row's sum of squares is added in its order.
cudaError_t launch_rms_norm_quant(const RmsNormQuantParams& p, cudaStream_t stream) {
  if (p.num_rows == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.hidden <= 0 || p.num_rows > 0x7fffffff || p.out == nullptr || p.scale == nullptr)
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const bool add = p.residual != nullptr;
    const bool vectorizable = p.hidden % kVec == 0 && p.x_row_stride % kVec == 0 && is_aligned(p.x, 16) &&
                              is_aligned(p.weight, 16) && is_aligned(p.out, 16) &&
                              (!add || (p.residual_row_stride % kVec == 0 && is_aligned(p.residual, 16)));
    return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
      const dim3 grid(static_cast<unsigned>(p.num_rows));
      const dim3 block(norm::threads_for_row(p.hidden / VEC));
      const bool e4m3 = p.format == NormQuantFormat::kE4m3;
      if (add)
        return e4m3 ? launch_kernel(norm::rms_norm_quant_kernel<T, VEC, norm::E4m3Codes, true>, grid, block, 0, stream, p)
                    : launch_kernel(norm::rms_norm_quant_kernel<T, VEC, norm::Int8Codes, true>, grid, block, 0, stream, p);
      return e4m3 ? launch_kernel(norm::rms_norm_quant_kernel<T, VEC, norm::E4m3Codes, false>, grid, block, 0, stream, p)
                  : launch_kernel(norm::rms_norm_quant_kernel<T, VEC, norm::Int8Codes, false>, grid, block, 0, stream, p);
    });
  });
}

}  // namespace fastinfer
