// Host checks of the prefill attention launch plan (fastinfer/attention/launch_plan.h) that need
// no device: plan_prefill_launch on a table of shapes (decode-like, tree verification, long
// prefill, chunked-prefill continuations, the default-mode key split, the deterministic mode's
// fold, keys by rank and split-parallel launches, the test overrides, refused shapes), its work
// items, split choices and workspace layout against values worked out by hand from the rules in
// attention.h. Built and run by tests/test_launch_plan.py against the installed
// lib/libfastinfer_kernels_simt.a (the plan is host code, the same object in either library).
// Prints OK on success.
#include <cstdio>
#include <cstdint>

#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"

using namespace fastinfer;

static int failures = 0;
#define CHECK_EQ(a, b)                                                                                    \
  do {                                                                                                    \
    const long long va = static_cast<long long>(a), vb = static_cast<long long>(b);                       \
    if (va != vb) {                                                                                       \
      std::printf("FAILED line %d: %s == %s (%lld vs %lld)\n", __LINE__, #a, #b, va, vb);                 \
      ++failures;                                                                                         \
    }                                                                                                     \
  } while (0)

static const DeviceDescription kH200{132, 9, 0};
static const DeviceDescription kUnknown{};

// Llama-3-8B heads: Hq / Hkv 32 / 8 (group 4), D 128; shapes only (the plan reads no pointer but
// which ones are set).
static PrefillAttentionParams base(int batch, int max_q, int64_t tokens) {
  PrefillAttentionParams p;
  p.batch_size = batch;
  p.num_q_heads = 32;
  p.num_kv_heads = 8;
  p.head_dim = 128;
  p.max_seqlen_q = max_q;
  p.num_q_tokens = tokens;
  return p;
}
static const bool kMaskByte = true;
static const int32_t kTableEntry = 0;
static PrefillAttentionParams paged(int batch, int max_q, int64_t tokens, int64_t table_stride, int block_size = 16) {
  PrefillAttentionParams p = base(batch, max_q, tokens);
  p.block_table = &kTableEntry;
  p.block_table_stride = table_stride;
  p.block_size = block_size;
  return p;
}
static PrefillAttentionParams tree(int batch, int nodes, int64_t table_stride) {
  PrefillAttentionParams p = paged(batch, nodes, static_cast<int64_t>(batch) * nodes, table_stride);
  p.custom_mask = &kMaskByte;
  return p;
}

static void check_region(const WorkspaceRegion& r, size_t offset, size_t bytes, int line) {
  if (r.offset != offset || r.bytes != bytes) {
    std::printf("FAILED line %d: region (%zu, %zu), expected (%zu, %zu)\n", line, r.offset, r.bytes, offset, bytes);
    ++failures;
  }
}
#define CHECK_REGION(r, offset, bytes) check_region(r, offset, bytes, __LINE__)

static void check_no_split(const PrefillLaunchPlan& plan, int line) {
  if (plan.key_splits != 0 || plan.splits_per_launch != 0 || plan.merge_blocks != 0 || plan.default_split) {
    std::printf("FAILED line %d: unexpected key splits %lld\n", line, static_cast<long long>(plan.key_splits));
    ++failures;
  }
}

int main() {
  // Refused shapes, the empty batch.
  {
    PrefillAttentionParams p = base(1, 1, 1);
    p.head_dim = 96;
    CHECK_EQ(plan_prefill_launch(p, kH200).status, cudaErrorInvalidValue);
    p = base(1, 1, 1);
    p.num_kv_heads = 3;
    CHECK_EQ(plan_prefill_launch(p, kH200).status, cudaErrorInvalidValue);
    p = base(1, 1, 1);
    p.fixed_split_size = 100;  // not a multiple of 64
    CHECK_EQ(plan_prefill_launch(p, kH200).status, cudaErrorInvalidValue);
    p = base(1, 1, 0);
    p.fixed_split_size = 64;  // the deterministic mode needs the token count
    CHECK_EQ(plan_prefill_launch(p, kH200).status, cudaErrorInvalidValue);
    p = base(0, 0, 0);
    const PrefillLaunchPlan empty = plan_prefill_launch(p, kH200);
    CHECK_EQ(empty.status, cudaSuccess);
    CHECK_EQ(empty.work_items, 0);
    CHECK_EQ(empty.workspace_bytes, 0);
  }

  // Long prefill, contiguous: 8192 tokens of one sequence, 8192 * 4 / 128 = 256 work items x 8 KV
  // heads (2048 CTAs): no split, no workspace.
  {
    PrefillAttentionParams p = base(1, 8192, 8192);
    p.max_seqlen_k = 8192;
    const PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.status, cudaSuccess);
    CHECK_EQ(plan.rows_per_cta, 128);
    CHECK_EQ(plan.work_items, 256);
    CHECK_EQ(plan.tree_rows, false);
    check_no_split(plan, __LINE__);
    CHECK_EQ(plan.workspace_bytes, 0);
  }

  // The work-item bound of a ragged batch (attention.h): 16 sequences, max q 1024, 1024 + 15 * 8
  // tokens: loose 16 * 32, tight (4576 + 16 * 127) / 128 = 51.
  {
    PrefillAttentionParams p = paged(16, 1024, 0, 64);
    CHECK_EQ(plan_prefill_launch(p, kH200).work_items, 16 * 32);
    p.num_q_tokens = 1024 + 15 * 8;
    CHECK_EQ(plan_prefill_launch(p, kH200).work_items, (4576 + 16 * 127) / 128);
  }

  // Tree verification, default mode: B = 1, 16 nodes (64 rows: one work item per KV head).
  {
    PrefillAttentionParams p = tree(1, 16, 256);
    PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.work_items, 1);
    CHECK_EQ(plan.tree_rows, false);
    CHECK_EQ(plan.keys_by_rank, false);
    // with a window: the nodes' depths first (B * max_q int32)
    p.window_left = 100;
    plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.tree_rows, true);
    CHECK_REGION(plan.layout.tree_depth, 0, 64);
  }

  // Deterministic mode, tree rows by rank (F = 256), 16 nodes: a work item per token, the
  // scratch depth | sequence | keys, then the fold's state and its lse; one launch by SM count
  // (8 CTAs of the sequence's own items < half of 132 SMs), two when forced or on 8 SMs.
  {
    PrefillAttentionParams p = tree(1, 16, 256);
    p.fixed_split_size = 256;
    PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.status, cudaSuccess);
    CHECK_EQ(plan.keys_by_rank, true);
    CHECK_EQ(plan.tree_rows, true);
    CHECK_EQ(plan.work_items, 16);
    CHECK_EQ(plan.tree_two_phase, false);
    check_no_split(plan, __LINE__);
    CHECK_REGION(plan.layout.tree_depth, 0, 64);
    CHECK_REGION(plan.layout.tree_rank_seq, 64, 64);
    CHECK_REGION(plan.layout.tree_rank_keys, 128, 16 * 16 * 4);
    CHECK_REGION(plan.layout.split_state, 1152, 16 * 32 * 128 * 4);
    CHECK_REGION(plan.layout.split_state_lse, 1152 + 262144, 16 * 32 * 4);
    CHECK_EQ(plan.workspace_bytes, 1152 + 262144 + 2048);
    PrefillOverrides shared;
    shared.tree_prefix_plan = TreePrefixPlan::kShared;
    plan = plan_prefill_launch(p, kH200, shared);
    CHECK_EQ(plan.tree_two_phase, true);
    CHECK_EQ(plan.work_items_phase1, 1);
    CHECK_EQ(plan.work_items, 16);
    CHECK_EQ(plan_prefill_launch(p, DeviceDescription{8, 9, 0}).tree_two_phase, true);
    CHECK_EQ(plan_prefill_launch(p, kUnknown).tree_two_phase, false);
    PrefillOverrides per_token;
    per_token.tree_prefix_plan = TreePrefixPlan::kPerToken;
    CHECK_EQ(plan_prefill_launch(p, DeviceDescription{8, 9, 0}, per_token).tree_two_phase, false);
  }

  // Deterministic prefill (in-kernel fold, no custom mask): the state only.
  {
    PrefillAttentionParams p = base(2, 100, 150);
    p.fixed_split_size = 64;
    const PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    check_no_split(plan, __LINE__);
    CHECK_REGION(plan.layout.split_state, 0, 150 * 32 * 128 * 4);
    CHECK_EQ(plan.layout.split_state_lse.bytes, 0);
    CHECK_EQ(plan.workspace_bytes, 150 * 32 * 128 * 4);
  }

  // Deterministic decode (split-parallel): 64 sequences, key bound 256 * 16 = 4096, F = 256: 16
  // chunks in one launch (16 x 1 MiB of partials); with the partials of a launch bounded at three
  // chunks' worth, launches of 3, 3, 3, 3, 3, 1 chunks and the running state between them.
  {
    PrefillAttentionParams p = paged(64, 1, 64, 256);
    p.fixed_split_size = 256;
    p.split_parallel = true;
    PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    const int64_t rows = 64 * 32, row_bytes = rows * 129 * 4;
    CHECK_EQ(plan.work_items, 64);
    CHECK_EQ(plan.key_splits, 16);
    CHECK_EQ(plan.splits_per_launch, 16);
    CHECK_EQ(plan.default_split, false);
    CHECK_EQ(plan.merge_blocks, rows / 4);
    CHECK_REGION(plan.layout.split_out, 0, 16 * rows * 128 * 4);
    CHECK_REGION(plan.layout.split_lse, 16 * rows * 128 * 4, 16 * rows * 4);
    CHECK_EQ(plan.layout.running_out.bytes, 0);
    CHECK_EQ(plan.workspace_bytes, 16 * row_bytes);
    PrefillOverrides bounded;
    bounded.fixed_split_partial_bytes = 3 * row_bytes;
    plan = plan_prefill_launch(p, kH200, bounded);
    CHECK_EQ(plan.key_splits, 16);
    CHECK_EQ(plan.splits_per_launch, 3);
    CHECK_REGION(plan.layout.split_out, 0, 3 * rows * 128 * 4);
    CHECK_REGION(plan.layout.split_lse, 3 * rows * 128 * 4, 3 * rows * 4);
    CHECK_REGION(plan.layout.running_out, 3 * row_bytes, rows * 128 * 4);
    CHECK_REGION(plan.layout.running_lse, 3 * row_bytes + rows * 128 * 4, rows * 4);
    CHECK_EQ(plan.workspace_bytes, 4 * row_bytes);
    bounded.fixed_split_partial_bytes = 1;  // at least one chunk per launch
    CHECK_EQ(plan_prefill_launch(p, kH200, bounded).splits_per_launch, 1);
  }

  // Split-KV in the default mode (attention.h). Tree verification, B = 1, 16 nodes at ctx 4096
  // (a 256-entry block table of 16-key blocks): 1 work item x 8 KV heads = 8 CTAs on 132 SMs, so
  // S = min(132 / 8, 64 tiles / 4) = 16 parts of 4 tiles, 128 CTAs; partials [16][512 rows][128]
  // fp32 and their lse, merged by 512 / 4 blocks.
  {
    PrefillAttentionParams p = tree(1, 16, 256);
    PrefillLaunchPlan plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.default_split, true);
    CHECK_EQ(plan.key_splits, 16);
    CHECK_EQ(plan.splits_per_launch, 16);
    CHECK_EQ(plan.merge_blocks, 128);
    CHECK_REGION(plan.layout.split_out, 0, 16 * 512 * 128 * 4);
    CHECK_REGION(plan.layout.split_lse, 16 * 512 * 128 * 4, 16 * 512 * 4);
    CHECK_EQ(plan.layout.running_out.bytes, 0);
    CHECK_EQ(plan.workspace_bytes, 16 * 512 * 129 * 4);
    check_no_split(plan_prefill_launch(p, kUnknown), __LINE__);  // no SM count, no choice by occupancy
    p.window_left = 100;  // the depths first, then the partials
    plan = plan_prefill_launch(p, kH200);
    CHECK_EQ(plan.key_splits, 16);
    CHECK_REGION(plan.layout.tree_depth, 0, 64);
    CHECK_REGION(plan.layout.split_out, 64, 16 * 512 * 128 * 4);
    // a short context: 256 keys are 4 tiles, too few to split
    check_no_split(plan_prefill_launch(tree(1, 16, 16), kH200), __LINE__);
    // 16 trees of 8 nodes at ctx 1024: 16 x 8 = 128 CTAs already
    check_no_split(plan_prefill_launch(tree(16, 8, 64), kH200), __LINE__);
  }

  // A 128-token chunk continuing a 32k context, B = 1 (paged, causal): 4 work items x 8 KV heads
  // = 32 CTAs, S = 132 / 32 = 4 parts of the 512 tiles.
  {
    const PrefillLaunchPlan plan = plan_prefill_launch(paged(1, 128, 128, 2048), kH200);
    CHECK_EQ(plan.work_items, 4);
    CHECK_EQ(plan.key_splits, 4);
    CHECK_EQ(plan.default_split, true);
    CHECK_EQ(plan.workspace_bytes, 4 * 128 * 32 * 129 * 4);
  }

  // Contiguous K/V: the key bound is max_seqlen_k (0: unknown, no split).
  {
    PrefillAttentionParams p = base(1, 16, 16);
    check_no_split(plan_prefill_launch(p, kH200), __LINE__);
    p.max_seqlen_k = 4096;
    CHECK_EQ(plan_prefill_launch(p, kH200).key_splits, 16);
  }

  // The override: S parts whatever the occupancy (1: none); the deterministic mode ignores it.
  {
    PrefillOverrides forced;
    forced.default_key_splits = 3;
    PrefillAttentionParams p = tree(1, 16, 16);
    PrefillLaunchPlan plan = plan_prefill_launch(p, kUnknown, forced);
    CHECK_EQ(plan.key_splits, 3);
    CHECK_EQ(plan.default_split, true);
    CHECK_EQ(plan.workspace_bytes, 3 * 16 * 32 * 129 * 4);  // 16 tokens x 32 heads
    CHECK_EQ(plan_prefill_launch(base(1, 8192, 8192), kH200, forced).key_splits, 3);
    forced.default_key_splits = 1;
    check_no_split(plan_prefill_launch(p, kH200, forced), __LINE__);
    forced.default_key_splits = 3;
    p.fixed_split_size = 64;
    plan = plan_prefill_launch(p, kH200, forced);
    CHECK_EQ(plan.default_split, false);
    check_no_split(plan, __LINE__);  // the in-kernel fold
  }

  // The kernel instance (mode) of each plan: default without splits, split with key splits of
  // either mode, the fold for the deterministic mode without split-parallel.
  {
    CHECK_EQ(static_cast<int>(plan_prefill_launch(base(4, 512, 2048), kH200).mode),
             static_cast<int>(PrefillMode::kDefault));
    CHECK_EQ(static_cast<int>(plan_prefill_launch(tree(1, 16, 256), kH200).mode), static_cast<int>(PrefillMode::kSplit));
    PrefillAttentionParams p = tree(1, 16, 256);
    p.fixed_split_size = 64;
    CHECK_EQ(static_cast<int>(plan_prefill_launch(p, kH200).mode), static_cast<int>(PrefillMode::kFold));
    p.split_parallel = true;
    CHECK_EQ(static_cast<int>(plan_prefill_launch(p, kH200).mode), static_cast<int>(PrefillMode::kSplit));
    CHECK_EQ(static_cast<int>(plan_prefill_launch(tree(1, 16, 16), kH200).mode), static_cast<int>(PrefillMode::kDefault));
  }

  // Head dim 256 (Gemma): 64-row CTAs, so a 300-token prefill of 8 query heads over 4 KV heads
  // (group 2, 600 rows) is ceil(600 / 64) = 10 work items; the plans still count keys in 64-key
  // units (a multiple of the kernel's 16-key tiles), so the deterministic chunks are unchanged.
  {
    PrefillAttentionParams p = base(1, 300, 300);
    p.num_q_heads = 8;
    p.num_kv_heads = 4;
    p.head_dim = 256;
    PrefillLaunchPlan plan = plan_prefill_launch(p, kUnknown);
    CHECK_EQ(plan.status, cudaSuccess);
    CHECK_EQ(plan.rows_per_cta, 64);
    CHECK_EQ(plan.work_items, 10);
    p.fixed_split_size = 64;
    plan = plan_prefill_launch(p, kUnknown);
    CHECK_EQ(static_cast<int>(plan.mode), static_cast<int>(PrefillMode::kFold));
    CHECK_REGION(plan.layout.split_state, 0, 300 * 8 * 256 * 4);
    p.head_dim = 192;  // no kernel
    CHECK_EQ(plan_prefill_launch(p, kUnknown).status, cudaErrorInvalidValue);
  }

  std::printf("%s\n", failures ? "FAILED" : "OK");
  return failures ? 1 : 0;
}
