// CPU implementation of the MoE routing ops, in fp32 with the arithmetic of the kernels
// (moe/routing.h): the same selection order (exact: it compares the inputs) and the same
// exponentials and divisions, summed serially; one row per task on ATen's thread pool.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "moe/contract.h"

namespace fastinfer::binding {
namespace {

// Descending logit, ties to the lower expert, NaN after every number.
bool ranks_before(const float* x, int32_t a, int32_t b) {
  const bool nan_a = std::isnan(x[a]), nan_b = std::isnan(x[b]);
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && x[a] != x[b]) return x[a] > x[b];
  return a < b;
}

template <typename T>
void moe_topk_rows(const T* logits, int64_t num_tokens, int64_t E, int64_t k, bool renormalize,
                   MoeScoring scoring, float* weights, int32_t* ids) {
  torch::stable::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits[t * E + e]);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t a, int32_t b) { return ranks_before(x.data(), a, b); });
      float* w = weights + t * k;
      const float shift = x[order[0]];  // the row max unless the row is all NaN
      float row_sum = 1.f;              // softmax: the denominator over all E (NaN ones included)
      if (scoring == MoeScoring::kSoftmax) {
        row_sum = 0.f;
        for (int64_t e = 0; e < E; ++e) row_sum += std::exp(x[e] - shift);
      }
      float selected_sum = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        w[j] = std::exp(x[order[j]] - shift);
        if (scoring == MoeScoring::kSoftmax) w[j] = w[j] / row_sum;
        selected_sum += w[j];
        ids[t * k + j] = order[j];
      }
      if (scoring == MoeScoring::kTopkSoftmax || renormalize)
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / selected_sum;
    }
  });
}

std::tuple<Tensor, Tensor> moe_topk_cpu(const Tensor& router_logits, int64_t top_k, bool renormalize,
                                        std::string_view scoring_str) {
  const char* op = "moe_topk";
  const MoeScoring scoring = validate_moe_topk(op, router_logits, top_k, renormalize, scoring_str);
  check_on_cpu(router_logits, op, "router_logits");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  auto weights = empty_on(router_logits, {T, top_k}, kFloat);
  auto ids = empty_on(router_logits, {T, top_k}, kInt);
  if (T > 0) {
    FASTINFER_DISPATCH_FLOAT_TYPES(router_logits.scalar_type(), "moe_topk", [&] {
      moe_topk_rows<scalar_t>(router_logits.const_data_ptr<scalar_t>(), T, E, top_k, renormalize, scoring,
                              weights.mutable_data_ptr<float>(), ids.mutable_data_ptr<int32_t>());
    });
  }
  return {weights, ids};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk_cpu));
}
