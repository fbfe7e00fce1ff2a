// apply_token_bitmask launcher: logits {fp32, fp16, bf16} x {16-byte vectors, scalar}; the index
// dtype is a runtime branch.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/sampling/token_bitmask.cuh"

namespace fastinfer {
namespace {

template <typename T>
cudaError_t launch_token_bitmask_typed(const TokenBitmaskParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable =
      p.vocab_size % kVec == 0 && p.logits_row_stride % kVec == 0 && is_aligned(p.logits, 16);
  return FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, [&] {
    const int64_t vecs_per_row = (p.vocab_size + VEC - 1) / VEC;
    int64_t threads = (vecs_per_row + 31) / 32 * 32;
    if (threads > sampling::kThreads) threads = sampling::kThreads;
    const int64_t chunks = (vecs_per_row + threads - 1) / threads;
    // Rows beyond gridDim.y's limit are masked in slices of 65535 selected rows.
    for (int64_t first = 0; first < p.num_rows; first += 65535) {
      TokenBitmaskParams slice = p;
      slice.num_rows = p.num_rows - first < 65535 ? p.num_rows - first : 65535;
      if (p.indices != nullptr) {
        const int64_t bytes = p.index_type == IndexType::kInt32 ? 4 : 8;
        slice.indices = static_cast<const char*>(p.indices) + first * bytes;
      } else {
        slice.logits = static_cast<T*>(p.logits) + first * p.logits_row_stride;
        slice.bitmask = p.bitmask + first * p.bitmask_row_stride;
        slice.batch_size = p.batch_size - first;
      }
      const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(slice.num_rows));
      const cudaError_t err = launch_kernel(sampling::apply_token_bitmask_kernel<T, VEC>, grid,
                                            dim3(static_cast<unsigned>(threads)), 0, stream, slice);
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
}

}  // namespace

cudaError_t launch_apply_token_bitmask(const TokenBitmaskParams& p, cudaStream_t stream) {
  if (p.num_rows == 0 || p.vocab_size == 0 || p.batch_size == 0) return cudaSuccess;
  if (p.num_rows < 0 || p.vocab_size < 0 || p.batch_size < 0 || p.logits == nullptr || p.bitmask == nullptr ||
      p.logits_row_stride < p.vocab_size || p.bitmask_row_stride < (p.vocab_size + 31) / 32)
    return cudaErrorInvalidValue;
  if (p.indices == nullptr && p.num_rows != p.batch_size) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_token_bitmask_typed<float>(p, stream);
    case DType::kFloat16: return launch_token_bitmask_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_token_bitmask_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fastinfer
