// Prefill attention launcher and its instantiations: {fp16, bf16} x head dim {64, 128, 256} x
// {contiguous ragged K/V, paged K/V, paged fp8 e4m3 K/V} = 18 kernels, plus the tree-rows kernel that tree attention
// with a window or in the deterministic mode runs first. The launches are the plan's
// (launch_plan.h, attention_launch_plan.cu); the grid walks work items (prefill.cuh):
// (items, num_kv_heads[, key splits]).
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

template <typename T>
T* region(void* workspace, const WorkspaceRegion& r) {
  return r.bytes == 0 ? nullptr : reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + r.offset);
}

// The launcher-owned state of the plan's launches: its workspace regions.
PrefillLaunchState launch_state(const PrefillAttentionParams& p, const PrefillLaunchPlan& plan) {
  const PrefillWorkspaceLayout& l = plan.layout;
  PrefillLaunchState s{};
  s.tree_depth = region<int32_t>(p.workspace, l.tree_depth);
  if (plan.keys_by_rank) {
    s.tree_rank_seq = region<int32_t>(p.workspace, l.tree_rank_seq);
    s.tree_rank_keys = region<int32_t>(p.workspace, l.tree_rank_keys);
  }
  s.split_state = region<float>(p.workspace, l.split_state);
  return s;
}

template <typename T, int D, bool kPaged, typename CacheT = T>
cudaError_t launch_mma_sync(const PrefillAttentionParams& p, const PrefillLaunchPlan& plan, cudaStream_t stream) {
  using Traits = PrefillTraitsSm80<T, D, CacheT>;
  const auto kernel = plan.mode == PrefillMode::kSplit  ? prefill_attention_kernel<Traits, kPaged, PrefillMode::kSplit>
                      : plan.mode == PrefillMode::kFold ? prefill_attention_kernel<Traits, kPaged, PrefillMode::kFold>
                                                        : prefill_attention_kernel<Traits, kPaged, PrefillMode::kDefault>;
  const dim3 block(Traits::kThreads);
  const auto smem = static_cast<size_t>(Traits::kSmemBytes);
  const PrefillLaunchState state = launch_state(p, plan);
  if (plan.key_splits == 0) {  // one CTA per work item and KV head (default, or the in-kernel fold)
    PrefillLaunchState s = state;
    if (plan.tree_two_phase) {
      PrefillLaunchState s1 = state;  // phase 1: the sequences' work items over their prefix chunks
      s1.tree_rank_keys = nullptr;
      s1.tree_rank_seq = nullptr;
      s1.tree_phase = 1;
      s1.split_state_lse = region<float>(p.workspace, plan.layout.split_state_lse);
      const cudaError_t err =
          launch_kernel(kernel, dim3(static_cast<unsigned>(plan.work_items_phase1), static_cast<unsigned>(p.num_kv_heads)),
                        block, smem, stream, p, s1);
      if (err != cudaSuccess) return err;
      s.tree_phase = 2;  // phase 2: a work item per token over the rest, by rank
      s.split_state_lse = s1.split_state_lse;
    }
    return launch_kernel(kernel, dim3(static_cast<unsigned>(plan.work_items), static_cast<unsigned>(p.num_kv_heads)),
                         block, smem, stream, p, s);
  }
  // Key splits: groups of splits, each a kernel launch (grid.z = splits of the group) writing the
  // partials, then a fold of the group into the running state (the last one into out / lse).
  PrefillLaunchState s = state;
  s.split_out = region<float>(p.workspace, plan.layout.split_out);
  s.split_lse = region<float>(p.workspace, plan.layout.split_lse);
  float* running_out = region<float>(p.workspace, plan.layout.running_out);
  float* running_lse = region<float>(p.workspace, plan.layout.running_lse);
  const int64_t splits = plan.key_splits, group = plan.splits_per_launch;
  for (int64_t z0 = 0; z0 < splits; z0 += group) {
    const int64_t n = splits - z0 < group ? splits - z0 : group;
    s.split_begin = static_cast<int32_t>(z0);
    const dim3 grid(static_cast<unsigned>(plan.work_items), static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(n));
    cudaError_t err = launch_kernel(kernel, grid, block, smem, stream, p, s);
    if (err != cudaSuccess) return err;
    err = launch_kernel(prefill_merge_splits_kernel<T, D>, dim3(static_cast<unsigned>(plan.merge_blocks)),
                        dim3(kSplitMergeWarps * 32), 0, stream, p, s, running_out, running_lse, static_cast<int>(n),
                        z0 == 0, z0 + n >= splits);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Head dims the dispatch macro offers but no kernel is built for are refused here (a template, so
// `if constexpr` keeps their kernels from being instantiated).
template <typename T, int D>
cudaError_t launch_head_dim(const PrefillAttentionParams& p, const PrefillLaunchPlan& plan, cudaStream_t stream) {
  if constexpr (!prefill_supports_head_dim(D)) {
    return cudaErrorInvalidValue;
  } else {
    switch (select_prefill_backend(p)) {
      case PrefillBackend::kMmaSyncSm80:
        if (p.block_table == nullptr) return launch_mma_sync<T, D, false>(p, plan, stream);
        return p.cache_dtype == DType::kFloat8E4M3 ? launch_mma_sync<T, D, true, __nv_fp8_e4m3>(p, plan, stream)
                                                   : launch_mma_sync<T, D, true>(p, plan, stream);
    }
    return cudaErrorInvalidValue;
  }
}

// The tree rows' depths (tree attention with a window) and, with seq / keys, their keys by rank
// (the deterministic mode under a custom mask) into the tree scratch, first on the same stream so
// the attention kernel sees them.
cudaError_t launch_tree_rows(const PrefillAttentionParams& p, const PrefillLaunchState& s, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_q + kTreeDepthWarps - 1) / kTreeDepthWarps),
                  static_cast<unsigned>(p.batch_size));
  return launch_kernel(tree_rows_kernel, grid, dim3(kTreeDepthWarps * 32), 0, stream, p, s.tree_depth, s.tree_rank_seq,
                       s.tree_rank_keys);
}

}  // namespace
}  // namespace attention

cudaError_t query_device_description(int device, DeviceDescription* out) {
  if (out == nullptr) return cudaErrorInvalidValue;
  DeviceDescription d;
  cudaError_t err = cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return err;
  *out = d;
  return cudaSuccess;
}

cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, const PrefillLaunchPlan& plan,
                                     cudaStream_t stream) {
  if (plan.status != cudaSuccess) return plan.status;
  if (plan.work_items <= 0) return cudaSuccess;  // an empty batch
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr || p.cu_seqlens_q == nullptr)
    return cudaErrorInvalidValue;
  // cp.async and the 16-byte stores need 16-byte aligned rows.
  if (!is_aligned(p.q, 16) || !is_aligned(p.k, 16) || !is_aligned(p.v, 16) || !is_aligned(p.out, 16) ||
      p.q_token_stride % 8 != 0 || p.out_token_stride % 8 != 0 || p.q_token_stride < 0 || p.out_token_stride < 0)
    return cudaErrorInvalidValue;
  const bool paged = p.block_table != nullptr;
  const bool custom = p.custom_mask != nullptr || p.packed_custom_mask != nullptr;
  if (p.custom_mask != nullptr && p.packed_custom_mask != nullptr) return cudaErrorInvalidValue;  // one form
  if (paged) {
    if (p.seq_lens_k == nullptr || p.block_table_stride <= 0 || p.block_size < 8 || p.block_size > 256 ||
        (p.block_size & (p.block_size - 1)) != 0)
      return cudaErrorInvalidValue;
    if (custom && p.mask_offsets == nullptr) return cudaErrorInvalidValue;
    if (p.cache_dtype == DType::kFloat8E4M3 && (p.k_scale == nullptr || p.v_scale == nullptr))
      return cudaErrorInvalidValue;
  } else {
    if (p.cu_seqlens_k == nullptr || custom || p.k_token_stride % 8 != 0 || p.v_token_stride % 8 != 0 ||
        p.k_token_stride < 0 || p.v_token_stride < 0)
      return cudaErrorInvalidValue;
  }
  if (plan.workspace_bytes > 0 && (p.workspace == nullptr || !is_aligned(p.workspace, 16)))
    return cudaErrorInvalidValue;
  const attention::PrefillLaunchState state = attention::launch_state(p, plan);
  if (plan.tree_rows) {  // depths (and the keys by rank) first, on the same stream
    const cudaError_t err = attention::launch_tree_rows(p, state, stream);
    if (err != cudaSuccess) return err;
  }
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return FASTINFER_DISPATCH_HEAD_DIM(p.head_dim, D, [&] { return attention::launch_head_dim<T, D>(p, plan, stream); });
  });
}

}  // namespace fastinfer
