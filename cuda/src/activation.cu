// Activation launchers (gated and plain) and their instantiations.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/activation/gated.cuh"

#include <type_traits>

namespace fastinfer {
namespace {

// Launch `kernel` over p.num_rows rows of p.width outputs, VEC outputs per thread: grid (column
// chunk, row), rows beyond gridDim.y's limit in slices of 65535 rows. Params: GatedActivationParams
// or ActivationParams (the same row fields).
template <typename T, int VEC, typename Params, typename Kernel>
cudaError_t launch_rows(Kernel kernel, const Params& p, cudaStream_t stream) {
  const int64_t vecs_per_row = p.width / VEC;
  int64_t threads = (vecs_per_row + 31) / 32 * 32;
  if (threads > activation::kThreads) threads = activation::kThreads;
  const int64_t chunks = (vecs_per_row + threads - 1) / threads;
  for (int64_t first = 0; first < p.num_rows; first += 65535) {
    Params slice = p;
    slice.num_rows = p.num_rows - first < 65535 ? p.num_rows - first : 65535;
    slice.x = static_cast<const T*>(p.x) + first * p.x_row_stride;
    slice.out = static_cast<T*>(p.out) + first * p.out_row_stride;
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(slice.num_rows));
    const cudaError_t err = launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), 0, stream, slice);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// VEC-wide (16-byte accesses) when the widths, row strides and pointers allow, else one element
// per thread.
template <typename T, typename Params>
bool vectorizable(const Params& p) {
  constexpr int kVec = 16 / sizeof(T);
  return p.width % kVec == 0 && p.x_row_stride % kVec == 0 && p.out_row_stride % kVec == 0 &&
         is_aligned(p.x, 16) && is_aligned(p.out, 16);
}

template <typename Act>
cudaError_t launch_gated(const GatedActivationParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.width == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.width < 0) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return FASTINFER_DISPATCH_VEC(vectorizable<T>(p), T, VEC, [&] {
      if constexpr (std::is_same_v<Act, activation::Silu>)
        return launch_rows<T, VEC>(activation::silu_and_mul_kernel<T, VEC>, p, stream);
      else if constexpr (std::is_same_v<Act, activation::GeluErf>)
        return launch_rows<T, VEC>(activation::gelu_and_mul_kernel<T, VEC>, p, stream);
      else
        return launch_rows<T, VEC>(activation::gelu_tanh_and_mul_kernel<T, VEC>, p, stream);
    });
  });
}

template <typename Act>
cudaError_t launch_plain(const ActivationParams& p, cudaStream_t stream) {
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return FASTINFER_DISPATCH_VEC(vectorizable<T>(p), T, VEC, [&] {
      return launch_rows<T, VEC>(activation::activation_kernel<Act, T, VEC>, p, stream);
    });
  });
}

}  // namespace

cudaError_t launch_silu_and_mul(const GatedActivationParams& p, cudaStream_t stream) {
  return launch_gated<activation::Silu>(p, stream);
}

cudaError_t launch_gelu_and_mul(const GatedActivationParams& p, cudaStream_t stream) {
  return launch_gated<activation::GeluErf>(p, stream);
}

cudaError_t launch_gelu_tanh_and_mul(const GatedActivationParams& p, cudaStream_t stream) {
  return launch_gated<activation::GeluTanh>(p, stream);
}

cudaError_t launch_activation(const ActivationParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.width == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.width < 0) return cudaErrorInvalidValue;
  switch (p.activation) {
    case Activation::kGeluNew: return launch_plain<activation::GeluTanh>(p, stream);
    case Activation::kGeluFast: return launch_plain<activation::GeluFast>(p, stream);
    case Activation::kQuickGelu: return launch_plain<activation::QuickGelu>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastinfer
