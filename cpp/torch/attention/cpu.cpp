// CPU implementations of the attention ops (fp32 inside). Prefill: ATen's CPU flash kernel per
// sequence where it applies (long chunks, no softcap or custom mask), else the per-row items of
// decode (K/V are never repeated per query head). Decode: a direct
// loop over (sequence, KV head) pairs on torch's thread pool, reading each paged K/V row once for
// the whole query-head group (no gather, no per-sequence op overhead: the CPU runner's hot path).
// Exact masking rules of the contract; checked against the fp64 reference.
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_simd.h"
#include "attention/contract.h"
#include "gemm_fp8/e4m3_cpu.h"

namespace fastinfer::binding {
namespace {

// A row's keys in a paged cache: token j of sequence b is row table[j / BS] * BS + j % BS.
// The first `length` rows [length, Hkv, D] of a sequence, gathered contiguously (the flash path).
Tensor gather_paged(const Tensor& cache, const int32_t* table_row, int64_t length) {
  const int64_t bs = cache.size(1), row_bytes = cache.size(2) * cache.size(3) * static_cast<int64_t>(cache.element_size());
  auto out = empty_on(cache, {length, cache.size(2), cache.size(3)});
  const auto* src = static_cast<const unsigned char*>(cache.const_data_ptr());
  auto* dst = static_cast<unsigned char*>(out.mutable_data_ptr());
  for (int64_t j = 0; j < length; ++j)
    std::memcpy(dst + j * row_bytes, src + (static_cast<int64_t>(table_row[j / bs]) * bs + j % bs) * row_bytes,
                static_cast<size_t>(row_bytes));
  return out;
}

// value_dim > 0: out is [T, Hq, value_dim] (a latent cache's values are narrower than its keys).
std::tuple<Tensor, Tensor> make_outputs(const Tensor& q, bool return_lse, int64_t value_dim = 0) {
  auto out = zeros_on(q, value_dim > 0 ? Shape{q.size(0), q.size(1), value_dim} : shape_of(q));
  auto lse = return_lse ? full_on(q, {q.size(0), q.size(1)}, -std::numeric_limits<double>::infinity(), kFloat)
                        : empty_on(q, {0}, kFloat);
  return {out, lse};
}

void prefill_items(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::vector<int64_t>& cq, const std::vector<int64_t>& ck, double scale, bool causal,
                   int64_t window_left, double softcap, int64_t fixed_split, const float* sinks, Tensor& out,
                   Tensor& lse, const std::vector<bool>& done);

// An attention sink merged into a row's state (attention.h): one more term exp(sink) of the
// denominator with a zero value row, so the state's value is scaled by `weight` and its lse
// becomes log(exp(lse) + exp(sink)); a row that saw no key keeps out = 0 and gets lse = sink. The
// arithmetic of the deterministic mode's chunk merge, the sink being one last chunk.
struct SinkMerge {
  float weight, lse;
};
SinkMerge merge_sink(float lse, float sink) {
  if (lse == -std::numeric_limits<float>::infinity()) return {0.0f, sink};
  if (std::isnan(lse)) return {lse, lse};  // a row that saw a NaN stays NaN
  const float mx = std::max(lse, sink);
  const float ea = std::exp(lse - mx), eb = std::exp(sink - mx), sum = ea + eb;
  return {ea / sum, mx + std::log(sum)};
}

// ATen's CPU flash attention (blocked GEMMs in the input dtype, fp32 softmax, GQA without
// repeating K/V, called through the dispatcher) for one sequence; q [ql, Hq, D], k/v [kl, Hkv, D].
// Only where every query sees a key (kl >= ql) and the attention is plain (no softcap, custom
// mask, sink or fp8 cache): the per-row items (attend_items) do the rest.
bool flash_applies(int64_t ql, int64_t kl, bool plain) { return ql > 0 && kl >= ql && plain; }

// True when t ([n, H, D], heads packed, any row stride; float32 / float16 / bfloat16) holds only
// finite values. The flash path is taken only then: ATen's kernel adds its mask to the scores (a
// hidden NaN or infinite key stays NaN) and multiplies hidden keys' zero weights by their value
// rows, so a non-finite key or value would reach rows that cannot see it; the per-row items keep
// the contract (docs/design.md "Non-finite values"). x * 0 is NaN exactly for a non-finite x;
// 16 independent sums (width = heads * D, a multiple of 16) keep the scan vectorisable.
template <typename T>
bool finite_rows(const T* data, int64_t rows, int64_t row_stride, int64_t width) {
  float lanes[16] = {};
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = data + r * row_stride;
    for (int64_t i = 0; i < width; i += 16)
      for (int j = 0; j < 16; ++j) lanes[j] += static_cast<float>(row[i + j]) * 0.0f;
  }
  return cpu::tree_sum<16>(lanes) == 0.0f;
}
bool all_finite(const Tensor& t) {
  const int64_t rows = t.size(0), width = t.size(1) * t.size(2), stride = t.stride(0);
  switch (t.scalar_type()) {
    case kHalf: return finite_rows(t.const_data_ptr<Half>(), rows, stride, width);
    case kBFloat16: return finite_rows(t.const_data_ptr<BFloat16>(), rows, stride, width);
    default: return finite_rows(t.const_data_ptr<float>(), rows, stride, width);
  }
}

template <typename T>
void fill_window_mask(T* m, int64_t ql, int64_t kl, bool causal, int64_t window_left) {
  const T zero = static_cast<T>(0.0f), neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < ql; ++i) {
    const int64_t p = kl - ql + i;  // bottom-right aligned (attention.h)
    for (int64_t j = 0; j < kl; ++j) {
      const bool visible = (!causal || j <= p) && (window_left < 0 || j >= p - window_left);
      m[i * kl + j] = visible ? zero : neg_inf;
    }
  }
}

void attend_flash(const Tensor& q, const Tensor& k, const Tensor& v, double scale, bool causal,
                  int64_t window_left, Tensor& out, Tensor& lse, int64_t row) {
  using torch::stable::transpose;
  using torch::stable::unsqueeze;
  const int64_t ql = q.size(0), kl = k.size(0);
  std::optional<Tensor> mask;  // additive, in q's dtype (what the kernel takes)
  bool is_causal = false;      // its own causal flag is top-left aligned: only when ql == kl
  if (window_left >= 0 || (causal && kl != ql)) {
    mask = empty_on(q, {ql, kl});
    switch (q.scalar_type()) {
      case kHalf: fill_window_mask(mask->mutable_data_ptr<Half>(), ql, kl, causal, window_left); break;
      case kBFloat16: fill_window_mask(mask->mutable_data_ptr<BFloat16>(), ql, kl, causal, window_left); break;
      default: fill_window_mask(mask->mutable_data_ptr<float>(), ql, kl, causal, window_left);
    }
  } else {
    is_causal = causal;
  }
  const auto [o, l] = aten_call<2>("aten::_scaled_dot_product_flash_attention_for_cpu", "",
                                   unsqueeze(transpose(q, 0, 1), 0), unsqueeze(transpose(k, 0, 1), 0),
                                   unsqueeze(transpose(v, 0, 1), 0), 0.0, is_causal, mask,
                                   std::optional<double>(scale));
  auto out_rows = slice(out, 0, row, ql);
  torch::stable::copy_(out_rows, transpose(torch::stable::select(o, 0, 0), 0, 1));
  if (lse.numel() > 0) {
    auto lse_rows = slice(lse, 0, row, ql);
    torch::stable::copy_(lse_rows, transpose(torch::stable::select(l, 0, 0), 0, 1));
  }
}

std::tuple<Tensor, Tensor> prefill_attention_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& cu_seqlens_q_in, const Tensor& cu_seqlens_k_in,
                                                 int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal,
                                                 int64_t window_left, double softcap, bool return_lse,
                                                 int64_t fixed_split_size, const std::optional<Tensor>& sinks) {
  const Tensor cu_seqlens_q = index_layout(cu_seqlens_q_in);
  const Tensor cu_seqlens_k = index_layout(cu_seqlens_k_in);
  const char* op = "prefill_attention";
  validate_prefill_attention(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, true, fixed_split_size, sinks);
  validate_attention_options(op, scale, window_left, softcap);
  validate_max_seqlen(op, max_seqlen_k, "max_seqlen_k");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_on_cpu(*t, op, name);
  check_packed_heads(q, op, "q");
  check_packed_heads(k, op, "k");
  check_packed_heads(v, op, "v");
  check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens(op, cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k");
  auto [out, lse] = make_outputs(q, return_lse);
  const auto cq = host_indices(cu_seqlens_q), ck = host_indices(cu_seqlens_k);
  std::vector<bool> done(cq.size(), false);  // sequences the flash path wrote
  if (fixed_split_size <= 0) {
    for (size_t b = 0; b + 1 < cq.size(); ++b) {
      const int64_t qs = cq[b], ql = cq[b + 1] - qs;
      const int64_t ks = ck[b], kl = ck[b + 1] - ks;
      if (!flash_applies(ql, kl, softcap <= 0 && !sinks.has_value())) continue;
      const Tensor qb = slice(q, 0, qs, ql), kb = slice(k, 0, ks, kl), vb = slice(v, 0, ks, kl);
      if (!all_finite(qb) || !all_finite(kb) || !all_finite(vb)) continue;
      attend_flash(qb, kb, vb, scale, causal, window_left, out, lse, qs);
      done[b] = true;
    }
  }
  prefill_items(op, q, k, v, cq, ck, scale, causal, window_left, softcap, fixed_split_size,
                sinks ? sinks->const_data_ptr<float>() : nullptr, out, lse, done);
  return {out, lse};
}

// Dot product with 16 independent partial sums: vectorisable without reassociation flags.
template <typename CT>
FASTINFER_CPU_INLINE float dot(const float* q, const CT* k, int64_t d) {
  float lanes[16] = {};
  for (int64_t i = 0; i < d; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += q[i + j] * static_cast<float>(k[i + j]);
  return cpu::tree_sum<16>(lanes);
}

constexpr float kUnitScale = 1.0f;

struct DecodeArgs {
  const void* q;        // [rows, Hq, D], heads packed, row stride q_row_stride
  const void* k_cache;  // [NB, BS, Hkv, D]
  const void* v_cache;
  void* out;            // [rows, Hq, D] contiguous
  float* lse;           // [rows, Hq] or nullptr
  const int32_t* block_table;
  int64_t table_stride;
  int64_t q_row_stride;
  int64_t num_q_heads, num_kv_heads, head_dim, block_size;
  float scale, softcap;
  // Dequantisation scales of an fp8 cache (1 for the others): KV head h's is k_scale[h *
  // k_scale_stride] (stride 0: one per tensor, 1: one per KV head).
  const float* k_scale = &kUnitScale;
  const float* v_scale = &kUnitScale;
  int64_t k_scale_stride = 0, v_scale_stride = 0;
  int64_t fixed_split = 0;  // > 0: the deterministic mode (attend_items_fixed)
  const float* sinks = nullptr;  // [num_q_heads] or nullptr
  bool contiguous = false;  // K/V rows are [Tk, Hkv, D] contiguous (prefill_attention), key j of
                            // item it at row it.k_start + j; else paged through block_table
  // Multi-head latent attention (mla_decode_attention): v_cache is k_cache and a key row's first
  // value_dim elements are its value (0: value_dim = head_dim); token_scale (or nullptr) is an
  // fp8 cache's per-token scale, slot s's at token_scale[s], applied to its score and its value.
  int64_t value_dim = 0;
  const float* token_scale = nullptr;
};

// The widest key row the per-row items take: 256 for the paged K/V ops, 576 for a latent cache.
constexpr int64_t kMaxRowDim = 576;

// An fp8 cache's scales (CPU float32, 1 element or one per KV head; validate_kv_cache_scales) into a.
void set_cache_scales(DecodeArgs& a, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  if (k_scale.has_value()) {
    a.k_scale = k_scale->const_data_ptr<float>();
    a.k_scale_stride = k_scale->numel() > 1 ? 1 : 0;
  }
  if (v_scale.has_value()) {
    a.v_scale = v_scale->const_data_ptr<float>();
    a.v_scale_stride = v_scale->numel() > 1 ? 1 : 0;
  }
}

// One query row against the keys [start, end) of sequence b (the caller applies the causal and
// window rules); with `mask`, key j >= mask_key0 is visible only where mask[j - mask_key0] (a tree
// mask row over the trailing keys) and, with `mask_pos` (tree attention with a window), only where
// mask_pos[j - mask_key0] >= pos_lo (the trailing keys' tree positions against the window edge).
struct QueryItem {
  int64_t b, row, start, end;
  const bool* mask = nullptr;
  int64_t mask_key0 = 0;
  const int64_t* mask_pos = nullptr;
  int64_t pos_lo = 0;
  int64_t k_start = 0;  // contiguous K/V only: row of the sequence's key 0
  // The deterministic mode with a custom mask: the row's keys by rank (its visible keys in index
  // order, attention.h): key j < key_map_lo is key j, key j >= key_map_lo is key key_map_lo +
  // key_map[j - key_map_lo] (the row's visible trailing keys); [start, end) are ranks.
  const int64_t* key_map = nullptr;
  int64_t key_map_lo = 0;
};

// Work items [begin, end) of (query item, KV head): online softmax over the visible keys for the
// `group` query heads of the KV head, kKeys keys at a time (scores first, one rescale per chunk,
// then the V accumulation). D is a multiple of 16 (the ops require 64/128/256).
template <typename QT, typename CT>
FASTINFER_CPU_INLINE void attend_items(const DecodeArgs& a, const QueryItem* items, int64_t begin, int64_t end) {
  constexpr int64_t kKeys = 32;
  constexpr int64_t kMaxGroup = 16;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t d = a.head_dim, hkv = a.num_kv_heads, group = a.num_q_heads / hkv, bs = a.block_size;
  const int64_t dv = a.value_dim > 0 ? a.value_dim : d;
  const int64_t row_stride = hkv * d;
  alignas(64) float acc[kMaxGroup * kMaxRowDim], qf[kMaxGroup * kMaxRowDim], s[kMaxGroup * kKeys], m[kMaxGroup],
      l[kMaxGroup];
  for (int64_t w = begin; w < end; ++w) {
    const QueryItem& it = items[w / hkv];
    const int64_t h = w % hkv;
    const float k_scale = a.k_scale[h * a.k_scale_stride], v_scale = a.v_scale[h * a.v_scale_stride];
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {  // query heads of this KV head, 16 at a time
      const int64_t ng = std::min(kMaxGroup, group - g0);
      const int64_t head0 = h * group + g0;
      const QT* q = static_cast<const QT*>(a.q) + it.row * a.q_row_stride + head0 * d;
      const CT* k_base = static_cast<const CT*>(a.k_cache) + h * d;
      const CT* v_base = static_cast<const CT*>(a.v_cache) + h * d;
      const int32_t* table = a.contiguous ? nullptr : a.block_table + it.b * a.table_stride;
      for (int64_t g = 0; g < ng; ++g) {
        m[g] = kNegInf;
        l[g] = 0;
      }
      for (int64_t i = 0; i < ng * d; ++i) qf[i] = static_cast<float>(q[i]) * (a.scale * k_scale);
      for (int64_t i = 0; i < ng * dv; ++i) acc[i] = 0;
      int64_t rows[kKeys];
      float token_scale[kKeys];
      for (int64_t j0 = it.start; j0 < it.end; j0 += kKeys) {
        const int64_t n = std::min<int64_t>(kKeys, it.end - j0);
        if (table == nullptr) {
          for (int64_t jj = 0; jj < n; ++jj) rows[jj] = (it.k_start + j0 + jj) * row_stride;
        } else {
          for (int64_t jj = 0, blk = j0 / bs, off = j0 % bs; jj < n; ++jj) {  // no division per key
            rows[jj] = (static_cast<int64_t>(table[blk]) * bs + off) * row_stride;
            if (++off == bs) {
              off = 0;
              ++blk;
            }
          }
        }
        if (a.token_scale != nullptr)
          for (int64_t jj = 0; jj < n; ++jj) token_scale[jj] = a.token_scale[rows[jj] / row_stride];
        // Keys the custom mask hides: their scores are -inf before the max and the sum, and their
        // value rows are not read (0 * NaN would reach a row that cannot see a NaN value).
        bool hidden[kKeys] = {};
        if (it.mask != nullptr)
          for (int64_t jj = 0; jj < n; ++jj) {
            const int64_t m = j0 + jj - it.mask_key0;
            hidden[jj] = m >= 0 && (!it.mask[m] || (it.mask_pos != nullptr && it.mask_pos[m] < it.pos_lo));
          }
        for (int64_t g = 0; g < ng; ++g) {
          float* sg = s + g * kKeys;
          for (int64_t jj = 0; jj < n; ++jj) sg[jj] = dot(qf + g * d, k_base + rows[jj], d);
          if (a.token_scale != nullptr)
            for (int64_t jj = 0; jj < n; ++jj) sg[jj] *= token_scale[jj];
          if (a.softcap > 0)
            for (int64_t jj = 0; jj < n; ++jj) sg[jj] = a.softcap * std::tanh(sg[jj] / a.softcap);
          if (it.mask != nullptr)
            for (int64_t jj = 0; jj < n; ++jj)
              if (hidden[jj]) sg[jj] = kNegInf;
          for (int64_t jj = n; jj < kKeys; ++jj) sg[jj] = kNegInf;
          float lanes[kKeys];
          for (int64_t jj = 0; jj < kKeys; ++jj) lanes[jj] = sg[jj];
          const float chunk_max = cpu::tree_max<kKeys>(lanes);
          if (chunk_max == kNegInf) {  // every key of the chunk masked: nothing to add
            for (int64_t jj = 0; jj < kKeys; ++jj) sg[jj] = 0;
            continue;
          }
          if (chunk_max > m[g]) {  // rescale what was accumulated under the old maximum
            const float c = cpu::fast_exp(m[g] - chunk_max);
            l[g] *= c;
            for (int64_t i = 0; i < dv; ++i) acc[g * dv + i] *= c;
            m[g] = chunk_max;
          }
          for (int64_t jj = 0; jj < kKeys; ++jj) lanes[jj] = sg[jj] = cpu::fast_exp(sg[jj] - m[g]);  // masked -> 0
          l[g] += cpu::tree_sum<kKeys>(lanes);
        }
        for (int64_t jj = 0; jj < n; ++jj) {
          if (hidden[jj]) continue;
          const CT* v = v_base + rows[jj];
          const float vs = a.token_scale != nullptr ? v_scale * token_scale[jj] : v_scale;
          for (int64_t g = 0; g < ng; ++g) {
            const float pv = s[g * kKeys + jj] * vs;
            float* acc_g = acc + g * dv;
            for (int64_t i = 0; i < dv; ++i) acc_g[i] += pv * static_cast<float>(v[i]);
          }
        }
      }
      QT* out = static_cast<QT*>(a.out) + (it.row * a.num_q_heads + head0) * dv;
      for (int64_t g = 0; g < ng; ++g) {
        // No visible key (l == 0): zeros, lse = -inf. A NaN score or value seen: l or acc is NaN
        // (tree_max keeps a NaN score, exp(NaN) reaches l), and so are out and lse.
        float inv = l[g] == 0 ? 0.0f : 1.0f / l[g];
        float lse = l[g] == 0 ? kNegInf : m[g] + std::log(l[g]);
        if (a.sinks != nullptr) {
          const SinkMerge w = merge_sink(lse, a.sinks[head0 + g]);
          inv *= w.weight;
          lse = w.lse;
        }
        for (int64_t i = 0; i < dv; ++i) out[g * dv + i] = static_cast<QT>(acc[g * dv + i] * inv);
        if (a.lse != nullptr) a.lse[it.row * a.num_q_heads + head0 + g] = lse;
      }
    }
  }
}

// The deterministic mode (fixed_split > 0): the one per-row routine of all three ops. A row's
// keys are reduced in chunks [c * F, (c + 1) * F) from absolute key 0 (F = fixed_split, a
// multiple of kKeys), each chunk by an online softmax over kKeys-key tiles aligned at absolute
// multiples of kKeys (keys outside [start, end) or hidden by the mask score -inf and add exact
// zeros), and the chunks' (out, lse) are merged left to right. Under a custom mask the keys are
// taken by rank (QueryItem::key_map: a tree row's ancestors at the indices they have in a plain
// sequence). The arithmetic of a row therefore depends only on its query and its visible keys in
// order: not on which op built the item, the batch, q_len, the tree around it or where the item's
// [start, end) was cut.
template <typename QT, typename CT>
FASTINFER_CPU_INLINE void attend_items_fixed(const DecodeArgs& a, const QueryItem* items, int64_t begin, int64_t end) {
  constexpr int64_t kKeys = 32;
  constexpr int64_t kMaxGroup = 16;  // query heads of a KV head done together: one K/V row read each
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t d = a.head_dim, hkv = a.num_kv_heads, group = a.num_q_heads / hkv, bs = a.block_size;
  const int64_t row_stride = hkv * d, split = a.fixed_split;
  const int64_t dv = a.value_dim > 0 ? a.value_dim : d;
  // Per head g of the group: its query, chunk accumulators (acc, m, l), merged state (st, st_lse)
  // and tile scores. Every head runs the same sequence of operations on its own arrays as it would
  // alone, so grouping changes no bits.
  alignas(64) float acc[kMaxGroup * kMaxRowDim], qf[kMaxGroup * kMaxRowDim], st[kMaxGroup * kMaxRowDim],
      s[kMaxGroup * kKeys];
  alignas(64) float lanes[kKeys];
  float token_scale[kKeys];
  float m[kMaxGroup], l[kMaxGroup], st_lse[kMaxGroup];
  bool seen[kMaxGroup];
  int64_t rows[kKeys];
  for (int64_t w = begin; w < end; ++w) {
    const QueryItem& it = items[w / hkv];
    const int64_t h = w % hkv;
    const float k_scale = a.k_scale[h * a.k_scale_stride], v_scale = a.v_scale[h * a.v_scale_stride];
    const CT* k_base = static_cast<const CT*>(a.k_cache) + h * d;
    const CT* v_base = static_cast<const CT*>(a.v_cache) + h * d;
    const int32_t* table = a.contiguous ? nullptr : a.block_table + it.b * a.table_stride;
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      const int64_t ng = std::min(kMaxGroup, group - g0);
      const int64_t head0 = h * group + g0;
      const QT* q = static_cast<const QT*>(a.q) + it.row * a.q_row_stride + head0 * d;
      for (int64_t i = 0; i < ng * d; ++i) qf[i] = static_cast<float>(q[i]) * (a.scale * k_scale);
      for (int64_t i = 0; i < ng * dv; ++i) st[i] = 0;
      for (int64_t g = 0; g < ng; ++g) st_lse[g] = kNegInf;  // merged state of the chunks so far
      for (int64_t c0 = it.start > 0 ? it.start / split * split : 0; c0 < it.end; c0 += split) {
        const int64_t c1 = std::min(c0 + split, it.end);
        for (int64_t g = 0; g < ng; ++g) {
          m[g] = kNegInf;
          l[g] = 0;
        }
        for (int64_t i = 0; i < ng * dv; ++i) acc[i] = 0;
        for (int64_t j0 = std::max(c0, it.start / kKeys * kKeys); j0 < c1; j0 += kKeys) {
          const int64_t n = std::min<int64_t>(kKeys, c1 - j0);
          for (int64_t jj = 0; jj < n; ++jj) {
            int64_t j = j0 + jj;
            if (it.key_map != nullptr && j >= it.key_map_lo) j = it.key_map_lo + it.key_map[j - it.key_map_lo];
            rows[jj] = table != nullptr ? (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * row_stride
                                        : (it.k_start + j) * row_stride;
          }
          if (a.token_scale != nullptr)
            for (int64_t jj = 0; jj < n; ++jj) token_scale[jj] = a.token_scale[rows[jj] / row_stride];
          // Keys of the tile the row does not see (before its start, or hidden by the mask): -inf
          // scores, value rows not read (as attend_items).
          bool hidden[kKeys];
          for (int64_t jj = 0; jj < n; ++jj) {
            const int64_t mk = j0 + jj - it.mask_key0;
            hidden[jj] = j0 + jj < it.start ||
                         (it.mask != nullptr && mk >= 0 &&
                          (!it.mask[mk] || (it.mask_pos != nullptr && it.mask_pos[mk] < it.pos_lo)));
          }
          for (int64_t g = 0; g < ng; ++g) {
            float* sg = s + g * kKeys;
            for (int64_t jj = 0; jj < n; ++jj) sg[jj] = dot(qf + g * d, k_base + rows[jj], d);
            if (a.token_scale != nullptr)
              for (int64_t jj = 0; jj < n; ++jj) sg[jj] *= token_scale[jj];
            if (a.softcap > 0)
              for (int64_t jj = 0; jj < n; ++jj) sg[jj] = a.softcap * std::tanh(sg[jj] / a.softcap);
            for (int64_t jj = 0; jj < n; ++jj)
              if (hidden[jj]) sg[jj] = kNegInf;
            for (int64_t jj = n; jj < kKeys; ++jj) sg[jj] = kNegInf;
            for (int64_t jj = 0; jj < kKeys; ++jj) lanes[jj] = sg[jj];
            const float tile_max = cpu::tree_max<kKeys>(lanes);
            seen[g] = tile_max != kNegInf;
            if (!seen[g]) continue;  // nothing visible in this tile: the identity for this head
            if (tile_max > m[g]) {
              const float r = cpu::fast_exp(m[g] - tile_max);
              l[g] *= r;
              for (int64_t i = 0; i < dv; ++i) acc[g * dv + i] *= r;
              m[g] = tile_max;
            }
            for (int64_t jj = 0; jj < kKeys; ++jj) lanes[jj] = sg[jj] = cpu::fast_exp(sg[jj] - m[g]);
            l[g] += cpu::tree_sum<kKeys>(lanes);
          }
          for (int64_t jj = 0; jj < n; ++jj) {
            if (hidden[jj]) continue;
            const CT* v = v_base + rows[jj];
            const float vs = a.token_scale != nullptr ? v_scale * token_scale[jj] : v_scale;
            for (int64_t g = 0; g < ng; ++g) {
              if (!seen[g]) continue;
              const float pv = s[g * kKeys + jj] * vs;
              float* acc_g = acc + g * dv;
              for (int64_t i = 0; i < dv; ++i) acc_g[i] += pv * static_cast<float>(v[i]);
            }
          }
        }
        for (int64_t g = 0; g < ng; ++g) {
          if (l[g] == 0) continue;  // an empty chunk merges as the identity (a NaN one as NaN)
          float* st_g = st + g * dv;
          const float* acc_g = acc + g * dv;
          const float inv = 1.0f / l[g], lse_c = m[g] + std::log(l[g]);
          if (st_lse[g] == kNegInf) {
            for (int64_t i = 0; i < dv; ++i) st_g[i] = acc_g[i] * inv;
            st_lse[g] = lse_c;
            continue;
          }
          const float mx = std::max(st_lse[g], lse_c);
          const float ea = std::exp(st_lse[g] - mx), eb = std::exp(lse_c - mx), sum = ea + eb;
          const float wa = ea / sum, wb = eb / sum;
          for (int64_t i = 0; i < dv; ++i) st_g[i] = wa * st_g[i] + wb * (acc_g[i] * inv);
          st_lse[g] = mx + std::log(sum);
        }
      }
      if (a.sinks != nullptr)  // the sink after the last chunk
        for (int64_t g = 0; g < ng; ++g) {
          const SinkMerge w = merge_sink(st_lse[g], a.sinks[head0 + g]);
          for (int64_t i = 0; i < dv; ++i) st[g * dv + i] *= w.weight;
          st_lse[g] = w.lse;
        }
      QT* out = static_cast<QT*>(a.out) + (it.row * a.num_q_heads + head0) * dv;
      for (int64_t i = 0; i < ng * dv; ++i) out[i] = static_cast<QT>(st[i]);
      if (a.lse != nullptr)
        for (int64_t g = 0; g < ng; ++g) a.lse[it.row * a.num_q_heads + head0 + g] = st_lse[g];
    }
  }
}

// One ISA-cloned entry per (query dtype, cache dtype): target_clones does not apply to templates.
using AttendEntry = void (*)(const DecodeArgs&, const QueryItem*, int64_t, int64_t);
#define FASTINFER_ATTEND_ENTRY(NAME, QT, CT)                                                 \
  FASTINFER_CPU_CLONES void NAME(const DecodeArgs& a, const QueryItem* items, int64_t begin, \
                                 int64_t end) {                                              \
    if (a.fixed_split > 0) {                                                                 \
      attend_items_fixed<QT, CT>(a, items, begin, end);                                      \
    } else {                                                                                 \
      attend_items<QT, CT>(a, items, begin, end);                                            \
    }                                                                                        \
  }
FASTINFER_ATTEND_ENTRY(attend_f32, float, float)
FASTINFER_ATTEND_ENTRY(attend_f16, Half, Half)
FASTINFER_ATTEND_ENTRY(attend_bf16, BFloat16, BFloat16)
FASTINFER_ATTEND_ENTRY(attend_f32_fp8, float, Float8_e4m3fn)
FASTINFER_ATTEND_ENTRY(attend_f16_fp8, Half, Float8_e4m3fn)
FASTINFER_ATTEND_ENTRY(attend_bf16_fp8, BFloat16, Float8_e4m3fn)
#undef FASTINFER_ATTEND_ENTRY

AttendEntry attend_entry(const char* op, ScalarType q_dtype, ScalarType cache_dtype) {
  const bool fp8 = cache_dtype == kFloat8_e4m3fn;
  switch (q_dtype) {
    case kFloat: return fp8 ? attend_f32_fp8 : attend_f32;
    case kHalf: return fp8 ? attend_f16_fp8 : attend_f16;
    case kBFloat16: return fp8 ? attend_bf16_fp8 : attend_bf16;
    default: FI_CHECK(false, op, "q must be float32, float16 or bfloat16, got ", q_dtype);
  }
  return nullptr;
}

// Runs the items over torch's thread pool (an item reads ~len * D * 2 cache elements per KV head).
void run_items(const char* op, const Tensor& q, const Tensor& k_cache, const DecodeArgs& a,
               const std::vector<QueryItem>& items) {
  const AttendEntry entry = attend_entry(op, q.scalar_type(), k_cache.scalar_type());
  torch::stable::parallel_for(0, static_cast<int64_t>(items.size()) * a.num_kv_heads, 1,
                   [&](int64_t begin, int64_t end) { entry(a, items.data(), begin, end); });
}

// prefill_attention through the per-row items (the deterministic mode: every row; else the
// sequences the flash path did not take), reading the contiguous K/V rows of their sequence.
void prefill_items(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                   const std::vector<int64_t>& cq, const std::vector<int64_t>& ck, double scale, bool causal,
                   int64_t window_left, double softcap, int64_t fixed_split, const float* sinks, Tensor& out,
                   Tensor& lse, const std::vector<bool>& done) {
  std::vector<QueryItem> items;
  for (size_t b = 0; b + 1 < cq.size(); ++b) {
    if (done[b]) continue;
    const int64_t qs = cq[b], ql = cq[b + 1] - qs, kl = ck[b + 1] - ck[b];
    for (int64_t i = 0; i < ql; ++i) {
      const int64_t p = kl - ql + i;
      QueryItem it{static_cast<int64_t>(b), qs + i, window_left >= 0 ? std::max<int64_t>(0, p - window_left) : 0,
                   causal ? std::min(kl, std::max<int64_t>(0, p + 1)) : kl};
      it.k_start = ck[b];
      items.push_back(it);
    }
  }
  if (items.empty()) return;
  const auto kc = torch::stable::contiguous(k), vc = torch::stable::contiguous(v);
  DecodeArgs a{q.const_data_ptr(), kc.const_data_ptr(), vc.const_data_ptr(), out.mutable_data_ptr(),
               lse.numel() > 0 ? lse.mutable_data_ptr<float>() : nullptr, nullptr, 0, q.stride(0), q.size(1), kc.size(1),
               q.size(2), 1, static_cast<float>(scale), static_cast<float>(softcap)};
  a.fixed_split = fixed_split;
  a.sinks = sinks;
  a.contiguous = true;
  run_items(op, q, kc, a, items);
}

std::tuple<Tensor, Tensor> paged_attention_cpu(const char* op, const Tensor& q, const Tensor& k_cache,
                                                       const Tensor& v_cache, const Tensor& block_table,
                                                       const Tensor& cu_seqlens_q, const Tensor& seq_lens_k,
                                                       bool causal, int64_t window_left, double softcap, double scale,
                                                       const std::optional<Tensor>& custom_mask, bool return_lse,
                                                       int64_t fixed_split, const std::optional<Tensor>& sinks,
                                                       const std::optional<Tensor>& k_scale,
                                                       const std::optional<Tensor>& v_scale,
                                                       int64_t value_dim = 0, const float* token_scale = nullptr) {
  auto [out, lse] = make_outputs(q, return_lse, value_dim);
  const auto cq = host_indices(cu_seqlens_q), lens = host_indices(seq_lens_k);
  // Short chunks (speculative verification, small prefill chunks), custom masks and softcap: one
  // decode-style pass per query straight from the paged cache, no gather. Longer ones: the flash
  // kernel on the gathered keys.
  constexpr int64_t kShortChunk = 16;
  std::vector<QueryItem> items;
  Tensor mask_c;
  if (custom_mask.has_value()) mask_c = torch::stable::contiguous(*custom_mask);
  const bool* mask_data = custom_mask.has_value() ? mask_c.const_data_ptr<bool>() : nullptr;
  // Tree attention with a window: tree positions of every query row (by token row).
  std::vector<int64_t> tree_pos;
  if (custom_mask.has_value() && window_left >= 0) tree_pos.resize(static_cast<size_t>(q.size(0)));
  const auto table_c = torch::stable::contiguous(block_table);
  const int32_t* table = table_c.const_data_ptr<int32_t>();
  const int64_t table_w = block_table.size(1);
  // The deterministic mode with a custom mask: each row's visible trailing keys, in index order
  // (its keys by rank; sized once so the items' pointers stay valid).
  std::vector<int64_t> rank_keys;
  if (mask_data != nullptr && fixed_split > 0)
    rank_keys.reserve(static_cast<size_t>(std::count(mask_data, mask_data + mask_c.numel(), true)));
  int64_t mask_offset = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t qs = cq[b], ql = cq[b + 1] - qs, kl = lens[b];
    const int64_t mask_at = mask_offset;
    if (custom_mask.has_value()) mask_offset += ql * ql;
    const bool* rows = mask_data != nullptr ? mask_data + mask_at : nullptr;
    if (fixed_split > 0 && rows != nullptr) {  // deterministic tree rows: keys by rank (attention.h)
      const int64_t prefix = kl - ql;
      for (int64_t i = 0; i < ql; ++i) {
        const int64_t first = static_cast<int64_t>(rank_keys.size());
        for (int64_t m = 0; m < ql; ++m)
          if (rows[i * ql + m]) rank_keys.push_back(m);
        const int64_t count = static_cast<int64_t>(rank_keys.size()) - first;
        const int64_t p = prefix + count - 1;  // the query's position: its rank (tree depth)
        QueryItem it{static_cast<int64_t>(b), qs + i, window_left >= 0 ? std::max<int64_t>(0, p - window_left) : 0,
                     prefix + count};
        it.key_map = rank_keys.data() + first;
        it.key_map_lo = prefix;
        items.push_back(it);
      }
      continue;
    }
    const bool plain = softcap <= 0 && rows == nullptr && !sinks.has_value() && !k_scale.has_value() && value_dim == 0;
    if (ql > kShortChunk && fixed_split <= 0 && flash_applies(ql, kl, plain)) {
      const int32_t* row = table + static_cast<int64_t>(b) * table_w;
      const Tensor qb = slice(q, 0, qs, ql), kb = gather_paged(k_cache, row, kl), vb = gather_paged(v_cache, row, kl);
      if (all_finite(qb) && all_finite(kb) && all_finite(vb)) {
        attend_flash(qb, kb, vb, scale, causal, window_left, out, lse, qs);
        continue;
      }
    }
    const bool tree_window = rows != nullptr && window_left >= 0;
    if (tree_window)  // node i: prefix + depth, depth = (trailing keys its row sees) - 1
      for (int64_t i = 0; i < ql; ++i)
        tree_pos[qs + i] = (kl - ql - 1) + std::count(rows + i * ql, rows + (i + 1) * ql, true);
    for (int64_t i = 0; i < ql; ++i) {
      const int64_t p = tree_window ? tree_pos[qs + i] : kl - ql + i;  // the query's position
      // A window cuts prefix keys by index; every trailing key is scanned (the tree-window test
      // is by position, per key, in attend_items).
      const int64_t lo = tree_window ? std::min(kl - ql, p - window_left) : p - window_left;
      QueryItem it{static_cast<int64_t>(b), qs + i, window_left >= 0 ? std::max<int64_t>(0, lo) : 0,
                   causal && rows == nullptr ? p + 1 : kl};
      if (rows != nullptr) {
        it.mask = rows + i * ql;
        it.mask_key0 = kl - ql;
      }
      if (tree_window) {
        it.mask_pos = tree_pos.data() + qs;
        it.pos_lo = p - window_left;
      }
      items.push_back(it);
    }
  }
  if (!items.empty()) {
    DecodeArgs a{q.const_data_ptr(), k_cache.const_data_ptr(), v_cache.const_data_ptr(), out.mutable_data_ptr(),
                 return_lse ? lse.mutable_data_ptr<float>() : nullptr, table, table_w,
                 q.stride(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                 static_cast<float>(scale), static_cast<float>(softcap)};
    a.fixed_split = fixed_split;
    a.sinks = sinks ? sinks->const_data_ptr<float>() : nullptr;
    set_cache_scales(a, k_scale, v_scale);
    a.value_dim = value_dim;
    a.token_scale = token_scale;
    run_items(op, q, k_cache, a, items);
  }
  return {out, lse};
}

void check_paged_inputs_on_cpu(const char* op, const Tensor& q, const Tensor& k_cache,
                               const Tensor& v_cache, const Tensor& block_table) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_table, "block_table"}})
    check_on_cpu(*t, op, name);
  check_packed_heads(q, op, "q");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
}

// The bool form of a bit-packed custom mask (entry e = bit e % 8 of byte e / 8).
Tensor unpack_custom_mask(const Tensor& packed, int64_t entries) {
  const auto bytes = torch::stable::contiguous(packed);
  const uint8_t* src = bytes.const_data_ptr<uint8_t>();
  auto mask = empty_on(bytes, {entries}, kBool);
  bool* dst = mask.mutable_data_ptr<bool>();
  for (int64_t e = 0; e < entries; ++e) dst[e] = ((src[e >> 3] >> (e & 7)) & 1) != 0;
  return mask;
}

std::tuple<Tensor, Tensor> paged_prefill_attention_cpu(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table_in,
    const Tensor& cu_seqlens_q_in, const Tensor& seq_lens_k_in, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<Tensor>& custom_mask, bool return_lse,
    const std::optional<Tensor>& packed_custom_mask, int64_t fixed_split_size, const std::optional<Tensor>& sinks,
    const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  const Tensor block_table = index_layout(block_table_in);
  const Tensor cu_seqlens_q = index_layout(cu_seqlens_q_in);
  const Tensor seq_lens_k = index_layout(seq_lens_k_in);
  const char* op = "paged_prefill_attention";
  validate_paged_prefill_attention(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                                   custom_mask, packed_custom_mask, true, fixed_split_size, sinks, k_scale, v_scale);
  validate_attention_options(op, scale, window_left, softcap);
  check_paged_inputs_on_cpu(op, q, k_cache, v_cache, block_table);
  check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  check_paged_indices(op, block_table, seq_lens_k, "seq_lens_k", k_cache.size(0), k_cache.size(1), &cu_seqlens_q);
  if (custom_mask.has_value()) check_custom_mask_size(op, *custom_mask, cu_seqlens_q);
  std::optional<Tensor> mask = custom_mask;
  if (packed_custom_mask.has_value()) {
    check_on_cpu(*packed_custom_mask, op, "packed_custom_mask");
    check_packed_custom_mask_size(op, *packed_custom_mask, cu_seqlens_q);
    mask = unpack_custom_mask(*packed_custom_mask, custom_mask_entries(cu_seqlens_q));
  }
  return paged_attention_cpu(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, causal, window_left,
                             softcap, scale, mask, return_lse, fixed_split_size, sinks, k_scale, v_scale);
}

std::tuple<Tensor, Tensor> paged_decode_attention_cpu(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table_in,
    const Tensor& seq_lens_in, double scale, int64_t window_left, double softcap, int64_t num_splits,
    bool return_lse, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
    int64_t fixed_split_size, const std::optional<Tensor>& sinks) {
  const Tensor block_table = index_layout(block_table_in);
  const Tensor seq_lens = index_layout(seq_lens_in);
  const char* op = "paged_decode_attention";
  validate_paged_decode_attention(op, q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale, true,
                                  fixed_split_size, sinks);
  validate_attention_options(op, scale, window_left, softcap);
  check_paged_inputs_on_cpu(op, q, k_cache, v_cache, block_table);
  check_paged_indices(op, block_table, seq_lens, "seq_lens", k_cache.size(0), k_cache.size(1), nullptr);
  auto out = empty_as(q);
  auto lse = return_lse ? empty_on(q, {q.size(0), q.size(1)}, kFloat)
                        : empty_on(q, {0}, kFloat);
  const auto lens = to_cpu(seq_lens, kLong);
  const auto table = torch::stable::contiguous(block_table);
  DecodeArgs a{q.const_data_ptr(), k_cache.const_data_ptr(), v_cache.const_data_ptr(), out.data_ptr(),
               return_lse ? lse.mutable_data_ptr<float>() : nullptr, table.const_data_ptr<int32_t>(), table.size(1),
               q.stride(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
               static_cast<float>(scale), static_cast<float>(softcap)};
  a.fixed_split = fixed_split_size;
  a.sinks = sinks ? sinks->const_data_ptr<float>() : nullptr;
  set_cache_scales(a, k_scale, v_scale);
  std::vector<QueryItem> items(q.size(0));
  const int64_t* len = lens.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b)  // the query is the last token (position len - 1)
    items[b] = {b, b, window_left >= 0 ? std::max<int64_t>(0, len[b] - 1 - window_left) : 0, len[b]};
  run_items(op, q, k_cache, a, items);
  return {out, lse};
}

// mask (per token of `heads` rows, or null): a false entry keeps state a, bit for bit.
template <typename T>
void merge_rows(const T* va, const float* la, const T* vb, const float* lb, T* vo, float* lo, int64_t rows, int64_t d,
                const bool* mask, int64_t heads) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    if (mask != nullptr && !mask[r / heads]) {
      std::copy(va + r * d, va + (r + 1) * d, vo + r * d);
      lo[r] = la[r];
      continue;
    }
    const float a = la[r], b = lb[r], mx = std::isnan(b) ? b : std::max(a, b);  // NaN either side: NaN
    // logaddexp; both -inf: -inf, and the merged value is 0; a NaN: NaN lse, weights and value.
    const float lse = mx == kNegInf ? kNegInf : mx + std::log1p(std::exp(-std::fabs(a - b)));
    const bool none = lse == kNegInf;
    const float wa = none ? 0.0f : std::exp(a - lse), wb = none ? 0.0f : std::exp(b - lse);
    for (int64_t i = 0; i < d; ++i)
      vo[r * d + i] = static_cast<T>(static_cast<float>(va[r * d + i]) * wa + static_cast<float>(vb[r * d + i]) * wb);
    lo[r] = lse;
  }
}

std::tuple<Tensor, Tensor> merge_attention_states_cpu(const Tensor& v_a, const Tensor& lse_a, const Tensor& v_b,
                                                      const Tensor& lse_b, const std::optional<Tensor>& mask) {
  const char* op = "merge_attention_states";
  validate_merge_attention_states(op, v_a, lse_a, v_b, lse_b, mask);
  check_on_cpu(v_a, op, "v_a");
  if (mask.has_value()) check_contiguous(*mask, op, "mask");
  const bool* mk = mask.has_value() ? mask->const_data_ptr<bool>() : nullptr;
  const int64_t heads = std::max<int64_t>(v_a.size(1), 1);
  const auto va = torch::stable::contiguous(v_a), vb = torch::stable::contiguous(v_b);
  const auto la = torch::stable::contiguous(lse_a), lb = torch::stable::contiguous(lse_b);
  auto v = empty_as(va);
  auto lse = empty_as(la);
  const int64_t rows = la.numel(), d = v_a.size(2);
  const float* pa = la.const_data_ptr<float>();
  const float* pb = lb.const_data_ptr<float>();
  float* po = lse.mutable_data_ptr<float>();
  switch (v_a.scalar_type()) {
    case kHalf:
      merge_rows(va.const_data_ptr<Half>(), pa, vb.const_data_ptr<Half>(), pb, v.mutable_data_ptr<Half>(), po, rows, d, mk, heads);
      break;
    case kBFloat16:
      merge_rows(va.const_data_ptr<BFloat16>(), pa, vb.const_data_ptr<BFloat16>(), pb, v.mutable_data_ptr<BFloat16>(),
                 po, rows, d, mk, heads);
      break;
    default:
      merge_rows(va.const_data_ptr<float>(), pa, vb.const_data_ptr<float>(), pb, v.mutable_data_ptr<float>(), po, rows, d, mk, heads);
  }
  return {v, lse};
}

// Multi-head latent attention: the cache as one KV head whose rows are [kv_c | k_pe] (the key) and
// whose first 512 values are the value, through the paged items of paged_prefill_attention.
std::tuple<Tensor, Tensor> mla_decode_attention_cpu(const Tensor& q, const Tensor& kv_cache,
                                                    const Tensor& block_table_in, const Tensor& seq_lens_in,
                                                    const Tensor& cu_seqlens_q_in, double scale, bool causal,
                                                    const std::optional<Tensor>& custom_mask, int64_t num_splits,
                                                    bool return_lse, const std::optional<Tensor>& kv_scale,
                                                    int64_t fixed_split_size) {
  const Tensor block_table = index_layout(block_table_in);
  const Tensor seq_lens = index_layout(seq_lens_in);
  const Tensor cu_seqlens_q = index_layout(cu_seqlens_q_in);
  const char* op = "mla_decode_attention";
  validate_mla_decode_attention(op, q, kv_cache, block_table, seq_lens, cu_seqlens_q, custom_mask, num_splits,
                                kv_scale, fixed_split_size, true);
  validate_attention_options(op, scale, -1, 0.0);
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&kv_cache, "kv_cache"}, {&block_table, "block_table"}})
    check_on_cpu(*t, op, name);
  check_packed_heads(q, op, "q");
  check_contiguous(kv_cache, op, "kv_cache");
  check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), 0, nullptr);
  check_paged_indices(op, block_table, seq_lens, "seq_lens", kv_cache.size(0), kv_cache.size(1), &cu_seqlens_q);
  if (custom_mask.has_value()) check_custom_mask_size(op, *custom_mask, cu_seqlens_q);
  const bool per_token = mla_scale_per_token(kv_scale);
  const auto cache = torch::stable::unsqueeze(kv_cache, 2);  // [NB, BS, 1, 576]
  std::optional<Tensor> tensor_scale;
  if (kv_scale.has_value() && !per_token) tensor_scale = kv_scale;
  return paged_attention_cpu(op, q, cache, cache, block_table, cu_seqlens_q, seq_lens, causal, -1, 0.0, scale,
                             custom_mask, return_lse, fixed_split_size, std::nullopt, tensor_scale, tensor_scale,
                             kMlaLatentDim, per_token ? kv_scale->const_data_ptr<float>() : nullptr);
}

// [kv_c | k_pe] rows into the latent cache; an fp8 cache takes e4m3(clamp(x / scale, -448, 448)),
// the per-token scale max(amax of the 576 values, 1e-12) / 448 written first (fp8_quantize's rule).
template <typename T>
void mla_store_rows(const T* kv_c, int64_t kv_stride, const T* k_pe, int64_t pe_stride, void* cache,
                    ScalarType cache_dtype, const int64_t* slots, int64_t num_tokens, const float* tensor_scale,
                    float* token_scale) {
  torch::stable::parallel_for(0, num_tokens, 32, [&](int64_t b, int64_t e) {
    float row[kMlaRowDim];
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t i = 0; i < kMlaLatentDim; ++i) row[i] = static_cast<float>(kv_c[t * kv_stride + i]);
      for (int64_t i = 0; i < kMlaRopeDim; ++i) row[kMlaLatentDim + i] = static_cast<float>(k_pe[t * pe_stride + i]);
      if (cache_dtype != kFloat8_e4m3fn) {
        T* dst = static_cast<T*>(cache) + slot * kMlaRowDim;
        for (int64_t i = 0; i < kMlaLatentDim; ++i) dst[i] = kv_c[t * kv_stride + i];
        for (int64_t i = 0; i < kMlaRopeDim; ++i) dst[kMlaLatentDim + i] = k_pe[t * pe_stride + i];
        continue;
      }
      float sc = tensor_scale != nullptr ? *tensor_scale : 0.0f;
      if (token_scale != nullptr) {
        float amax = 0.0f;
        bool nan = false;  // a NaN makes the amax, the scale and every code of the row NaN
        for (int64_t i = 0; i < kMlaRowDim; ++i) {
          nan |= std::isnan(row[i]);
          amax = std::max(amax, std::fabs(row[i]));
        }
        if (nan) amax = std::numeric_limits<float>::quiet_NaN();
        sc = token_scale[slot] = scale_from_amax(amax);
      }
      auto* dst = static_cast<Float8_e4m3fn*>(cache) + slot * kMlaRowDim;
      for (int64_t i = 0; i < kMlaRowDim; ++i) dst[i] = to_e4m3(row[i], sc);
    }
  });
}

void mla_cache_write_cpu(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                         const std::optional<Tensor>& kv_scale) {
  const char* op = "mla_cache_write";
  validate_mla_cache_write(op, kv_c, k_pe, kv_cache, slot_mapping, kv_scale, true);
  for (const auto& [t, name] : {std::pair{&kv_c, "kv_c"}, {&k_pe, "k_pe"}, {&kv_cache, "kv_cache"},
                                {&slot_mapping, "slot_mapping"}})
    check_on_cpu(*t, op, name);
  check_mla_cache_write_layout(op, kv_c, k_pe, kv_cache, slot_mapping);
  const int64_t num_slots = kv_cache.size(0) * kv_cache.size(1);
  check_index_range(slot_mapping, -1, num_slots, op, "slot_mapping", "-1 or a slot < num_blocks * block_size");
  const int64_t T = kv_c.size(0);
  if (T == 0) return;
  const auto slots_t = contiguous_as(slot_mapping, kLong);
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  const bool per_token = mla_scale_per_token(kv_scale);
  const float* tensor_scale = kv_scale.has_value() && !per_token ? kv_scale->const_data_ptr<float>() : nullptr;
  float* token_scale = per_token ? kv_scale->mutable_data_ptr<float>() : nullptr;
  const int64_t kv_stride = row_stride_of(kv_c), pe_stride = row_stride_of(k_pe);
  void* cache = kv_cache.mutable_data_ptr();
  switch (kv_c.scalar_type()) {
    case kHalf:
      mla_store_rows(kv_c.const_data_ptr<Half>(), kv_stride, k_pe.const_data_ptr<Half>(), pe_stride, cache,
                     kv_cache.scalar_type(), slots, T, tensor_scale, token_scale);
      break;
    case kBFloat16:
      mla_store_rows(kv_c.const_data_ptr<BFloat16>(), kv_stride, k_pe.const_data_ptr<BFloat16>(), pe_stride, cache,
                     kv_cache.scalar_type(), slots, T, tensor_scale, token_scale);
      break;
    default:
      mla_store_rows(kv_c.const_data_ptr<float>(), kv_stride, k_pe.const_data_ptr<float>(), pe_stride, cache,
                     kv_cache.scalar_type(), slots, T, tensor_scale, token_scale);
  }
}

void move_kv_slots_cpu(Tensor& k_cache, Tensor& v_cache, const Tensor& src_slots, const Tensor& dst_slots) {
  const char* op = "move_kv_slots";
  validate_move_kv_slots(op, k_cache, v_cache, src_slots, dst_slots);
  check_on_cpu(k_cache, op, "k_cache");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(src_slots, 0, num_slots, op, "src_slots", "slots < num_blocks * block_size");
  check_index_range(dst_slots, 0, num_slots, op, "dst_slots", "slots < num_blocks * block_size");
  const auto src = host_indices(src_slots), dst = host_indices(dst_slots);
  if (num_slots == 0 || src.empty()) return;
  // Bytes of one slot: any cache dtype, fp8 included. Every source is read before any
  // destination is written (a move may overwrite another move's source).
  const size_t row = static_cast<size_t>(k_cache.numel() / num_slots) * k_cache.element_size();
  std::vector<unsigned char> staged(row * src.size());
  for (Tensor* cache : {&k_cache, &v_cache}) {
    auto* base = static_cast<unsigned char*>(cache->mutable_data_ptr());
    for (size_t i = 0; i < src.size(); ++i) std::memcpy(staged.data() + i * row, base + src[i] * row, row);
    for (size_t i = 0; i < dst.size(); ++i) std::memcpy(base + dst[i] * row, staged.data() + i * row, row);
  }
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("prefill_attention", TORCH_BOX(&prefill_attention_cpu));
  m.impl("paged_prefill_attention", TORCH_BOX(&paged_prefill_attention_cpu));
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention_cpu));
  m.impl("merge_attention_states", TORCH_BOX(&merge_attention_states_cpu));
  m.impl("move_kv_slots", TORCH_BOX(&move_kv_slots_cpu));
  m.impl("mla_cache_write", TORCH_BOX(&mla_cache_write_cpu));
  m.impl("mla_decode_attention", TORCH_BOX(&mla_decode_attention_cpu));
}
