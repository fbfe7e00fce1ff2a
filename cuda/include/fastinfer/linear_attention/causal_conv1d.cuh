#pragma once
// causal_conv1d kernels (contract in causal_conv1d.h). Two forms of one arithmetic (the same taps
// in the same order for every output, so the launcher's choice never changes a bit):
// - per sequence (decode and verification: few tokens per sequence): grid (sequence, channel
//   block), one thread per (sequence, channel) keeps the window in registers, reads its state rows
//   once, writes its outputs, then its new state rows (it alone touches that column of the slot);
// - per chunk of tokens (prefill). Outputs: grid (16-token chunk, channel block), one thread per
// (chunk, channel): it finds the chunk's first sequence in cu_seqlens (binary search over
// num_seqs + 1 entries, shared by the block), fills its window from the sequence's padded rows
// (x, or state rows), and walks the chunk's tokens, moving to the next sequence at a boundary;
// neighbouring threads read neighbouring channels, so every load and store is coalesced and each x
// row is read once per chunk plus W - 1 rows of halo. States: grid
// (sequence, channel block), one thread per (sequence, channel) writes the W - 1 new state rows
// after the output kernel has read the old ones (stream order), reading the old rows it still
// needs before overwriting them (row p takes old row L + p >= p).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/linear_attention/causal_conv1d.h"

namespace fastinfer::linear_attention {

constexpr int kConvThreads = 128;

__device__ __forceinline__ int64_t slot_of(const CausalConv1dParams& p, int64_t seq) {
  return p.index_type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p.state_indices)[seq])
                                           : static_cast<const int64_t*>(p.state_indices)[seq];
}

// Row r of sequence seq's padded input (r < W - 1: its state row, else x row start + r - (W - 1)),
// channel c, as fp32.
template <typename T>
__device__ __forceinline__ float padded_input(const CausalConv1dParams& p, int64_t seq, int64_t start, int64_t r,
                                              int c, bool from_state, int64_t slot) {
  const int64_t hist = p.width - 1;
  if (r >= hist) return to_float(static_cast<const T*>(p.x)[(start + r - hist) * p.x_row_stride + c]);
  if (!from_state) return 0.f;
  return to_float(static_cast<const T*>(p.conv_states)[(slot * hist + r) * p.dim + c]);
}

// Outputs of tokens [t, stop) of sequence seq (rows start ..), the window win[0 .. W - 2] holding
// padded rows t - start .. t - start + W - 2 on entry: each row's taps in order, then the window
// moves by one. Constant indices only (the window stays in registers).
template <typename T>
__device__ __forceinline__ void conv_walk(const CausalConv1dParams& p, int c, int64_t t, int64_t stop,
                                          const float (&wt)[kCausalConvMaxWidth], float b,
                                          float (&win)[kCausalConvMaxWidth]) {
  const int hist = p.width - 1;
  for (; t < stop; ++t) {
    const float xv = to_float(static_cast<const T*>(p.x)[t * p.x_row_stride + c]);
#pragma unroll
    for (int i = 0; i < kCausalConvMaxWidth; ++i)
      if (i == hist) win[i] = xv;
    float acc = b;
#pragma unroll
    for (int i = 0; i < kCausalConvMaxWidth; ++i)
      if (i < p.width) acc = fmaf(wt[i], win[i], acc);
    if (p.silu) acc = acc / (1.f + expf(-acc));
    static_cast<T*>(p.out)[t * p.dim + c] = from_float<T>(acc);
#pragma unroll
    for (int i = 0; i + 1 < kCausalConvMaxWidth; ++i)
      if (i < hist) win[i] = win[i + 1];
  }
}

template <typename T>
__device__ __forceinline__ void load_taps(const CausalConv1dParams& p, int c, float (&wt)[kCausalConvMaxWidth],
                                          float& b) {
  const T* w = static_cast<const T*>(p.weight) + static_cast<int64_t>(c) * p.width;
#pragma unroll
  for (int i = 0; i < kCausalConvMaxWidth; ++i) wt[i] = i < p.width ? to_float(w[i]) : 0.f;
  b = p.bias != nullptr ? to_float(static_cast<const T*>(p.bias)[c]) : 0.f;
}

// Prefill: kConvChunk consecutive tokens per thread (one channel), crossing sequence boundaries;
// each x row is read once, plus W - 1 rows of halo per chunk.
constexpr int kConvChunk = 16;

template <typename T>
__global__ void __launch_bounds__(kConvThreads) causal_conv1d_kernel(const CausalConv1dParams p) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kConvChunk;
  const int64_t last = first + kConvChunk < p.num_tokens ? first + kConvChunk : p.num_tokens;
  const int c = blockIdx.y * kConvThreads + threadIdx.x;
  __shared__ int64_t s_seq;
  if (threadIdx.x == 0) {  // the last sequence starting at or before the first token (empty ones skipped)
    int64_t lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens[mid] <= first)
        lo = mid;
      else
        hi = mid - 1;
    }
    s_seq = lo;
  }
  __syncthreads();
  if (c >= p.dim) return;
  float wt[kCausalConvMaxWidth], b, win[kCausalConvMaxWidth];
  load_taps<T>(p, c, wt, b);
  for (int64_t seq = s_seq, t = first; t < last; ++seq) {
    const int64_t start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
    if (t >= end) continue;
    const bool from_state = p.has_initial_state == nullptr || p.has_initial_state[seq];
    const int64_t slot = from_state ? slot_of(p, seq) : 0;
#pragma unroll
    for (int i = 0; i < kCausalConvMaxWidth; ++i)
      win[i] = i < p.width - 1 ? padded_input<T>(p, seq, start, t - start + i, c, from_state, slot) : 0.f;
    const int64_t stop = end < last ? end : last;
    conv_walk<T>(p, c, t, stop, wt, b, win);
    t = stop;
  }
}

template <typename T>
__global__ void __launch_bounds__(kConvThreads) causal_conv1d_seq_kernel(const CausalConv1dParams p) {
  const int64_t seq = blockIdx.x;
  const int c = blockIdx.y * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  const bool from_state = p.has_initial_state == nullptr || p.has_initial_state[seq];
  const int64_t slot = slot_of(p, seq), hist = p.width - 1;
  T* state = static_cast<T*>(p.conv_states) + slot * hist * p.dim + c;
  float wt[kCausalConvMaxWidth], b, win[kCausalConvMaxWidth];
  load_taps<T>(p, c, wt, b);
#pragma unroll
  for (int i = 0; i < kCausalConvMaxWidth; ++i) win[i] = i < hist && from_state ? to_float(state[i * p.dim]) : 0.f;
  conv_walk<T>(p, c, start, end, wt, b, win);
#pragma unroll
  for (int i = 0; i < kCausalConvMaxWidth - 1; ++i)
    if (i < hist) state[i * p.dim] = from_float<T>(win[i]);
}

template <typename T>
__global__ void __launch_bounds__(kConvThreads) causal_conv1d_states_kernel(const CausalConv1dParams p) {
  const int64_t seq = blockIdx.x;
  const int c = blockIdx.y * kConvThreads + threadIdx.x;
  if (c >= p.dim) return;
  const int64_t start = p.cu_seqlens[seq], len = p.cu_seqlens[seq + 1] - start;
  const bool from_state = p.has_initial_state == nullptr || p.has_initial_state[seq];
  const int64_t slot = slot_of(p, seq), hist = p.width - 1;
  T* state = static_cast<T*>(p.conv_states) + slot * hist * p.dim + c;
  for (int64_t r = 0; r < hist; ++r)  // new row r = padded row len + r (old row len + r >= r: unread yet)
    state[r * p.dim] = from_float<T>(padded_input<T>(p, seq, start, len + r, c, from_state, slot));
}

}  // namespace fastinfer::linear_attention
