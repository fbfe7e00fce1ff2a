#pragma once
// Writes new K/V rows into the paged cache (torch-free C++ API).
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; slot = block * block_size
// + offset, so token t lands in row slot_mapping[t] of the cache viewed as [num_slots, Hkv * D].
// Slot -1 is skipped (padding). With an fp8 e4m3 cache, stored = e4m3(clamp(x / scale, +-448)), the
// scale per tensor or per KV head.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

struct ReshapeAndCacheParams {
  const void* k = nullptr;          // [num_tokens, num_kv_heads, head_dim], token stride k_token_stride
  const void* v = nullptr;          // same shape, token stride v_token_stride
  void* k_cache = nullptr;          // [num_slots, num_kv_heads, head_dim]
  void* v_cache = nullptr;
  const void* slot_mapping = nullptr;  // [num_tokens], int32 or int64; -1 = skip
  IndexType slot_type = IndexType::kInt64;
  // fp8 cache only, device: KV head h's scale is k_scale[h * k_scale_stride] (stride 0: one per
  // tensor, 1: one per KV head)
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int32_t k_scale_stride = 0, v_scale_stride = 0;
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t k_token_stride = 0;       // elements
  int64_t v_token_stride = 0;
  int64_t num_slots = 0;            // num_blocks * block_size (slots beyond it are a caller bug)
  DType dtype = DType::kBFloat16;        // of k and v: float16 or bfloat16
  DType cache_dtype = DType::kBFloat16;  // dtype, or kFloat8E4M3
};

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& params, cudaStream_t stream);

}  // namespace fastinfer
