#pragma once
// Multi-head latent attention kernels (mla.h states the contract): the latent cache write and the
// absorbed decode on mma.sync m16n8k16.
//
// Decode. A CTA owns kRows (token, head) rows of one sequence, token-major as the prefill kernel
// packs a GQA group (work_items.cuh: find_work_item with group = num_heads), and walks the 576-wide
// latent rows of its keys in tiles of kBlockN keys through a two-stage cp.async ring:
//
//   gmem --cp.async--> smem Q [kRows][576] (once); K/V tile [kBlockN][576] (gathered per key from
//                      the block table; an fp8 tile staged as bytes and converted to T exactly,
//                      2^-8 times the stored values, as the prefill kernel's fp8 path)
//   S = Q K^T   : 36 k-steps of 16 over all 576 columns (ldmatrix of Q rows = A, of K rows = B "col")
//   softmax     : prefill_steps.cuh's online_softmax (exp2 domain, safe max, -inf masks)
//   O += P V    : prefill_steps.cuh's pv_tile on the first 512 columns of the same tile (ldmatrix
//                 .trans), so the latent is read from global memory once per CTA for both products
//
// Warps: kRows / 16 row groups x 2 value halves. Warp (rg, vh) owns rows 16 rg .. 16 rg + 15 and
// output columns 256 vh .. 256 vh + 255 (128 fp32 accumulators a thread: 512 columns would not fit
// in registers); both warps of a row group compute the same S and softmax (the same instructions on
// the same data: identical state, no exchange, at the price of computing Q K^T twice). An fp8
// cache's scale (per tensor, or per token in s_scale) multiplies each key's score and its P entry.
//
// A row's arithmetic depends only on its own query, its keys and the tile grid (tiles aligned at
// absolute multiples of kBlockN from key 0): not on the other rows of the CTA. A tile a row sees
// nothing of is an exact identity (max unchanged, p = 0, V rows past the sequence zero-filled).
// As in the prefill kernel, P V multiplies a hidden key's zero weight by its value row, so a NaN
// in a hidden key's latent reaches the other rows of its tile in out (not in lse).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/mma.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/attention/mask.cuh"
#include "fastinfer/attention/mla.h"
#include "fastinfer/attention/prefill_steps.cuh"
#include "fastinfer/attention/work_items.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fastinfer::attention::mla {

// ---- cache write -------------------------------------------------------------------------------
// One warp per token, lane i owning elements i + 32 k of the 576 (k < 16: kv_c, then k_pe): the
// loads and stores of a warp are contiguous runs. fp8: the per-token scale from the warp's amax
// (NaN kept), then e4m3(x / scale) (divided, rounded once, saturated), fp8_quantize's rule.
constexpr int kWriteWarps = 4;
constexpr int kWritePerLane = kMlaRowDim / 32;

template <typename T, typename CacheT>
__global__ void __launch_bounds__(kWriteWarps * 32) mla_cache_write_kernel(const MlaCacheWriteParams p) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWriteWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (token >= p.num_tokens) return;  // whole warp
  const int64_t slot = p.slot_type == IndexType::kInt32
                           ? static_cast<int64_t>(static_cast<const int32_t*>(p.slot_mapping)[token])
                           : static_cast<const int64_t*>(p.slot_mapping)[token];
  if (slot < 0) return;  // padding token: the whole warp
  const T* kv_c = static_cast<const T*>(p.kv_c) + token * p.kv_c_stride;
  const T* k_pe = static_cast<const T*>(p.k_pe) + token * p.k_pe_stride;
  CacheT* dst = static_cast<CacheT*>(p.kv_cache) + slot * kMlaRowDim;
  T x[kWritePerLane];
#pragma unroll
  for (int i = 0; i < kWritePerLane; ++i) {
    const int e = lane + 32 * i;
    x[i] = e < kMlaLatentDim ? kv_c[e] : k_pe[e - kMlaLatentDim];
  }
  if constexpr (std::is_same_v<T, CacheT>) {
#pragma unroll
    for (int i = 0; i < kWritePerLane; ++i) dst[lane + 32 * i] = x[i];
  } else {
    float scale;
    if (p.scale_per_token) {
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < kWritePerLane; ++i) amax = max_nan(amax, fabsf(to_float(x[i])));
      amax = warp_reduce_max_nan(amax);
      scale = amax != amax ? amax : fmaxf(amax, 1e-12f) / 448.f;
      if (lane == 0) p.kv_scale[slot] = scale;
    } else {
      scale = p.kv_scale[0];
    }
#pragma unroll
    for (int i = 0; i < kWritePerLane; ++i) dst[lane + 32 * i] = from_float<CacheT>(to_float(x[i]) / scale);
  }
}

// ---- decode ------------------------------------------------------------------------------------
// kHeadDim, kBlockN, kChunksPerRow and T are the names prefill_steps.cuh's online_softmax and
// pv_tile read: kHeadDim is a warp's 256 output columns, kChunksPerRow the 72 16-byte chunks of a
// 576-wide row (a multiple of 8: the XOR swizzle stays in the row, and column 256 vh starts at byte
// 512 vh of every swizzled row).
template <typename T_, typename CacheT_, int kRows_>
struct MlaTraits {
  using T = T_;
  using CacheT = CacheT_;
  static constexpr bool kFp8Cache = !std::is_same_v<T, CacheT>;
  static constexpr int kRows = kRows_;
  static constexpr int kRowGroups = kRows / 16;
  static constexpr int kWarps = 2 * kRowGroups;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = kRows == 64 ? 32 : 16;
  static constexpr int kHeadDim = kMlaLatentDim / 2;
  static constexpr int kValueHalfBytes = kHeadDim * 2;
  static constexpr int kChunksPerRow = kMlaRowDim * 2 / 16;
  static constexpr int kFp8ChunksPerRow = kMlaRowDim / 16;
  static constexpr int kSteps = kMlaRowDim / 16;  // k-steps of Q K^T
  static constexpr int kStages = 2;
  static constexpr int kQBytes = kRows * kMlaRowDim * 2;
  static constexpr int kTileBytes = kBlockN * kMlaRowDim * 2;
  static constexpr int kFp8TileBytes = kBlockN * kMlaRowDim;
  static constexpr int kTileBuffers = kFp8Cache ? 1 : kStages;  // T tiles the mma steps read
  static constexpr int kStagingOffset = kQBytes + kTileBuffers * kTileBytes;
  static constexpr int kScaleOffset = kStagingOffset + (kFp8Cache ? kStages * kFp8TileBytes : 0);
  // kSplitKeys (32-key tiles): the two warps of a row group split the tile's keys for S and
  // exchange their row maxima, P (in T) and at the end their row sums through shared memory.
  static constexpr bool kSplitKeys = kBlockN == 32;
  static constexpr int kHalfN = kBlockN / 2;
  static constexpr int kPRowBytes = kBlockN * 2;  // P [kRows][kBlockN] in T, plain rows
  static constexpr int kPOffset = kScaleOffset + kStages * kBlockN * static_cast<int>(sizeof(float));
  static constexpr int kRowStatOffset = kPOffset + (kSplitKeys ? kRows * kPRowBytes : 0);
  static constexpr int kSmemBytes = kRowStatOffset + (kSplitKeys ? 2 * kRows * static_cast<int>(sizeof(float)) : 0);
  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(kRows == 64 || kRows == 32, "64 or 32 rows");
  static_assert((kRows * kChunksPerRow) % kThreads == 0 && (kBlockN * kChunksPerRow) % kThreads == 0,
                "whole cp.async passes");
};

// Where a split CTA's partials go (kSplit instances): the prefill split layout (split_fold.cuh),
// out [z][num_q_tokens * num_heads][512] fp32 normalised, lse [z][num_q_tokens * num_heads]. In the
// deterministic mode blockIdx.z + chunk_begin is the chunk of fixed_split_size keys; otherwise
// blockIdx.z is the part of the CTA's key tiles, of gridDim.z parts.
struct MlaSplitState {
  float* out;
  float* lse;
  int32_t chunk_begin;
};

// The key row of key j of the tile's sequence (slot * 576 elements).
__device__ __forceinline__ int64_t key_row_offset(const MlaDecodeParams& p, int b, int j) {
  const int shift = __ffs(p.block_size) - 1;
  const int64_t block = p.block_table[static_cast<int64_t>(b) * p.block_table_stride + (j >> shift)];
  return ((block << shift) + (j & (p.block_size - 1))) * kMlaRowDim;
}

template <typename Traits>
__device__ __forceinline__ void load_q_rows(unsigned char* s_q, const MlaDecodeParams& p, const PrefillTile& tile,
                                            int tid) {
  using T = typename Traits::T;
  constexpr int kCPR = Traits::kChunksPerRow;
  const T* __restrict__ q = static_cast<const T*>(p.q);
#pragma unroll 2
  for (int i = 0; i < Traits::kRows * kCPR / Traits::kThreads; ++i) {
    const int idx = tid + i * Traits::kThreads;
    const int r = idx / kCPR, c = idx % kCPR;
    const int row = tile.row0 + r;
    const bool pred = row < tile.rows;
    int64_t off = 0;
    if (pred) {
      const int token = row / tile.group;
      off = (tile.q_start + token) * p.q_token_stride + static_cast<int64_t>(row - token * tile.group) * kMlaRowDim;
    }
    ptx::cp_async_cg_16(s_q + mma::swizzle<kCPR>(r, c), q + off + c * 8, pred);
  }
}

// Key tile n0 into a stage (no commit): T rows swizzled, or an fp8 tile's plain rows of 576 bytes;
// keys past k_len are zero-filled. An fp8 cache: each key's dequantisation factor (its scale times
// 2^8, 0 past k_len) into s_scale.
template <typename Traits>
__device__ __forceinline__ void load_kv_rows(unsigned char* stage, float* s_scale, const MlaDecodeParams& p,
                                             const PrefillTile& tile, int n0, int tid) {
  using CacheT = typename Traits::CacheT;
  const CacheT* __restrict__ cache = static_cast<const CacheT*>(p.kv_cache);
  if constexpr (!Traits::kFp8Cache) {
    constexpr int kCPR = Traits::kChunksPerRow;
#pragma unroll 3
    for (int i = 0; i < Traits::kBlockN * kCPR / Traits::kThreads; ++i) {
      const int idx = tid + i * Traits::kThreads;
      const int r = idx / kCPR, c = idx % kCPR;
      const int j = n0 + r;
      const bool pred = j < tile.k_len;
      const int64_t off = pred ? key_row_offset(p, tile.b, j) : 0;
      ptx::cp_async_cg_16(stage + mma::swizzle<kCPR>(r, c), cache + off + c * 8, pred);
    }
  } else {
    constexpr int kCPR8 = Traits::kFp8ChunksPerRow;
    for (int idx = tid; idx < Traits::kBlockN * kCPR8; idx += Traits::kThreads) {
      const int r = idx / kCPR8, c = idx % kCPR8;
      const int j = n0 + r;
      const bool pred = j < tile.k_len;
      const int64_t off = pred ? key_row_offset(p, tile.b, j) : 0;
      ptx::cp_async_cg_16(stage + idx * 16, cache + off + c * 16, pred);
    }
    if (tid < Traits::kBlockN) {
      const int j = n0 + tid;
      float f = 0.f;
      if (j < tile.k_len) {
        const float s = p.scale_per_token ? p.kv_scale[key_row_offset(p, tile.b, j) / kMlaRowDim] : p.kv_scale[0];
        f = s * kE4m3HalfRescale;
      }
      s_scale[tid] = f;
    }
  }
}

// An fp8 staged tile into the T tile the mma steps read (exact: 2^-8 times the stored values).
template <typename Traits>
__device__ __forceinline__ void convert_fp8_rows(unsigned char* dst, const unsigned char* src, int tid) {
  using T = typename Traits::T;
  constexpr int kCPR8 = Traits::kFp8ChunksPerRow;
  for (int idx = tid; idx < Traits::kBlockN * kCPR8; idx += Traits::kThreads) {
    const int r = idx / kCPR8, c8 = idx % kCPR8;
    const uint4 w = *reinterpret_cast<const uint4*>(src + idx * 16);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t out[8];
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
    *reinterpret_cast<uint4*>(dst + mma::swizzle<Traits::kChunksPerRow>(r, 2 * c8)) =
        make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(dst + mma::swizzle<Traits::kChunksPerRow>(r, 2 * c8 + 1)) =
        make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// S = Q K^T over the 576 columns for the warp's 16 rows and the tile's kBlockN keys.
template <typename Traits>
__device__ __forceinline__ void qk_latent(float (&s)[Traits::kBlockN / 8][4], const unsigned char* s_q,
                                          const unsigned char* sk, int rg, int lane) {
  using T = typename Traits::T;
  constexpr int kCPR = Traits::kChunksPerRow;
#pragma unroll
  for (int nt = 0; nt < Traits::kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const mma::LdmatrixLane l(lane);
#pragma unroll 4
  for (int kk = 0; kk < Traits::kSteps; ++kk) {
    uint32_t a[4];
    mma::load_a<kCPR>(a, s_q, l.a_row(rg), 2 * kk + l.a_chunk());
#pragma unroll
    for (int np = 0; np < Traits::kBlockN / 16; ++np) {
      uint32_t b0[2], b1[2];
      mma::load_b_pair<kCPR>(b0, b1, sk, l.b_row(np), 2 * kk + l.b_chunk());
      ptx::mma_m16n8k16<T>(s[2 * np], a, b0);
      ptx::mma_m16n8k16<T>(s[2 * np + 1], a, b1);
    }
  }
}

// Each key's fp8 factor into its scores (or P entries): key 8 nt + 2 t + e of the tile.
template <int kTiles>
__device__ __forceinline__ void scale_keys(float (&s)[kTiles][4], const float* s_scale, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const float f0 = s_scale[nt * 8 + 2 * t], f1 = s_scale[nt * 8 + 2 * t + 1];
    s[nt][0] *= f0;
    s[nt][1] *= f1;
    s[nt][2] *= f0;
    s[nt][3] *= f1;
  }
}

// ---- the key-split steps (kSplitKeys) ----------------------------------------------------------
// S for the warp's half of the tile's keys (keys kHalfN vh .. kHalfN vh + kHalfN - 1).
template <typename Traits>
__device__ __forceinline__ void qk_latent_half(float (&s)[Traits::kHalfN / 8][4], const unsigned char* s_q,
                                               const unsigned char* sk, int rg, int vh, int lane) {
  using T = typename Traits::T;
  constexpr int kCPR = Traits::kChunksPerRow;
#pragma unroll
  for (int nt = 0; nt < Traits::kHalfN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const mma::LdmatrixLane l(lane);
#pragma unroll 4
  for (int kk = 0; kk < Traits::kSteps; ++kk) {
    uint32_t a[4];
    mma::load_a<kCPR>(a, s_q, l.a_row(rg), 2 * kk + l.a_chunk());
#pragma unroll
    for (int np = 0; np < Traits::kHalfN / 16; ++np) {
      uint32_t b0[2], b1[2];
      mma::load_b_pair<kCPR>(b0, b1, sk, l.b_row(np) + vh * Traits::kHalfN, 2 * kk + l.b_chunk());
      ptx::mma_m16n8k16<T>(s[2 * np], a, b0);
      ptx::mma_m16n8k16<T>(s[2 * np + 1], a, b1);
    }
  }
}

// -inf for the scores of the half tile (keys n0 .. n0 + kHalfN - 1) the mask hides.
template <typename Traits>
__device__ __forceinline__ void mask_half(float (&s)[Traits::kHalfN / 8][4], const PrefillTile& tile,
                                          const SequenceMask& mask, int n0, int rg, int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, rg, lane);
  const int t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < Traits::kHalfN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = n0 + nt * 8 + 2 * t + e;
        if (!rows.valid[h] || !mask.visible(rows.token[h], rows.pos[h], j)) s[nt][2 * h + e] = -INFINITY;
      }
}

// Byte offset of chunk c (8 keys) of row r of P: 64-byte rows, chunk c stored at c ^ ((r >> 1) & 3),
// so the 8 rows of an ldmatrix phase land on 8 distinct 16-byte bank groups (unswizzled: 4-way).
template <typename Traits>
__device__ __forceinline__ int p_offset(int r, int c) {
  static_assert(Traits::kPRowBytes == 64, "32-key P rows");
  return r * Traits::kPRowBytes + ((c ^ ((r >> 1) & 3)) * 16);
}

// O += P V with P [16 rows][kBlockN keys] of the row group read from shared memory (A fragments).
template <typename Traits>
__device__ __forceinline__ void pv_from_smem(float (&o)[Traits::kHeadDim / 8][4], const unsigned char* s_p,
                                             const unsigned char* sv, int rg, int lane) {
  using T = typename Traits::T;
  const mma::LdmatrixLane l(lane);
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    uint32_t pa[4];
    ptx::ldmatrix_x4(pa, s_p + p_offset<Traits>(l.a_row(rg), 2 * kk + l.a_chunk()));
#pragma unroll
    for (int dp = 0; dp < Traits::kHeadDim / 16; ++dp) {
      uint32_t b0[2], b1[2];
      mma::load_b_pair<Traits::kChunksPerRow, /*kTrans=*/true>(b0, b1, sv, l.a_row(kk), 2 * dp + l.a_chunk());
      ptx::mma_m16n8k16<T>(o[2 * dp], pa, b0);
      ptx::mma_m16n8k16<T>(o[2 * dp + 1], pa, b1);
    }
  }
}

// grid (work items, 1, parts), block kThreads, dynamic smem kSmemBytes. kSplit: fp32 partials into
// ss (merged by prefill_merge_splits_kernel); else out in T and lse.
template <typename Traits, bool kSplit>
__global__ void __launch_bounds__(Traits::kThreads) mla_decode_kernel(const MlaDecodeParams p, const MlaSplitState ss) {
  constexpr int kRows = Traits::kRows, kBlockN = Traits::kBlockN;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int rg = warp % Traits::kRowGroups, vh = warp / Traits::kRowGroups;

  // The work item and its masking rule, uniform over the CTA: in shared memory (registers are
  // short: a thread holds 128 output accumulators).
  __shared__ PrefillTile s_tile;
  __shared__ SequenceMask s_mask;
  if (warp == 0) {
    const WorkItem w = find_work_item(p.cu_seqlens_q, p.batch_size, p.num_heads, kRows, blockIdx.x, lane);
    if (lane == 0) {
      PrefillTile tile{};
      SequenceMask m{};
      tile.b = w.b;
      if (w.b >= 0) {
        tile.q_start = p.cu_seqlens_q[w.b];
        tile.q_len = p.cu_seqlens_q[w.b + 1] - tile.q_start;
        const int64_t max_keys = p.block_table_stride * p.block_size;
        int k_len = p.seq_lens[w.b];
        if (k_len < 0) k_len = 0;
        if (k_len > max_keys) k_len = static_cast<int>(max_keys);  // caller bug: never read past the table
        tile.k_len = k_len;
        tile.group = p.num_heads;
        tile.rows = tile.q_len * p.num_heads;
        tile.row0 = w.index * kRows;
        tile.out_scale = 1.f;
        m.q_len = tile.q_len;
        m.k_len = tile.k_len;
        m.pos_offset = tile.k_len - tile.q_len;
        m.window = -1;
        m.custom = CustomMask{nullptr, 0, false};
        if (p.custom_mask != nullptr)
          m.custom.base = reinterpret_cast<const uint8_t*>(p.custom_mask) + p.mask_offsets[w.b];
        m.causal = p.causal && !m.custom.present();
        m.tree_depth = nullptr;
      }
      s_tile = tile;
      s_mask = m;
    }
  }
  __syncthreads();
  const PrefillTile& tile = s_tile;
  const SequenceMask& mask = s_mask;
  if (tile.b < 0) return;  // past the last work item: uniform, no barrier follows for this CTA

  unsigned char* smem = dynamic_smem<unsigned char>();
  unsigned char* s_q = smem;
  unsigned char* s_tiles = smem + Traits::kQBytes;
  unsigned char* s_staging = smem + Traits::kStagingOffset;
  float* s_scale = reinterpret_cast<float*>(smem + Traits::kScaleOffset);
  unsigned char* s_p = smem + Traits::kPOffset;
  float* s_stat = reinterpret_cast<float*>(smem + Traits::kRowStatOffset);  // [2][kRows]: maxima, then sums

  // The CTA's key tiles: those its tokens may see, cut into this CTA's chunk or part.
  const int last_row = min(tile.row0 + kRows, tile.rows) - 1;
  const KeyRange keys = mask.key_range(tile.row0 / tile.group, last_row / tile.group);
  const int num_tiles = keys.hi > 0 ? (keys.hi + kBlockN - 1) / kBlockN : 0;
  int t_begin = 0, t_end = num_tiles;
  if (p.fixed_split_size > 0) {
    const int per_chunk = p.fixed_split_size / kBlockN;
    t_begin = (ss.chunk_begin + static_cast<int>(blockIdx.z)) * per_chunk;
    t_end = min(num_tiles, t_begin + per_chunk);
  } else if (kSplit) {
    const int per = (num_tiles + gridDim.z - 1) / gridDim.z;
    t_begin = static_cast<int>(blockIdx.z) * per;
    t_end = min(num_tiles, t_begin + per);
  }

  // The warp's rows and their tokens (a warp past the tile's rows computes nothing).
  const int warp_row0 = tile.row0 + rg * 16;
  const bool warp_active = warp_row0 < tile.rows;
  const int warp_tok0 = warp_row0 / tile.group;
  const int warp_tok1 = (min(warp_row0 + 16, tile.rows) - 1) / tile.group;

  float o[Traits::kHeadDim / 8][4];
#pragma unroll
  for (int dt = 0; dt < Traits::kHeadDim / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const ScoreScale sc{p.scale * kLog2e, 0.f, 0.f, false};

  load_q_rows<Traits>(s_q, p, tile, tid);
  if (t_begin < t_end)
    load_kv_rows<Traits>(Traits::kFp8Cache ? s_staging : s_tiles, s_scale, p, tile, t_begin * kBlockN, tid);
  ptx::cp_async_commit();
  for (int t = t_begin; t < t_end; ++t) {
    const int stage = (t - t_begin) & 1;
    if (t + 1 < t_end) {
      unsigned char* next = Traits::kFp8Cache ? s_staging + (stage ^ 1) * Traits::kFp8TileBytes
                                              : s_tiles + (stage ^ 1) * Traits::kTileBytes;
      load_kv_rows<Traits>(next, s_scale + (stage ^ 1) * kBlockN, p, tile, (t + 1) * kBlockN, tid);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();
    const unsigned char* sk = s_tiles + (Traits::kFp8Cache ? 0 : stage * Traits::kTileBytes);
    if constexpr (Traits::kFp8Cache) {
      convert_fp8_rows<Traits>(s_tiles, s_staging + stage * Traits::kFp8TileBytes, tid);
      __syncthreads();
    }
    const int n0 = t * kBlockN;
    const bool active = warp_active && !mask.none_visible(n0, n0 + kBlockN, warp_tok0, warp_tok1);
    if constexpr (Traits::kSplitKeys) {
      // Warp (rg, vh): S of keys kHalfN vh .. of the tile, the row maxima exchanged, its P half into
      // s_p, then P V over all kBlockN keys for its output columns. Both warps of a row group take
      // the same branches (active depends on rg only) and the same maxima, so their online-softmax
      // states stay identical; each keeps the sum of its own half.
      constexpr int kHalfN = Traits::kHalfN;
      const int g = lane / 4, tq = lane % 4;
      float s[kHalfN / 8][4];
      if (active) {
        qk_latent_half<Traits>(s, s_q, sk, rg, vh, lane);
        if constexpr (Traits::kFp8Cache) scale_keys(s, s_scale + stage * kBlockN + vh * kHalfN, lane);
#pragma unroll
        for (int nt = 0; nt < kHalfN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] *= sc.scale_log2;
        if (mask.needs_element_mask(n0, n0 + kBlockN, warp_tok0, warp_tok1))
          mask_half<Traits>(s, tile, mask, n0 + vh * kHalfN, rg, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kHalfN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
          mx = warp_reduce_max<4>(mx);
          if (tq == 0) s_stat[vh * kRows + rg * 16 + g + 8 * h] = mx;
        }
      }
      __syncthreads();
      if (active) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = rg * 16 + g + 8 * h;
          const float mx = fmaxf(fmaxf(s_stat[r], s_stat[kRows + r]), row_max[h]);
          // Safe max (online_softmax's rule): a row with no visible key so far keeps -inf.
          const float m_use = mx == -INFINITY ? 0.f : mx;
          const float alpha = exp2f(row_max[h] - m_use);
          row_max[h] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kHalfN / 8; ++nt) {
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
        if constexpr (Traits::kFp8Cache) scale_keys(s, s_scale + stage * kBlockN + vh * kHalfN, lane);
        using T = typename Traits::T;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int nt = 0; nt < kHalfN / 8; ++nt)
            *reinterpret_cast<uint32_t*>(s_p + p_offset<Traits>(rg * 16 + g + 8 * h, (vh * kHalfN + nt * 8) / 8) +
                                         4 * tq) =
                mma::pack2<T>(s[nt][2 * h], s[nt][2 * h + 1]);
      }
      __syncthreads();
      if (active) pv_from_smem<Traits>(o, s_p, sk + vh * Traits::kValueHalfBytes, rg, lane);
    } else if (active) {
      float s[kBlockN / 8][4];
      qk_latent<Traits>(s, s_q, sk, rg, lane);
      if constexpr (Traits::kFp8Cache) scale_keys(s, s_scale + stage * kBlockN, lane);
      scores_to_log2<Traits>(s, sc);
      if (mask.needs_element_mask(n0, n0 + kBlockN, warp_tok0, warp_tok1)) mask_scores<Traits>(s, tile, mask, n0, rg, lane);
      online_softmax<Traits>(s, row_max, row_sum, o);
      if constexpr (Traits::kFp8Cache) scale_keys(s, s_scale + stage * kBlockN, lane);
      pv_tile<Traits>(o, s, sk + vh * Traits::kValueHalfBytes, lane);
    }
    __syncthreads();  // the stage (and P) are refilled by the next iteration
  }
  ptx::cp_async_wait<0>();

  // Rows g and g + 8 of the warp: normalise and store (out in T and lse, or the split partials).
  // With kSplitKeys each warp of a row group summed its half of the keys: the two sums are added
  // in a fixed order (half 0 + half 1), the same in both warps.
  const int g = lane / 4, tq = lane % 4;
  float l_rows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) l_rows[h] = warp_reduce_sum<4>(row_sum[h]);
  if constexpr (Traits::kSplitKeys) {
    if (tq == 0) {
      s_stat[vh * kRows + rg * 16 + g] = l_rows[0];
      s_stat[vh * kRows + rg * 16 + g + 8] = l_rows[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) l_rows[h] = s_stat[rg * 16 + g + 8 * h] + s_stat[kRows + rg * 16 + g + 8 * h];
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = l_rows[h];
    const float inv = row_inverse(1.f, l);
    const float lse = chunk_lse(row_max[h], l);
    const int row = warp_row0 + g + 8 * h;
    if (row >= tile.rows) continue;
    const int token = row / tile.group;
    const int64_t r = (tile.q_start + token) * static_cast<int64_t>(p.num_heads) + (row - token * tile.group);
    const int col0 = vh * Traits::kHeadDim + 2 * tq;
    if constexpr (kSplit) {
      const int64_t slot = static_cast<int64_t>(blockIdx.z) * p.num_q_tokens * p.num_heads + r;
      float2* dst = reinterpret_cast<float2*>(ss.out + slot * kMlaLatentDim + col0);
#pragma unroll
      for (int dt = 0; dt < Traits::kHeadDim / 8; ++dt) dst[dt * 4] = make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      if (vh == 0 && tq == 0) ss.lse[slot] = lse;
    } else {
      using T = typename Traits::T;
      T* out = static_cast<T*>(p.out) + (tile.q_start + token) * p.out_token_stride +
               static_cast<int64_t>(row - token * tile.group) * kMlaLatentDim + col0;
#pragma unroll
      for (int dt = 0; dt < Traits::kHeadDim / 8; ++dt)
        *reinterpret_cast<uint32_t*>(out + dt * 8) = mma::pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      if (vh == 0 && tq == 0 && p.lse != nullptr) p.lse[r] = lse;
    }
  }
}

}  // namespace fastinfer::attention::mla
