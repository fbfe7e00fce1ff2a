#pragma once
// Attention launchers (torch-free C++ API). Conventions shared by every kernel here:
//  - q, k, v, out: [tokens, heads, head_dim] with the heads packed (stride head_dim) and a free
//    token stride; GQA maps query head h to KV head h / (num_q_heads / num_kv_heads).
//  - Paged KV cache per layer: [num_blocks, block_size, num_kv_heads, head_dim], contiguous;
//    block_table [batch, block_table_stride] int32 maps logical block j of a sequence to a
//    physical block; token i of a sequence lives in block block_table[b][i / BS], row i % BS.
//  - Scores s = (q . k) * scale; with softcap > 0: s = softcap * tanh(s / softcap).
//  - Causal masks are bottom-right aligned: query i of a sequence with q_len queries and k_len
//    keys has absolute position p = k_len - q_len + i and sees keys j <= p; with window_left = W
//    >= 0 it sees keys j in [p - W, p] (the window applies to non-causal attention too).
//  - Tree attention (custom mask) with a window: the window applies on top of the mask, by
//    absolute position. Tree node i (query i, and trailing key k_len - q_len + i) is at
//    p_i = k_len - q_len + depth(i), depth(i) = (number of trailing keys mask row i sees) - 1 (its
//    depth when row i sees exactly its ancestors and itself); prefix key j is at j. Query i sees
//    the keys the mask lets it see (prefix keys, mask-allowed trailing keys) whose position is
//    >= p_i - W.
//  - lse (optional, float32 [tokens, num_q_heads]): natural log of the sum of exp(s) over the
//    visible keys. A query that sees no key gets out = 0 and lse = -inf (never NaN); one that
//    sees a NaN score (a NaN query or visible key) gets NaN out and lse, and a visible NaN value
//    is NaN in those elements of out (docs/design.md; the prefill kernel's P.V also carries a
//    hidden NaN value row to the rows of its 64-key tile).
//  - Attention sinks (optional, float32 [num_q_heads], gpt-oss): query head h adds one logit
//    sinks[h], in the domain of s (after scale and softcap), to every softmax denominator with no
//    value row: out = sum_j exp(s_j) v_j / (exp(sinks[h]) + sum_j exp(s_j)). The lse includes it,
//    log(exp(sinks[h]) + sum_j exp(s_j)); a query that sees no key gets out = 0 and lse =
//    sinks[h]. Split-KV partials leave it out and their merge counts it once (state_merge.cuh:
//    merged after the last key, in the deterministic mode after the last chunk). merge_attention_states
//    knows nothing of sinks: merging two results that both include a sink counts it twice.
//
// Deterministic mode (fixed_split_size = F > 0, the ops' `fixed_split_size`). The default kernels
// reduce a query row's keys in an order that depends on the call: decode splits the keys by a
// count chosen from B x Hkv and the SM count and sums them with CUDA-core FMAs, prefill sums all
// keys in one mma.sync pass. With F > 0 every row's keys are reduced the same way in all three
// ops: in chunks [c F, (c + 1) F) from absolute key 0, each chunk by one prefill-kernel CTA (its
// 64-key tiles aligned at absolute multiples of 64, so a tile's keys sit in the same fragment
// lanes whatever the row's q_len, window start or tile), written as an fp32 partial (out / l,
// lse), and the partials folded left to right by prefill_merge_splits_kernel (an empty chunk is
// skipped, so the number of splits launched does not matter). Decode in this mode is the same
// kernel on q_len = 1 rows (launch_decode_attention is not used). What a row's bits depend on:
// its query, its visible keys and their indices, scale / softcap / window, F, dtype and the
// architecture; not the batch, the CTA's other rows (GQA packing, other tokens, padding rows: a
// row's scores, softmax and P V accumulation only read its own fragment row, and tiles it sees
// nothing of are exact identities), q_len, chunking or split counts. Under a custom mask (tree
// verification) the keys are taken by rank: a row's visible keys in index order, the prefix keys
// then the trailing keys its mask row sees, so a tree node's ancestors occupy the indices they
// have in the plain sequence, whatever the tree's layout (tree_rows_kernel lists them; each query
// token is then a work item of its own, q_len = 1 against its prefix + count keys, as in decode;
// the whole chunks of the prefix may be folded first by the sequence's work items: tree_phase).
// The row's position is its rank (prefix + depth), the window applies by rank: for a tree mask
// (a row sees its ancestors and itself) that is the tree position rule above. Limits: head_dim
// 256 is not supported; the cost is the split workspace traffic, for decode
// CTAs of 128 rows holding `group` rows, and for tree rows the prefix read once per node instead
// of once per tree (bench/model.py, "model").
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/attention/launch_plan.h"
#include "fastinfer/common/types.h"

namespace fastinfer {

// Prefill over a ragged batch of B sequences; queries of sequence b are rows
// cu_seqlens_q[b] .. cu_seqlens_q[b+1] of q. K/V come either from contiguous ragged tensors
// (cu_seqlens_k != nullptr) or from the paged cache (block_table != nullptr), in which case the
// q_len queries of a sequence are its LAST q_len tokens, already written to the cache.
struct PrefillAttentionParams {
  const void* q = nullptr;  // [T, Hq, D]
  const void* k = nullptr;  // contiguous: [Tk, Hkv, D]; paged: k_cache [NB, BS, Hkv, D]
  const void* v = nullptr;
  void* out = nullptr;      // [T, Hq, D]
  float* lse = nullptr;     // [T, Hq] or nullptr

  const int32_t* cu_seqlens_q = nullptr;  // [B + 1], device
  const int32_t* cu_seqlens_k = nullptr;  // [B + 1], device (contiguous K/V)
  const int32_t* seq_lens_k = nullptr;    // [B], device (paged K/V): keys per sequence
  const int32_t* block_table = nullptr;   // [B, block_table_stride], device (paged K/V)
  int64_t block_table_stride = 0;
  int32_t block_size = 0;                 // paged: power of two in [8, 256]

  // Tree attention (paged path only): for sequence b with q_len queries, a [q_len, q_len] block
  // of entries starting at entry mask_offsets[b]: row i says which of the trailing q_len keys
  // query i sees (it replaces the causal rule among them; prefix keys stay visible). Two storage
  // forms, at most one given: custom_mask, one bool per entry; packed_custom_mask, 8 entries per
  // byte (entry e is bit e % 8 of byte e / 8, little-endian bit order: the whole flattened batch
  // mask packed at once, so a sequence may start mid-byte; numpy.packbits(m, bitorder="little")).
  const bool* custom_mask = nullptr;
  const uint8_t* packed_custom_mask = nullptr;
  const int64_t* mask_offsets = nullptr;  // [B + 1], device: prefix sums of q_len^2 (entries)

  int32_t batch_size = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;                   // 64, 128 or 256
  int32_t max_seqlen_q = 0;               // upper bound of q_len over the batch (sizes the grid)
  int64_t num_q_tokens = 0;               // rows of q (cu_seqlens_q[B]) when known, else 0: with it
                                          // the grid is within B CTAs per KV head of the work
  int64_t q_token_stride = 0;             // elements
  int64_t k_token_stride = 0;             // contiguous K/V only
  int64_t v_token_stride = 0;
  int64_t out_token_stride = 0;

  float scale = 1.0f;
  bool causal = true;
  int32_t window_left = -1;               // < 0: no window
  float softcap = 0.0f;                   // <= 0: none
  DType dtype = DType::kBFloat16;         // q, k, v, out: float16 or bfloat16
  const float* sinks = nullptr;           // [num_q_heads] attention sinks, or nullptr
  // Paged K/V only: kFloat8E4M3 for a float8 e4m3 cache (any other value: the cache is in dtype),
  // which needs the dequantisation scales (device; KV head h's is k_scale[h * k_scale_stride], stride 0: one per tensor, 1: one per
  // KV head). The kernel converts each K/V tile to dtype exactly (times 2^-8) in shared memory and
  // applies the scales in fp32: k_scale to the scores, v_scale to the output.
  DType cache_dtype = DType::kBFloat16;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int32_t k_scale_stride = 0, v_scale_stride = 0;

  // Deterministic mode (see above): F > 0, a multiple of 64. Needs num_q_tokens > 0. Two ways to
  // run it with the same bits: one CTA folds all chunks of its rows (split_parallel = false: the
  // prefill shapes) or a CTA per chunk plus a merge kernel (split_parallel = true: decode, where
  // one CTA per (sequence, KV head) would leave the GPU idle; needs the key bound: contiguous
  // max_seqlen_k, paged block_table_stride * block_size).
  int32_t fixed_split_size = 0;
  bool split_parallel = false;
  // Upper bound of k_len (contiguous K/V): the key bound of the split-parallel mode and of the
  // default-mode split (launch_plan.h); 0: unknown (no default-mode split).
  int32_t max_seqlen_k = 0;
  // Scratch of plan_prefill_launch(params, ...).workspace_bytes bytes, 16-byte aligned, device
  // (nullptr when that is 0): the tree rows, the deterministic mode's state or partials, the
  // default-mode split's partials (launch_plan.h, PrefillWorkspaceLayout).
  void* workspace = nullptr;
};

// The launch grid of the attention kernel: (work items, num_kv_heads[, key splits]). A work item
// is one tile of plan.rows_per_cta rows of one sequence, a row being a (query token, query head of
// the KV head's group) pair; sequence b has ceil(q_len_b * group / rows) items. The host does not
// know the q_len_b (they are on the device), so the item count is the bound
// min(B * ceil(max_seqlen_q * group / rows), floor((num_q_tokens * group + min(B, num_q_tokens) *
// (rows - 1)) / rows)) (the second term only when num_q_tokens > 0); the CTAs past the real count
// exit at once. In the deterministic mode under a custom mask a work item is one query token's
// ceil(group / rows) tiles: num_q_tokens * ceil(group / rows) (phase 2, or the only launch).
// Deterministic mode, split-parallel: chunks of the key bound, and groups of chunks per kernel
// launch (bounded so the partials take at most ~256 MiB), each followed by a merge launch.
//
// Split-KV in the default mode (fixed_split_size == 0). When (work items x num_kv_heads) CTAs
// would leave most SMs idle and the sequences may have many keys (the key bound: paged
// block_table_stride * block_size, contiguous max_seqlen_k), the plan splits the key range of
// every CTA (the keys its rows can see under the causal rule and the window) into S parts of
// whole 64-key tiles, ceil(tiles / S) tiles each, one CTA per (work item, KV head, part) (grid.z
// = S). S = min(floor(num_sms / CTAs), key bound tiles / 4, the partials' bound): one wave of
// CTAs at most, each part at least four tiles of the longest sequence. Each CTA writes its rows'
// fp32 partials (out / l and the lse of its part; a part a row sees nothing of: zeros and -inf)
// and prefill_merge_splits_kernel folds the S partials of each row (empty ones skipped: exact)
// into out in dtype and the merged lse. Results differ from the unsplit kernel's by rounding only
// (the default mode promises no bits; the deterministic mode is unaffected).
//
// plan must be plan_prefill_launch(params, ...) for these params (its workspace in
// params.workspace).
cudaError_t launch_prefill_attention(const PrefillAttentionParams& params, const PrefillLaunchPlan& plan,
                                     cudaStream_t stream);

// Decode: one query per sequence against its paged KV (seq_lens[b] keys, the query being the
// last token, absolute position seq_lens[b] - 1). Split-KV: num_splits CTAs per (sequence, KV
// head) each reduce a slice of the keys into fp32 partials in `workspace`, merged by a second
// kernel; num_splits == 1 writes out directly.
struct DecodeAttentionParams {
  const void* q = nullptr;        // [B, Hq, D]
  const void* k_cache = nullptr;  // [NB, BS, Hkv, D], dtype or fp8 e4m3
  const void* v_cache = nullptr;
  void* out = nullptr;            // [B, Hq, D]
  float* lse = nullptr;           // [B, Hq] or nullptr
  const int32_t* block_table = nullptr;  // [B, block_table_stride]
  int64_t block_table_stride = 0;
  const int32_t* seq_lens = nullptr;     // [B]
  // fp8 cache: dequantisation scales (device); KV head h's is k_scale[h * k_scale_stride] (stride 0:
  // one per tensor, 1: one per KV head).
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int32_t k_scale_stride = 0, v_scale_stride = 0;
  const float* sinks = nullptr;          // [num_q_heads] attention sinks, or nullptr

  int32_t batch_size = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 0;
  int64_t q_token_stride = 0;
  int64_t out_token_stride = 0;

  int32_t num_splits = 1;          // >= 1 (resolve 0 with decode_attention_num_splits first)
  void* workspace = nullptr;       // decode_attention_workspace_size(params) bytes, when num_splits > 1

  float scale = 1.0f;
  int32_t window_left = -1;
  float softcap = 0.0f;
  DType dtype = DType::kBFloat16;        // q and out
  DType cache_dtype = DType::kBFloat16;  // dtype or kFloat8E4M3
};

// The split count chosen when the user asks for num_splits = 0: enough CTAs to fill num_sms
// given B x Hkv, bounded by the keys a sequence can have (block_table_stride * block_size).
int32_t decode_attention_num_splits(const DecodeAttentionParams& params, int32_t num_sms);
size_t decode_attention_workspace_size(const DecodeAttentionParams& params);
cudaError_t launch_decode_attention(const DecodeAttentionParams& params, cudaStream_t stream);

// Merges two attention results over disjoint key sets (split-KV, shared prefix + suffix):
// lse = log(exp(lse_a) + exp(lse_b)); v = v_a * exp(lse_a - lse) + v_b * exp(lse_b - lse).
// -inf inputs are handled (both -inf: v = 0, lse = -inf). v_out may alias v_a or v_b.
struct MergeAttentionStatesParams {
  const void* v_a = nullptr;   // [T, H, D]
  const float* lse_a = nullptr;  // [T, H]
  const void* v_b = nullptr;
  const float* lse_b = nullptr;
  void* v_out = nullptr;
  float* lse_out = nullptr;
  const bool* mask = nullptr;  // [T], or null: tokens whose entry is false keep (v_a, lse_a) as they are
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kBFloat16;  // of the v tensors: float16, bfloat16 or float32
};

cudaError_t launch_merge_attention_states(const MergeAttentionStatesParams& params, cudaStream_t stream);

// KV compaction after speculative acceptance: cache[dst_slots[i]] = cache[src_slots[i]] for
// every i, for both caches, with all sources read before any destination is written (so chains
// such as 5 -> 4, 7 -> 5 are safe). Uses `workspace` of move_kv_slots_workspace_size bytes.
struct MoveKvSlotsParams {
  void* k_cache = nullptr;  // [num_slots, row_bytes] viewed as bytes
  void* v_cache = nullptr;
  const void* src_slots = nullptr;
  const void* dst_slots = nullptr;
  IndexType slot_type = IndexType::kInt64;
  int64_t num_moves = 0;
  int64_t row_bytes = 0;    // Hkv * D * element size
  void* workspace = nullptr;
};

size_t move_kv_slots_workspace_size(const MoveKvSlotsParams& params);
cudaError_t launch_move_kv_slots(const MoveKvSlotsParams& params, cudaStream_t stream);

}  // namespace fastinfer
