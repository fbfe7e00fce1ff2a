#pragma once
// reshape_and_cache: one CTA per token; the token's K and V rows (Hkv * D contiguous elements
// each) are copied with 16-byte loads into their cache slot, converted to fp8 when asked. Every
// thread moves one 16-byte vector of K and one of V, so T tokens are T CTAs of Hkv * D / 8 threads:
// at T = 512 (8 x 128) 0.24 of a wave of the 16 CTAs an SM can hold (bench/model.py). The work is
// that small (2 MB); more threads per token would have nothing to do.
#include "fastinfer/cache/reshape_and_cache.h"
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"

namespace fastinfer::cache {

constexpr int kMaxThreads = 256;

template <typename T, typename CacheT, int VEC>
__global__ void __launch_bounds__(kMaxThreads) reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_type == IndexType::kInt32
                           ? static_cast<int64_t>(static_cast<const int32_t*>(p.slot_mapping)[token])
                           : static_cast<const int64_t*>(p.slot_mapping)[token];
  if (slot < 0) return;  // padding token: the whole CTA leaves together
  const int64_t row = p.num_kv_heads * p.head_dim;
  const T* k = static_cast<const T*>(p.k) + token * p.k_token_stride;
  const T* v = static_cast<const T*>(p.v) + token * p.v_token_stride;
  CacheT* k_dst = static_cast<CacheT*>(p.k_cache) + slot * row;
  CacheT* v_dst = static_cast<CacheT*>(p.v_cache) + slot * row;

  if constexpr (std::is_same_v<T, CacheT>) {
    for (int64_t i = threadIdx.x * VEC; i < row; i += blockDim.x * VEC) {
      Vec<T, VEC> a, b;
      a.load(k + i);
      b.load(v + i);
      a.store(k_dst + i);
      b.store(v_dst + i);
    }
  } else {
    // Divide (not multiply by a reciprocal) so the result matches x / scale rounded once. A vector
    // lies within one head (the launcher vectorises per-head scales only when VEC divides D).
    for (int64_t i = threadIdx.x * VEC; i < row; i += blockDim.x * VEC) {
      const int64_t head = i / p.head_dim;
      const float ks = p.k_scale[head * p.k_scale_stride], vs = p.v_scale[head * p.v_scale_stride];
      Vec<T, VEC> a, b;
      Vec<CacheT, VEC> qa, qb;
      a.load(k + i);
      b.load(v + i);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        qa[j] = from_float<CacheT>(to_float(a[j]) / ks);
        qb[j] = from_float<CacheT>(to_float(b[j]) / vs);
      }
      qa.store(k_dst + i);
      qb.store(v_dst + i);
    }
  }
}

}  // namespace fastinfer::cache
