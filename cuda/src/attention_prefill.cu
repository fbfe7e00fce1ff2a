// Prefill attention launcher and its instantiations: {fp16, bf16} x head dim {64, 128} x
// {contiguous ragged K/V, paged K/V} = 8 kernels, plus the tree-rows kernel that tree attention
// with a window or in the deterministic mode runs first. The grid walks work items (prefill.cuh): (items, num_kv_heads).
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

bool has_custom_mask(const PrefillAttentionParams& p) { return p.custom_mask != nullptr || p.packed_custom_mask != nullptr; }
bool needs_tree_depth(const PrefillAttentionParams& p) { return has_custom_mask(p) && p.window_left >= 0; }
// The deterministic mode under a custom mask takes each row's keys by rank (attention.h): one work
// item per query token.
bool keys_by_rank(const PrefillAttentionParams& p) {
  return p.fixed_split_size > 0 && p.block_table != nullptr && has_custom_mask(p);
}

// Upper bound of the work items (attention.h, prefill_attention_work_items) for tiles of `rows`:
// the sequences' tiles or, per_token, ceil(group / rows) per query token.
int64_t work_items_bound(const PrefillAttentionParams& p, int rows, bool per_token) {
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  if (per_token) return p.num_q_tokens * ((group + rows - 1) / rows);
  const int64_t batch = p.batch_size;
  const int64_t per_seq = (static_cast<int64_t>(p.max_seqlen_q) * group + rows - 1) / rows;
  int64_t items = batch * per_seq;
  if (p.num_q_tokens > 0) {  // sum of ceil(q_len_b * group / rows) with sum q_len_b = num_q_tokens
    const int64_t seqs = batch < p.num_q_tokens ? batch : p.num_q_tokens;  // non-empty sequences
    const int64_t tight = (p.num_q_tokens * group + seqs * (rows - 1)) / rows;
    if (tight < items) items = tight;
  }
  return items;
}

// Fixed mode (attention.h): keys per sequence at most, chunks, chunks per launch.
int64_t key_bound(const PrefillAttentionParams& p) {
  return p.block_table != nullptr ? p.block_table_stride * p.block_size : static_cast<int64_t>(p.max_seqlen_k);
}
int64_t num_key_splits(const PrefillAttentionParams& p) {
  if (p.fixed_split_size <= 0 || !p.split_parallel) return 0;
  const int64_t keys = key_bound(p);
  return keys <= 0 ? 1 : (keys + p.fixed_split_size - 1) / p.fixed_split_size;
}
constexpr int64_t kSplitPartialBytes = int64_t{256} << 20;  // partials of one launch, at most
constexpr int64_t kMaxSplitsPerLaunch = 65535;               // grid.z
// PrefillOverrides::fixed_split_partial_bytes overrides the bound (tests: small shapes then take
// several launches and the running state, as large batches do).
int64_t split_partial_bytes(const PrefillOverrides& o) {
  return o.fixed_split_partial_bytes > 0 ? o.fixed_split_partial_bytes : kSplitPartialBytes;
}
int64_t split_row_bytes(const PrefillAttentionParams& p) {  // one chunk's partials
  return p.num_q_tokens * p.num_q_heads * (static_cast<int64_t>(p.head_dim) + 1) * static_cast<int64_t>(sizeof(float));
}
int64_t splits_per_launch(const PrefillAttentionParams& p, const PrefillOverrides& o) {
  const int64_t z = num_key_splits(p);
  if (z <= 0) return 0;
  const int64_t row = split_row_bytes(p);
  int64_t g = row > 0 ? split_partial_bytes(o) / row : z;
  if (g < 1) g = 1;
  if (g > kMaxSplitsPerLaunch) g = kMaxSplitsPerLaunch;
  return g < z ? g : z;
}
int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The in-kernel fold under a custom mask in two launches (attention.h, tree_phase) when the
// sequences' own work items would give at least half the SMs a CTA; PrefillOverrides::
// tree_prefix_plan forces either way (tests: both give the same bits).
bool share_tree_prefix(int64_t sequence_ctas, const PrefillOverrides& o) {
  if (o.tree_prefix_plan == TreePrefixPlan::kShared) return true;
  if (o.tree_prefix_plan == TreePrefixPlan::kPerToken) return false;
  int dev = 0, num_sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev) !=
                                                 cudaSuccess)
    return false;
  return 2 * sequence_ctas >= num_sms;
}

template <typename T, int D, bool kPaged>
cudaError_t launch_mma_sync(const PrefillAttentionParams& p, const PrefillOverrides& o, cudaStream_t stream) {
  using Traits = PrefillTraitsSm80<T, D>;
  const bool per_token = p.tree_rank_keys != nullptr;
  const int64_t items = work_items_bound(p, Traits::kBlockM, per_token);
  if (items <= 0) return cudaSuccess;
  if (items > 0x7fffffff) return cudaErrorInvalidValue;  // grid.x
  if (p.fixed_split_size <= 0 || !p.split_parallel) {  // default, or the in-kernel fold
    PrefillAttentionParams q = p;
    if (p.fixed_split_size > 0) q.split_state = static_cast<float*>(p.split_workspace);
    const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(p.num_kv_heads));
    if (per_token) {
      const int64_t seq_items = work_items_bound(p, Traits::kBlockM, false);
      if (seq_items <= 0x7fffffff && share_tree_prefix(seq_items * p.num_kv_heads, o)) {
        PrefillAttentionParams q1 = q;  // phase 1: the sequences' work items over their prefix chunks
        q1.tree_rank_keys = nullptr;
        q1.tree_rank_seq = nullptr;
        q1.tree_phase = 1;
        q1.split_state_lse = reinterpret_cast<float*>(static_cast<unsigned char*>(p.split_workspace) +
                                                      align16(p.num_q_tokens * p.num_q_heads * D * 4));
        const cudaError_t err = launch_kernel(prefill_attention_kernel<Traits, kPaged>,
                                              dim3(static_cast<unsigned>(seq_items), static_cast<unsigned>(p.num_kv_heads)),
                                              dim3(Traits::kThreads), static_cast<size_t>(Traits::kSmemBytes), stream, q1);
        if (err != cudaSuccess) return err;
        q.tree_phase = 2;  // phase 2: a work item per token over the rest, by rank
        q.split_state_lse = q1.split_state_lse;
      }
    }
    return launch_kernel(prefill_attention_kernel<Traits, kPaged>, grid, dim3(Traits::kThreads),
                         static_cast<size_t>(Traits::kSmemBytes), stream, q);
  }
  // Fixed mode: groups of chunks, each a kernel launch (grid.z = chunks of the group) writing the
  // partials, then a fold of the group into the running state (the last one into out / lse).
  const int64_t splits = num_key_splits(p), group = splits_per_launch(p, o);
  const int64_t rows = p.num_q_tokens * p.num_q_heads;
  unsigned char* ws = static_cast<unsigned char*>(p.split_workspace);
  float* running_out = reinterpret_cast<float*>(ws + align16(group * rows * D * 4) + align16(group * rows * 4));
  float* running_lse = running_out + rows * D;
  PrefillAttentionParams q = p;
  q.split_out = reinterpret_cast<float*>(ws);
  q.split_lse = reinterpret_cast<float*>(ws + align16(group * rows * D * 4));
  const int64_t merge_blocks = (rows + kSplitMergeWarps - 1) / kSplitMergeWarps;
  if (merge_blocks > 0x7fffffff) return cudaErrorInvalidValue;
  for (int64_t z0 = 0; z0 < splits; z0 += group) {
    const int64_t n = splits - z0 < group ? splits - z0 : group;
    q.split_begin = static_cast<int32_t>(z0);
    const dim3 grid(static_cast<unsigned>(items), static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(n));
    cudaError_t err = launch_kernel(prefill_attention_kernel<Traits, kPaged>, grid, dim3(Traits::kThreads),
                                    static_cast<size_t>(Traits::kSmemBytes), stream, q);
    if (err != cudaSuccess) return err;
    err = launch_kernel(prefill_merge_splits_kernel<T, D>, dim3(static_cast<unsigned>(merge_blocks)),
                        dim3(kSplitMergeWarps * 32), 0, stream, q, running_out, running_lse, static_cast<int>(n),
                        z0 == 0, z0 + n >= splits);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Head dims the dispatch macro offers but no kernel is built for are refused here (a template, so
// `if constexpr` keeps their kernels from being instantiated).
template <typename T, int D>
cudaError_t launch_head_dim(const PrefillAttentionParams& p, const PrefillOverrides& o, cudaStream_t stream) {
  if constexpr (!prefill_supports_head_dim(D)) {
    return cudaErrorInvalidValue;
  } else {
    switch (select_prefill_backend(p)) {
      case PrefillBackend::kMmaSyncSm80:
        return p.block_table != nullptr ? launch_mma_sync<T, D, true>(p, o, stream)
                                        : launch_mma_sync<T, D, false>(p, o, stream);
    }
    return cudaErrorInvalidValue;
  }
}

template <int D>
constexpr int32_t rows_per_cta_for() {
  if constexpr (prefill_supports_head_dim(D)) {
    return PrefillTraitsSm80<__half, D>::kBlockM;
  } else {
    return 0;
  }
}

// The tree rows' depths (tree attention with a window) and, with seq / keys, their keys by rank
// (the deterministic mode under a custom mask) into the tree scratch, first on the same stream so
// the attention kernel sees them.
cudaError_t launch_tree_rows(const PrefillAttentionParams& p, int32_t* seq, int32_t* keys, cudaStream_t stream) {
  if (p.batch_size > 65535) return cudaErrorInvalidValue;  // grid.y
  const dim3 grid(static_cast<unsigned>((p.max_seqlen_q + kTreeDepthWarps - 1) / kTreeDepthWarps),
                  static_cast<unsigned>(p.batch_size));
  return launch_kernel(tree_rows_kernel, grid, dim3(kTreeDepthWarps * 32), 0, stream, p, seq, keys);
}

}  // namespace
}  // namespace attention

size_t prefill_attention_workspace_size(const PrefillAttentionParams& p) {
  if (p.batch_size <= 0 || p.max_seqlen_q <= 0) return 0;
  if (attention::keys_by_rank(p))  // depth | sequence | keys of each query row
    return p.num_q_tokens <= 0 ? 0
                               : static_cast<size_t>(p.num_q_tokens) * (2 + static_cast<size_t>(p.max_seqlen_q)) *
                                     sizeof(int32_t);
  if (!attention::needs_tree_depth(p)) return 0;
  return static_cast<size_t>(p.batch_size) * static_cast<size_t>(p.max_seqlen_q) * sizeof(int32_t);
}

int64_t prefill_attention_num_key_splits(const PrefillAttentionParams& p) { return attention::num_key_splits(p); }
int64_t prefill_attention_splits_per_launch(const PrefillAttentionParams& p, const PrefillOverrides& o) {
  return attention::splits_per_launch(p, o);
}

size_t prefill_attention_split_workspace_size(const PrefillAttentionParams& p, const PrefillOverrides& o) {
  using attention::align16;
  if (p.fixed_split_size <= 0 || p.num_q_tokens <= 0 || p.num_q_heads <= 0 || p.head_dim <= 0) return 0;
  const int64_t rows = p.num_q_tokens * p.num_q_heads;
  if (!p.split_parallel)  // the fold's state; under a custom mask also its lse (two-launch fold)
    return static_cast<size_t>(align16(rows * p.head_dim * 4) + (attention::keys_by_rank(p) ? align16(rows * 4) : 0));
  const int64_t splits = attention::num_key_splits(p), group = attention::splits_per_launch(p, o);
  int64_t bytes = align16(group * rows * p.head_dim * 4) + align16(group * rows * 4);
  if (splits > group) bytes += align16(rows * p.head_dim * 4) + align16(rows * 4);
  return static_cast<size_t>(bytes);
}

int32_t prefill_attention_rows_per_cta(const PrefillAttentionParams& p) {
  int32_t rows = 0;
  FASTINFER_DISPATCH_HEAD_DIM(p.head_dim, D, [&] {
    rows = attention::rows_per_cta_for<D>();
    return cudaSuccess;
  });
  return rows;
}

int64_t prefill_attention_work_items(const PrefillAttentionParams& p) {
  const int32_t rows = prefill_attention_rows_per_cta(p);
  if (rows == 0 || p.batch_size <= 0 || p.max_seqlen_q <= 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0)
    return 0;
  return attention::work_items_bound(p, rows, attention::keys_by_rank(p));
}

cudaError_t launch_prefill_attention(const PrefillAttentionParams& p, cudaStream_t stream, const PrefillOverrides& o) {
  if (p.batch_size == 0 || p.max_seqlen_q == 0) return cudaSuccess;
  if (p.batch_size < 0 || p.max_seqlen_q < 0 || p.num_q_tokens < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0)
    return cudaErrorInvalidValue;
  if (!attention::prefill_supports_head_dim(p.head_dim)) return cudaErrorInvalidValue;
  if (p.num_kv_heads > 65535) return cudaErrorInvalidValue;  // grid.y
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr || p.cu_seqlens_q == nullptr)
    return cudaErrorInvalidValue;
  // cp.async and the 16-byte stores need 16-byte aligned rows.
  if (!is_aligned(p.q, 16) || !is_aligned(p.k, 16) || !is_aligned(p.v, 16) || !is_aligned(p.out, 16) ||
      p.q_token_stride % 8 != 0 || p.out_token_stride % 8 != 0 || p.q_token_stride < 0 || p.out_token_stride < 0)
    return cudaErrorInvalidValue;
  const bool paged = p.block_table != nullptr;
  const bool custom = attention::has_custom_mask(p);
  if (p.custom_mask != nullptr && p.packed_custom_mask != nullptr) return cudaErrorInvalidValue;  // one form
  if (paged) {
    if (p.seq_lens_k == nullptr || p.block_table_stride <= 0 || p.block_size < 8 || p.block_size > 256 ||
        (p.block_size & (p.block_size - 1)) != 0)
      return cudaErrorInvalidValue;
    if (custom && p.mask_offsets == nullptr) return cudaErrorInvalidValue;
    if ((attention::needs_tree_depth(p) || attention::keys_by_rank(p)) && p.tree_depth == nullptr)
      return cudaErrorInvalidValue;
  } else {
    if (p.cu_seqlens_k == nullptr || custom || p.k_token_stride % 8 != 0 || p.v_token_stride % 8 != 0 ||
        p.k_token_stride < 0 || p.v_token_stride < 0)
      return cudaErrorInvalidValue;
  }
  if (p.fixed_split_size < 0 || (p.fixed_split_size > 0 && (p.fixed_split_size % 64 != 0 || p.num_q_tokens <= 0 ||
                                                            p.split_workspace == nullptr ||
                                                            !is_aligned(p.split_workspace, 16) ||
                                                            (p.split_parallel && !paged && p.max_seqlen_k < 0))))
    return cudaErrorInvalidValue;
  PrefillAttentionParams r = p;
  if (paged && attention::keys_by_rank(p)) {  // scratch: depth | sequence | keys of each query row
    int32_t* seq = p.tree_depth + p.num_q_tokens;
    int32_t* keys = seq + p.num_q_tokens;
    const cudaError_t err = attention::launch_tree_rows(p, seq, keys, stream);
    if (err != cudaSuccess) return err;
    r.tree_rank_seq = seq;
    r.tree_rank_keys = keys;
  } else if (paged && attention::needs_tree_depth(p)) {
    const cudaError_t err = attention::launch_tree_rows(p, nullptr, nullptr, stream);
    if (err != cudaSuccess) return err;
  }
  return FASTINFER_DISPATCH_HALF(r.dtype, T, [&] {
    return FASTINFER_DISPATCH_HEAD_DIM(r.head_dim, D, [&] { return attention::launch_head_dim<T, D>(r, o, stream); });
  });
}

}  // namespace fastinfer
