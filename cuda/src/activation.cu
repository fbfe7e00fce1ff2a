// Gated activation launchers and their instantiations.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/activation/gated.cuh"

#include <type_traits>

namespace fastinfer {
namespace {

// The gated kernel of activation Act over the rows, VEC-wide when the rows allow 16-byte accesses.
template <typename Act>
cudaError_t launch_gated(const GatedActivationParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.width == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.width < 0) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorizable = p.width % kVec == 0 && p.x_row_stride % kVec == 0 &&
                              p.out_row_stride % kVec == 0 && is_aligned(p.x, 16) && is_aligned(p.out, 16);
    return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
      constexpr auto kernel = std::is_same_v<Act, activation::Silu> ? activation::silu_and_mul_kernel<T, VEC>
                                                                    : activation::gelu_tanh_and_mul_kernel<T, VEC>;
      const int64_t vecs_per_row = p.width / VEC;
      int64_t threads = (vecs_per_row + 31) / 32 * 32;
      if (threads > activation::kThreads) threads = activation::kThreads;
      const int64_t chunks = (vecs_per_row + threads - 1) / threads;
      // Rows beyond gridDim.y's limit are processed in slices of 65535 rows.
      for (int64_t first = 0; first < p.num_rows; first += 65535) {
        GatedActivationParams slice = p;
        slice.num_rows = p.num_rows - first < 65535 ? p.num_rows - first : 65535;
        slice.x = static_cast<const T*>(p.x) + first * p.x_row_stride;
        slice.out = static_cast<T*>(p.out) + first * p.out_row_stride;
        const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(slice.num_rows));
        const cudaError_t err = launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), 0, stream, slice);
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    });
  });
}

}  // namespace

cudaError_t launch_silu_and_mul(const GatedActivationParams& p, cudaStream_t stream) {
  return launch_gated<activation::Silu>(p, stream);
}

cudaError_t launch_gelu_tanh_and_mul(const GatedActivationParams& p, cudaStream_t stream) {
  return launch_gated<activation::GeluTanh>(p, stream);
}

}  // namespace fastinfer
