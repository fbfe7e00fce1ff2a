// CPU implementations of the attention ops (fp32 inside). Prefill: a loop over the sequences of
// the batch with grouped-query matmuls (K/V are never repeated per query head). Decode: a direct
// loop over (sequence, KV head) pairs on ATen's thread pool, reading each paged K/V row once for
// the whole query-head group (no gather, no per-sequence op overhead: the CPU runner's hot path).
// Exact masking rules of the contract; checked against the fp64 reference.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "validate_attention.h"

namespace fastinfer::binding {
namespace {

// Bool [q_len, k_len]: which keys each query sees (see attention.h for the rules).
at::Tensor visibility(int64_t q_len, int64_t k_len, bool causal, int64_t window_left, const at::Tensor* custom) {
  const auto i = at::arange(q_len, at::kLong).unsqueeze(1);
  const auto j = at::arange(k_len, at::kLong).unsqueeze(0);
  const auto pos = i + (k_len - q_len);
  const int64_t prefix = k_len - q_len;
  at::Tensor visible = at::ones({q_len, k_len}, at::kBool);
  if (custom != nullptr) {
    auto tail = at::zeros({q_len, k_len}, at::kBool);
    tail.narrow(1, prefix, q_len).copy_(custom->reshape({q_len, q_len}));
    visible = j.lt(prefix).logical_or(tail);
  } else if (causal) {
    visible = j.le(pos).expand({q_len, k_len});
  }
  if (window_left >= 0) visible = visible.logical_and(j.ge(pos - window_left));
  return visible;
}

// q [q_len, Hq, D], k/v [k_len, Hkv, D] (float32) -> out [q_len, Hq, D], lse [q_len, Hq].
std::pair<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                         double softcap, const at::Tensor& visible) {
  const int64_t q_len = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1), group = hq / hkv;
  // [Hkv, group * q_len, D] x [Hkv, D, k_len]: each KV head serves its group of query heads.
  const auto qg = q.reshape({q_len, hkv, group, d}).permute({1, 2, 0, 3}).reshape({hkv, group * q_len, d});
  auto s = at::bmm(qg, k.permute({1, 2, 0})).mul_(scale).view({hq, q_len, -1});
  if (softcap > 0) s = s.div(softcap).tanh_().mul_(softcap);
  s.masked_fill_(visible.logical_not().unsqueeze(0), -std::numeric_limits<float>::infinity());
  const auto lse = at::logsumexp(s, -1);  // [Hq, q_len]; -inf where nothing is visible
  const auto p = at::where(lse.isfinite().unsqueeze(-1), (s - lse.unsqueeze(-1)).exp(), at::zeros({}, s.options()));
  const auto out = at::bmm(p.view({hkv, group * q_len, -1}), v.permute({1, 0, 2}));  // [Hkv, group * q_len, D]
  return {out.view({hq, q_len, d}).transpose(0, 1), lse.transpose(0, 1)};
}

// The first `length` rows [length, Hkv, D] of sequence b from a paged cache, as float32.
at::Tensor gather_paged(const at::Tensor& cache, const at::Tensor& table_row, int64_t length,
                        const std::optional<at::Tensor>& scale) {
  const int64_t bs = cache.size(1);
  const auto j = at::arange(length, at::kLong);
  const auto slots = table_row.to(at::kLong).index_select(0, j.div(bs, "floor")).mul(bs).add(j.remainder(bs));
  auto rows = cache.view({-1, cache.size(2), cache.size(3)}).index_select(0, slots).to(at::kFloat);
  if (scale.has_value()) rows.mul_(scale->to(at::kFloat).reshape({}));
  return rows;
}

// A small int index tensor as a host vector (read once, not with an .item() per sequence).
std::vector<int64_t> host_indices(const at::Tensor& t) {
  const auto c = t.to(at::kCPU, at::kLong).contiguous();
  return {c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel()};
}

std::tuple<at::Tensor, at::Tensor> make_outputs(const at::Tensor& q, bool return_lse) {
  auto out = at::zeros_like(q, at::MemoryFormat::Contiguous);
  auto lse = return_lse ? at::full({q.size(0), q.size(1)}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat))
                        : at::empty({0}, q.options().dtype(at::kFloat));
  return {out, lse};
}

void store(at::Tensor& out, at::Tensor& lse, int64_t row, const std::pair<at::Tensor, at::Tensor>& result) {
  const int64_t n = result.first.size(0);
  if (n == 0) return;
  out.narrow(0, row, n).copy_(result.first);
  if (lse.numel() > 0) lse.narrow(0, row, n).copy_(result.second);
}

std::tuple<at::Tensor, at::Tensor> prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                         int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                         bool causal, int64_t window_left, double softcap,
                                                         bool return_lse) {
  const char* op = "prefill_attention";
  validate_prefill_attention(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, true);
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_on_cpu(*t, op, name);
  check_packed_heads(q, op, "q");
  check_packed_heads(k, op, "k");
  check_packed_heads(v, op, "v");
  check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens(op, cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k");
  auto [out, lse] = make_outputs(q, return_lse);
  const auto cq = host_indices(cu_seqlens_q), ck = host_indices(cu_seqlens_k);
  const auto qf = q.to(at::kFloat), kf = k.to(at::kFloat), vf = v.to(at::kFloat);
  for (size_t b = 0; b + 1 < cq.size(); ++b) {
    const int64_t qs = cq[b], ql = cq[b + 1] - qs;
    const int64_t ks = ck[b], kl = ck[b + 1] - ks;
    const auto vis = visibility(ql, kl, causal, window_left, nullptr);
    store(out, lse, qs, attend(qf.narrow(0, qs, ql), kf.narrow(0, ks, kl), vf.narrow(0, ks, kl), scale, softcap, vis));
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                                       const at::Tensor& v_cache, const at::Tensor& block_table,
                                                       const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
                                                       bool causal, int64_t window_left, double softcap, double scale,
                                                       const std::optional<at::Tensor>& custom_mask, bool return_lse,
                                                       const std::optional<at::Tensor>& k_scale,
                                                       const std::optional<at::Tensor>& v_scale) {
  auto [out, lse] = make_outputs(q, return_lse);
  const auto cq = host_indices(cu_seqlens_q), lens = host_indices(seq_lens_k);
  const auto qf = q.to(at::kFloat);
  int64_t mask_offset = 0;
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t qs = cq[b], ql = cq[b + 1] - qs, kl = lens[b];
    at::Tensor mask;
    if (custom_mask.has_value()) {
      mask = custom_mask->narrow(0, mask_offset, ql * ql);
      mask_offset += ql * ql;
    }
    const auto vis = visibility(ql, kl, causal, window_left, custom_mask.has_value() ? &mask : nullptr);
    const auto kb = gather_paged(k_cache, block_table[static_cast<int64_t>(b)], kl, k_scale);
    const auto vb = gather_paged(v_cache, block_table[static_cast<int64_t>(b)], kl, v_scale);
    store(out, lse, qs, attend(qf.narrow(0, qs, ql), kb, vb, scale, softcap, vis));
  }
  return {out, lse};
}

void check_paged_inputs_on_cpu(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_table) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&block_table, "block_table"}})
    check_on_cpu(*t, op, name);
  check_packed_heads(q, op, "q");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  check_contiguous(block_table, op, "block_table");
}

std::tuple<at::Tensor, at::Tensor> paged_prefill_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& custom_mask, bool return_lse) {
  const char* op = "paged_prefill_attention";
  validate_paged_prefill_attention(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_q,
                                   window_left, custom_mask, true);
  check_paged_inputs_on_cpu(op, q, k_cache, v_cache, block_table);
  check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  check_paged_indices(op, block_table, seq_lens_k, "seq_lens_k", k_cache.size(0), k_cache.size(1), &cu_seqlens_q);
  if (custom_mask.has_value()) check_custom_mask_size(op, *custom_mask, cu_seqlens_q);
  return paged_attention_cpu(op, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, causal, window_left,
                             softcap, scale, custom_mask, return_lse, std::nullopt, std::nullopt);
}

// Dot product with 8 independent partial sums: vectorisable without reassociation flags.
template <typename CT>
inline float dot(const float* q, const CT* k, int64_t d) {
  float lanes[8] = {};
  for (int64_t i = 0; i < d; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += q[i + j] * static_cast<float>(k[i + j]);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// One (sequence, KV head): online softmax over the visible keys for the `group` query heads,
// kKeys keys at a time (scores first, one rescale per chunk, then the V accumulation).
template <typename QT, typename CT>
void decode_one(const QT* q, const CT* k_cache, const CT* v_cache, const int32_t* table_row, int64_t len,
                int64_t block_size, int64_t row_stride, int64_t group, int64_t d, float scale, float softcap,
                int64_t window_left, float k_scale, float v_scale, QT* out, float* lse, std::vector<float>& buf) {
  constexpr int64_t kKeys = 32;
  buf.assign(group * d * 2 + group * kKeys + 2 * group, 0.0f);
  float* acc = buf.data();           // [group, d]
  float* qf = acc + group * d;       // [group, d]
  float* s = qf + group * d;         // [group, kKeys]
  float* m = s + group * kKeys;      // [group]
  float* l = m + group;              // [group]
  for (int64_t g = 0; g < group; ++g) m[g] = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < group * d; ++i) qf[i] = static_cast<float>(q[i]) * scale * k_scale;
  const CT* rows[kKeys];
  const int64_t start = window_left >= 0 ? std::max<int64_t>(0, len - 1 - window_left) : 0;
  for (int64_t j0 = start; j0 < len; j0 += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, len - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = j0 + jj;
      rows[jj] = k_cache + (static_cast<int64_t>(table_row[j / block_size]) * block_size + j % block_size) * row_stride;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * kKeys;
      float chunk_max = -std::numeric_limits<float>::infinity();
      for (int64_t jj = 0; jj < n; ++jj) {
        float x = dot(qf + g * d, rows[jj], d);
        if (softcap > 0) x = softcap * std::tanh(x / softcap);
        sg[jj] = x;
        chunk_max = std::max(chunk_max, x);
      }
      if (chunk_max > m[g]) {  // rescale what was accumulated under the old maximum
        const float c = std::exp(m[g] - chunk_max);
        l[g] *= c;
        for (int64_t i = 0; i < d; ++i) acc[g * d + i] *= c;
        m[g] = chunk_max;
      }
      for (int64_t jj = 0; jj < n; ++jj) {
        sg[jj] = std::exp(sg[jj] - m[g]);
        l[g] += sg[jj];
      }
    }
    for (int64_t jj = 0; jj < n; ++jj) {
      const CT* v = v_cache + (rows[jj] - k_cache);
      for (int64_t g = 0; g < group; ++g) {
        const float pv = s[g * kKeys + jj] * v_scale;
        float* a = acc + g * d;
        for (int64_t i = 0; i < d; ++i) a[i] += pv * static_cast<float>(v[i]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = l[g] > 0 ? 1.0f / l[g] : 0.0f;  // no visible key: zeros, lse = -inf
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = static_cast<QT>(acc[g * d + i] * inv);
    if (lse != nullptr) lse[g] = l[g] > 0 ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
  }
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, double scale, int64_t window_left, double softcap, int64_t num_splits,
    bool return_lse, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const char* op = "paged_decode_attention";
  validate_paged_decode_attention(op, q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale, true);
  check_paged_inputs_on_cpu(op, q, k_cache, v_cache, block_table);
  check_paged_indices(op, block_table, seq_lens, "seq_lens", k_cache.size(0), k_cache.size(1), nullptr);
  auto [out, lse] = make_outputs(q, return_lse);
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2), group = hq / hkv;
  const auto qc = q.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto table = block_table.contiguous();
  const float ks = k_scale ? k_scale->item<float>() : 1.0f, vs = v_scale ? v_scale->item<float>() : 1.0f;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    using QT = scalar_t;
    auto run = [&](auto cache_tag) {
      using CT = decltype(cache_tag);
      const CT* kp = reinterpret_cast<const CT*>(k_cache.const_data_ptr());
      const CT* vp = reinterpret_cast<const CT*>(v_cache.const_data_ptr());
      at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> acc;
        for (int64_t w = begin; w < end; ++w) {
          const int64_t b = w / hkv, h = w % hkv;
          decode_one<QT, CT>(qc.const_data_ptr<QT>() + (b * hq + h * group) * d, kp + h * d, vp + h * d,
                             table.const_data_ptr<int32_t>() + b * table.size(1), lens.const_data_ptr<int32_t>()[b],
                             k_cache.size(1), hkv * d, group, d, static_cast<float>(scale),
                             static_cast<float>(softcap), window_left, ks, vs,
                             out.data_ptr<QT>() + (b * hq + h * group) * d,
                             lse.numel() > 0 ? lse.data_ptr<float>() + b * hq + h * group : nullptr, acc);
        }
      });
    };
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
      run(c10::Float8_e4m3fn());
    else
      run(QT());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& v_a, const at::Tensor& lse_a,
                                                              const at::Tensor& v_b, const at::Tensor& lse_b) {
  const char* op = "merge_attention_states";
  validate_merge_attention_states(op, v_a, lse_a, v_b, lse_b);
  check_on_cpu(v_a, op, "v_a");
  const auto lse = at::logaddexp(lse_a, lse_b);
  const auto finite = lse.isfinite();
  const auto zero = at::zeros({}, lse.options());
  const auto wa = at::where(finite, (lse_a - lse).exp(), zero).unsqueeze(-1);
  const auto wb = at::where(finite, (lse_b - lse).exp(), zero).unsqueeze(-1);
  return {(v_a.to(at::kFloat) * wa + v_b.to(at::kFloat) * wb).to(v_a.scalar_type()), lse};
}

void move_kv_slots_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& src_slots,
                       const at::Tensor& dst_slots) {
  const char* op = "move_kv_slots";
  validate_move_kv_slots(op, k_cache, v_cache, src_slots, dst_slots);
  check_on_cpu(k_cache, op, "k_cache");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(src_slots, 0, num_slots, op, "src_slots", "slots < num_blocks * block_size");
  check_index_range(dst_slots, 0, num_slots, op, "dst_slots", "slots < num_blocks * block_size");
  const auto src = src_slots.to(at::kLong), dst = dst_slots.to(at::kLong);
  for (at::Tensor* cache : {&k_cache, &v_cache}) {
    auto flat = cache->view(at::kByte).view({num_slots, -1});  // bytes: any cache dtype, fp8 included
    flat.index_copy_(0, dst, flat.index_select(0, src));        // index_select copies: sources read first
  }
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, CPU, m) {
  using namespace fastinfer::binding;
  m.impl("prefill_attention", &prefill_attention_cpu);
  m.impl("paged_prefill_attention", &paged_prefill_attention_cpu);
  m.impl("paged_decode_attention", &paged_decode_attention_cpu);
  m.impl("merge_attention_states", &merge_attention_states_cpu);
  m.impl("move_kv_slots", &move_kv_slots_cpu);
}
