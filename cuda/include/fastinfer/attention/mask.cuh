#pragma once
// Attention masking rules in one place: which keys a query sees under the causal rule, a sliding
// window and a custom (tree) mask (attention.h states the contract). The prefill kernel uses them
// for its key range, for its per-(warp, tile) decisions and per element; they are written in terms
// of (query index, key index) only, with no fragment layout, so a Hopper (wgmma) kernel can use
// them as they are.
//
// One sequence with q_len queries and k_len keys; query i (0 <= i < q_len) and the trailing key
// pos_offset + m (0 <= m < q_len) are tree node i / m when a custom mask is given.
//  - positions: query i is at pos_offset + i (pos_offset = k_len - q_len: bottom-right aligned);
//    with a custom mask AND a window at pos_offset + depth(i) (tree positions; depth from
//    tree_depth, written by tree_rows_kernel), trailing key m at pos_offset + depth(m), prefix
//    key j at j.
//  - visible(i, j) = j < k_len
//                    and (causal: j <= pos(i))                      [not with a custom mask]
//                    and (custom mask: j < pos_offset or mask[i][j - pos_offset])
//                    and (window W >= 0: pos(j) >= pos(i) - W).
//  - custom mask storage: bool (one byte per entry) or bit-packed (8 entries per byte, entry e at
//    bit e % 8 of byte e / 8: the batch's flattened [sum of q_len^2] mask packed as a whole, so
//    sequence b's entries start at bit mask_offsets[b], not necessarily at a byte boundary).
#include "fastinfer/common/platform.cuh"
#include "fastinfer/attention/attention.h"

#include <cstdint>

namespace fastinfer::attention {

// Half-open key range [lo, hi); empty when hi <= lo.
struct KeyRange {
  int lo, hi;
  __device__ __forceinline__ bool empty() const { return hi <= lo; }
};

// The custom mask of one sequence: entry e = i * q_len + m says whether query i sees trailing key m.
// (The mask structs are trivial types, no member initialisers: a kernel may keep them in static
// shared memory.)
struct CustomMask {
  const uint8_t* base;  // bool form: entry 0; bit-packed: the byte holding entry 0; nullptr: none
  int first_bit;        // bit-packed: bit of *base holding entry 0 (0 in the bool form)
  bool packed;

  __device__ __forceinline__ bool present() const { return base != nullptr; }
  __device__ __forceinline__ bool entry(int64_t e) const {
    if (!packed) return base[e] != 0;
    const int64_t bit = e + first_bit;
    return ((base[bit >> 3] >> (bit & 7)) & 1) != 0;
  }
  __device__ __forceinline__ bool sees(int i, int m, int q_len) const {
    return entry(static_cast<int64_t>(i) * q_len + m);
  }
};

// Sequence b's custom mask from the launch parameters (absent when neither form is given).
__device__ __forceinline__ CustomMask custom_mask_of(const PrefillAttentionParams& p, int b) {
  CustomMask c{nullptr, 0, false};
  if (p.custom_mask != nullptr) {
    c.base = reinterpret_cast<const uint8_t*>(p.custom_mask) + p.mask_offsets[b];
  } else if (p.packed_custom_mask != nullptr) {
    const int64_t bit = p.mask_offsets[b];
    c.base = p.packed_custom_mask + (bit >> 3);
    c.first_bit = static_cast<int>(bit & 7);
    c.packed = true;
  }
  return c;
}

// The masking rule of one sequence.
struct SequenceMask {
  int q_len, k_len;
  int pos_offset;                // k_len - q_len
  int window;                    // < 0: no window
  bool causal;                   // false whenever a custom mask is given (it replaces the rule)
  CustomMask custom;
  const int32_t* tree_depth;     // custom mask and window: depth of each node; else nullptr

  __device__ __forceinline__ bool use_window() const { return window >= 0; }
  __device__ __forceinline__ bool tree_positions() const { return tree_depth != nullptr; }

  // Position of query i (0 <= i < q_len).
  __device__ __forceinline__ int query_pos(int i) const { return pos_offset + (tree_depth ? tree_depth[i] : i); }
  // Position of key j (0 <= j < k_len).
  __device__ __forceinline__ int key_pos(int j) const {
    return tree_depth != nullptr && j >= pos_offset ? pos_offset + tree_depth[j - pos_offset] : j;
  }
  // Bounds on the positions of the queries [i_first, i_last] (tree positions lie in
  // [pos_offset - 1, k_len - 1]: depth >= -1, a node's depth < q_len).
  __device__ __forceinline__ int min_query_pos(int i_first) const {
    return tree_depth ? pos_offset - 1 : pos_offset + i_first;
  }
  __device__ __forceinline__ int max_query_pos(int i_last) const { return tree_depth ? k_len - 1 : pos_offset + i_last; }

  // Keys some query of [i_first, i_last] may see (a superset of the visible ones).
  __device__ __forceinline__ KeyRange key_range(int i_first, int i_last) const {
    KeyRange r{0, k_len};
    if (causal) r.hi = min(r.hi, pos_offset + i_last + 1);
    if (use_window()) r.lo = max(0, min_query_pos(i_first) - window);
    return r;
  }

  // False when every key of [n0, n1) is visible to every query of [i_first, i_last] (no element
  // mask needed); true when some may not be.
  __device__ __forceinline__ bool needs_element_mask(int n0, int n1, int i_first, int i_last) const {
    return n1 > k_len || (causal && n1 - 1 > pos_offset + i_first) ||
           (use_window() && n0 < max_query_pos(i_last) - window) || (custom.present() && n1 > pos_offset);
  }

  // True only when no query of [i_first, i_last] sees any key of [n0, n1) (the block's work can be
  // skipped: its scores would all be -inf, which leaves the online softmax unchanged). Conservative
  // under a custom mask (never skips on the mask's entries).
  __device__ __forceinline__ bool none_visible(int n0, int n1, int i_first, int i_last) const {
    if (n0 >= k_len || n1 <= n0) return true;
    if (causal && n0 > pos_offset + i_last) return true;
    // the window's lower edge for the lowest query, against the highest key position of the block
    if (use_window() && !tree_positions() && n1 - 1 < pos_offset + i_first - window) return true;
    return false;
  }

  // Query i (at position pos = query_pos(i), passed in: a kernel computes it once per row) sees
  // key j (0 <= j, any j: keys past k_len are not visible).
  __device__ __forceinline__ bool visible(int i, int pos, int j) const {
    if (j >= k_len) return false;
    if (causal && j > pos) return false;
    if (custom.present() && j >= pos_offset && !custom.sees(i, j - pos_offset, q_len)) return false;
    if (use_window() && key_pos(j) < pos - window) return false;
    return true;
  }
};

// The rule of sequence b (q_len, k_len known); tree_depth is the launch's depth scratch, indexed
// by query row (this sequence's nodes start at row q_start). kCustom = false ignores any custom
// mask (the contiguous-K/V path has none).
template <bool kCustom = true>
__device__ __forceinline__ SequenceMask sequence_mask(const PrefillAttentionParams& p, const int32_t* tree_depth, int b,
                                                      int q_start, int q_len, int k_len) {
  SequenceMask m;
  m.q_len = q_len;
  m.k_len = k_len;
  m.pos_offset = k_len - q_len;
  m.window = p.window_left;
  m.custom = kCustom ? custom_mask_of(p, b) : CustomMask{nullptr, 0, false};
  m.causal = p.causal && !m.custom.present();
  m.tree_depth = m.custom.present() && m.window >= 0 ? tree_depth + q_start : nullptr;
  return m;
}

}  // namespace fastinfer::attention
