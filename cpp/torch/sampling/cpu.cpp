// CPU implementation of apply_token_bitmask: per selected row, every 0 bit of the row's mask words
// sets its token's logit to -inf (allowed tokens are not written), rows on ATen's thread pool.
#include <limits>

#include "sampling/contract.h"

namespace fastinfer::binding {
namespace {

template <typename T>
void mask_rows(T* logits, const int32_t* bitmask, const std::vector<int64_t>& rows, int64_t V, int64_t W) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  torch::stable::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = rows[k];
      T* row = logits + r * V;
      const int32_t* words = bitmask + r * W;
      for (int64_t i = 0; i * 32 < V; ++i) {
        const uint32_t word = static_cast<uint32_t>(words[i]);
        if (word == 0xffffffffu) continue;
        const int64_t n = V - i * 32 < 32 ? V - i * 32 : 32;
        for (int64_t j = 0; j < n; ++j)
          if (((word >> j) & 1u) == 0u) row[i * 32 + j] = neg_inf;
      }
    }
  });
}

void apply_token_bitmask_cpu(Tensor& logits, const Tensor& bitmask, const std::optional<Tensor>& indices) {
  const char* op = "apply_token_bitmask";
  validate_apply_token_bitmask(op, logits, bitmask, indices);
  check_on_cpu(logits, op, "logits");
  check_apply_token_bitmask_layout(op, logits, bitmask, indices);
  check_apply_token_bitmask_indices(op, logits, indices);
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  std::vector<int64_t> rows;
  if (indices.has_value()) {
    rows = host_indices(*indices);
  } else {
    rows.resize(static_cast<size_t>(B));
    for (int64_t r = 0; r < B; ++r) rows[r] = r;
  }
  if (rows.empty() || V == 0) return;
  FASTINFER_DISPATCH_ACT_TYPES(logits.scalar_type(), op, [&] {
    mask_rows<scalar_t>(logits.mutable_data_ptr<scalar_t>(), bitmask.const_data_ptr<int32_t>(), rows, V, W);
  });
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("apply_token_bitmask", TORCH_BOX(&fastinfer::binding::apply_token_bitmask_cpu));
}
