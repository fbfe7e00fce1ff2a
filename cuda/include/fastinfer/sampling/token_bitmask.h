#pragma once
// Token bitmask launcher (torch-free C++ API): constrained decoding's mask on the logits.
//
// apply_token_bitmask: for each selected row r (all rows, or rows indices[0..num_rows) when
// indices != nullptr) and each token t < vocab_size, logits[r, t] <- -inf where bit t % 32 of
// int32 word bitmask[r, t / 32] is 0; allowed tokens (bit 1) are left untouched. The layout is
// xgrammar's and FlashInfer's (a grammar matcher fills it on the host). Bits of the mask beyond
// vocab_size are ignored. A row index outside [0, batch_size) is skipped (the torch binding
// rejects such indices before the launch).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct TokenBitmaskParams {
  void* logits = nullptr;          // [batch_size, vocab_size] dtype, row stride logits_row_stride
  const int32_t* bitmask = nullptr;  // [batch_size, >= ceil(vocab_size / 32)], row stride bitmask_row_stride
  const void* indices = nullptr;   // [num_rows] index_type, or nullptr: every row
  int64_t batch_size = 0;
  int64_t num_rows = 0;            // rows to mask: batch_size without indices, else len(indices)
  int64_t vocab_size = 0;
  int64_t logits_row_stride = 0;   // elements
  int64_t bitmask_row_stride = 0;  // int32 words
  DType dtype = DType::kFloat32;   // float32, float16 or bfloat16
  IndexType index_type = IndexType::kInt64;
};

cudaError_t launch_apply_token_bitmask(const TokenBitmaskParams& params, cudaStream_t stream);

}  // namespace fastinfer
