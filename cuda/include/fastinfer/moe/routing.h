#pragma once
// Mixture-of-experts routing launchers (torch-free C++ API).
//
// moe_topk: the experts of each token and their weights from the router logits [T, E].
//  - Selection: the k largest logits of the row (softmax is monotone, so these are also the k
//    largest probabilities; selecting on the inputs makes the ids independent of how exp rounds).
//    Order: descending logit, ties to the lower expert id; a NaN logit ranks above every number
//    (+inf included), as in torch.topk, so a NaN reaches its row's weights under both scorings. -0.0 and +0.0 are equal.
//  - kSoftmax: p = softmax(logits over all E) in fp32, w_j = p[id_j]; renormalize divides the k
//    weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob). A NaN anywhere in the row makes
//    the row's weights NaN.
//  - kTopkSoftmax: w = softmax of the k selected logits (gpt-oss); the weights already sum to 1,
//    renormalize is not accepted (the binding refuses it; the kernel ignores the flag). A NaN
//    logit is the first selected, so it makes the row's weights NaN.
//  Outputs topk_weights [T, k] fp32 and topk_ids [T, k] int32, column j the j-th in the order above.
//
// moe_align: the layout of vLLM's moe_align_block_size (fused_moe). The flattened slots
// s = token * top_k + j of topk_ids [T, top_k] are grouped by expert (ascending expert, and in
// ascending slot order within an expert: deterministic), each expert's group padded to a multiple
// of block_m with the sentinel T * top_k. Outputs:
//   sorted_token_ids [T * top_k + E * (block_m - 1)]  the groups back to back, then sentinels;
//   expert_ids [ceil(len(sorted_token_ids) / block_m)] the expert of each block of block_m
//                                                      entries, 0 for the unused trailing blocks;
//   num_tokens_post_padded [1]                         the used length (sum of padded groups).
// An expert with no slots has no block. Ids outside [0, E) are skipped: their slot appears
// nowhere (-1 is how expert parallelism marks a non-local expert; the binding rejects other
// out-of-range ids when it checks values).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

enum class MoeScoring : int32_t {
  kSoftmax = 0,      // softmax over all experts, then the top k
  kTopkSoftmax = 1,  // the top k logits, then softmax over them
};

// One warp per token: the k selections are one lane each.
constexpr int32_t kMoeTopkMaxK = 32;

struct MoeTopkParams {
  const void* router_logits = nullptr;  // [T, E] logits_dtype, contiguous
  float* topk_weights = nullptr;        // [T, k]
  int32_t* topk_ids = nullptr;          // [T, k]
  int32_t num_tokens = 0;
  int32_t num_experts = 0;              // E >= 1
  int32_t top_k = 0;                    // 1 <= k <= min(E, kMoeTopkMaxK)
  bool renormalize = false;             // kSoftmax only
  MoeScoring scoring = MoeScoring::kSoftmax;
  DType logits_dtype = DType::kFloat32;  // float32, float16 or bfloat16
};

cudaError_t launch_moe_topk(const MoeTopkParams& params, cudaStream_t stream);

// Each CTA builds the whole expert histogram in shared memory.
constexpr int32_t kMoeAlignMaxExperts = 1024;

struct MoeAlignParams {
  const void* topk_ids = nullptr;             // [T * top_k] index_type (the flattened [T, top_k])
  int32_t* sorted_token_ids = nullptr;        // [moe_align_sorted_size(...)]
  int32_t* expert_ids = nullptr;              // [ceil(sorted size / block_m)]
  int32_t* num_tokens_post_padded = nullptr;  // [1]
  int32_t num_slots = 0;                      // T * top_k (also the sentinel)
  int32_t num_experts = 0;                    // 1 <= E <= kMoeAlignMaxExperts
  int32_t block_m = 0;                        // a power of two
  IndexType index_type = IndexType::kInt32;
};

// The length of sorted_token_ids: every expert's group padded by at most block_m - 1 (constexpr:
// the kernel calls it too).
constexpr int64_t moe_align_sorted_size(int64_t num_slots, int64_t num_experts, int64_t block_m) {
  return num_slots + num_experts * (block_m - 1);
}

cudaError_t launch_moe_align(const MoeAlignParams& params, cudaStream_t stream);

}  // namespace fastinfer
