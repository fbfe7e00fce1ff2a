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

}  // namespace fastinfer::binding
