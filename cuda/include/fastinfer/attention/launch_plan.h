#pragma once
// The launch plan of the prefill attention kernel (torch-free, host only): every decision
// launch_prefill_attention takes before it launches, as a plain struct computed from the caller's
// PrefillAttentionParams, a DeviceDescription and the test overrides. launch_prefill_attention
// executes a plan and decides nothing itself; a caller asks the plan for the workspace bytes
// (plan.workspace_bytes, one allocation for every region below) before the launch.
//
// What the plan decides:
//  - work items: the grid's x bound and the rows of one CTA (attention.h, work items);
//  - the tree rows kernel (tree depths; in the deterministic mode the keys by rank) and, in the
//    deterministic mode under a custom mask, one launch of per-token items or the two-launch fold
//    (tree_phase 1 and 2), by the device's SM count;
//  - key splits: the deterministic mode's chunks of F keys (split-parallel: a CTA per chunk,
//    groups of chunks per launch bounded by the partials' bytes), and in the default mode a split
//    of each CTA's key range into `key_splits` parts of whole 64-key tiles, a CTA per part, when
//    (work items x KV heads) CTAs would leave most SMs idle and the sequences have many keys
//    (attention.h, "Split-KV in the default mode");
//  - the workspace layout: 16-byte aligned byte offsets of each region in one workspace.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fastinfer {

struct PrefillAttentionParams;  // attention.h

namespace attention {
// The prefill kernel's tile shape, which the plans count in (prefill_traits.cuh, PrefillTraitsSm80): warps
// of 16 rows, 8 per CTA for head dims 64 and 128, 4 for 256 (whose Q tile and output accumulators
// are twice as large); K/V tiles of 64 keys (16 for head dim 256). kPrefillKeysPerTile is the
// unit the plans count keys in and the deterministic mode's chunks are multiples of: a multiple of
// every kernel's K/V tile.
constexpr bool prefill_supports_head_dim(int d) { return d == 64 || d == 128 || d == 256; }
constexpr int prefill_rows_per_cta(int d) { return d <= 128 ? 128 : 64; }
constexpr int prefill_keys_per_tile(int d) { return d <= 128 ? 64 : 16; }
constexpr int kPrefillKeysPerTile = 64;
// Rows (warps) per CTA of prefill_merge_splits_kernel and of tree_rows_kernel.
constexpr int kSplitMergeWarps = 4;
constexpr int kTreeDepthWarps = 4;
// The default-mode split keeps each part at least this many 64-key tiles of the key bound.
constexpr int kMinTilesPerDefaultSplit = 4;
}  // namespace attention

// What the plans need to know of a device: queried once per device (query_device_description, a
// CUDA runtime query, in cuda/src/attention_prefill.cu) and kept by the caller, so no launch
// queries the device.
struct DeviceDescription {
  int32_t num_sms = 0;  // 0: unknown (no choice by occupancy: no default-mode split, one tree launch)
  int32_t cc_major = 0, cc_minor = 0;
};
cudaError_t query_device_description(int device, DeviceDescription* out);

// Test overrides of the plan's own choices (the bindings fill them from FASTINFER_TEST_*; the
// library never reads the environment). Every choice gives a correct result; in the deterministic
// mode each gives the same bits.
enum class TreePrefixPlan {
  kBySmCount,  // two launches when the sequences' work items give at least half the SMs a CTA
  kShared,     // always the two launches (phase 1 over the shared prefix chunks, then per token)
  kPerToken,   // always one launch of per-token work items
};
struct PrefillOverrides {
  int64_t fixed_split_partial_bytes = 0;  // > 0: bound of one split-parallel launch's partials (else 256 MiB)
  TreePrefixPlan tree_prefix_plan = TreePrefixPlan::kBySmCount;
  int32_t default_key_splits = 0;         // > 0: the default mode's key splits whatever the occupancy (1: none)
};

// One region of the workspace: [offset, offset + bytes), offset a multiple of 16; bytes 0: absent.
struct WorkspaceRegion {
  size_t offset = 0;
  size_t bytes = 0;
};

struct PrefillWorkspaceLayout {
  // int32 [num tree rows]: node depths (custom mask with a window, or deterministic keys by rank).
  WorkspaceRegion tree_depth;
  // Deterministic keys by rank: the sequence of each query row, its visible trailing keys
  // [num_q_tokens][max_seqlen_q] (int32).
  WorkspaceRegion tree_rank_seq, tree_rank_keys;
  // In-kernel fold (deterministic, not split-parallel): fp32 state [rows][D], and under a custom
  // mask its lse [rows] (rows = num_q_tokens * Hq).
  WorkspaceRegion split_state, split_state_lse;
  // Split-parallel (deterministic) and the default-mode split: fp32 partials of one launch
  // [splits_per_launch][rows][D] and their lse [splits_per_launch][rows]; the running state
  // [rows][D] / [rows] between launches when there are several.
  WorkspaceRegion split_out, split_lse, running_out, running_lse;
};

// What a prefill kernel instance does with the keys of its rows: a template parameter of the
// kernel, so each mode is an instance of its own without the other modes' state and branches.
enum class PrefillMode : int32_t {
  kDefault,  // all of a CTA's keys: normalise, write out and lse
  kSplit,    // a part of them (key splits): fp32 partials that prefill_merge_splits_kernel combines
  kFold,     // the deterministic in-kernel fold of fixed_split_size chunks (and the tree phases)
};

struct PrefillLaunchPlan {
  cudaError_t status = cudaSuccess;  // cudaErrorInvalidValue: the shape is refused (nothing else is set)
  PrefillMode mode = PrefillMode::kDefault;  // the kernel instance every attention launch runs
  int32_t rows_per_cta = 0;          // kBlockM of the head dim's kernel
  // Work items of the attention kernel's grid (x); 0: nothing to launch.
  int64_t work_items = 0;
  bool keys_by_rank = false;         // deterministic mode under a custom mask: a work item per query token
  bool tree_rows = false;            // the tree rows kernel runs first (depths; with keys_by_rank, the keys)
  // The deterministic fold under a custom mask in two launches (phase 1 over the sequences' own
  // work_items_phase1 items, phase 2 per token), else one.
  bool tree_two_phase = false;
  int64_t work_items_phase1 = 0;
  // Key splits: 0 = none (one CTA per work item and KV head over all its keys, or the in-kernel
  // fold); deterministic split-parallel: chunks of fixed_split_size keys over the key bound;
  // default mode: parts of each CTA's key range (key_splits >= 2).
  int64_t key_splits = 0;
  bool default_split = false;        // key_splits are the default mode's parts
  int64_t splits_per_launch = 0;     // grid.z of one launch (all key_splits but in the deterministic mode)
  int64_t merge_blocks = 0;          // grid of prefill_merge_splits_kernel (with key splits)
  PrefillWorkspaceLayout layout;
  size_t workspace_bytes = 0;        // PrefillAttentionParams::workspace needs at least this much
};

// The plan of a launch of params on `device` (status != cudaSuccess: shapes the launcher refuses:
// head dim, Hq % Hkv, negative sizes). Pure host arithmetic on params' sizes; pointers are not read.
PrefillLaunchPlan plan_prefill_launch(const PrefillAttentionParams& params, const DeviceDescription& device,
                                      const PrefillOverrides& overrides = {});

}  // namespace fastinfer
