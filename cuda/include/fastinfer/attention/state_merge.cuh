#pragma once
// Merging attention states (value normalised by its own denominator, natural-log lse) on the
// device: one arithmetic for the deterministic mode's chunk fold in the prefill kernel, for the
// split merge kernels, and for attention sinks (attention.h). The expressions are spelled out
// (fmaf) so that contraction cannot differ between the places that must agree bit for bit.
#include "fastinfer/common/platform.cuh"

#include <cmath>

namespace fastinfer::attention {

struct ChunkMerge {
  float wa, wb, lse;
};

// Weights of state a and partial b (both lse finite) and the merged lse.
__device__ __forceinline__ ChunkMerge chunk_merge(float lse_a, float lse_b) {
  const float m = fmaxf(lse_a, lse_b);
  const float ea = expf(lse_a - m), eb = expf(lse_b - m);
  const float sum = ea + eb;
  return {ea / sum, eb / sum, m + logf(sum)};
}
__device__ __forceinline__ float chunk_merge_value(const ChunkMerge& w, float a, float b) {
  return fmaf(w.wa, a, w.wb * b);
}

// An attention sink merged into a state after its last key: one more term exp(sink) of the
// denominator with a zero value row, so the value becomes chunk_merge_value(w, a, 0) = a * wa and
// the lse log(exp(lse) + exp(sink)); a state that saw no key (lse -inf) keeps its zeros and gets
// lse = sink.
__device__ __forceinline__ ChunkMerge sink_merge(float lse, float sink) {
  if (lse == -INFINITY) return {0.f, 0.f, sink};
  return chunk_merge(lse, sink);
}

}  // namespace fastinfer::attention
