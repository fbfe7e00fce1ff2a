// Prefill attention launcher and its instantiations: {fp16, bf16} x head dim {64, 128} x
// {contiguous ragged K/V, paged K/V} = 8 kernels, plus the tree-depth kernel that tree attention
// with a window runs first.
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/prefill.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/common/vec.cuh"

namespace fastinfer {
namespace attention {
namespace {

// The single dispatch point between prefill kernel families. Today every architecture (sm_80 ..
// sm_90) runs the mma.sync kernel; a Hopper wgmma/TMA kernel would add kWgmmaSm90 here, chosen
// from the device's compute capability, with its own traits struct and launch function.
enum class PrefillBackend { kMmaSyncSm80 };

inline PrefillBackend select_prefill_backend(const PrefillAttentionParams&) { return PrefillBackend::kMmaSyncSm80; }

template <typename T, int D, bool kPaged>
cudaError_t launch_mma_sync(const PrefillAttentionParams& p, cudaStream_t stream) {
  using Traits = PrefillTraitsSm80<T, D>;
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                  static_cast<unsigned>(p.num_q_heads), static_cast<unsigned>(p.batch_size));
  return launch_kernel(prefill_attention_kernel<Traits, kPaged>, grid, dim3(Traits::kThreads),
                       static_cast<size_t>(Traits::kSmemBytes), stream, p);
}

template <typename T, int D>
cudaError_t launch_head_dim(const PrefillAttentionParams& p, cudaStream_t stream) {
  switch (select_prefill_backend(p)) {
    case PrefillBackend::kMmaSyncSm80:
      return p.block_table != nullptr ? launch_mma_sync<T, D, true>(p, stream) : launch_mma_sync<T, D, false>(p, stream);
  }
  return cudaErrorInvalidValue;
}

// Tree attention with a window: the nodes' depths first (same stream, so the attention kernel
// sees them).
cudaError_t launch_tree_depth(const PrefillAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_q + kTreeDepthWarps - 1) / kTreeDepthWarps),
                  static_cast<unsigned>(p.batch_size));
  return launch_kernel(tree_depth_kernel, grid, dim3(kTreeDepthWarps * 32), 0, stream, p);
}

bool needs_tree_depth(const PrefillAttentionParams& p) { return p.custom_mask != nullptr && p.window_left >= 0; }

}  // namespace
}  // namespace attention

size_t prefill_attention_workspace_size(const PrefillAttentionParams& p) {
  if (!attention::needs_tree_depth(p) || p.batch_size <= 0 || p.max_seqlen_q <= 0) return 0;
  return static_cast<size_t>(p.batch_size) * static_cast<size_t>(p.max_seqlen_q) * sizeof(int32_t);
}

cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream) {
  if (p.batch_size == 0 || p.max_seqlen_q == 0) return cudaSuccess;
  if (p.batch_size < 0 || p.max_seqlen_q < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0)
    return cudaErrorInvalidValue;
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorInvalidValue;
  if (p.batch_size > 65535 || p.num_q_heads > 65535) return cudaErrorInvalidValue;  // grid.z / grid.y
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr || p.cu_seqlens_q == nullptr)
    return cudaErrorInvalidValue;
  // cp.async and the 16-byte stores need 16-byte aligned rows.
  if (!is_aligned(p.q, 16) || !is_aligned(p.k, 16) || !is_aligned(p.v, 16) || !is_aligned(p.out, 16) ||
      p.q_token_stride % 8 != 0 || p.out_token_stride % 8 != 0 || p.q_token_stride < 0 || p.out_token_stride < 0)
    return cudaErrorInvalidValue;
  const bool paged = p.block_table != nullptr;
  if (paged) {
    if (p.seq_lens_k == nullptr || p.block_table_stride <= 0 || p.block_size < 8 || p.block_size > 256 ||
        (p.block_size & (p.block_size - 1)) != 0)
      return cudaErrorInvalidValue;
    if (p.custom_mask != nullptr && p.mask_offsets == nullptr) return cudaErrorInvalidValue;
    if (attention::needs_tree_depth(p) && p.tree_depth == nullptr) return cudaErrorInvalidValue;
  } else {
    if (p.cu_seqlens_k == nullptr || p.custom_mask != nullptr || p.k_token_stride % 8 != 0 ||
        p.v_token_stride % 8 != 0 || p.k_token_stride < 0 || p.v_token_stride < 0)
      return cudaErrorInvalidValue;
  }
  if (paged && attention::needs_tree_depth(p)) {
    const cudaError_t err = attention::launch_tree_depth(p, stream);
    if (err != cudaSuccess) return err;
  }
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return p.head_dim == 64 ? attention::launch_head_dim<T, 64>(p, stream)
                            : attention::launch_head_dim<T, 128>(p, stream);
  });
}

}  // namespace fastinfer
