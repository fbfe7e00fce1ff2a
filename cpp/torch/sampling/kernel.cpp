// CUDA implementation of apply_token_bitmask (also built for simt, see kernel_backend.h): validate,
// fill the Params, launch. No host sync unless FASTINFER_CHECK_INDICES=1 asks for the index check.
#include "kernel_backend.h"
#include "sampling/contract.h"

namespace fastinfer::binding {
namespace {

void apply_token_bitmask(Tensor& logits, const Tensor& bitmask, const std::optional<Tensor>& indices) {
  const char* op = "apply_token_bitmask";
  validate_apply_token_bitmask(op, logits, bitmask, indices);
  check_device(logits, op, "logits");
  check_apply_token_bitmask_layout(op, logits, bitmask, indices);
  check_apply_token_bitmask_indices(op, logits, indices);
  const int64_t B = logits.size(0), V = logits.size(1);
  const int64_t rows = indices.has_value() ? indices->size(0) : B;
  if (rows == 0 || V == 0 || B == 0) return;
  KernelScope scope(op, logits);
  TokenBitmaskParams p;
  p.logits = logits.data_ptr();
  p.bitmask = bitmask.const_data_ptr<int32_t>();
  p.indices = indices.has_value() ? indices->data_ptr() : nullptr;
  p.batch_size = B;
  p.num_rows = rows;
  p.vocab_size = V;
  p.logits_row_stride = V;
  p.bitmask_row_stride = bitmask.size(1);
  p.dtype = to_dtype(logits.scalar_type());
  p.index_type = indices.has_value() ? to_index_type(indices->scalar_type()) : IndexType::kInt64;
  check_launch(launch_apply_token_bitmask(p, scope.stream()), op);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  m.impl("apply_token_bitmask", TORCH_BOX(&fastinfer::binding::apply_token_bitmask));
}
