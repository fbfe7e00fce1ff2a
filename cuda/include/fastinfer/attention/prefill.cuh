#pragma once
// Fused prefill attention (FlashAttention-2 structure) on mma.sync m16n8k16, for sm_80 .. sm_90.
//
// Work items and GQA packing. The grid is (work items, num_kv_heads). A CTA owns one KV head and
// kBlockM = 128 rows (64 for head dim 256) of one sequence, a row being a (query token, query head) pair of the KV
// head's group, token-major: row r of the sequence is token r / group, query head
// kv_head * group + r % group. So the group's query heads share every K/V tile the CTA loads (each
// tile is read once per KV head and 128 / group tokens, instead of once per query head and 64
// tokens before), and a short sequence (a speculative tree of 8 nodes with group 4: 32 rows)
// fills one CTA per KV head instead of one mostly idle CTA per query head. Sequence b has
// ceil(q_len_b * group / kBlockM) items, numbered sequence after sequence, its last tile first
// (under a causal mask the one with the most keys); a CTA finds its (sequence, tile) from
// cu_seqlens_q with a warp prefix sum (find_work_item), so ragged batches launch no CTA per
// (max_seqlen_q tile, head, sequence) slot as before: the grid is the host's bound on the item
// count (attention.h), the few CTAs past the real count exit at once.
//
// One CTA = 8 warps (4 for head dim 256: traits); warp w owns rows 16w .. 16w + 15 of the tile for the whole kernel, so softmax
// statistics never leave the warp (registers as with 64-row tiles: 16 rows per warp either way).
//
//   gmem --cp.async--> smem Q (once) --ldmatrix--> Q A-fragments (registers, whole kernel)
//   gmem --cp.async--> smem K/V ring of kStages tiles of kBlockN keys (gathered per row when paged)
//   S = Q K^T        : ldmatrix (non-trans) of K rows = B operand "col" (key = n, dim = k)
//   online softmax   : fp32 registers, exp2 domain (scale * log2 e folded into the scores)
//   O += P V         : P re-packed from the S accumulators into A-fragments (no smem round trip),
//                      ldmatrix .trans of V rows = B operand (key = k, dim = n)
//   epilogue         : O / l -> dtype -> smem (the warp's own Q rows) -> 16-byte coalesced stores
// Each step is a device function below (load_q_tile, load_kv_tile, load_q_fragments, qk_tile,
// scores_to_log2, mask_scores, online_softmax, pv_tile, epilogue); the kernel is their sequence.
// What a CTA does with its keys' result is the plan's PrefillMode (launch_plan.h), a template
// parameter: the default instance normalises and writes out / lse; kSplit writes fp32 partials of
// a part of the keys (epilogue_split); kFold folds the deterministic mode's chunks in the kernel
// (fold_chunk, the tree phases). Each mode is its own instance, so the default one carries none
// of the others' state (bf16 D = 128: 248 registers, against 254 with the modes as run-time
// branches).
//
// Shared memory layout (bytes, element size 2): Q [kBlockM][D] | K[kStages][kBlockN][D] |
// V[kStages][kBlockN][D]. Every row is D*2 bytes = D/8 16-byte chunks (>= 8 since D >= 64); chunk
// c of row r is stored at chunk position c ^ (r & 7) of that row. ldmatrix reads 8 rows at the same
// logical chunk, which the XOR spreads over 8 distinct chunk positions = all 32 banks (no
// conflicts); the cp.async writes and the epilogue use the same `swizzle` function.
//
// Masking: attention/mask.cuh (SequenceMask) is the rule. The CTA loads only the K/V tiles of the
// key range its tokens can see; per (warp, tile) a warp skips the tile when none of its rows sees
// any of its keys (the causal diagonal of a 128-row tile, rows past the sequence) and runs the
// element masks only when the tile crosses a boundary for its rows (sequence end, causal
// diagonal, window edge, custom-mask region). Rows that see no key produce out = 0 and lse = -inf
// (safe max of 0 while the running max is -inf). Tree attention with a window reads the nodes'
// depths from the launch state's tree_depth (tree_rows_kernel, launched just before).
//
// Requirements checked by the launcher: q/k/v/out 16-byte aligned, token strides multiples of 8
// elements (cp.async and the epilogue move 16-byte chunks); max_seqlen_q >= every q_len.
//
// Hopper: this kernel is the portable path. A wgmma/TMA kernel (warp-specialised producer,
// register-resident P as the A operand of wgmma) would get its own traits struct and kernel
// and be selected at the single dispatch point `select_prefill_backend` in
// cuda/src/attention_prefill.cu; the Params contract, the work items and the masking helpers of
// mask.cuh are shared.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/math.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/mask.cuh"
#include "fastinfer/attention/state_merge.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fastinfer::attention {

// ---- traits ----------------------------------------------------------------------------------
// mma.sync (sm_80+) kernel configuration for head dim D, and the paged cache's element type
// (T, or __nv_fp8_e4m3: an fp8 cache).
template <typename T_, int kHeadDim_, typename CacheT_ = T_>
struct PrefillTraitsSm80 {
  using T = T_;
  using CacheT = CacheT_;
  static constexpr bool kFp8Cache = !std::is_same_v<T, CacheT>;
  static constexpr int kHeadDim = kHeadDim_;
  // D = 256: 4 warps and 16-key tiles, so that the 128 fp32 output accumulators of a thread fit
  // in registers beside the scores without spilling (32-key tiles spilled 84 bytes) and the shared
  // memory (Q 32 KiB + two stages of K and V 32 KiB) fits sm_89's 99 KiB; the Q fragments are then read from shared memory at each k-step instead of being kept in
  // 64 registers for the whole kernel.
  static constexpr int kWarps = prefill_rows_per_cta(kHeadDim) / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kWarps;  // rows per CTA: (token, query head) pairs, 16 per warp
  static constexpr int kBlockN = prefill_keys_per_tile(kHeadDim);  // keys per K/V tile
  static constexpr bool kQInRegisters = kHeadDim <= 128;
  static constexpr int kQFragments = kQInRegisters ? kHeadDim / 16 : 1;  // A operands kept in registers
  // K/V pipeline depth: D=64 tiles are small enough for a third stage.
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;

  static_assert(sizeof(T) == 2, "fp16 / bf16 only");
  static_assert(prefill_supports_head_dim(kHeadDim), "head dim 64, 128 or 256");
  static_assert(kPrefillKeysPerTile % kBlockN == 0, "the plans' key unit is whole tiles");
  static constexpr int kElemsPerChunk = 16 / sizeof(T);          // 8
  static constexpr int kChunksPerRow = kHeadDim / kElemsPerChunk;  // 8 or 16 (>= 8 for the swizzle)
  static constexpr int kQBytes = kBlockM * kHeadDim * sizeof(T);
  static constexpr int kTileBytes = kBlockN * kHeadDim * sizeof(T);
  static constexpr int kRowsPerPass = kThreads / kChunksPerRow;  // rows one cp.async sweep covers
  static_assert(kBlockN % kRowsPerPass == 0 && kBlockM % kRowsPerPass == 0, "tile / thread mismatch");
  // An fp8 cache: the cp.async ring holds kStages fp8 tiles per K and V (kBlockN rows of D bytes,
  // unswizzled: each is read once, 16 bytes a thread), converted at the top of each iteration into
  // the one K and one V tile of T that the mma steps read (convert_kv_tile).
  static_assert(!kFp8Cache || std::is_same_v<CacheT, __nv_fp8_e4m3>, "cache: T or e4m3");
  static constexpr int kTileBuffers = kFp8Cache ? 1 : kStages;  // K (and V) tiles of T in smem
  static constexpr int kFp8TileBytes = kBlockN * kHeadDim;
  static constexpr int kFp8ChunksPerRow = kHeadDim / 16;
  static constexpr int kFp8RowsPerPass = kThreads / kFp8ChunksPerRow;
  static_assert(kBlockN % kFp8RowsPerPass == 0, "fp8 tile / thread mismatch");
  static constexpr int kSmemBytes =
      kQBytes + 2 * kTileBuffers * kTileBytes + (kFp8Cache ? 2 * kStages * kFp8TileBytes : 0);
};

static_assert(PrefillTraitsSm80<__half, 64>::kSmemBytes <= 99 * 1024 && PrefillTraitsSm80<__half, 128>::kSmemBytes <= 99 * 1024 &&
                  PrefillTraitsSm80<__half, 256>::kSmemBytes <= 99 * 1024 &&
                  PrefillTraitsSm80<__half, 256, __nv_fp8_e4m3>::kSmemBytes <= 99 * 1024,
              "every instance fits sm_86 / sm_89's 99 KiB of shared memory per block");

// ---- launch state ----------------------------------------------------------------------------
// What launch_prefill_attention sets for one launch beside the caller's params (launch_plan.h: the
// plan's choices and its workspace regions), passed to the kernels as a second argument.
struct PrefillLaunchState {
  // Tree rows (tree_rows_kernel writes them): depth of each query row (custom mask with a window,
  // or keys by rank); keys by rank only: tree_rank_seq [num_q_tokens] the sequence of query row t,
  // tree_rank_keys [num_q_tokens][max_seqlen_q] its visible trailing keys in index order
  // (tree_depth[t] + 1 of them).
  int32_t* tree_depth;
  int32_t* tree_rank_seq;
  int32_t* tree_rank_keys;
  // The in-kernel fold under a custom mask in two launches, where the sequences' own work items
  // fill the GPU (else one launch of per-token items). Phase 1: the sequence's work items over the
  // whole chunks of its prefix, [0, floor(P / F) F) with P = k_len - q_len (every row sees those
  // keys at the same ranks: one K/V read per tree and KV head), leaving each row's state in
  // split_state / split_state_lse; phase 2: a work item per query token over the rest of its keys
  // by rank, from that state. The fold is left to right either way: same bits.
  int32_t tree_phase;  // 0: one launch; 1, 2: the phases
  // In-kernel fold: split_state [num_q_tokens * Hq][D] fp32, split_state_lse [num_q_tokens * Hq]
  // (phases 1 and 2).
  float* split_state;
  float* split_state_lse;
  // Split-parallel and the default-mode split, per launch: split_out [z][num_q_tokens * Hq][D]
  // and split_lse [z][num_q_tokens * Hq] receive the partials of blockIdx.z; deterministic:
  // blockIdx.z + split_begin is the chunk of fixed_split_size keys; default mode (fixed_split_size
  // == 0): blockIdx.z is the part of the CTA's key range, of gridDim.z parts.
  int32_t split_begin;
  float* split_out;
  float* split_lse;
};

// ---- small helpers ---------------------------------------------------------------------------
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

// ---- tree rows: depths (tree attention with a window) and keys by rank (deterministic mode) ---
// One warp per query row t of a sequence: tree_depth[t] = (number of true entries of mask row t)
// - 1, the node's depth when the row sees exactly its ancestors and itself; with `keys` (the
// deterministic mode under a custom mask) also keys[t][0 .. count) = the trailing keys the row
// sees in index order and seq[t] = b. The lanes read the row coalesced, 32 entries a step, and
// count / place them with a ballot and popcounts (exact integers).
// grid (ceil(max_seqlen_q / kTreeDepthWarps), batch), block kTreeDepthWarps * 32, no smem.
__global__ void __launch_bounds__(kTreeDepthWarps * 32)
    tree_rows_kernel(const PrefillAttentionParams p, int32_t* depth, int32_t* seq, int32_t* keys) {
  const int b = blockIdx.y;
  const int q_start = p.cu_seqlens_q[b];
  const int q_len = p.cu_seqlens_q[b + 1] - q_start;
  const int row = blockIdx.x * kTreeDepthWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= q_len) return;  // uniform over the warp: the ballots below see all 32 lanes
  const CustomMask mask = custom_mask_of(p, b);
  int32_t* dst = keys != nullptr ? keys + static_cast<int64_t>(q_start + row) * p.max_seqlen_q : nullptr;
  int count = 0;
  for (int c0 = 0; c0 < q_len; c0 += 32) {
    const int c = c0 + lane;
    const bool sees = c < q_len && mask.sees(row, c, q_len);
    const unsigned bits = __ballot_sync(kFullWarpMask, sees);
    const int at = count + __popc(bits & ((1u << lane) - 1u));
    if (dst != nullptr && sees && at < p.max_seqlen_q) dst[at] = c;  // (q_len <= max_seqlen_q: the caller's promise)
    count += __popc(bits);
  }
  if (lane == 0) {
    depth[q_start + row] = count - 1;
    if (seq != nullptr) seq[q_start + row] = b;
  }
}

// ---- work items ------------------------------------------------------------------------------
// The (sequence, tile) of work item `item`: sequence b has tiles_b = ceil(q_len_b * group /
// rows_per_tile) items, numbered sequence after sequence. One warp computes it alone (32 sequences
// per step: tile counts, inclusive prefix sum by shuffles, ballot for the first prefix past the
// item); every warp of the CTA gets the same answer, so no shared memory or barrier is needed.
// b = -1 when the item is past the last one.
struct WorkItem {
  int b;      // -1: none
  int index;  // item within the sequence (0 .. tiles - 1)
  int tiles;
};

__device__ __forceinline__ WorkItem find_work_item(const int32_t* cu_seqlens_q, int batch, int group,
                                                   int rows_per_tile, int64_t item, int lane) {
  WorkItem w{-1, 0, 0};
  int64_t base = 0;
  for (int b0 = 0; b0 < batch; b0 += 32) {  // trip count uniform over the warp
    const int b = b0 + lane;
    int n = 0;
    if (b < batch) {
      const int64_t rows = static_cast<int64_t>(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) * group;
      n = static_cast<int>((rows + rows_per_tile - 1) / rows_per_tile);
    }
    int incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(kFullWarpMask, incl, o);
      if (lane >= o) incl += x;
    }
    const unsigned hit = __ballot_sync(kFullWarpMask, item < base + incl);
    if (hit != 0) {
      const int l = __ffs(hit) - 1;
      const int excl = __shfl_sync(kFullWarpMask, incl - n, l);
      w.tiles = __shfl_sync(kFullWarpMask, n, l);
      w.b = b0 + l;
      w.index = static_cast<int>(item - base - excl);
      return w;
    }
    base += __shfl_sync(kFullWarpMask, incl, 31);
  }
  return w;
}

// Geometry of a CTA's tile (uniform over the CTA; a trivial type: it lives in shared memory).
struct PrefillTile {
  int b;
  int q_start, q_len, k_len;
  int64_t k_start;  // contiguous K/V: first key row of the sequence
  int group, kv_head;
  int rows;         // rows of the sequence: q_len * group
  int row0;         // first row of this tile
  // Keys by rank (deterministic tree rows; nullptr otherwise): key j >= key_map_lo is the
  // sequence's key key_map_lo + key_map[j - key_map_lo].
  const int32_t* key_map;
  int key_map_lo;
  // An fp8 cache: the factor of the P V accumulators (the V tiles hold 2^-8 times the stored
  // values): v_scale of the KV head * 2^8. 1 otherwise (and not read).
  float out_scale;
};

// The numerator of the normalisation 1 / l (the fp8 cache's out_scale; exactly 1 otherwise, so
// the other instances compute 1.f / l as before).
template <typename Traits>
__device__ __forceinline__ float out_numerator(const PrefillTile& tile) {
  if constexpr (Traits::kFp8Cache) return tile.out_scale;
  return 1.f;
}

// The fragment rows of a thread (rows g and g + 8 of its warp's 16): token, position, validity.
// Computed where needed (masked tiles, epilogue) rather than kept live through the main loop.
struct FragmentRows {
  int token[2];
  int pos[2];
  bool valid[2];
};

__device__ __forceinline__ FragmentRows fragment_rows(const PrefillTile& tile, const SequenceMask& mask, int warp,
                                                      int lane) {
  FragmentRows rows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = tile.row0 + warp * 16 + lane / 4 + 8 * h;
    rows.valid[h] = row < tile.rows;
    rows.token[h] = rows.valid[h] ? row / tile.group : 0;
    rows.pos[h] = rows.valid[h] ? mask.query_pos(rows.token[h]) : 0;
  }
  return rows;
}

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
    ptx::cp_async_cg_16(s_q + swizzle<kCPR>(r, chunk), q_ptr + off + chunk * Traits::kElemsPerChunk, pred);
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
    const int so = kFp8 ? (r * kCPR + chunk) * 16 : swizzle<kCPR>(r, chunk);
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
        out[k] = pack2<T>(f.x, f.y);
      }
    }
    *reinterpret_cast<uint4*>(dst + swizzle<Traits::kChunksPerRow>(r, 2 * c8)) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(dst + swizzle<Traits::kChunksPerRow>(r, 2 * c8 + 1)) =
        make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// The Q fragment of k-step kk (dims 16kk..16kk+15) of the warp's 16 rows from shared memory.
// ldmatrix_x4 matrices: 0 = rows 0-7 / dims 0-7, 1 = rows 8-15 / dims 0-7, 2 = rows 0-7 / dims
// 8-15, 3 = rows 8-15 / dims 8-15 -> exactly a[0..3] of the m16n8k16 A layout.
template <typename Traits>
__device__ __forceinline__ void load_q_fragment(uint32_t (&a)[4], const unsigned char* s_q, int kk, int warp,
                                                int lane) {
  const int mat = lane / 8, r = lane % 8;
  ptx::ldmatrix_x4(a, s_q + swizzle<Traits::kChunksPerRow>(warp * 16 + r + 8 * (mat & 1), 2 * kk + (mat >> 1)));
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
// g+8. ldmatrix_x4 on K rows (key = n, dim = k): matrices 0/1 = keys 0-7 of the pair, dims 0-7 /
// 8-15 (b[0], b[1] of n-tile 2np); 2/3 = keys 8-15 (n-tile 2np + 1).
// The A operands: qf (kQInRegisters) or, for D = 256, read from s_q at each k-step.
template <typename Traits>
__device__ __forceinline__ void qk_tile(float (&s)[Traits::kBlockN / 8][4],
                                        const uint32_t (&qf)[Traits::kQFragments][4], const unsigned char* s_q,
                                        const unsigned char* sk, int warp, int lane) {
  using T = typename Traits::T;
  constexpr int kBlockN = Traits::kBlockN;
#pragma unroll
  for (int nt = 0; nt < kBlockN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const int mat = lane / 8, r = lane % 8;
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
      uint32_t kb[4];
      ptx::ldmatrix_x4(kb, sk + swizzle<Traits::kChunksPerRow>(np * 16 + r + 8 * (mat >> 1), 2 * kk + (mat & 1)));
      const uint32_t b0[2] = {kb[0], kb[1]};
      const uint32_t b1[2] = {kb[2], kb[3]};
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
// V B operand (key = k, dim = n) via ldmatrix .trans on V rows: matrices 0/1 = keys 0-7 / 8-15 of
// dims 16dp..+7 (b[0], b[1] of d-tile 2dp), 2/3 = the same for d-tile 2dp + 1.
template <typename Traits>
__device__ __forceinline__ void pv_tile(float (&o)[Traits::kHeadDim / 8][4], const float (&s)[Traits::kBlockN / 8][4],
                                        const unsigned char* sv, int lane) {
  using T = typename Traits::T;
  const int mat = lane / 8, r = lane % 8;
#pragma unroll
  for (int kk = 0; kk < Traits::kBlockN / 16; ++kk) {
    const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                            pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dp = 0; dp < Traits::kHeadDim / 16; ++dp) {
      uint32_t vb[4];
      ptx::ldmatrix_x4_trans(vb, sv + swizzle<Traits::kChunksPerRow>(kk * 16 + r + 8 * (mat & 1), 2 * dp + (mat >> 1)));
      const uint32_t b0[2] = {vb[0], vb[1]};
      const uint32_t b1[2] = {vb[2], vb[3]};
      ptx::mma_m16n8k16<T>(o[2 * dp], pa, b0);
      ptx::mma_m16n8k16<T>(o[2 * dp + 1], pa, b1);
    }
  }
}

// ---- epilogue ----------------------------------------------------------------------------------
// The lse of a row (or of a deterministic-mode chunk) from its log2-domain max and quad-reduced
// sum (-inf when it saw no key).
__device__ __forceinline__ float chunk_lse(float row_max, float l) {
  return l > 0.f ? (row_max + log2f(l)) * kLn2 : -INFINITY;
}

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
    float inv = l > 0.f ? (folded_lse != nullptr ? 1.f : out_numerator<Traits>(tile)) / l : 0.f;
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
      *reinterpret_cast<uint32_t*>(s_q + swizzle<kCPR>(r, dt) + 4 * t) =
          pack2<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
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
      const uint4 val = *reinterpret_cast<const uint4*>(s_q + swizzle<kCPR>(r, chunk));
      *reinterpret_cast<uint4*>(out_ptr + (tile.q_start + token) * p.out_token_stride + static_cast<int64_t>(head) * D +
                                chunk * Traits::kElemsPerChunk) = val;
    }
  }
}

// ---- deterministic mode (attention.h, fixed_split_size) -----------------------------------------
// The in-kernel fold (prefill: one CTA walks all chunks) and prefill_merge_splits_kernel (decode: a
// CTA per chunk) fold with the one arithmetic of state_merge.cuh.

// Row index (token * Hq + head) of fragment half h, or -1 past the sequence.
__device__ __forceinline__ int64_t fragment_row_index(const PrefillAttentionParams& p, const PrefillTile& tile,
                                                      const FragmentRows& rows, int warp, int lane, int h) {
  if (!rows.valid[h]) return -1;
  const int row = tile.row0 + warp * 16 + lane / 4 + 8 * h;
  const int head = tile.kv_head * tile.group + (row - rows.token[h] * tile.group);
  return (tile.q_start + rows.token[h]) * static_cast<int64_t>(p.num_q_heads) + head;
}

// Split-parallel mode (deterministic decode) and the default-mode split: the chunk's (part's)
// normalised fp32 output and lse of each valid row go to split slot blockIdx.z (a row that saw no
// key of it: zeros and -inf, skipped by the merge).
template <typename Traits>
__device__ __forceinline__ void epilogue_split(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                               const PrefillTile& tile,
                                               const SequenceMask& mask, const float (&o)[Traits::kHeadDim / 8][4],
                                               const float (&row_max)[2], const float (&row_sum)[2], int warp,
                                               int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
  const int64_t slot = static_cast<int64_t>(blockIdx.z) * p.num_q_tokens * p.num_q_heads;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_reduce_sum<4>(row_sum[h]);
    const float inv = l > 0.f ? out_numerator<Traits>(tile) / l : 0.f;
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    if (r >= 0) {
      // The thread's two adjacent elements of each d-tile in one 8-byte store (the quad's four
      // stores fill a 32-byte sector; the row starts 16-byte aligned: D floats from a 16-byte base).
      float2* dst = reinterpret_cast<float2*>(ls.split_out + (slot + r) * D + 2 * (lane % 4));
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) dst[dt * 4] = make_float2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
      if (lane % 4 == 0) ls.split_lse[slot + r] = chunk_lse(row_max[h], l);
    }
  }
}

// In-kernel fold (prefill): at the end of each chunk, its partial (o / l, lse) is merged into the
// row's state (fp32 in split_state, each thread its own fragment elements, so no barrier; the
// state's lse in registers, st_lse) and the online-softmax accumulators restart. A chunk the row
// saw nothing of is skipped; the first one the row sees becomes the state as it is. Warp-uniform.
template <typename Traits>
__device__ __forceinline__ void fold_chunk(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                           const PrefillTile& tile,
                                           const SequenceMask& mask, float (&o)[Traits::kHeadDim / 8][4],
                                           float (&row_max)[2], float (&row_sum)[2], float (&st_lse)[2], int warp,
                                           int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = warp_reduce_sum<4>(row_sum[h]);
    const float inv = l > 0.f ? out_numerator<Traits>(tile) / l : 0.f;
    const float lse_c = chunk_lse(row_max[h], l);
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    const bool store = r >= 0 && lse_c != -INFINITY;  // else the state stays as it is
    const bool first = st_lse[h] == -INFINITY;       // the first chunk the row sees: the state as it is
    const ChunkMerge w = store && !first ? chunk_merge(st_lse[h], lse_c) : ChunkMerge{0.f, 0.f, lse_c};
    float* st = ls.split_state + (store ? r : 0) * D + 2 * (lane % 4);
    // In groups of kFoldGroup d-tiles with a __syncwarp between them (warp-uniform: the predicates
    // are per element), which keeps the compiler from loading the whole state row at once: with the
    // loop's state live, that would spill at head dim 256.
    constexpr int kFoldGroup = 8;
#pragma unroll
    for (int g = 0; g < D / 8; g += kFoldGroup) {
#pragma unroll
      for (int dt = g; dt < g + kFoldGroup; ++dt) {
        if (store) {
          st[dt * 8] = first ? o[dt][2 * h] * inv : chunk_merge_value(w, st[dt * 8], o[dt][2 * h] * inv);
          st[dt * 8 + 1] = first ? o[dt][2 * h + 1] * inv : chunk_merge_value(w, st[dt * 8 + 1], o[dt][2 * h + 1] * inv);
        }
      }
      __syncwarp();
    }
    if (store) st_lse[h] = w.lse;
    row_max[h] = -INFINITY;
    row_sum[h] = 0.f;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][2 * h] = o[dt][2 * h + 1] = 0.f;
  }
}

// In-kernel fold, after the last chunk: the state back into the accumulators with row_sum such
// that the epilogue's quad sum is exactly 1 (4 x 0.25), so it stores the state rounded once; the
// sink merged last, as prefill_merge_splits_kernel does.
template <typename Traits>
__device__ __forceinline__ void load_folded_state(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                                  const PrefillTile& tile,
                                                  const SequenceMask& mask, float (&o)[Traits::kHeadDim / 8][4],
                                                  float (&row_sum)[2], float (&st_lse)[2], int warp, int lane) {
  constexpr int D = Traits::kHeadDim;
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    const bool seen = r >= 0 && st_lse[h] != -INFINITY;
    const float* st = ls.split_state + (seen ? r : 0) * D + 2 * (lane % 4);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][2 * h] = seen ? st[dt * 8] : 0.f;
      o[dt][2 * h + 1] = seen ? st[dt * 8 + 1] : 0.f;
    }
    if (p.sinks != nullptr && r >= 0) {
      const ChunkMerge w = sink_merge(st_lse[h], p.sinks[r % p.num_q_heads]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * h] = chunk_merge_value(w, o[dt][2 * h], 0.f);
        o[dt][2 * h + 1] = chunk_merge_value(w, o[dt][2 * h + 1], 0.f);
      }
      st_lse[h] = w.lse;
    }
    row_sum[h] = 0.25f;
  }
}

// The two-launch fold (PrefillLaunchState::tree_phase): each valid row's state lse, stored by
// phase 1 (one lane of the row's quad: all four hold it) and loaded by phase 2.
__device__ __forceinline__ void store_state_lse(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                                const PrefillTile& tile,
                                                const SequenceMask& mask, const float (&st_lse)[2], int warp,
                                                int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    if (r >= 0 && lane % 4 == 0) ls.split_state_lse[r] = st_lse[h];
  }
}
__device__ __forceinline__ void load_state_lse(const PrefillAttentionParams& p, const PrefillLaunchState& ls,
                                               const PrefillTile& tile,
                                               const SequenceMask& mask, float (&st_lse)[2], int warp, int lane) {
  const FragmentRows rows = fragment_rows(tile, mask, warp, lane);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = fragment_row_index(p, tile, rows, warp, lane, h);
    st_lse[h] = r >= 0 ? ls.split_state_lse[r] : -INFINITY;
  }
}

// Split-parallel mode: folds the `splits` partials of this launch, in split order, into each
// (token, head) row's state: from the running state (or empty when `first`) to the running state
// (or, when `last`, out in dtype and lse), with fold_chunk's arithmetic. One warp per row, lane i
// owning elements i, i + 32, ... grid ceil(rows / kSplitMergeWarps), block kSplitMergeWarps * 32.
template <typename T, int D>
__global__ void __launch_bounds__(kSplitMergeWarps * 32)
    prefill_merge_splits_kernel(const PrefillAttentionParams p, const PrefillLaunchState ls, float* running_out,
                                float* running_lse, int splits,
                                bool first, bool last) {
  constexpr int kPerLane = D / 32;
  const int64_t num_rows = p.num_q_tokens * p.num_q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kSplitMergeWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= num_rows) return;
  float acc[kPerLane];
  float lse = first ? -INFINITY : running_lse[row];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = lse == -INFINITY ? 0.f : running_out[row * D + lane + 32 * i];
  for (int z = 0; z < splits; ++z) {
    const int64_t r = static_cast<int64_t>(z) * num_rows + row;
    const float lb = ls.split_lse[r];
    const float* vb = ls.split_out + r * D + lane;
    if (lb == -INFINITY) continue;
    if (lse == -INFINITY) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[i] = vb[32 * i];
      lse = lb;
      continue;
    }
    const ChunkMerge w = chunk_merge(lse, lb);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = chunk_merge_value(w, acc[i], vb[32 * i]);
    lse = w.lse;
  }
  if (!last) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) running_out[row * D + lane + 32 * i] = acc[i];
    __syncwarp();  // every lane of the row has read running_lse before lane 0 overwrites it
    if (lane == 0) running_lse[row] = lse;
    return;
  }
  const int64_t token = row / p.num_q_heads;
  const int head = static_cast<int>(row - token * p.num_q_heads);
  if (p.sinks != nullptr) {  // once, after the last split (partials leave it out)
    const ChunkMerge w = sink_merge(lse, p.sinks[head]);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = chunk_merge_value(w, acc[i], 0.f);
    lse = w.lse;
  }
  T* out = static_cast<T*>(p.out) + token * p.out_token_stride + static_cast<int64_t>(head) * D + lane;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) out[32 * i] = from_float<T>(acc[i]);
  if (lane == 0 && p.lse != nullptr) p.lse[row] = lse;
}

// ---- kernel ----------------------------------------------------------------------------------
// grid (plan.work_items, num_kv_heads[, plan.splits_per_launch]), block kThreads, dynamic smem
// kSmemBytes; ls: the launch state of the plan (launch_plan.h), kMode its plan.mode (the default
// instance carries none of the split, fold or tree-phase state).
template <typename Traits, bool kPaged, PrefillMode kMode>
__global__ void __launch_bounds__(Traits::kThreads)
    prefill_attention_kernel(const PrefillAttentionParams p, const PrefillLaunchState ls) {
  constexpr int D = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;

  // ---- work item -> tile geometry and masking rule, kept in shared memory ----
  // Uniform over the CTA but, being read from memory, not in ptxas's uniform registers: kept in
  // shared memory (written once, read where used) instead of ~15 registers live through the main
  // loop (the D = 128 kernel is at the 255-register cap).
  __shared__ PrefillTile s_tile;
  __shared__ SequenceMask s_mask;
  {
    const int group = p.num_q_heads / p.num_kv_heads;
    if (kMode != PrefillMode::kDefault && ls.tree_rank_keys != nullptr) {  // deterministic tree rows:
      // one query token (q_len 1) per item
      const int per_token = (group + kBlockM - 1) / kBlockM;
      const int64_t token = blockIdx.x / per_token;
      if (token >= p.num_q_tokens) return;  // uniform over the CTA, before any barrier
      if (tid == 0) {
        PrefillTile tile;
        tile.b = ls.tree_rank_seq[token];
        const int prefix = p.seq_lens_k[tile.b] - (p.cu_seqlens_q[tile.b + 1] - p.cu_seqlens_q[tile.b]);
        tile.group = group;
        tile.kv_head = blockIdx.y;
        tile.row0 = static_cast<int>(blockIdx.x % per_token) * kBlockM;
        tile.q_start = static_cast<int>(token);
        tile.q_len = 1;
        tile.k_start = 0;
        tile.k_len = prefix + ls.tree_depth[token] + 1;  // the prefix and the keys its mask row sees
        tile.rows = group;
        tile.key_map = ls.tree_rank_keys + token * p.max_seqlen_q;
        tile.key_map_lo = prefix;
        tile.out_scale = Traits::kFp8Cache ? p.v_scale[tile.kv_head * p.v_scale_stride] * kE4m3HalfRescale : 1.f;
        s_tile = tile;
        SequenceMask m = sequence_mask<false>(p, nullptr, tile.b, tile.q_start, 1, tile.k_len);
        m.causal = true;  // the last of its keys by rank: position prefix + depth, as in decode
        s_mask = m;
      }
    } else {
      const WorkItem w = find_work_item(p.cu_seqlens_q, p.batch_size, group, kBlockM, blockIdx.x, lane);
      if (w.b < 0) return;  // past the last item: every warp found the same, before any barrier
      if (tid == 0) {
        PrefillTile tile;
        tile.key_map = nullptr;
        tile.key_map_lo = 0;
        tile.b = w.b;
        tile.group = group;
        tile.kv_head = blockIdx.y;
        tile.row0 = (w.tiles - 1 - w.index) * kBlockM;  // the sequence's last tile first
        tile.q_start = p.cu_seqlens_q[w.b];
        tile.q_len = p.cu_seqlens_q[w.b + 1] - tile.q_start;
        if constexpr (kPaged) {
          tile.k_start = 0;
          tile.k_len = p.seq_lens_k[w.b];
        } else {
          tile.k_start = p.cu_seqlens_k[w.b];
          tile.k_len = p.cu_seqlens_k[w.b + 1] - static_cast<int>(tile.k_start);
        }
        tile.rows = tile.q_len * group;
        tile.out_scale = Traits::kFp8Cache ? p.v_scale[tile.kv_head * p.v_scale_stride] * kE4m3HalfRescale : 1.f;
        s_tile = tile;
        s_mask = sequence_mask<kPaged>(p, ls.tree_depth, tile.b, tile.q_start, tile.q_len, tile.k_len);
      }
    }
  }
  __syncthreads();
  const PrefillTile& tile = s_tile;
  const SequenceMask& mask = s_mask;

  // The CTA's key range (tokens of its valid rows; in the fixed mode only its chunk's keys, chunk
  // edges being tile edges; under the default-mode split only its part's tiles) and this warp's
  // tokens.
  int tile_lo, num_tiles;
  {
    const int last_row = min(tile.row0 + kBlockM, tile.rows) - 1;
    KeyRange keys = mask.key_range(tile.row0 / tile.group, last_row / tile.group);
    if (kMode == PrefillMode::kSplit && p.fixed_split_size > 0) {  // split-parallel: chunk split_begin + blockIdx.z only
      const int64_t c0 = static_cast<int64_t>(ls.split_begin + blockIdx.z) * p.fixed_split_size;
      if (c0 >= keys.hi) {
        keys.hi = keys.lo;  // empty
      } else {
        keys.lo = max(keys.lo, static_cast<int>(c0));
        keys.hi = static_cast<int>(min(static_cast<int64_t>(keys.hi), c0 + p.fixed_split_size));
      }
    } else if (kMode == PrefillMode::kSplit && !keys.empty()) {  // default-mode split: part blockIdx.z of gridDim.z
      const int t0 = keys.lo / kBlockN, tiles = (keys.hi + kBlockN - 1) / kBlockN - t0;
      const int per = (tiles + static_cast<int>(gridDim.z) - 1) / static_cast<int>(gridDim.z);  // whole tiles
      const int lo = (t0 + static_cast<int>(blockIdx.z) * per) * kBlockN;
      keys.lo = max(keys.lo, lo);
      keys.hi = min(keys.hi, lo + per * kBlockN);  // empty when the part starts past the range
    }
    if constexpr (kMode == PrefillMode::kFold) {
      if (ls.tree_phase == 1)  // the whole chunks of the prefix (tile: the sequence's own)
        keys.hi = min(keys.hi, (tile.k_len - tile.q_len) / p.fixed_split_size * p.fixed_split_size);
      else if (ls.tree_phase == 2)  // the rest, by rank (tile: one query token)
        keys.lo = max(keys.lo, tile.key_map_lo / p.fixed_split_size * p.fixed_split_size);
    }
    tile_lo = keys.lo / kBlockN;
    num_tiles = keys.empty() ? 0 : (keys.hi + kBlockN - 1) / kBlockN - tile_lo;
  }
  const int warp_row0 = tile.row0 + warp * 16;
  const bool warp_has_rows = warp_row0 < tile.rows;
  const int warp_first = warp_row0 / tile.group;
  const int warp_last = min(warp_row0 + 15, tile.rows - 1) / tile.group;

  unsigned char* smem = dynamic_smem<unsigned char>();
  unsigned char* s_q = smem;
  unsigned char* s_k = smem + Traits::kQBytes;  // kTileBuffers tiles of T each (prefill.cuh, traits)
  unsigned char* s_v = s_k + Traits::kTileBuffers * Traits::kTileBytes;
  // Where the cp.async ring of stage s lands: the T tiles, or the fp8 staging tiles after them.
  unsigned char* ring_k = Traits::kFp8Cache ? s_v + Traits::kTileBytes : s_k;
  unsigned char* ring_v = Traits::kFp8Cache ? ring_k + kStages * Traits::kFp8TileBytes : s_v;
  constexpr int kRingBytes = Traits::kFp8Cache ? Traits::kFp8TileBytes : Traits::kTileBytes;

  // Output accumulators: d-tile dt (dims 8dt..8dt+7), C layout: o[dt][0..1] row g, [2..3] row g+8.
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain, rows g and g + 8
  float row_sum[2] = {0.f, 0.f};              // this thread's partial sums (reduced at the end)
  // In-kernel fold of the deterministic mode: chunks of tiles_per_chunk tiles, the state's lse.
  constexpr bool fold = kMode == PrefillMode::kFold;
  const int tiles_per_chunk = fold ? p.fixed_split_size / kBlockN : 1;
  float st_lse[2] = {-INFINITY, -INFINITY};
  if (fold && ls.tree_phase == 2) load_state_lse(p, ls, tile, mask, st_lse, warp, lane);  // phase 1's fold

  if (num_tiles > 0) {
    // ---- prologue: Q (group 0), then K/V tiles 0 .. kStages-2 (one group each, maybe empty) ----
    load_q_tile<Traits>(s_q, p, tile, tid);
    ptx::cp_async_commit();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < num_tiles)
        load_kv_tile<Traits, kPaged>(ring_k + s * kRingBytes, ring_v + s * kRingBytes, p, tile,
                                     (tile_lo + s) * kBlockN, tid);
      ptx::cp_async_commit();
    }

    uint32_t qf[Traits::kQFragments][4];
    ptx::cp_async_wait<kStages - 1>();  // the Q group is complete
    __syncthreads();
    if constexpr (Traits::kQInRegisters) load_q_fragments<Traits>(qf, s_q, warp, lane);

    ScoreScale sc;
    // An fp8 cache: the K tiles hold 2^-8 times the stored values; k_scale * 2^8 joins the scale.
    const float qk_scale =
        Traits::kFp8Cache ? p.scale * (p.k_scale[tile.kv_head * p.k_scale_stride] * kE4m3HalfRescale) : p.scale;
    sc.scale_log2 = qk_scale * kLog2e;
    sc.softcap = p.softcap > 0.f;
    sc.cap_in = sc.softcap ? qk_scale / p.softcap : 0.f;
    sc.cap_out = p.softcap * kLog2e;

    for (int it = 0; it < num_tiles; ++it) {
      // Tile `it` is complete for this thread; the barrier makes it complete for all threads and
      // guarantees everybody finished reading the stage that the next load overwrites.
      ptx::cp_async_wait<kStages - 2>();
      __syncthreads();
      {
        const int next = it + kStages - 1;
        if (next < num_tiles)
          load_kv_tile<Traits, kPaged>(ring_k + (next % kStages) * kRingBytes, ring_v + (next % kStages) * kRingBytes,
                                       p, tile, (tile_lo + next) * kBlockN, tid);
        ptx::cp_async_commit();  // always commit: keeps the group count uniform
      }
      const int stage = it % kStages;
      const unsigned char* k_tile = s_k + stage * Traits::kTileBytes;
      const unsigned char* v_tile = s_v + stage * Traits::kTileBytes;
      if constexpr (Traits::kFp8Cache) {  // the staged fp8 tile into the T tiles (the barrier above
        // ordered every warp's last reads of them before these writes)
        convert_kv_tile<Traits>(s_k, ring_k + stage * kRingBytes, tid);
        convert_kv_tile<Traits>(s_v, ring_v + stage * kRingBytes, tid);
        __syncthreads();
        k_tile = s_k;
        v_tile = s_v;
      }
      const int n0 = (tile_lo + it) * kBlockN;
      if constexpr (fold) {
        if (it > 0 && (tile_lo + it) % tiles_per_chunk == 0)  // a chunk ends: uniform over the CTA
          fold_chunk<Traits>(p, ls, tile, mask, o, row_max, row_sum, st_lse, warp, lane);
      }
      // Warp-uniform: skip a tile none of the warp's rows sees (its update would be the identity).
      if (!warp_has_rows || mask.none_visible(n0, n0 + kBlockN, warp_first, warp_last)) continue;

      float s[kBlockN / 8][4];
      qk_tile<Traits>(s, qf, s_q, k_tile, warp, lane);
      scores_to_log2<Traits>(s, sc);
      if (mask.needs_element_mask(n0, n0 + kBlockN, warp_first, warp_last))
        mask_scores<Traits>(s, tile, mask, n0, warp, lane);
      online_softmax<Traits>(s, row_max, row_sum, o);
      pv_tile<Traits>(o, s, v_tile, lane);
    }
    ptx::cp_async_wait<0>();  // only empty groups remain; keeps the invariant explicit
  }

  if constexpr (kMode == PrefillMode::kSplit) {
    epilogue_split<Traits>(p, ls, tile, mask, o, row_max, row_sum, warp, lane);
  } else if constexpr (fold) {
    fold_chunk<Traits>(p, ls, tile, mask, o, row_max, row_sum, st_lse, warp, lane);
    if (ls.tree_phase == 1) {  // the state stays for phase 2 (split_state written by fold_chunk)
      store_state_lse(p, ls, tile, mask, st_lse, warp, lane);
      return;
    }
    load_folded_state<Traits>(p, ls, tile, mask, o, row_sum, st_lse, warp, lane);
    epilogue<Traits>(s_q, p, tile, mask, o, row_max, row_sum, warp, lane, st_lse);
  } else {
    epilogue<Traits>(s_q, p, tile, mask, o, row_max, row_sum, warp, lane);
  }
}

}  // namespace fastinfer::attention
