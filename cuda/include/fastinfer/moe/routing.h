#pragma once
// Mixture-of-experts routing launchers (torch-free C++ API).
//
// moe_topk: the experts of each token and their weights from the router logits [T, E].
//  - Selection: the k largest logits of the row (softmax is monotone, so these are also the k
//    largest probabilities; selecting on the inputs makes the ids independent of how exp rounds).
//    Order: descending logit, ties to the lower expert id; a NaN logit ranks below every number
//    (-inf included), so the ids are always valid experts. -0.0 and +0.0 are equal.
//  - kSoftmax: p = softmax(logits over all E) in fp32, w_j = p[id_j]; renormalize divides the k
//    weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob). A NaN anywhere in the row makes
//    the row's weights NaN.
//  - kTopkSoftmax: w = softmax of the k selected logits (gpt-oss); the weights already sum to 1,
//    renormalize is not accepted (the binding refuses it; the kernel ignores the flag). A NaN
//    among the k selected logits (fewer than k numbers in the row) makes the row's weights NaN.
//  Outputs topk_weights [T, k] fp32 and topk_ids [T, k] int32, column j the j-th in the order above.
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

}  // namespace fastinfer
