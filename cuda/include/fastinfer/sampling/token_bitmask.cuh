#pragma once
// apply_token_bitmask kernel: grid (vocabulary chunk, selected row); each thread owns VEC
// consecutive tokens (VEC divides 32, so they share one mask word) and touches the logits only when
// one of its VEC bits is 0: a 16-byte load, the masked lanes set to -inf, a 16-byte store. A fully
// allowed span (the common case once a grammar opens a string) costs one 4-byte mask read. Every
// element is written by one thread with a value independent of the schedule.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/sampling/token_bitmask.h"

#include <cmath>

namespace fastinfer::sampling {

constexpr int kThreads = 256;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) apply_token_bitmask_kernel(const TokenBitmaskParams p) {
  static_assert(32 % VEC == 0, "a thread's tokens must share one mask word");
  const int64_t slot = blockIdx.y;
  int64_t row = slot;
  if (p.indices != nullptr)
    row = p.index_type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p.indices)[slot])
                                            : static_cast<const int64_t*>(p.indices)[slot];
  if (row < 0 || row >= p.batch_size) return;
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC;
  if (t >= p.vocab_size) return;
  const uint32_t word = static_cast<uint32_t>(p.bitmask[row * p.bitmask_row_stride + t / 32]);
  constexpr uint32_t kAll = VEC == 32 ? 0xffffffffu : (1u << VEC) - 1u;
  const uint32_t bits = (word >> (t % 32)) & kAll;
  if (bits == kAll) return;
  T* ptr = static_cast<T*>(p.logits) + row * p.logits_row_stride + t;
  Vec<T, VEC> v;
  v.load(ptr);
#pragma unroll
  for (int j = 0; j < VEC; ++j)
    if (((bits >> j) & 1u) == 0u) v[j] = from_float<T>(-INFINITY);
  v.store(ptr);
}

}  // namespace fastinfer::sampling
