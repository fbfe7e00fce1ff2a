#pragma once
// Shape/dtype/argument rules of the MoE routing ops (shared by the CPU and CUDA impls).
#include <string>
#include <string_view>

#include "common.h"
#include "fastinfer/moe/routing.h"

namespace fastinfer::binding {

// The schemas of the MoE ops (schema.cpp registers them for every module). The defaults live in
// the Python wrappers (fastinfer/ops/moe.py).
inline void define_moe_ops(StableLibrary& m) {
  // Mixture-of-experts routing (docs/design.md "Mixture of experts").
  m.def("moe_topk(Tensor router_logits, int top_k, bool renormalize, str scoring) -> (Tensor topk_weights, "
        "Tensor topk_ids)");
  m.def("moe_align(Tensor topk_ids, int num_experts, int block_m) -> (Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded)");
}

inline MoeScoring parse_moe_scoring(const char* op, std::string_view scoring) {
  if (scoring == "softmax") return MoeScoring::kSoftmax;
  if (scoring == "topk_softmax") return MoeScoring::kTopkSoftmax;
  fail(op, "scoring must be 'softmax' or 'topk_softmax', got '", std::string(scoring), "'");
}

// Checks router_logits [T, E] (contiguous), top_k, renormalize and scoring; returns the scoring.
inline MoeScoring validate_moe_topk(const char* op, const Tensor& router_logits, int64_t top_k, bool renormalize,
                                    std::string_view scoring_str) {
  const MoeScoring scoring = parse_moe_scoring(op, scoring_str);
  check_dim(router_logits, 2, op, "router_logits", "[num_tokens, num_experts]");
  check_dtype_in(router_logits, {kFloat, kHalf, kBFloat16}, op, "router_logits");
  check_contiguous(router_logits, op, "router_logits");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  FI_CHECK(E >= 1 && E < (int64_t{1} << 31) && T < (int64_t{1} << 31), op,
           "router_logits must have 1 <= num_experts < 2^31 and num_tokens < 2^31, got shape ",
           shape_str(router_logits));
  FI_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, num_experts = ", E, "], got ", top_k);
  FI_CHECK(top_k <= kMoeTopkMaxK, op, "top_k must be <= ", kMoeTopkMaxK, " (one lane per selected expert), got ",
           top_k);
  FI_CHECK(!(renormalize && scoring == MoeScoring::kTopkSoftmax), op,
           "renormalize must be False with scoring='topk_softmax' (its k weights already sum to 1)");
  return scoring;
}

// Checks topk_ids [T, top_k] (int32/int64, contiguous), num_experts and block_m; the value check of
// the ids (in [-1, E): -1 is a slot routed to no local expert) runs on CPU tensors always and on
// CUDA tensors with FASTINFER_CHECK_INDICES=1 (the kernel skips out-of-range ids either way).
inline void validate_moe_align(const char* op, const Tensor& topk_ids, int64_t num_experts, int64_t block_m) {
  check_dim(topk_ids, 2, op, "topk_ids", "[num_tokens, top_k]");
  check_dtype_in(topk_ids, {kInt, kLong}, op, "topk_ids");
  check_contiguous(topk_ids, op, "topk_ids");
  FI_CHECK(num_experts >= 1 && num_experts <= kMoeAlignMaxExperts, op, "num_experts must be in [1, ",
           kMoeAlignMaxExperts, "] (the kernel keeps a histogram of every expert in shared memory), got ",
           num_experts);
  FI_CHECK(block_m >= 1 && block_m <= (int64_t{1} << 16) && (block_m & (block_m - 1)) == 0, op,
           "block_m must be a power of two in [1, 65536], got ", block_m);
  FI_CHECK(moe_align_sorted_size(topk_ids.numel(), num_experts, block_m) < (int64_t{1} << 31), op,
           "topk_ids.numel() + num_experts * (block_m - 1) must be < 2^31 (int32 slot ids), got shape ",
           shape_str(topk_ids), ", num_experts ", num_experts, ", block_m ", block_m);
  check_index_range(topk_ids, -1, num_experts, op, "topk_ids", "expert ids; -1 marks a slot with no local expert");
}

}  // namespace fastinfer::binding
