#pragma once
// Gated DeltaNet linear attention (torch-free C++ API): Qwen3.5 / Qwen3-Next's recurrent layer over
// each sequence of a varlen batch, with a pool of fp32 states.
//
// Sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1]). Its state S [Dk, Dv] per value head
// starts as states[state_indices[b], h] (zeros, the slot unread, when has_initial_state[b] is
// false). Value head h reads key head h / (Hv / Hk). Per token, in fp32: q and k of the head
// (l2-normalised, x / sqrt(sum x^2 + 1e-6), when use_qk_l2norm), q times scale; then
//   S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
// o rounded once to the dtype of q. The slot then holds the final state; state_history[t] (when
// given) the state after token t. Slots of the sequences must be distinct.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

// Head dims the kernels take (Qwen3.5 / Qwen3-Next: 128; smaller models 64).
inline constexpr bool gated_delta_rule_head_dim_supported(int64_t d) { return d == 64 || d == 128; }

struct GatedDeltaRuleParams {
  const void* q = nullptr;                 // [num_tokens, num_k_heads, head_dim_k], token stride q_token_stride
  const void* k = nullptr;                 // [num_tokens, num_k_heads, head_dim_k], token stride k_token_stride
  const void* v = nullptr;                 // [num_tokens, num_v_heads, head_dim_v], token stride v_token_stride
  const float* g = nullptr;                // [num_tokens, num_v_heads], contiguous: the log decay
  const void* beta = nullptr;              // [num_tokens, num_v_heads], contiguous, fp32 or the dtype of q
  void* out = nullptr;                     // [num_tokens, num_v_heads, head_dim_v], contiguous, the dtype of q
  float* states = nullptr;                 // [num_slots, num_v_heads, head_dim_k, head_dim_v], contiguous
  float* state_history = nullptr;          // [num_tokens, num_v_heads, head_dim_k, head_dim_v] or nullptr
  const int32_t* cu_seqlens = nullptr;     // [num_seqs + 1], 0 .. num_tokens, non-decreasing
  const void* state_indices = nullptr;     // [num_seqs] index_type, each in [0, num_slots)
  const bool* has_initial_state = nullptr;  // [num_seqs], or nullptr: every sequence starts from its slot
  int64_t num_tokens = 0;
  int64_t num_seqs = 0;
  int64_t num_slots = 0;
  int32_t num_k_heads = 0;
  int32_t num_v_heads = 0;                 // a multiple of num_k_heads
  int32_t head_dim_k = 128;
  int32_t head_dim_v = 128;
  int64_t q_token_stride = 0;              // elements; heads packed (head stride = head dim)
  int64_t k_token_stride = 0;
  int64_t v_token_stride = 0;
  float scale = 0.f;
  bool use_qk_l2norm = false;
  bool beta_fp32 = true;                   // beta in fp32, else in the dtype of q
  DType dtype = DType::kBFloat16;          // q, k, v, out: float32, float16 or bfloat16
  IndexType index_type = IndexType::kInt32;
};

// One launch of the recurrent kernel: a CTA per (sequence, value head, 32 value columns) walks the
// sequence's tokens with the state in registers.
cudaError_t launch_gated_delta_rule(const GatedDeltaRuleParams& params, cudaStream_t stream);

}  // namespace fastinfer
