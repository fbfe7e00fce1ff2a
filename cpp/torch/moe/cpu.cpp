// CPU implementations of the MoE routing ops. moe_topk: fp32 with the arithmetic of the kernel
// (moe/routing.h): the same selection order (exact: it compares the inputs) and the same
// exponentials and divisions, summed serially; one row per task on ATen's thread pool. moe_align:
// a counting sort of the slots, serial (it is integer bookkeeping over T * top_k ids).

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

std::tuple<Tensor, Tensor, Tensor> moe_align_cpu(const Tensor& topk_ids, int64_t num_experts, int64_t block_m) {
  const char* op = "moe_align";
  validate_moe_align(op, topk_ids, num_experts, block_m);
  check_on_cpu(topk_ids, op, "topk_ids");
  const int64_t num_slots = topk_ids.numel();
  const int64_t sorted_size = moe_align_sorted_size(num_slots, num_experts, block_m);
  const int64_t num_blocks = (sorted_size + block_m - 1) / block_m;
  const auto ids = host_indices(topk_ids);
  std::vector<int64_t> offset(static_cast<size_t>(num_experts) + 1, 0);  // padded group starts
  for (int64_t id : ids)
    if (id >= 0) ++offset[id + 1];
  for (int64_t e = 0; e < num_experts; ++e)
    offset[e + 1] = offset[e] + (offset[e + 1] + block_m - 1) / block_m * block_m;
  auto sorted_t = full_on(topk_ids, {sorted_size}, static_cast<double>(num_slots), kInt);
  auto experts_t = zeros_on(topk_ids, {num_blocks}, kInt);
  auto total_t = full_on(topk_ids, {1}, static_cast<double>(offset[num_experts]), kInt);
  int32_t* sorted = sorted_t.mutable_data_ptr<int32_t>();
  int32_t* experts = experts_t.mutable_data_ptr<int32_t>();
  std::vector<int64_t> next(offset.begin(), offset.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s)  // ascending slots: ascending within each group
    if (ids[s] >= 0) sorted[next[ids[s]]++] = static_cast<int32_t>(s);
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t b = offset[e] / block_m; b < offset[e + 1] / block_m; ++b) experts[b] = static_cast<int32_t>(e);
  return {sorted_t, experts_t, total_t};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk_cpu));
  m.impl("moe_align", TORCH_BOX(&fastinfer::binding::moe_align_cpu));
}
