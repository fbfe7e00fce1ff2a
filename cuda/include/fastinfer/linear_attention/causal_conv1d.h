#pragma once
// Causal depthwise convolution of the linear-attention layers (torch-free C++ API): Gated
// DeltaNet's and Mamba's short convolution over each sequence's tokens, with a state pool.
//
// Sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1]) of x [T, D] (row stride x_row_stride,
// channels contiguous), L_b of them. Its padded input is the W - 1 rows of its state slot
// conv_states[state_indices[b]] ([W - 1, D], oldest first) followed by its L_b rows of x; the
// state rows are zeros when has_initial_state[b] is false (the slot is then never read). Output
// row t of the sequence, channel c:
//   out[t, c] = act(bias[c] + sum_{i = 0}^{W - 1} weight[c, i] * xpad[t + i, c])
// accumulated in fp32 from bias (0 without it) in the order i = 0 .. W - 1 with fused multiply-adds,
// act = silu (x / (1 + exp(-x))) or the identity, rounded once to the dtype of x. weight[c, W - 1]
// multiplies the current token (PyTorch's Conv1d weight [D, 1, W] with padding W - 1, squeezed).
// Afterwards the slot holds the last W - 1 rows of xpad: the sequence's state for its next tokens
// (decode and speculative verification are the same op with has_initial_state == nullptr: every
// sequence continues from its slot). Slots of the sequences must be distinct.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

// Convolution widths the kernels take (Qwen3.5 and Qwen3-Next use 4, Mamba 4, RWKV-style 2..3).
constexpr int32_t kCausalConvMinWidth = 2;
constexpr int32_t kCausalConvMaxWidth = 4;

struct CausalConv1dParams {
  const void* x = nullptr;                 // [num_tokens, dim], row stride x_row_stride (elements)
  const void* weight = nullptr;            // [dim, width], contiguous, the dtype of x
  const void* bias = nullptr;              // [dim] or nullptr, the dtype of x
  void* out = nullptr;                     // [num_tokens, dim], contiguous
  void* conv_states = nullptr;             // [num_slots, width - 1, dim], contiguous, the dtype of x
  const int32_t* cu_seqlens = nullptr;     // [num_seqs + 1], 0 .. num_tokens, non-decreasing
  const void* state_indices = nullptr;     // [num_seqs] index_type, each in [0, num_slots)
  const bool* has_initial_state = nullptr;  // [num_seqs], or nullptr: every sequence starts from its slot
  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t num_slots = 0;
  int32_t dim = 0;
  int32_t width = 4;
  int64_t x_row_stride = 0;                // >= dim
  bool silu = true;                        // act: silu, or the identity
  DType dtype = DType::kBFloat16;          // float32, float16 or bfloat16
  IndexType index_type = IndexType::kInt32;
};

// One launch (a thread per sequence and channel) for up to 4 tokens per sequence on average, else
// two: the outputs (reading the old states), then the new states.
cudaError_t launch_causal_conv1d(const CausalConv1dParams& params, cudaStream_t stream);

}  // namespace fastinfer
