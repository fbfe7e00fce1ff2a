#pragma once
// Rotary position embedding launcher (torch-free C++ API), in place on q and k.
// cos_sin_cache row p = [cos(p * f_0) .. cos(p * f_{R/2-1}), sin(p * f_0) .. sin(p * f_{R/2-1})].
// The first R = rotary_dim dims of every head rotate (R == head_dim is the usual case):
//   neox (HF Llama, rotate halves): pair (i, i + R/2);  GPT-J (interleaved): pair (2i, 2i + 1).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct RotaryEmbeddingParams {
  const void* positions = nullptr;  // [num_tokens], int32 or int64, in [0, max_position)
  IndexType position_type = IndexType::kInt64;
  void* q = nullptr;                // [num_tokens, num_q_heads, head_dim], token stride q_token_stride
  void* k = nullptr;                // [num_tokens, num_kv_heads, head_dim] or nullptr
  const void* cos_sin_cache = nullptr;  // [max_position, rotary_dim], float32 or dtype
  DType cache_dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;           // even, <= head_dim
  int64_t q_token_stride = 0;       // elements; heads are packed (stride head_dim)
  int64_t k_token_stride = 0;
  bool is_neox = true;
  DType dtype = DType::kBFloat16;   // of q and k: float16 or bfloat16
};

cudaError_t launch_rotary_embedding(const RotaryEmbeddingParams& params, cudaStream_t stream);

}  // namespace fastinfer
