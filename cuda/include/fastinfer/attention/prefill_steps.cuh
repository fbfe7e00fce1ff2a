#pragma once
// The steps of one prefill CTA on mma.sync m16n8k16 (prefill.cuh is their sequence): Q and K/V
// tile loads (cp.async, paged gathers, the fp8 tile conversion), Q fragments, S = Q K^T, the score
// transform and masks, the online softmax, O += P V, and the epilogue that normalises and stores
// the rows.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/mask.cuh"
#include "fastinfer/attention/prefill_traits.cuh"
#include "fastinfer/attention/state_merge.cuh"
#include "fastinfer/attention/work_items.cuh"

#include <cmath>
#include <cstdint>

namespace fastinfer::attention {

// ---- loads -------------------------------------------------------------------------------------
// Q rows of the tile into smem (one cp.async group). Thread tid copies chunk tid % kCPR of rows
// tid / kCPR + i * kRowsPerPass; a row's (token, head) source is contiguous per token (the group's
// heads are adjacent), rows past the sequence are zero-filled.
template <typename Traits>
__device__ __forceinline__ void load_q_tile(unsigned char* s_q, const PrefillAttentionParams& p,
                                            const PrefillTile& tile, int tid) {
  using T = typename Traits::T;
  constexpr int D = Traits::kHeadDim, kCPR = Traits::kChunksPerRow;
  const T* __restrict__ q_ptr = static_cast<const T*>(p.q);
  const int chunk = tid % kCPR;
#pragma unroll
  for (int i = 0; i < Traits::kBlockM / Traits::kRowsPerPass; ++i) {
    const int r = tid / kCPR + i * Traits::kRowsPerPass;
    const int row = tile.row0 + r;
    const bool pred = row < tile.rows;
    int64_t off = 0;
    if (pred) {
      const int token = row / tile.group;
      const int head = tile.kv_head * tile.group + (row - token * tile.group);
      off = (tile.q_start + token) * p.q_token_stride + static_cast<int64_t>(head) * D;
    }
    ptx::cp_async_cg_16(s_q + mma::swizzle<kCPR>(r, chunk), q_ptr + off + chunk * Traits::kElemsPerChunk, pred);
  }
}

// K/V tile `n0 / kBlockN` into stage buffers sk / sv (no commit). Keys past k_len are zero-filled.
// T: swizzled rows of T; an fp8 cache: plain rows of D bytes (the staging ring, convert_kv_tile).
template <typename Traits, bool kPaged>
__device__ __forceinline__ void load_kv_tile(unsigned char* sk, unsigned char* sv, const PrefillAttentionParams& p,
                                             const PrefillTile& tile, int n0, int tid) {
  using CacheT = typename Traits::CacheT;
  constexpr int D = Traits::kHeadDim;
  constexpr bool kFp8 = Traits::kFp8Cache;
  constexpr int kCPR = kFp8 ? Traits::kFp8ChunksPerRow : Traits::kChunksPerRow;
  constexpr int kRowsPerPass = kFp8 ? Traits::kFp8RowsPerPass : Traits::kRowsPerPass;
  constexpr int kElemsPerChunk = 16 / sizeof(CacheT);
  static_assert(kPaged || !kFp8, "an fp8 cache is paged");
  const CacheT* __restrict__ k_ptr = static_cast<const CacheT*>(p.k);
  const CacheT* __restrict__ v_ptr = static_cast<const CacheT*>(p.v);
  const int chunk = tid % kCPR;
#pragma unroll
  for (int i = 0; i < Traits::kBlockN / kRowsPerPass; ++i) {
    const int r = tid / kCPR + i * kRowsPerPass;
    const int j = n0 + r;
    const bool pred = j < tile.k_len;
    int64_t k_off = 0, v_off = 0;
    if (pred) {
      if constexpr (kPaged) {
        const int shift = __ffs(p.block_size) - 1;
        const int jk = tile.key_map != nullptr && j >= tile.key_map_lo ? tile.key_map_lo + tile.key_map[j - tile.key_map_lo]
                                                                       : j;
        const int64_t block = p.block_table[static_cast<int64_t>(tile.b) * p.block_table_stride + (jk >> shift)];
        k_off = ((block << shift) + (jk & (p.block_size - 1))) * static_cast<int64_t>(p.num_kv_heads) * D +
                static_cast<int64_t>(tile.kv_head) * D;
        v_off = k_off;
      } else {
        k_off = (tile.k_start + j) * p.k_token_stride + static_cast<int64_t>(tile.kv_head) * D;
        v_off = (tile.k_start + j) * p.v_token_stride + static_cast<int64_t>(tile.kv_head) * D;
      }
    }
    const int so = kFp8 ? (r * kCPR + chunk) * 16 : mma::swizzle<kCPR>(r, chunk);
    ptx::cp_async_cg_16(sk + so, k_ptr + k_off + chunk * kElemsPerChunk, pred);  // !pred: zero-fill
    ptx::cp_async_cg_16(sv + so, v_ptr + v_off + chunk * kElemsPerChunk, pred);
  }
}

// An fp8 cache: one staged tile (plain rows of D e4m3 bytes) into the swizzled T tile the mma steps
// read, 2^-8 times the stored values exactly (e4m3x2_to_half2_scaled; fp16 -> bf16 is exact too).
// Thread tid converts 16-byte chunk tid % kFp8ChunksPerRow of rows tid / kFp8ChunksPerRow + i *
// kFp8RowsPerPass: 16 elements, two 16-byte chunks of T.
template <typename Traits>
__device__ __forceinline__ void convert_kv_tile(unsigned char* dst, const unsigned char* src, int tid) {
  using T = typename Traits::T;
  constexpr int kCPR8 = Traits::kFp8ChunksPerRow;
  const int c8 = tid % kCPR8;
#pragma unroll
  for (int i = 0; i < Traits::kBlockN / Traits::kFp8RowsPerPass; ++i) {
    const int r = tid / kCPR8 + i * Traits::kFp8RowsPerPass;
    const uint4 w = *reinterpret_cast<const uint4*>(src + (r * kCPR8 + c8) * 16);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t out[8];  // 16 values of T, two per register
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t h = e4m3x2_to_half2_scaled(words[k / 2], k % 2);
      if constexpr (std::is_same_v<T, __half>) {
        out[k] = h;
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
        out[k] = mma::pack2<T>(f.x, f.y);
      }
    }
    *reinterpret_cast<uint4*>(dst + mma::swizzle<Traits::kChunksPerRow>(r, 2 * c8)) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(dst + mma::swizzle<Traits::kChunksPerRow>(r, 2 * c8 + 1)) =
        make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// The Q fragment of k-step kk (dims 16kk..16kk+15) of the warp's 16 rows from shared memory.
template <typename Traits>
__device__ __forceinline__ void load_q_fragment(uint32_t (&a)[4], const unsigned char* s_q, int kk, int warp,
                                                int lane) {
  const mma::LdmatrixLane l(lane);
  mma::load_a<Traits::kChunksPerRow>(a, s_q, l.a_row(warp), 2 * kk + l.a_chunk());
}

// Q fragments of the warp's 16 rows kept in registers for the whole kernel (kQInRegisters):
// qf[kk] = A operand of k-step kk.
template <typename Traits>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[Traits::kQFragments][4], const unsigned char* s_q,
                                                 int warp, int lane) {
#pragma unroll
  for (int kk = 0; kk < Traits::kQFragments; ++kk) load_q_fragment<Traits>(qf[kk], s_q, kk, warp, lane);
}

// ---- S = Q K^T (16 x kBlockN per warp) -------------------------------------------------------
// s[nt] holds keys 8nt .. 8nt+7 of the tile: s[nt][0..1] = row g, keys 2t, 2t+1; s[nt][2..3] = row
// g+8. K rows (key = n, dim = k) are the "col" B operand: keys 16np .. 16np + 15 give n-tiles 2np
// and 2np + 1.
// The A operands: qf (kQInRegisters) or, for D = 256, read from s_q at each k-step.
template <typename Traits>
__device__ __forceinline__ void qk_tile(float (&s)[Traits::kBlockN / 8][4],
                                        const uint32_t (&qf)[Traits::kQFragments][4], const unsigned char* s_q,
                                        const unsigned char* sk, int warp, int lane) {
  using T = typename Traits::T;
  constexpr int kBlockN = Traits::kBlockN;
#pragma unroll
  for (int nt = 0; nt < kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const mma::LdmatrixLane l(lane);
#pragma unroll
  for (int kk = 0; kk < Traits::kHeadDim / 16; ++kk) {
    uint32_t a[4];
    if constexpr (Traits::kQInRegisters) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = qf[kk][i];
    } else {
      load_q_fragment<Traits>(a, s_q, kk, warp, lane);
    }
#pragma unroll
    for (int np = 0; np < kBlockN / 16; ++np) {
      uint32_t b0[2], b1[2];
      mma::load_b_pair<Traits::kChunksPerRow>(b0, b1, sk, l.b_row(np), 2 * kk + l.b_chunk());
      ptx::mma_m16n8k16<T>(s[2 * np], a, b0);
      ptx::mma_m16n8k16<T>(s[2 * np + 1], a, b1);
    }
  }
}

// Scores to the log2 domain: s * scale * log2 e, or softcap * tanh(s * scale / softcap) * log2 e
// (softcap before any mask).
struct ScoreScale {
  float scale_log2;  // scale * log2 e
  float cap_in;      // scale / softcap (softcap > 0)
  float cap_out;     // softcap * log2 e
  bool softcap;
};

template <typename Traits>
__device__ __forceinline__ void scores_to_log2(float (&s)[Traits::kBlockN / 8][4], const ScoreScale& sc) {
  if (sc.softcap) {
#pragma unroll
    for (int nt = 0; nt < Traits::kBlockN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = tanhf(s[nt][e] * sc.cap_in) * sc.cap_out;
  } else {
#pragma unroll
    for (int nt = 0; nt < Traits::kBlockN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= sc.scale_log2;
  }
}

// -inf for the scores the mask hides (keys n0 + 8nt + 2t + e).
template <typename Traits>
__device__ __forceinline__ void mask_scores(float (&s)[Traits::kBlockN / 8][4], const PrefillTile& tile,
                                            const SequenceMask& mask, int n0, int warp, int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
  const int t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int nt = 0; nt < Traits::kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = n0 + nt * 8 + 2 * t + e;
        if (!rows.valid[h] || !mask.visible(rows.token[h], rows.pos[h], j)) s[nt][2 * h + e] = -INFINITY;
      }
    }
  }
}

// ---- online softmax (rows g and g + 8; the 4 lanes of a quad share a row) ---------------------
// Scores become probabilities exp2(s - max) in place; the running max / sum and the output
// accumulators are rescaled by exp2(old max - new max).
template <typename Traits>
__device__ __forceinline__ void online_softmax(float (&s)[Traits::kBlockN / 8][4], float (&row_max)[2],
                                               float (&row_sum)[2], float (&o)[Traits::kHeadDim / 8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int nt = 0; nt < Traits::kBlockN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    mx = warp_reduce_max<4>(mx);
    // Safe max: a row with no visible key so far keeps max -inf; subtracting 0 keeps
    // exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
    const float m_use = mx == -INFINITY ? 0.f : mx;
    const float alpha = exp2f(row_max[h] - m_use);  // old max -inf -> 0 (nothing accumulated)
    row_max[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < Traits::kBlockN / 8; ++nt) {
      s[nt][2 * h] = exp2f(s[nt][2 * h] - m_use);
      s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - m_use);
      sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    row_sum[h] = row_sum[h] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < Traits::kHeadDim / 8; ++dt) {
      o[dt][2 * h] *= alpha;
      o[dt][2 * h + 1] *= alpha;
    }
  }
}

// ---- O += P V ----------------------------------------------------------------------------------
// P as the A operand of k-step kk (keys 16kk..16kk+15): the C fragments of n-tiles 2kk and 2kk+1
// already sit where the A layout wants them:
//   a[0] = P[g][2t..2t+1]     = s[2kk][0..1]      a[1] = P[g+8][2t..2t+1]   = s[2kk][2..3]
//   a[2] = P[g][2t+8..2t+9]   = s[2kk+1][0..1]    a[3] = P[g+8][2t+8..2t+9] = s[2kk+1][2..3]
// V rows (key = k, dim = n) give the B operand by ldmatrix .trans: dims 16dp .. 16dp + 15 are
// d-tiles 2dp and 2dp + 1.
template <typename Traits>
__device__ __forceinline__ void pv_tile(float (&o)[Traits::kHeadDim / 8][4], const float (&s)[Traits::kBlockN / 8][4],
                                        const unsigned char* sv, int lane) {
  using T = typename Traits::T;
  const mma::LdmatrixLane l(lane);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    const uint32_t pa[4] = {mma::pack2<T>(s[2 * kk][0], s[2 * kk][1]), mma::pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                            mma::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            mma::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < Traits::kHeadDim / 16; ++dp) {
      uint32_t b0[2], b1[2];
      mma::load_b_pair<Traits::kChunksPerRow, /*kTrans=*/true>(b0, b1, sv, l.a_row(kk), 2 * dp + l.a_chunk());
      ptx::mma_m16n8k16<T>(o[2 * dp], pa, b0);
      ptx::mma_m16n8k16<T>(o[2 * dp + 1], pa, b1);
    }
  }
}

// ---- epilogue ----------------------------------------------------------------------------------
// The lse of a row (or of a deterministic-mode chunk) from its log2-domain max and quad-reduced
// sum: -inf when it saw no key (l == 0), NaN when it saw a NaN score. The running max may skip a
// NaN (fmaxf), but exp2(NaN - max) = NaN reaches the sum, and the sum is tested for 0, not > 0.
__device__ __forceinline__ float chunk_lse(float row_max, float l) {
  return l == 0.f ? -INFINITY : (row_max + log2f(l)) * kLn2;
}
// 1 / the row's sum times `numerator`: 0 for a row that saw no key, NaN (kept) for a NaN sum.
__device__ __forceinline__ float row_inverse(float numerator, float l) { return l == 0.f ? 0.f : numerator / l; }

// Normalise, stage the warp's 16 rows in its own Q rows of smem, store them with 16-byte coalesced
// writes (rows past the sequence are dropped), lse per valid row. Only this warp ever read those
// Q rows (its ldmatrix completed before), so a __syncwarp between the fragment writes and the
// row reads is enough.
template <typename Traits>
__device__ __forceinline__ void epilogue(unsigned char* s_q, const PrefillAttentionParams& p, const PrefillTile& tile,
                                         const SequenceMask& mask, const float (&o)[Traits::kHeadDim / 8][4],
                                         const float (&row_max)[2], const float (&row_sum)[2], int warp, int lane,
                                         const float* folded_lse = nullptr) {
  using T = typename Traits::T;
  constexpr int D = Traits::kHeadDim, kCPR = Traits::kChunksPerRow;
  const int g = lane / 4, t = lane % 4;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_reduce_sum<4>(row_sum[h]);
    // No visible key: out = 0. The folded state is in the output's units already.
    float inv = row_inverse(folded_lse != nullptr ? 1.f : out_numerator<Traits>(tile), l);
    const int r = warp * 16 + g + 8 * h;
    const int head = tile.kv_head * tile.group + (tile.row0 + r - rows.token[h] * tile.group);
    float lse = folded_lse != nullptr ? folded_lse[h] : chunk_lse(row_max[h], l);
    if (folded_lse == nullptr && p.sinks != nullptr && rows.valid[h]) {  // (the fold merged it already)
      const ChunkMerge w = sink_merge(lse, p.sinks[head]);
      inv *= w.wa;
      lse = w.lse;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(s_q + mma::swizzle<kCPR>(r, dt) + 4 * t) =
          mma::pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && t == 0 && rows.valid[h])
      p.lse[(tile.q_start + rows.token[h]) * static_cast<int64_t>(p.num_q_heads) + head] = lse;
  }
  __syncwarp();
  T* __restrict__ out_ptr = static_cast<T*>(p.out);
#pragma unroll
  for (int c = lane; c < 16 * kCPR; c += 32) {
    const int r = warp * 16 + c / kCPR;
    const int chunk = c % kCPR;
    const int row = tile.row0 + r;
    if (row < tile.rows) {
      const int token = row / tile.group;
      const int head = tile.kv_head * tile.group + (row - token * tile.group);
      const uint4 val = *reinterpret_cast<const uint4*>(s_q + mma::swizzle<kCPR>(r, chunk));
      *reinterpret_cast<uint4*>(out_ptr + (tile.q_start + token) * p.out_token_stride + static_cast<int64_t>(head) * D +
                                chunk * Traits::kElemsPerChunk) = val;
    }
  }
}

}  // namespace fastinfer::attention
