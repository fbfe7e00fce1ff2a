#pragma once
// The contract of the sampling-side ops: schemas, and the shape, dtype, device and index rules of
// apply_token_bitmask shared by the CPU and the CUDA/sim impls.
#include "common.h"

namespace fastinfer::binding {

// The schemas of the sampling ops (schema.cpp registers them for every module).
inline void define_sampling_ops(StableLibrary& m) {
  // Constrained decoding (docs/design.md "Sampling").
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor? indices=None) -> ()");
}

// logits [B, V] float32/float16/bfloat16; bitmask int32 [B, W] with 32 W >= V (xgrammar's and
// FlashInfer's layout: bit j of word i allows token 32 i + j; a wider mask's extra bits are
// ignored); indices int32/int64 [K] selecting rows of both, or None (every row). All contiguous
// and on one device.
inline void validate_apply_token_bitmask(const char* op, const Tensor& logits, const Tensor& bitmask,
                                         const std::optional<Tensor>& indices) {
  check_dim(logits, 2, op, "logits", "[batch, vocab]");
  check_dtype_in(logits, {kFloat, kHalf, kBFloat16}, op, "logits");
  check_dim(bitmask, 2, op, "bitmask", "[batch, ceil(vocab / 32)] (int32 words, bit j of word i allows token 32 i + j)");
  FI_CHECK(bitmask.scalar_type() == kInt, op, "bitmask must be int32 (32 tokens per word), got ",
           bitmask.scalar_type());
  check_same_device(bitmask, logits, op, "bitmask", "logits");
  const int64_t B = logits.size(0), V = logits.size(1);
  FI_CHECK(bitmask.size(0) == B, op, "bitmask must have batch = ", B, " rows (logits.size(0)), got shape ",
           shape_str(bitmask));
  FI_CHECK(bitmask.size(1) * 32 >= V, op, "bitmask must have at least ceil(vocab / 32) = ", (V + 31) / 32,
           " words per row to cover the vocabulary of logits (", V, " tokens), got shape ", shape_str(bitmask));
  if (indices.has_value()) {
    check_dim(*indices, 1, op, "indices", "[num_rows] (rows of logits and bitmask to mask)");
    check_dtype_in(*indices, {kInt, kLong}, op, "indices");
    check_same_device(*indices, logits, op, "indices", "logits");
  }
}

inline void check_apply_token_bitmask_layout(const char* op, const Tensor& logits, const Tensor& bitmask,
                                             const std::optional<Tensor>& indices) {
  check_contiguous(logits, op, "logits");
  check_contiguous(bitmask, op, "bitmask");
  if (indices.has_value()) check_contiguous(*indices, op, "indices");
}

inline void check_apply_token_bitmask_indices(const char* op, const Tensor& logits,
                                              const std::optional<Tensor>& indices) {
  if (indices.has_value())
    check_index_range(*indices, 0, logits.size(0), op, "indices", "rows of logits and bitmask");
}

}  // namespace fastinfer::binding
