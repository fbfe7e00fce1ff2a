#pragma once
// Speculative-decoding launchers (torch-free C++ API).
//
// tree_verify: verification of a draft token tree against the target model's logits, one walk
// per sequence from the root (node 0, the last committed token). Node c's parent is parents[b][c]
// (parents[b][0] = -1, 0 <= parents[b][c] < c); the children of a node are tried in ascending node
// order. Sampling reproduces the target distribution p = softmax(logits / temperature) exactly:
//  - draft_probs == nullptr: children are deterministic candidates; child c with token x is
//    accepted when u * r_sum < r(x) (u = uniforms[b][c], r the current residual, unnormalised);
//    on rejection r(x) <- 0.
//  - draft_probs != nullptr: the children were drawn without replacement from the draft's
//    distribution q at the node (draft_probs[b][node]); accepted when u * q(x) < p(x); on
//    rejection p <- norm(max(p - q, 0)) and q <- norm(q without x) (recursive rejection sampling
//    without replacement). q is used as given until the first rejection at a node.
//  - greedy: accepted when x == argmax of the target logits at the node (lowest id on ties).
// next_token: greedy the argmax at the last accepted node; sampling the inverse-CDF sample of the
// residual there with u = uniforms[b][N]: the smallest t with cumsum(r)[t] > u * sum(r) (when
// rounding leaves no such t: the largest t with r[t] > 0, or 0 if r is all zero).
// Outputs: accepted_nodes [B, N] (the path root first, -1 padded), num_accepted [B] (accepted
// DRAFT nodes = path length - 1), next_token [B]; all of index_type.
// Robustness: token ids outside [0, V) are never read (such a child is rejected); only nodes
// c > node with parents[b][c] == node are children, so malformed trees cannot cause out-of-range
// accesses (the torch binding rejects them with an error before the launch).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct TreeVerifyParams {
  const void* draft_tokens = nullptr;   // [B, N] index_type
  const void* parents = nullptr;        // [B, N] index_type
  const void* target_logits = nullptr;  // [B, N, V] logits_dtype, contiguous
  const float* draft_probs = nullptr;   // [B, N, V] fp32 contiguous, or nullptr
  const float* temperature = nullptr;   // [B] (ignored when greedy)
  const float* uniforms = nullptr;      // [B, N + 1] in [0, 1)
  void* accepted_nodes = nullptr;       // [B, N] index_type
  void* num_accepted = nullptr;         // [B] index_type
  void* next_token = nullptr;           // [B] index_type
  float* workspace = nullptr;           // tree_verify_workspace_size(params) bytes (sampling with draft_probs)

  int32_t batch_size = 0;
  int32_t num_nodes = 0;                // N >= 1, <= kTreeVerifyMaxNodes
  int32_t vocab_size = 0;               // V >= 1
  bool greedy = false;
  DType logits_dtype = DType::kBFloat16;  // float32, float16 or bfloat16
  IndexType index_type = IndexType::kInt64;
};

constexpr int32_t kTreeVerifyMaxNodes = 4096;

// Bytes of fp32 workspace: the residual p and q of every sequence ([2, B, V] fp32) when sampling
// with draft_probs, else 0.
size_t tree_verify_workspace_size(const TreeVerifyParams& params);
cudaError_t launch_tree_verify(const TreeVerifyParams& params, cudaStream_t stream);

}  // namespace fastinfer
