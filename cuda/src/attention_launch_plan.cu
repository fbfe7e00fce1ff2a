// plan_prefill_launch (launch_plan.h): host arithmetic only, no CUDA call, so a host program can
// link it from the library and check the plans without a device (tests/host/prefill_launch_plan_checks.cpp).
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"

namespace fastinfer {
namespace attention {
namespace {

bool has_custom_mask(const PrefillAttentionParams& p) { return p.custom_mask != nullptr || p.packed_custom_mask != nullptr; }
bool needs_tree_depth(const PrefillAttentionParams& p) { return has_custom_mask(p) && p.window_left >= 0; }
// The deterministic mode under a custom mask takes each row's keys by rank (attention.h): one work
// item per query token.
bool keys_by_rank(const PrefillAttentionParams& p) {
  return p.fixed_split_size > 0 && p.block_table != nullptr && has_custom_mask(p);
}

// Upper bound of the work items (attention.h) for tiles of `rows`: the sequences' tiles or,
// per_token, ceil(group / rows) per query token.
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

// Keys per sequence at most (the split-parallel chunks and the default-mode split count in it).
int64_t key_bound(const PrefillAttentionParams& p) {
  return p.block_table != nullptr ? p.block_table_stride * p.block_size : static_cast<int64_t>(p.max_seqlen_k);
}
constexpr int64_t kSplitPartialBytes = int64_t{256} << 20;  // partials of one launch, at most
constexpr int64_t kMaxSplitsPerLaunch = 65535;               // grid.z
constexpr int64_t kMaxGridX = 0x7fffffff;

int64_t split_partial_bytes(const PrefillOverrides& o) {
  return o.fixed_split_partial_bytes > 0 ? o.fixed_split_partial_bytes : kSplitPartialBytes;
}
// Splits whose partials fit in `bound` bytes (at least 1, at most grid.z).
int64_t splits_within(int64_t bound, int64_t row_bytes) {
  int64_t g = row_bytes > 0 ? bound / row_bytes : kMaxSplitsPerLaunch;
  if (g < 1) g = 1;
  return g < kMaxSplitsPerLaunch ? g : kMaxSplitsPerLaunch;
}

// The deterministic fold under a custom mask in two launches (attention.h, tree_phase) when the
// sequences' own work items would give at least half the SMs a CTA; PrefillOverrides::
// tree_prefix_plan forces either way (tests: both give the same bits). Unknown SM count: one.
bool share_tree_prefix(int64_t sequence_ctas, const DeviceDescription& d, const PrefillOverrides& o) {
  if (o.tree_prefix_plan == TreePrefixPlan::kShared) return true;
  if (o.tree_prefix_plan == TreePrefixPlan::kPerToken) return false;
  return d.num_sms > 0 && 2 * sequence_ctas >= d.num_sms;
}

// The default mode's key splits (attention.h, "Split-KV in the default mode"): 0 or >= 2.
int64_t default_key_splits(const PrefillAttentionParams& p, int64_t ctas, int64_t row_bytes,
                           const DeviceDescription& d, const PrefillOverrides& o) {
  if (p.num_q_tokens <= 0 || ctas <= 0) return 0;  // the partials are laid out by query row
  int64_t s;
  if (o.default_key_splits > 0) {
    s = o.default_key_splits;
  } else {
    if (d.num_sms <= 0) return 0;
    s = d.num_sms / ctas;  // one wave at most
    const int64_t tiles = (key_bound(p) + kPrefillKeysPerTile - 1) / kPrefillKeysPerTile;
    if (tiles / kMinTilesPerDefaultSplit < s) s = tiles / kMinTilesPerDefaultSplit;
    const int64_t fit = splits_within(kSplitPartialBytes, row_bytes);
    if (fit < s) s = fit;
  }
  if (s > kMaxSplitsPerLaunch) s = kMaxSplitsPerLaunch;
  return s >= 2 ? s : 0;
}

size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Regions appended one after the other, each 16-byte aligned.
struct LayoutBuilder {
  size_t end = 0;
  WorkspaceRegion add(int64_t bytes) {
    if (bytes <= 0) return {};
    const WorkspaceRegion r{end, static_cast<size_t>(bytes)};
    end += align16(static_cast<size_t>(bytes));
    return r;
  }
};

PrefillLaunchPlan invalid() {
  PrefillLaunchPlan plan;
  plan.status = cudaErrorInvalidValue;
  return plan;
}

}  // namespace
}  // namespace attention

PrefillLaunchPlan plan_prefill_launch(const PrefillAttentionParams& p, const DeviceDescription& device,
                                      const PrefillOverrides& o) {
  using namespace attention;
  PrefillLaunchPlan plan;
  if (p.batch_size == 0 || p.max_seqlen_q == 0) return plan;  // nothing to do
  if (p.batch_size < 0 || p.max_seqlen_q < 0 || p.num_q_tokens < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || !prefill_supports_head_dim(p.head_dim) || p.num_kv_heads > 65535)
    return invalid();
  const bool paged = p.block_table != nullptr;
  if (p.fixed_split_size < 0 ||
      (p.fixed_split_size > 0 && (p.fixed_split_size % kPrefillKeysPerTile != 0 || p.num_q_tokens <= 0 ||
                                  (p.split_parallel && !paged && p.max_seqlen_k < 0))))
    return invalid();

  const int rows = prefill_rows_per_cta(p.head_dim);
  plan.rows_per_cta = rows;
  plan.keys_by_rank = keys_by_rank(p);
  plan.tree_rows = plan.keys_by_rank || (paged && needs_tree_depth(p));
  plan.work_items = work_items_bound(p, rows, plan.keys_by_rank);
  if (plan.work_items > kMaxGridX) return invalid();
  if (plan.tree_rows && p.batch_size > 65535) return invalid();  // the tree rows kernel's grid.y

  const int64_t q_rows = p.num_q_tokens * p.num_q_heads;  // (token, head) rows of the partials / state
  const int64_t d = p.head_dim;
  LayoutBuilder ws;
  if (plan.keys_by_rank) {  // depth | sequence | keys of each query row
    plan.layout.tree_depth = ws.add(p.num_q_tokens * 4);
    plan.layout.tree_rank_seq = ws.add(p.num_q_tokens * 4);
    plan.layout.tree_rank_keys = ws.add(p.num_q_tokens * static_cast<int64_t>(p.max_seqlen_q) * 4);
  } else if (plan.tree_rows) {
    plan.layout.tree_depth = ws.add(static_cast<int64_t>(p.batch_size) * p.max_seqlen_q * 4);
  }

  if (p.fixed_split_size > 0 && !p.split_parallel) {  // the in-kernel fold: the state (and its lse)
    plan.layout.split_state = ws.add(q_rows * d * 4);
    if (plan.keys_by_rank) {
      plan.layout.split_state_lse = ws.add(q_rows * 4);
      const int64_t seq_items = work_items_bound(p, rows, false);
      plan.tree_two_phase = seq_items <= kMaxGridX && share_tree_prefix(seq_items * p.num_kv_heads, device, o);
      if (plan.tree_two_phase) plan.work_items_phase1 = seq_items;
    }
  } else {
    const int64_t row_bytes = q_rows * (d + 1) * 4;  // one split's partials
    if (p.fixed_split_size > 0) {  // split-parallel: chunks of F keys over the key bound
      const int64_t keys = key_bound(p);
      plan.key_splits = keys <= 0 ? 1 : (keys + p.fixed_split_size - 1) / p.fixed_split_size;
      const int64_t g = splits_within(split_partial_bytes(o), row_bytes);
      plan.splits_per_launch = g < plan.key_splits ? g : plan.key_splits;
    } else {
      plan.key_splits = default_key_splits(p, plan.work_items * p.num_kv_heads, row_bytes, device, o);
      plan.default_split = plan.key_splits > 0;
      plan.splits_per_launch = plan.key_splits;
    }
    if (plan.key_splits > 0) {
      plan.merge_blocks = (q_rows + kSplitMergeWarps - 1) / kSplitMergeWarps;
      if (plan.merge_blocks > kMaxGridX) return invalid();
      plan.layout.split_out = ws.add(plan.splits_per_launch * q_rows * d * 4);
      plan.layout.split_lse = ws.add(plan.splits_per_launch * q_rows * 4);
      if (plan.key_splits > plan.splits_per_launch) {  // several launches: the running state between them
        plan.layout.running_out = ws.add(q_rows * d * 4);
        plan.layout.running_lse = ws.add(q_rows * 4);
      }
    }
  }
  plan.mode = plan.key_splits > 0        ? PrefillMode::kSplit
              : p.fixed_split_size > 0 ? PrefillMode::kFold
                                       : PrefillMode::kDefault;
  plan.workspace_bytes = ws.end;
  return plan;
}

}  // namespace fastinfer
