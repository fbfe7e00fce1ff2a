#pragma once
// move_kv_slots: cache[dst[i]] = cache[src[i]] for both caches, all sources read first.
// Two launches on the stream: gather (every source row of both caches -> workspace
// [2][num_moves][row_bytes]) then scatter (workspace -> destination rows), so chains such as
// 5 -> 4, 7 -> 5 are safe whatever the order of the moves. Grid (num_moves, 2 caches); each CTA
// copies one row with 16-byte (or, when unaligned, 1-byte) accesses. A move with a negative
// source or destination slot is skipped. The workspace round trip doubles the bytes moved (2x the
// ideal in bench/model.py, which counts distinct sectors per launch; the workspace is a few hundred
// KB, so on a GPU it lives in L2), and a speculative-decoding compaction moves a few dozen rows:
// fewer CTAs than SMs, latency-bound.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/common/vec.cuh"

namespace fastinfer::cache {

constexpr int kMoveMaxThreads = 256;

template <typename I>
__device__ __forceinline__ bool move_slots(const MoveKvSlotsParams& p, int64_t i, int64_t& src, int64_t& dst) {
  src = static_cast<int64_t>(static_cast<const I*>(p.src_slots)[i]);
  dst = static_cast<int64_t>(static_cast<const I*>(p.dst_slots)[i]);
  return src >= 0 && dst >= 0;
}

template <int VEC>
__device__ __forceinline__ void copy_row(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                                         int64_t row_bytes) {
  using V = Vec<unsigned char, VEC>;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < row_bytes; j += static_cast<int64_t>(blockDim.x) * VEC) {
    V v;
    v.load(src + j);
    v.store(dst + j);
  }
}

template <typename I, int VEC>
__global__ void __launch_bounds__(kMoveMaxThreads) move_kv_slots_gather_kernel(const MoveKvSlotsParams p) {
  const int64_t i = blockIdx.x;
  int64_t src, dst;
  if (!move_slots<I>(p, i, src, dst)) return;  // whole CTA
  const unsigned char* cache = static_cast<const unsigned char*>(blockIdx.y == 0 ? p.k_cache : p.v_cache);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace) + (blockIdx.y * p.num_moves + i) * p.row_bytes;
  copy_row<VEC>(ws, cache + src * p.row_bytes, p.row_bytes);
}

template <typename I, int VEC>
__global__ void __launch_bounds__(kMoveMaxThreads) move_kv_slots_scatter_kernel(const MoveKvSlotsParams p) {
  const int64_t i = blockIdx.x;
  int64_t src, dst;
  if (!move_slots<I>(p, i, src, dst)) return;
  unsigned char* cache = static_cast<unsigned char*>(blockIdx.y == 0 ? p.k_cache : p.v_cache);
  const unsigned char* ws =
      static_cast<const unsigned char*>(p.workspace) + (blockIdx.y * p.num_moves + i) * p.row_bytes;
  copy_row<VEC>(cache + dst * p.row_bytes, ws, p.row_bytes);
}

}  // namespace fastinfer::cache
