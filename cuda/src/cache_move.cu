// move_kv_slots launcher: {int32, int64} slots x {16-byte, 1-byte} copies, gather then scatter.
#include "fastinfer/cache/move_kv_slots.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"

namespace fastinfer {

size_t move_kv_slots_workspace_size(const MoveKvSlotsParams& p) {
  if (p.num_moves <= 0 || p.row_bytes <= 0) return 0;
  const size_t bytes = static_cast<size_t>(p.num_moves) * static_cast<size_t>(p.row_bytes) * 2;
  return (bytes + 15) / 16 * 16;
}

cudaError_t launch_move_kv_slots(const MoveKvSlotsParams& p, cudaStream_t stream) {
  if (p.num_moves == 0) return cudaSuccess;
  if (p.num_moves < 0 || p.num_moves > 0x7fffffff || p.row_bytes <= 0) return cudaErrorInvalidValue;
  if (p.k_cache == nullptr || p.v_cache == nullptr || p.src_slots == nullptr || p.dst_slots == nullptr ||
      p.workspace == nullptr)
    return cudaErrorInvalidValue;
  const bool vectorizable = p.row_bytes % 16 == 0 && is_aligned(p.k_cache, 16) && is_aligned(p.v_cache, 16) &&
                            is_aligned(p.workspace, 16);
  const dim3 grid(static_cast<unsigned>(p.num_moves), 2);
  return FASTINFER_DISPATCH_INDEX(p.slot_type, I, [&] {
    return FASTINFER_DISPATCH_VEC(vectorizable, unsigned char, VEC, [&] {
      int64_t threads = (p.row_bytes / VEC + 31) / 32 * 32;
      if (threads > cache::kMoveMaxThreads) threads = cache::kMoveMaxThreads;
      const dim3 block(static_cast<unsigned>(threads));
      cudaError_t err = launch_kernel(cache::move_kv_slots_gather_kernel<I, VEC>, grid, block, 0, stream, p);
      if (err != cudaSuccess) return err;
      return launch_kernel(cache::move_kv_slots_scatter_kernel<I, VEC>, grid, block, 0, stream, p);
    });
  });
}

}  // namespace fastinfer
