#pragma once
// Fused prefill attention (FlashAttention-2 structure) on mma.sync m16n8k16, for sm_80 .. sm_90.
//
// One CTA = 4 warps = kBlockM (64) query rows of one (sequence, query head); each warp owns 16
// rows for the whole kernel, so softmax statistics never leave the warp.
//
//   gmem --cp.async--> smem Q (once) --ldmatrix--> Q A-fragments (registers, whole kernel)
//   gmem --cp.async--> smem K/V ring of kStages tiles of kBlockN keys (gathered per row when paged)
//   S = Q K^T        : ldmatrix (non-trans) of K rows = B operand "col" (key = n, dim = k)
//   online softmax   : fp32 registers, exp2 domain (scale * log2 e folded into the scores)
//   O += P V         : P re-packed from the S accumulators into A-fragments (no smem round trip),
//                      ldmatrix .trans of V rows = B operand (key = k, dim = n)
//   epilogue         : O / l -> dtype -> smem (the warp's own Q rows) -> 16-byte coalesced stores
//
// Shared memory layout (bytes, element size 2): Q [kBlockM][D] | K[kStages][kBlockN][D] |
// V[kStages][kBlockN][D]. Every row is D*2 bytes = D/8 16-byte chunks (>= 8 since D >= 64); chunk
// c of row r is stored at chunk position c ^ (r & 7) of that row. ldmatrix reads 8 rows at the same
// logical chunk, which the XOR spreads over 8 distinct chunk positions = all 32 banks (no
// conflicts); the cp.async writes and the epilogue use the same `swizzle` function.
//
// Masking (query i of a sequence at absolute position p = k_len - q_len + i, key j): visible iff
// j < k_len, and j <= p when causal, and j >= p - window_left when window_left >= 0 (with or
// without causal: non-causal attention gets only the lower bound), and, when custom_mask is given
// (paged path), mask[i][j - (k_len - q_len)] for the trailing q_len keys instead of the causal
// rule (the `causal` flag is then ignored; prefix keys stay visible). With a custom mask AND a
// window, the window test uses tree positions (attention.h): query i is at k_len - q_len +
// depth(i) and trailing key k_len - q_len + m at k_len - q_len + depth(m), the depths read from
// p.tree_depth (written by tree_depth_kernel just before); the CTA's key range then starts at
// the lowest position any node can have (k_len - q_len - 1) minus the window (conservative: a
// CTA whose nodes are all deep loads about (their least depth + 1) / 64 extra tiles, fully
// masked; trees are shallow). Tiles entirely outside the CTA's
// visible key range are never loaded; element masks run only on tiles that cross a boundary
// (sequence end, causal diagonal, window edge, custom-mask region). Rows that see no
// key produce out = 0 and lse = -inf (safe max of 0 while the running max is -inf).
//
// Requirements checked by the launcher: q/k/v/out 16-byte aligned, token strides multiples of 8
// elements (cp.async and the epilogue move 16-byte chunks); max_seqlen_q >= every q_len.
//
// Hopper: this kernel is the portable path. A wgmma/TMA kernel (warp-specialised producer,
// register-resident P as the A operand of wgmma) would get its own traits struct and kernel
// and be selected at the single dispatch point `select_prefill_backend` in
// cuda/src/attention_prefill.cu; the Params contract and masking helpers here are shared.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/attention/attention.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fastinfer::attention {

// ---- traits ----------------------------------------------------------------------------------
// mma.sync (sm_80+) kernel configuration for head dim D.
template <typename T_, int kHeadDim_>
struct PrefillTraitsSm80 {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 64;   // query rows per CTA (16 per warp)
  static constexpr int kBlockN = 64;   // keys per K/V tile
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  // K/V pipeline depth: D=64 tiles are small enough for a third stage at the same occupancy.
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 128, "head dim 64 or 128");
  static constexpr int kElemsPerChunk = 16 / sizeof(T);          // 8
  static constexpr int kChunksPerRow = kHeadDim / kElemsPerChunk;  // 8 or 16 (>= 8 for the swizzle)
  static constexpr int kQBytes = kBlockM * kHeadDim * sizeof(T);
  static constexpr int kTileBytes = kBlockN * kHeadDim * sizeof(T);
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kTileBytes;
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // rows one cp.async sweep covers
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockM % kRowsPerPass == 0, "tile / thread mismatch");
};

// ---- helpers ---------------------------------------------------------------------------------
// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows][kChunksPerRow] swizzled tile.
template <int kChunksPerRow>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return (row * kChunksPerRow + (chunk ^ (row & 7))) * 16;
}

// Two fp32 -> one register of two 16-bit values (lower index in the low half), round to nearest.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __half>) {
    ptx::mma_m16n8k16_f16(d, a, b, d);
  } else {
    ptx::mma_m16n8k16_bf16(d, a, b, d);
  }
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- tree depths (tree attention with a window) ---------------------------------------------
// One warp per query row of a sequence: tree_depth[q_start + i] = (number of true entries of mask
// row i) - 1, the node's depth when the row sees exactly its ancestors and itself. The lanes read
// the row coalesced and sum with a butterfly (fixed order: the result is an exact integer anyway).
constexpr int kTreeDepthWarps = 4;

// grid (ceil(max_seqlen_q / kTreeDepthWarps), batch), block kTreeDepthWarps * 32, no smem.
__global__ void __launch_bounds__(kTreeDepthWarps * 32) tree_depth_kernel(const PrefillAttentionParams p) {
  const int b = blockIdx.y;
  const int q_start = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int row = blockIdx.x * kTreeDepthWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= q_len) return;  // uniform over the warp: the shuffles below see all 32 lanes
  const bool* mask_row = p.custom_mask + p.mask_offsets[b] + static_cast<int64_t>(row) * q_len;
  int count = 0;
  for (int c = lane; c < q_len; c += 32) count += mask_row[c] ? 1 : 0;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) count += __shfl_xor_sync(0xffffffffu, count, off);
  if (lane == 0) p.tree_depth[q_start + row] = count - 1;
}

// ---- kernel ----------------------------------------------------------------------------------
// grid (ceil(max_seqlen_q / kBlockM), num_q_heads, batch), block kThreads, dynamic smem kSmemBytes.
template <typename Traits, bool kPaged>
__global__ void __launch_bounds__(Traits::kThreads)
    prefill_attention_kernel(const PrefillAttentionParams p) {
  using T = typename Traits::T;
  constexpr int D = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kCPR = Traits::kChunksPerRow;
  constexpr int kEPC = Traits::kElemsPerChunk;
  constexpr int kRowsPerPass = Traits::kRowsPerPass;
  constexpr float kNegInf = -INFINITY;

  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // mma groupID: fragment rows g and g + 8
  const int t = lane % 4;  // thread in group: fragment columns 2t, 2t + 1

  // ---- sequence geometry (uniform over the CTA) ----
  const int q_start = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int m0 = m_block * kBlockM;
  if (m0 >= q_len) return;  // whole CTA, before any barrier

  int k_len;
  int64_t k_start = 0;
  if constexpr (kPaged) {
    k_len = p.seq_lens_k[b];
  } else {
    k_start = p.cu_seqlens_k[b];
    k_len = p.cu_seqlens_k[b + 1] - static_cast<int>(k_start);
  }
  const int kv_head = head / (p.num_q_heads / p.num_kv_heads);
  const int pos_offset = k_len - q_len;  // absolute position of query 0 (bottom-right alignment)
  const int rows_here = min(kBlockM, q_len - m0);
  const int pos_first = pos_offset + m0;
  const int pos_last = pos_offset + m0 + rows_here - 1;

  const bool* custom_mask = nullptr;
  if constexpr (kPaged) {
    if (p.custom_mask != nullptr) custom_mask = p.custom_mask + p.mask_offsets[b];
  }
  const bool use_custom = custom_mask != nullptr;
  const bool causal = p.causal && !use_custom;  // the custom mask replaces the causal rule
  const int window = p.window_left;             // < 0: none
  const bool use_window = window >= 0;
  // Tree attention with a window: positions are tree positions (depths of this sequence's nodes).
  const bool tree_window = use_custom && use_window;
  const int32_t* tree_depth = tree_window ? p.tree_depth + q_start : nullptr;

  // Keys any row of this CTA can see: [n_lo, n_hi). A tree node's position is >= pos_offset - 1
  // (depth >= -1) and every trailing key stays in range (its tree position is tested per key).
  int n_lo = 0, n_hi = k_len;
  if (causal) n_hi = min(n_hi, pos_last + 1);
  if (use_window) n_lo = max(0, (tree_window ? pos_offset - 1 : pos_first) - window);
  // Highest position of a row here (tree positions are <= pos_offset + q_len - 1 = k_len - 1).
  const int pos_hi = tree_window ? k_len - 1 : pos_last;
  const int tile_lo = n_lo / kBlockN;
  const int num_tiles = n_hi > n_lo ? (n_hi + kBlockN - 1) / kBlockN - tile_lo : 0;

  // ---- global pointers ----
  const T* __restrict__ q_ptr = static_cast<const T*>(p.q);
  const T* __restrict__ k_ptr = static_cast<const T*>(p.k);
  const T* __restrict__ v_ptr = static_cast<const T*>(p.v);
  T* __restrict__ out_ptr = static_cast<T*>(p.out);

  unsigned char* smem = dynamic_smem<unsigned char>();
  unsigned char* s_q = smem;
  unsigned char* s_k = smem + Traits::kQBytes;
  unsigned char* s_v = s_k + kStages * Traits::kTileBytes;

  // Each thread copies chunk `ld_chunk` of rows ld_row0 + i * kRowsPerPass (coalesced rows).
  const int ld_chunk = tid % kCPR;
  const int ld_row0 = tid / kCPR;

  auto load_kv_tile = [&](int tile, int stage) {
    const int n0 = tile * kBlockN;
    unsigned char* sk = s_k + stage * Traits::kTileBytes;
    unsigned char* sv = s_v + stage * Traits::kTileBytes;
#pragma unroll
    for (int i = 0; i < kBlockN / kRowsPerPass; ++i) {
      const int r = ld_row0 + i * kRowsPerPass;
      const int j = n0 + r;
      const bool pred = j < k_len;
      int64_t k_off = 0, v_off = 0;
      if (pred) {
        if constexpr (kPaged) {
          const int shift = __ffs(p.block_size) - 1;
          const int64_t block = p.block_table[static_cast<int64_t>(b) * p.block_table_stride + (j >> shift)];
          k_off = ((block << shift) + (j & (p.block_size - 1))) * static_cast<int64_t>(p.num_kv_heads) * D +
                  static_cast<int64_t>(kv_head) * D;
          v_off = k_off;
        } else {
          k_off = (k_start + j) * p.k_token_stride + static_cast<int64_t>(kv_head) * D;
          v_off = (k_start + j) * p.v_token_stride + static_cast<int64_t>(kv_head) * D;
        }
      }
      const int so = swizzle<kCPR>(r, ld_chunk);
      ptx::cp_async_cg_16(sk + so, k_ptr + k_off + ld_chunk * kEPC, pred);  // !pred: zero-fill
      ptx::cp_async_cg_16(sv + so, v_ptr + v_off + ld_chunk * kEPC, pred);
    }
  };

  // Output accumulators: d-tile dt (dims 8dt..8dt+7), C layout: o[dt][0..1] row g, [2..3] row g+8.
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {kNegInf, kNegInf};  // log2 domain, rows g and g + 8
  float row_sum[2] = {0.f, 0.f};          // this thread's partial sums (reduced at the end)

  if (num_tiles > 0) {
    // ---- prologue: Q (group 0), then K/V tiles 0 .. kStages-2 (one group each, maybe empty) ----
#pragma unroll
    for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
      const int r = ld_row0 + i * kRowsPerPass;
      const bool pred = m0 + r < q_len;
      const int64_t off = pred ? (q_start + m0 + r) * p.q_token_stride + static_cast<int64_t>(head) * D : 0;
      ptx::cp_async_cg_16(s_q + swizzle<kCPR>(r, ld_chunk), q_ptr + off + ld_chunk * kEPC, pred);
    }
    ptx::cp_async_commit();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_tiles) load_kv_tile(tile_lo + s, s);
      ptx::cp_async_commit();
    }

    // Q fragments for the whole kernel: qf[kk] = A operand of k-step kk (dims 16kk..16kk+15).
    // ldmatrix_x4 matrices: 0 = rows 0-7 / dims 0-7, 1 = rows 8-15 / dims 0-7, 2 = rows 0-7 /
    // dims 8-15, 3 = rows 8-15 / dims 8-15 -> exactly a[0..3] of the m16n8k16 A layout.
    uint32_t qf[D / 16][4];
    ptx::cp_async_wait<kStages - 1>();  // the Q group is complete
    __syncthreads();
    {
      const int mat = lane / 8, r = lane % 8;
      const int row = warp * 16 + r + 8 * (mat & 1);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ptx::ldmatrix_x4(qf[kk], s_q + swizzle<kCPR>(row, 2 * kk + (mat >> 1)));
    }

    const float scale_log2 = p.scale * kLog2e;
    const bool use_softcap = p.softcap > 0.f;
    const float cap_in = use_softcap ? p.scale / p.softcap : 0.f;  // tanh(s * scale / softcap)
    const float cap_out = p.softcap * kLog2e;                        // * softcap * log2 e

    // Sequence-local query indices of this thread's two fragment rows, and their positions.
    const int qi[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
    int row_pos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      row_pos[h] = pos_offset + (tree_window && qi[h] < q_len ? tree_depth[qi[h]] : qi[h]);

    for (int it = 0; it < num_tiles; ++it) {
      // Tile `it` is complete for this thread; the barrier makes it complete for all threads and
      // guarantees everybody finished reading the stage that the next load overwrites.
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      {
        const int next = it + kStages - 1;
        if (next < num_tiles) load_kv_tile(tile_lo + next, next % kStages);
        ptx::cp_async_commit();  // always commit: keeps the group count uniform
      }
      const int stage = it % kStages;
      const unsigned char* sk = s_k + stage * Traits::kTileBytes;
      const unsigned char* sv = s_v + stage * Traits::kTileBytes;
      const int n0 = (tile_lo + it) * kBlockN;

      // ---- S = Q K^T (16 x kBlockN per warp) ----
      // s[nt] holds keys n0 + 8nt .. +7: s[nt][0..1] = row g, keys 2t, 2t+1; s[nt][2..3] = row g+8.
      float s[kBlockN / 8][4];
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      {
        // ldmatrix_x4 on K rows (key = n, dim = k): matrices 0/1 = keys 0-7 of the pair, dims
        // 0-7 / 8-15 (b[0], b[1] of n-tile 2np); 2/3 = keys 8-15 (n-tile 2np + 1).
        const int mat = lane / 8, r = lane % 8;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
          for (int np = 0; np < kBlockN / 16; ++np) {
            uint32_t kb[4];
            ptx::ldmatrix_x4(kb, sk + swizzle<kCPR>(np * 16 + r + 8 * (mat >> 1), 2 * kk + (mat & 1)));
            const uint32_t b0[2] = {kb[0], kb[1]};
            const uint32_t b1[2] = {kb[2], kb[3]};
            mma16816<T>(s[2 * np], qf[kk], b0);
            mma16816<T>(s[2 * np + 1], qf[kk], b1);
          }
        }
      }

      // ---- scores to the log2 domain: softcap (before masking), then masks ----
      if (use_softcap) {
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = tanhf(s[nt][e] * cap_in) * cap_out;
      } else {
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] *= scale_log2;
      }

      // Element masks only on tiles that need them (uniform over the CTA).
      const bool need_mask = n0 + kBlockN > k_len || (causal && n0 + kBlockN - 1 > pos_first) ||
                             (use_window && n0 < pos_hi - window) || (use_custom && n0 + kBlockN > pos_offset);
      if (need_mask) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pos = row_pos[h];
          const bool row_valid = qi[h] < q_len;
#pragma unroll
          for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = n0 + nt * 8 + 2 * t + e;
              bool masked = j >= k_len || (causal && j > pos);
              if (use_custom && !masked && j >= pos_offset)
                masked = !row_valid || !custom_mask[static_cast<int64_t>(qi[h]) * q_len + (j - pos_offset)];
              if (use_window && !masked) {  // a key the mask shows (j < k_len): its (tree) position
                const int key_pos = tree_window && j >= pos_offset ? pos_offset + tree_depth[j - pos_offset] : j;
                masked = key_pos < pos - window;
              }
              if (masked) s[nt][2 * h + e] = kNegInf;
            }
          }
        }
      }

      // ---- online softmax (rows g and g + 8; the 4 lanes of a quad share a row) ----
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[h];
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Safe max: a row with no visible key so far keeps max -inf; subtracting 0 keeps
        // exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
        const float m_use = mx == kNegInf ? 0.f : mx;
        const float alpha = exp2f(row_max[h] - m_use);  // old max -inf -> 0 (nothing accumulated)
        row_max[h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          s[nt][2 * h] = exp2f(s[nt][2 * h] - m_use);
          s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - m_use);
          sum += s[nt][2 * h] + s[nt][2 * h + 1];
        }
        row_sum[h] = row_sum[h] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          o[dt][2 * h] *= alpha;
          o[dt][2 * h + 1] *= alpha;
        }
      }

      // ---- O += P V ----
      // P as the A operand of k-step kk (keys 16kk..16kk+15): the C fragments of n-tiles 2kk and
      // 2kk+1 already sit where the A layout wants them:
      //   a[0] = P[g][2t..2t+1]     = s[2kk][0..1]      a[1] = P[g+8][2t..2t+1]   = s[2kk][2..3]
      //   a[2] = P[g][2t+8..2t+9]   = s[2kk+1][0..1]    a[3] = P[g+8][2t+8..2t+9] = s[2kk+1][2..3]
      // V B operand (key = k, dim = n) via ldmatrix .trans on V rows: matrices 0/1 = keys 0-7 /
      // 8-15 of dims 16dp..+7 (b[0], b[1] of d-tile 2dp), 2/3 = the same for d-tile 2dp + 1.
      {
        const int mat = lane / 8, r = lane % 8;
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                  pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t vb[4];
            ptx::ldmatrix_x4_trans(vb, sv + swizzle<kCPR>(kk * 16 + r + 8 * (mat & 1), 2 * dp + (mat >> 1)));
            const uint32_t b0[2] = {vb[0], vb[1]};
            const uint32_t b1[2] = {vb[2], vb[3]};
            mma16816<T>(o[2 * dp], pa, b0);
            mma16816<T>(o[2 * dp + 1], pa, b1);
          }
        }
      }
    }
    ptx::cp_async_wait<0>();  // only empty groups remain; keeps the invariant explicit
  }

  // ---- epilogue: normalise, stage the warp's 16 rows in its own Q rows, coalesced stores ----
  // Only this warp ever read those Q rows (its ldmatrix already completed), so a __syncwarp
  // between the fragment writes and the row reads is enough.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: out = 0
    const int row = warp * 16 + g + 8 * h;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(s_q + swizzle<kCPR>(row, dt) + 4 * t) =
          pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    }
    if (p.lse != nullptr && t == 0 && m0 + row < q_len) {
      p.lse[(q_start + m0 + row) * static_cast<int64_t>(p.num_q_heads) + head] =
          l > 0.f ? (row_max[h] + log2f(l)) * kLn2 : kNegInf;
    }
  }
  __syncwarp();
#pragma unroll
  for (int c = lane; c < 16 * kCPR; c += 32) {
    const int row = warp * 16 + c / kCPR;
    const int chunk = c % kCPR;
    if (m0 + row < q_len) {
      const uint4 val = *reinterpret_cast<const uint4*>(s_q + swizzle<kCPR>(row, chunk));
      *reinterpret_cast<uint4*>(out_ptr + (q_start + m0 + row) * p.out_token_stride +
                                static_cast<int64_t>(head) * D + chunk * kEPC) = val;
    }
  }
}

}  // namespace fastinfer::attention
