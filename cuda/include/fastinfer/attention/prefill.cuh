#pragma once
// Fused prefill attention (FlashAttention-2 structure) on mma.sync m16n8k16, for sm_80 .. sm_90.
//
// Work items and GQA packing. The grid is (work items, num_kv_heads). A CTA owns one KV head and
// kBlockM = 128 rows (64 for head dim 256) of one sequence, a row being a (query token, query
// head) pair of the KV head's group, token-major: row r of the sequence is token r / group, query head
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
// One CTA = 8 warps (4 for head dim 256: traits); warp w owns rows 16w .. 16w + 15 of the tile
// for the whole kernel, so softmax statistics never leave the warp (registers as with 64-row
// tiles: 16 rows per warp either way).
//
//   gmem --cp.async--> smem Q (once) --ldmatrix--> Q A-fragments (registers, whole kernel)
//   gmem --cp.async--> smem K/V ring of kStages tiles of kBlockN keys (gathered per row when paged)
//   S = Q K^T        : ldmatrix (non-trans) of K rows = B operand "col" (key = n, dim = k)
//   online softmax   : fp32 registers, exp2 domain (scale * log2 e folded into the scores)
//   O += P V         : P re-packed from the S accumulators into A-fragments (no smem round trip),
//                      ldmatrix .trans of V rows = B operand (key = k, dim = n)
//   epilogue         : O / l -> dtype -> smem (the warp's own Q rows) -> 16-byte coalesced stores
// The kernel below is the sequence of the steps, one file per role: prefill_traits.cuh (tile
// shape, shared-memory layout, launch state), work_items.cuh (which rows a CTA owns),
// prefill_steps.cuh (load_q_tile, load_kv_tile, load_q_fragments, qk_tile, scores_to_log2,
// mask_scores, online_softmax, pv_tile, epilogue), split_fold.cuh (the split partials, the
// deterministic fold and the split merge kernel), tree_rows.cuh (tree depths and keys by rank).
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
// (safe max of 0 while the running max is -inf); a NaN score reaches the row sum through
// exp2(NaN - max), and the finalisers test the sum for 0, so the row's out and lse are NaN
// (prefill_steps.cuh: chunk_lse, row_inverse). Tree attention with a window reads the nodes'
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
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"
#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/launch_plan.h"
#include "fastinfer/attention/mask.cuh"
#include "fastinfer/attention/prefill_steps.cuh"
#include "fastinfer/attention/prefill_traits.cuh"
#include "fastinfer/attention/split_fold.cuh"
#include "fastinfer/attention/tree_rows.cuh"
#include "fastinfer/attention/work_items.cuh"

#include <cmath>
#include <cstdint>

namespace fastinfer::attention {

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
  unsigned char* s_k = smem + Traits::kQBytes;  // kTileBuffers tiles of T each (prefill_traits.cuh)
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
