#pragma once
// Paged decode attention (one query per sequence), GQA-aware, split-KV.
//
// Grid (batch, num_kv_heads * head_chunks, num_splits); 128 threads (4 warps) per CTA. A CTA owns
// one KV head of one sequence and up to G (1, 2, 4 or 8) of the query heads that share it, so
// every K/V row is read from global memory once per CTA. When the group is larger than 8 (or not
// a power of two) the group is cut into head_chunks chunks of G heads; the heads of the last
// chunk past the group are computed on zeros and never stored.
//
// Thread layout inside a warp: a K/V row of D elements is split into D/8 slices of 8 elements
// (16 bytes for fp16/bf16, 8 bytes for fp8); lane = row * (D/8) + slice, so a warp works on
// 32 / (D/8) keys at once (4, 2, 1 for D = 64, 128, 256) and each thread issues kUnroll loads of
// K and of V before using any of them. Each thread keeps, per query head, its q slice (fp32, scaled
// by scale * log2(e) [* k_scale]), an fp32 slice of the output accumulator and the running max /
// sum of the online softmax (base-2 exponentials). The kUnroll * G dot products of a step are
// reduced across the D/8 lanes of a row by a reduce-scatter + all-gather (row_allreduce: about 2V
// shuffles for V values instead of V * log2(D/8)); the block-table reads of the next step are
// issued while the current step's K/V loads are in flight. Warps take interleaved chunks of kUnroll * rows-per-warp keys; at the
// end the row groups of a warp are merged with shuffles and the warps through shared memory.
//
// Split s of a sequence handles keys [lo + s * per, lo + (s + 1) * per) of its visible range
// [lo, L) (lo = max(0, L - 1 - window_left) with a window), per = ceil((L - lo) / num_splits)
// rounded up to kSplitGranule keys; computed on the device from seq_lens, so no host sync. With
// num_splits > 1 the CTA writes an fp32 partial (normalised output and natural-log lse, -inf when
// the split saw no key) to the workspace and decode_merge_splits_kernel combines them.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/state_merge.cuh"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"

#include <cmath>
#include <type_traits>

namespace fastinfer::attention::decode {

constexpr int kNumWarps = 4;
constexpr int kNumThreads = kNumWarps * 32;
constexpr int kSliceElems = 8;   // elements of a K/V row handled by one thread
constexpr int kMaxGroup = 8;     // query heads per CTA

// The per-(D, G) tables, as constexpr functions: Config below and the host heuristics
// (cuda/src/attention_decode.cu) are computed by the same functions, so they cannot drift apart.
// Query heads per CTA for a GQA group size.
constexpr int group_chunk_for(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : kMaxGroup; }
// Keys per thread per step (more query heads per CTA: fewer keys, same registers).
constexpr int unroll_for(int group_chunk) { return group_chunk <= 2 ? 8 : (group_chunk == 4 ? 4 : 2); }
// Keys a CTA covers per step, and the split granule (splits are whole multiples of it).
constexpr int cta_keys_for(int head_dim, int group_chunk) {
  return 32 / (head_dim / kSliceElems) * unroll_for(group_chunk) * kNumWarps;
}
constexpr int split_granule(int head_dim, int group_chunk) {
  return cta_keys_for(head_dim, group_chunk) > 64 ? cta_keys_for(head_dim, group_chunk) : 64;
}
// CTAs resident per SM: the kernels' __launch_bounds__ minimum (ptxas caps the registers at
// 65536 / (n * 128): 128 for 4, 170 for 3, none for 2) and the split heuristic's slots per SM.
// The ptxas report (sm_80 .. sm_90a) gives 103-128 registers for chunks 1-2, 143-164 for 4 and
// 217-242 for 8 (two CTAs fit); without the hint ptxas spills a register of the G = 1 kernels
// on sm_80 instead of using 111.
constexpr int ctas_per_sm_for(int group_chunk) { return group_chunk <= 2 ? 4 : (group_chunk == 4 ? 3 : 2); }

template <int D, int G>
struct Config {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static_assert(G == 1 || G == 2 || G == 4 || G == 8, "group chunk 1, 2, 4 or 8");
  static constexpr int kThreadsPerRow = D / kSliceElems;      // 8, 16, 32
  static constexpr int kRowsPerWarp = 32 / kThreadsPerRow;    // 4, 2, 1
  static constexpr int kUnroll = unroll_for(G);               // keys per thread per step
  static constexpr int kWarpKeys = kRowsPerWarp * kUnroll;
  static constexpr int kCtaKeys = cta_keys_for(D, G);
  static_assert(kCtaKeys == kWarpKeys * kNumWarps, "cta_keys_for");
  static constexpr int kSplitGranule = split_granule(D, G);
  static constexpr int kMinCtas = ctas_per_sm_for(G);
  // Shared memory of the final merge: per warp and head the max, the sum and the D accumulators.
  static constexpr size_t kSmemBytes = sizeof(float) * kNumWarps * G * (D + 2);
};

// Sum of each of the V values over the TPR consecutive lanes of a row, left in every lane of the
// row: reduce-scatter (each xor step halves the values a lane keeps), plain xor steps once a lane
// keeps a single value, then all-gather. V + log2(TPR / V) - 1 + V - 1 shuffles (when V <= TPR)
// instead of V * log2(TPR) for independent butterflies.
template <int V, int TPR>
__device__ __forceinline__ void row_allreduce(float (&v)[V], int lane) {
  static_assert((V & (V - 1)) == 0 && (TPR & (TPR - 1)) == 0, "powers of two");
  constexpr int kLogT = ilog2(TPR);
  constexpr int kScatter = ilog2(V) < kLogT ? ilog2(V) : kLogT;
#pragma unroll
  for (int k = 0; k < kScatter; ++k) {
    const int o = TPR >> (k + 1);
    const int half = V >> (k + 1);
    const bool hi = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      const float received = __shfl_xor_sync(kFullWarpMask, hi ? a : b, o);
      v[i] = (hi ? b : a) + received;
    }
  }
#pragma unroll
  for (int k = kScatter; k < kLogT; ++k) v[0] += __shfl_xor_sync(kFullWarpMask, v[0], TPR >> (k + 1));
#pragma unroll
  for (int k = kScatter - 1; k >= 0; --k) {
    const int o = TPR >> (k + 1);
    const int half = V >> (k + 1);
    const bool hi = (lane & o) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float mine = v[i];
      const float other = __shfl_xor_sync(kFullWarpMask, mine, o);
      v[i] = hi ? other : mine;
      v[i + half] = hi ? mine : other;
    }
  }
}

// 8 storage elements -> fp32.
__device__ __forceinline__ void slice_to_float(const Vec<__nv_bfloat16, 8>& v, float (&f)[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(v.data);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void slice_to_float(const Vec<__half, 8>& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(*reinterpret_cast<const __half2*>(v.data + 2 * i));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
// e4m3 -> 2^-8 times its value (e4m3x2_to_half2_scaled; kE4m3HalfRescale is folded into the scales).
__device__ __forceinline__ void slice_to_float(const Vec<__nv_fp8_e4m3, 8>& v, float (&f)[8]) {
  const uint2 w = *reinterpret_cast<const uint2*>(v.data);
  const uint32_t words[2] = {w.x, w.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t h = e4m3x2_to_half2_scaled(words[i], j);
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[4 * i + 2 * j] = x.x;
      f[4 * i + 2 * j + 1] = x.y;
    }
  }
}

// Online-softmax merge of state b into state a (maxima in the log2 domain, -inf safe).
__device__ __forceinline__ void merge_state_scales(float m_a, float m_b, float& m, float& scale_a, float& scale_b) {
  m = fmaxf(m_a, m_b);
  const float ref = m == -INFINITY ? 0.f : m;
  scale_a = exp2f(m_a - ref);
  scale_b = exp2f(m_b - ref);
}

template <typename T, typename CacheT, int D, int G>
__global__ void __launch_bounds__(kNumThreads, (Config<D, G>::kMinCtas)) paged_decode_attention_kernel(const DecodeAttentionParams p,
                                                                            const int head_chunks) {
  using Cfg = Config<D, G>;
  constexpr int kTpr = Cfg::kThreadsPerRow;
  constexpr int kRpw = Cfg::kRowsPerWarp;
  constexpr int kUnroll = Cfg::kUnroll;
  constexpr bool kFp8 = !std::is_same_v<T, CacheT>;

  const int b = blockIdx.x;
  const int kv_head = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y % head_chunks;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head0 = kv_head * group + chunk * G;  // first query head of this CTA
  const int heads_here = min(G, group - chunk * G);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = lane / kTpr;    // which key of the warp's step
  const int slice = lane % kTpr;  // which 8 elements of the row

  // Visible key range of this split.
  const int64_t max_keys = p.block_table_stride * p.block_size;
  int seq_len = p.seq_lens[b];
  if (seq_len < 0) seq_len = 0;
  if (seq_len > max_keys) seq_len = static_cast<int>(max_keys);  // caller bug: never read past the table
  int lo = 0;
  if (p.window_left >= 0 && seq_len - 1 - p.window_left > 0) lo = seq_len - 1 - p.window_left;
  int per = seq_len - lo;
  if (num_splits > 1) {
    per = (per + num_splits - 1) / num_splits;
    per = (per + Cfg::kSplitGranule - 1) / Cfg::kSplitGranule * Cfg::kSplitGranule;
  }
  const int64_t start64 = lo + static_cast<int64_t>(split) * per;
  const int start = start64 < seq_len ? static_cast<int>(start64) : seq_len;
  const int end = seq_len - start > per ? start + per : seq_len;

  // q slices, pre-scaled so that q . k lands in the log2 domain (or in tanh's argument).
  const bool softcap = p.softcap > 0.f;
  float qk_scale = p.scale * (softcap ? 1.f / p.softcap : kLog2e);
  if constexpr (kFp8) qk_scale *= p.k_scale[kv_head * p.k_scale_stride] * kE4m3HalfRescale;
  const float softcap_log2 = p.softcap * kLog2e;
  float q[G][kSliceElems];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h < heads_here) {
      Vec<T, kSliceElems> qv;
      qv.load(static_cast<const T*>(p.q) + b * p.q_token_stride + static_cast<int64_t>(head0 + h) * D +
              slice * kSliceElems);
#pragma unroll
      for (int i = 0; i < kSliceElems; ++i) q[h][i] = to_float(qv[i]) * qk_scale;
    } else {
#pragma unroll
      for (int i = 0; i < kSliceElems; ++i) q[h][i] = 0.f;
    }
  }

  float m[G], l[G], o[G][kSliceElems];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < kSliceElems; ++i) o[h][i] = 0.f;
  }

  const int64_t slot_stride = static_cast<int64_t>(p.num_kv_heads) * D;  // elements between slots
  const int64_t head_offset = static_cast<int64_t>(kv_head) * D + slice * kSliceElems;
  const CacheT* __restrict__ k_cache = static_cast<const CacheT*>(p.k_cache) + head_offset;
  const CacheT* __restrict__ v_cache = static_cast<const CacheT*>(p.v_cache) + head_offset;
  const int32_t* __restrict__ block_table = p.block_table + b * p.block_table_stride;
  const int bs_shift = __ffs(p.block_size) - 1;
  const int bs_mask = p.block_size - 1;

  // Slot offsets of the kUnroll keys of this lane in a warp step. Keys past the end are clamped to
  // the last key (finite data) and masked below. The block-table reads of the next step are
  // issued while the current step's K/V loads are in flight.
  int64_t offset[kUnroll];
  auto compute_offsets = [&](int step_base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = min(step_base + u * kRpw + row, end - 1);
      const int64_t block = __ldg(block_table + (key >> bs_shift));
      offset[u] = ((block << bs_shift) + (key & bs_mask)) * slot_stride;
    }
  };
  const int first_base = start + warp * Cfg::kWarpKeys;
  if (first_base < end) compute_offsets(first_base);
  for (int base = first_base; base < end; base += Cfg::kCtaKeys) {
    Vec<CacheT, kSliceElems> kr[kUnroll], vr[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) kr[u].load(k_cache + offset[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) vr[u].load(v_cache + offset[u]);
    if (base + Cfg::kCtaKeys < end) compute_offsets(base + Cfg::kCtaKeys);

    float s[kUnroll * G];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kSliceElems];
      slice_to_float(kr[u], kf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < kSliceElems; ++i) acc = fmaf(q[h][i], kf[i], acc);
        s[u * G + h] = acc;
      }
    }
    row_allreduce<kUnroll * G, kTpr>(s, lane);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = base + u * kRpw + row < end;
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float x = s[u * G + h];
        if (softcap) x = softcap_log2 * tanhf(x);
        s[u * G + h] = valid ? x : -INFINITY;
      }
    }
    // Online softmax update, then p * V.
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float tile_max = s[h];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) tile_max = fmaxf(tile_max, s[u * G + h]);
      const float m_new = fmaxf(m[h], tile_max);
      const float ref = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[h] - ref);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int i = 0; i < kSliceElems; ++i) o[h][i] *= alpha;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float pr = exp2f(s[u * G + h] - ref);
        l[h] += pr;
        s[u * G + h] = pr;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float vf[kSliceElems];
      slice_to_float(vr[u], vf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
#pragma unroll
        for (int i = 0; i < kSliceElems; ++i) o[h][i] = fmaf(s[u * G + h], vf[i], o[h][i]);
      }
    }
  }

  // Merge the row groups of the warp (lanes that share a slice).
#pragma unroll
  for (int offset_lanes = kTpr; offset_lanes < 32; offset_lanes <<= 1) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float m_b = __shfl_xor_sync(kFullWarpMask, m[h], offset_lanes);
      const float l_b = __shfl_xor_sync(kFullWarpMask, l[h], offset_lanes);
      float m_new, sa, sb;
      merge_state_scales(m[h], m_b, m_new, sa, sb);
      m[h] = m_new;
      l[h] = l[h] * sa + l_b * sb;
#pragma unroll
      for (int i = 0; i < kSliceElems; ++i) {
        const float o_b = __shfl_xor_sync(kFullWarpMask, o[h][i], offset_lanes);
        o[h][i] = o[h][i] * sa + o_b * sb;
      }
    }
  }

  // Merge the warps through shared memory: [warp][head] max and sum, then [warp][head][D]. The D
  // accumulators of a (warp, head) are D / 4 float4 chunks; logical chunk q (elements 4q..4q+3)
  // lives at chunk q ^ ((q >> 3) & 1). A slice's two chunks 2 slice, 2 slice + 1 are adjacent, so
  // without the swizzle the quarter warps of each 128-bit store hit 16-byte chunks 32 bytes apart
  // (2-way bank conflicts, simt profiler); with it their 8 chunks are distinct mod 8, and the
  // readers below (8 consecutive logical chunks per quarter warp) stay conflict-free too.
  float* smem_ml = dynamic_smem<float>();
  float* smem_o = smem_ml + kNumWarps * G * 2;
  if (row == 0) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float* dst = smem_o + (warp * G + h) * D;
#pragma unroll
      for (int i = 0; i < kSliceElems; i += 4) {
        const int q = (slice * kSliceElems + i) / 4;
        *reinterpret_cast<float4*>(dst + 4 * (q ^ ((q >> 3) & 1))) =
            make_float4(o[h][i], o[h][i + 1], o[h][i + 2], o[h][i + 3]);
      }
      if (slice == 0) {
        smem_ml[(warp * G + h) * 2] = m[h];
        smem_ml[(warp * G + h) * 2 + 1] = l[h];
      }
    }
  }
  __syncthreads();

  const float v_scale = kFp8 ? p.v_scale[kv_head * p.v_scale_stride] * kE4m3HalfRescale : 1.f;
  constexpr int kSlicesPerHead = D / 4;  // the output is written 4 elements per thread
  for (int idx = threadIdx.x; idx < G * kSlicesPerHead; idx += kNumThreads) {
    const int h = idx / kSlicesPerHead;
    const int d = (idx % kSlicesPerHead) * 4;
    if (h >= heads_here) break;  // heads are ordered: the rest is past the group too
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) m_all = fmaxf(m_all, smem_ml[(w * G + h) * 2]);
    const float ref = m_all == -INFINITY ? 0.f : m_all;
    float sum = 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float scale_w = exp2f(smem_ml[(w * G + h) * 2] - ref);
      sum += smem_ml[(w * G + h) * 2 + 1] * scale_w;
      const int q = d / 4;
      const float4 ow = *reinterpret_cast<const float4*>(smem_o + (w * G + h) * D + 4 * (q ^ ((q >> 3) & 1)));
      acc[0] += ow.x * scale_w;
      acc[1] += ow.y * scale_w;
      acc[2] += ow.z * scale_w;
      acc[3] += ow.w * scale_w;
    }
    // sum == 0: no key; a NaN sum (a NaN score or value reached it) stays NaN in out and lse.
    float inv = sum == 0.f ? 0.f : v_scale / sum;
    float lse = sum == 0.f ? -INFINITY : (m_all + log2f(sum)) * kLn2;
    const int head = head0 + h;
    if (num_splits == 1) {
      if (p.sinks != nullptr) {  // (with splits, the merge kernel counts it)
        const ChunkMerge w = sink_merge(lse, p.sinks[head]);
        inv *= w.wa;
        lse = w.lse;
      }
      T* out = static_cast<T*>(p.out) + b * p.out_token_stride + static_cast<int64_t>(head) * D + d;
      Vec<T, 4> ov;
#pragma unroll
      for (int i = 0; i < 4; ++i) ov[i] = from_float<T>(acc[i] * inv);
      ov.store(out);
      if (d == 0 && p.lse != nullptr) p.lse[static_cast<int64_t>(b) * p.num_q_heads + head] = lse;
    } else {
      const int64_t out_row = static_cast<int64_t>(b) * p.num_q_heads + head;
      const int64_t row_index = static_cast<int64_t>(split) * p.batch_size * p.num_q_heads + out_row;
      float* partial_o = static_cast<float*>(p.workspace);
      float* partial_lse = partial_o + static_cast<int64_t>(num_splits) * p.batch_size * p.num_q_heads * D;
      *reinterpret_cast<float4*>(partial_o + row_index * D + d) =
          make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      if (d == 0) partial_lse[out_row * num_splits + split] = lse;  // [row][split], see the merge kernel
    }
  }
}

// Combines the num_splits partials of every (sequence, query head): one warp per row, 4 rows per
// CTA; lane i handles 4-element slices i, i + 32, ... of the row. Workspace: partial outputs
// [split][row][D], then partial lse [row][split] (contiguous per row: the lanes' lse reads coalesce;
// [split][row] made them one sector per lane). At B = 1 this is B * Hq / 4 = 8 CTAs for 32 heads,
// fewer than the SMs (bench/model.py): the whole merge reads num_splits * Hq * D * 4 bytes
// (0.5 MB at 32 splits), a few microseconds on any grid, so it is left at one warp per row.
constexpr int kMergeRowsPerCta = 4;

template <typename T>
__global__ void __launch_bounds__(kMergeRowsPerCta * 32) decode_merge_splits_kernel(const DecodeAttentionParams p,
                                                                                   const int num_splits) {
  const int64_t num_rows = static_cast<int64_t>(p.batch_size) * p.num_q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerCta + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= num_rows) return;  // whole warp
  const int D = p.head_dim;
  const float* partial_o = static_cast<const float*>(p.workspace);
  const float* partial_lse = partial_o + static_cast<int64_t>(num_splits) * num_rows * D;
  const float* lse_row = partial_lse + row * num_splits;

  const int64_t b = row / p.num_q_heads;
  const int64_t head = row % p.num_q_heads;
  // The sink (attention.h) is one more term of the denominator, with no value row.
  const float sink = p.sinks != nullptr ? p.sinks[head] : -INFINITY;
  float m_all = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) m_all = fmaxf(m_all, lse_row[s]);
  m_all = fmaxf(warp_reduce_max(m_all), sink);
  // fmaxf skips a NaN partial lse; exp(NaN - ref) = NaN carries it into the sum (an empty split,
  // lse -inf, adds exp(-inf) = 0 even when every split is empty: ref 0).
  const float ref = m_all == -INFINITY ? 0.f : m_all;
  float sum = 0.f;
  for (int s = lane; s < num_splits; s += 32) sum += expf(lse_row[s] - ref);
  sum = warp_reduce_sum(sum);
  if (sink != -INFINITY) sum += expf(sink - ref);
  const float inv = sum == 0.f ? 0.f : 1.f / sum;

  T* out = static_cast<T*>(p.out) + b * p.out_token_stride + head * D;
  for (int d = lane * 4; d < D; d += 128) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (sum != 0.f) {
      for (int s = 0; s < num_splits; ++s) {
        const float w = expf(lse_row[s] - ref) * inv;
        const float4 v = *reinterpret_cast<const float4*>(partial_o + (s * num_rows + row) * D + d);
        acc[0] = fmaf(w, v.x, acc[0]);
        acc[1] = fmaf(w, v.y, acc[1]);
        acc[2] = fmaf(w, v.z, acc[2]);
        acc[3] = fmaf(w, v.w, acc[3]);
      }
    }
    Vec<T, 4> ov;
#pragma unroll
    for (int i = 0; i < 4; ++i) ov[i] = from_float<T>(acc[i]);
    ov.store(out + d);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[row] = sum == 0.f ? -INFINITY : ref + logf(sum);
}

}  // namespace fastinfer::attention::decode
