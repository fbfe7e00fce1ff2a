// CPU implementations of the MoE ops. moe_topk: fp32 with the arithmetic of the kernel
// (moe/routing.h): the same selection order (exact: it compares the inputs) and the same
// exponentials and divisions, summed serially; one row per task on ATen's thread pool. moe_align:
// a counting sort of the slots, serial (it is integer bookkeeping over T * top_k ids). fused_moe:
// the slots grouped by expert, two batch-invariant GEMMs per expert (gemm_dense's), then each
// token's weighted sum in slot order (moe/fused_moe.h). fused_moe_fp8: the same with the GEMM
// inputs quantised to e4m3 and dequantised back (x per row or per 128-group, a per 64-group, the
// rule of gemm/fp8.h) and each expert's weights dequantised to fp32 with its scales. fused_moe_int4: each
// expert's weights decoded and dequantised as int4_gemm's CPU path does (rounded to x's dtype).
// fused_moe_fp4: each expert's weights decoded as fp4_gemm's CPU path does, h and y divided by the
// expert's global scales in fp32 before the biases.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"
#include "gemm_dense/batch_invariant_mm.h"
#include "gemm_fp4/decode_cpu.h"
#include "gemm_fp8/e4m3_cpu.h"
#include "gemm_int4/dequantize_cpu.h"
#include "moe/contract.h"

namespace fastinfer::binding {
namespace {

// Descending logit, ties to the lower expert, NaN before every number (as torch.topk).
bool ranks_before(const float* x, int32_t a, int32_t b) {
  const bool nan_a = std::isnan(x[a]), nan_b = std::isnan(x[b]);
  if (nan_a != nan_b) return nan_a;
  if (!nan_a && x[a] != x[b]) return x[a] > x[b];
  return a < b;
}

template <typename T>
void moe_topk_rows(const T* logits, int64_t num_tokens, int64_t E, int64_t k, bool renormalize,
                   MoeScoring scoring, float* weights, int32_t* ids) {
  torch::stable::parallel_for(0, num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < E; ++e) x[e] = static_cast<float>(logits[t * E + e]);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int32_t a, int32_t b) { return ranks_before(x.data(), a, b); });
      float* w = weights + t * k;
      const float shift = x[order[0]];  // the row max, or NaN (then every weight is NaN)
      float row_sum = 1.f;              // softmax: the denominator over all E (NaN ones included)
      if (scoring == MoeScoring::kSoftmax) {
        row_sum = 0.f;
        for (int64_t e = 0; e < E; ++e) row_sum += std::exp(x[e] - shift);
      }
      float selected_sum = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        w[j] = std::exp(x[order[j]] - shift);
        if (scoring == MoeScoring::kSoftmax) w[j] = w[j] / row_sum;
        selected_sum += w[j];
        ids[t * k + j] = order[j];
      }
      if (scoring == MoeScoring::kTopkSoftmax || renormalize)
        for (int64_t j = 0; j < k; ++j) w[j] = w[j] / selected_sum;
    }
  });
}

std::tuple<Tensor, Tensor> moe_topk_cpu(const Tensor& router_logits, int64_t top_k, bool renormalize,
                                        std::string_view scoring_str) {
  const char* op = "moe_topk";
  const MoeScoring scoring = validate_moe_topk(op, router_logits, top_k, renormalize, scoring_str);
  check_on_cpu(router_logits, op, "router_logits");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  auto weights = empty_on(router_logits, {T, top_k}, kFloat);
  auto ids = empty_on(router_logits, {T, top_k}, kInt);
  if (T > 0) {
    FASTINFER_DISPATCH_FLOAT_TYPES(router_logits.scalar_type(), "moe_topk", [&] {
      moe_topk_rows<scalar_t>(router_logits.const_data_ptr<scalar_t>(), T, E, top_k, renormalize, scoring,
                              weights.mutable_data_ptr<float>(), ids.mutable_data_ptr<int32_t>());
    });
  }
  return {weights, ids};
}

std::tuple<Tensor, Tensor, Tensor> moe_align_cpu(const Tensor& topk_ids, int64_t num_experts, int64_t block_m) {
  const char* op = "moe_align";
  validate_moe_align(op, topk_ids, num_experts, block_m);
  check_on_cpu(topk_ids, op, "topk_ids");
  const int64_t num_slots = topk_ids.numel();
  const int64_t sorted_size = moe_align_sorted_size(num_slots, num_experts, block_m);
  const int64_t num_blocks = (sorted_size + block_m - 1) / block_m;
  const auto ids = host_indices(topk_ids);
  std::vector<int64_t> offset(static_cast<size_t>(num_experts) + 1, 0);  // padded group starts
  for (int64_t id : ids)
    if (id >= 0) ++offset[id + 1];
  for (int64_t e = 0; e < num_experts; ++e)
    offset[e + 1] = offset[e] + (offset[e + 1] + block_m - 1) / block_m * block_m;
  auto sorted_t = full_on(topk_ids, {sorted_size}, static_cast<double>(num_slots), kInt);
  auto experts_t = zeros_on(topk_ids, {num_blocks}, kInt);
  auto total_t = full_on(topk_ids, {1}, static_cast<double>(offset[num_experts]), kInt);
  int32_t* sorted = sorted_t.mutable_data_ptr<int32_t>();
  int32_t* experts = experts_t.mutable_data_ptr<int32_t>();
  std::vector<int64_t> next(offset.begin(), offset.end() - 1);
  for (int64_t s = 0; s < num_slots; ++s)  // ascending slots: ascending within each group
    if (ids[s] >= 0) sorted[next[ids[s]]++] = static_cast<int32_t>(s);
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t b = offset[e] / block_m; b < offset[e + 1] / block_m; ++b) experts[b] = static_cast<int32_t>(e);
  return {sorted_t, experts_t, total_t};
}

// ---- fused_moe ----

// The activation of one (gate, up) pair, in fp32 (moe/fused_moe.h).
inline float expert_activation(const FusedMoeArgs& args, float gate, float up) {
  if (args.activation == MoeActivation::kSilu) return gate / (1.0f + cpu::fast_exp(-gate)) * up;
  const float limit = args.swiglu_limit;
  const float g = std::min(gate, limit);  // std::min / max return a NaN first operand: as torch.clamp
  const float u = std::max(std::min(up, limit), -limit);
  return (u + 1.0f) * (g / (1.0f + cpu::fast_exp(-args.swiglu_alpha * g)));
}

// Rows of about this many fp32 elements per parallel task.
int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

// An expert's weights as a GEMM reads them (rows of K elements of dtype).
struct ExpertMatrix {
  const void* data;
  ScalarType dtype;
};

// fused_moe's experts: the weights as they are, the GEMM inputs as they are.
struct FloatExperts {
  const void *w13, *w2;
  ScalarType dtype;
  int64_t H, I;
  int64_t bytes() const { return dtype == kFloat ? 4 : 2; }
  ExpertMatrix gate_up(int64_t e) const { return {static_cast<const char*>(w13) + e * 2 * I * H * bytes(), dtype}; }
  ExpertMatrix down(int64_t e) const { return {static_cast<const char*>(w2) + e * H * I * bytes(), dtype}; }
  void quantize_rows(float*, int64_t, int64_t) const {}
  void quantize_act_rows(float*, int64_t, int64_t) const {}
  void finish_gate_up(float*, int64_t, int64_t) const {}
  void finish_down(float*, int64_t, int64_t) const {}
};

// fused_moe_fp8's experts: e4m3 weights dequantised per expert into fp32 buffers (scale per
// row, or per 128 x 128 block), the GEMM inputs quantised and dequantised: x per row (per-channel
// scales) or per 128-group of a row (blockwise), a per 64-group of a row.
struct Fp8Experts {
  const uint8_t *w13, *w2;
  const float *w13_scale, *w2_scale;
  bool blockwise;
  int64_t H, I;
  std::vector<float> gate_up_buf, down_buf;

  void dequantize(const uint8_t* q, const float* scale, int64_t rows, int64_t K, std::vector<float>& buf) const {
    buf.resize(static_cast<size_t>(rows * K));
    const auto& lut = e4m3_table();
    const int64_t scale_cols = (K + kMoeFp8Block - 1) / kMoeFp8Block;
    torch::stable::parallel_for(0, rows, grain_rows(K), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t k = 0; k < K; ++k)
          buf[r * K + k] = lut[q[r * K + k]] *
                           (blockwise ? scale[(r / kMoeFp8Block) * scale_cols + k / kMoeFp8Block] : scale[r]);
    });
  }
  ExpertMatrix gate_up(int64_t e) {
    const int64_t scale_stride = blockwise ? ((2 * I + 127) / 128) * ((H + 127) / 128) : 2 * I;
    dequantize(w13 + e * 2 * I * H, w13_scale + e * scale_stride, 2 * I, H, gate_up_buf);
    return {gate_up_buf.data(), kFloat};
  }
  ExpertMatrix down(int64_t e) {
    const int64_t scale_stride = blockwise ? ((H + 127) / 128) * ((I + 127) / 128) : H;
    dequantize(w2 + e * H * I, w2_scale + e * scale_stride, H, I, down_buf);
    return {down_buf.data(), kFloat};
  }
  // x's rows [n, H] in place: v -> e4m3(v / s) * s, s from the amax of the row or of its 128-group.
  void quantize_rows(float* rows, int64_t n, int64_t K) const {
    quantize_groups(rows, n, K, blockwise ? kMoeFp8Block : K);
  }
  // a's rows [n, I]: per 64-group with either weight format.
  void quantize_act_rows(float* rows, int64_t n, int64_t I) const { quantize_groups(rows, n, I, kMoeActGroup); }
  void finish_gate_up(float*, int64_t, int64_t) const {}
  void finish_down(float*, int64_t, int64_t) const {}
  void quantize_groups(float* rows, int64_t n, int64_t K, int64_t group) const {
    const auto& lut = e4m3_table();
    torch::stable::parallel_for(0, n, grain_rows(K), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t k0 = 0; k0 < K; k0 += group) {  // the last group may be shorter
          float* v = rows + r * K + k0;
          const int64_t len = std::min(group, K - k0);
          float amax = 0.f;
          for (int64_t k = 0; k < len; ++k) {  // a NaN makes the scale NaN, as fp8_quantize's
            const float m = std::fabs(v[k]);
            amax = (m > amax || m != m) ? m : amax;
          }
          const float s = scale_from_amax(amax);
          for (int64_t k = 0; k < len; ++k) v[k] = lut[to_e4m3(v[k], s).x] * s;
        }
    });
  }
};

// fused_moe_int4's experts: each expert's packed weights decoded into fp32 buffers of values rounded
// to the activation dtype T (gemm/int4.h's dequantisation), the inputs as they are.
template <typename T>
struct Int4Experts {
  const int32_t *w13, *w2;
  const T *w13_scales, *w2_scales;
  const uint8_t *w13_zeros, *w2_zeros;  // nullptr: symmetric
  int64_t H, I, group_size;
  std::vector<float> gate_up_buf, down_buf;

  ExpertMatrix gate_up(int64_t e) {
    gate_up_buf.resize(static_cast<size_t>(2 * I * H));
    const int64_t groups = H / group_size;
    dequantize_int4_rows<T>(w13 + e * (H / 64) * 16 * I, w13_scales + e * groups * 2 * I,
                            w13_zeros ? w13_zeros + e * groups * 2 * I : nullptr, 2 * I, H, group_size, 0, 2 * I,
                            gate_up_buf.data());
    return {gate_up_buf.data(), kFloat};
  }
  ExpertMatrix down(int64_t e) {
    down_buf.resize(static_cast<size_t>(H * I));
    const int64_t groups = I / group_size;
    dequantize_int4_rows<T>(w2 + e * (I / 64) * 8 * H, w2_scales + e * groups * H,
                            w2_zeros ? w2_zeros + e * groups * H : nullptr, H, I, group_size, 0, H, down_buf.data());
    return {down_buf.data(), kFloat};
  }
  void quantize_rows(float*, int64_t, int64_t) const {}
  void quantize_act_rows(float*, int64_t, int64_t) const {}
  void finish_gate_up(float*, int64_t, int64_t) const {}
  void finish_down(float*, int64_t, int64_t) const {}
};

// fused_moe_fp4's experts: each expert's packed codes decoded into fp32 buffers (fp4_gemm's CPU
// decode: values rounded to T), the accumulators divided by the expert's global scales.
template <typename T>
struct Fp4Experts {
  const int32_t *w13, *w2;
  const uint8_t *w13_scales, *w2_scales;
  const float *w13_global, *w2_global;  // [E, 2] and [E], or nullptr
  bool nvfp4;
  int64_t H, I;
  std::vector<float> gate_up_buf, down_buf;

  int64_t group() const { return nvfp4 ? 16 : 32; }
  ExpertMatrix gate_up(int64_t e) {
    gate_up_buf.resize(static_cast<size_t>(2 * I * H));
    decode_fp4_rows<T>(reinterpret_cast<const uint32_t*>(w13) + e * (H / 64) * 16 * I,
                       w13_scales + e * (H / group()) * 2 * I, nvfp4, 2 * I, H, 0, 2 * I, gate_up_buf.data());
    return {gate_up_buf.data(), kFloat};
  }
  ExpertMatrix down(int64_t e) {
    down_buf.resize(static_cast<size_t>(H * I));
    decode_fp4_rows<T>(reinterpret_cast<const uint32_t*>(w2) + e * (I / 64) * 8 * H, w2_scales + e * (I / group()) * H,
                       nvfp4, H, I, 0, H, down_buf.data());
    return {down_buf.data(), kFloat};
  }
  void quantize_rows(float*, int64_t, int64_t) const {}
  void quantize_act_rows(float*, int64_t, int64_t) const {}
  // h [rows, 2I]: the gate half divided by w13_global[e][0], the up half by [e][1]
  void finish_gate_up(float* h, int64_t rows, int64_t e) const {
    if (w13_global == nullptr) return;
    const float gate = w13_global[2 * e], up = w13_global[2 * e + 1];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; ++i) {
        h[r * 2 * I + i] /= gate;
        h[r * 2 * I + I + i] /= up;
      }
  }
  void finish_down(float* y, int64_t rows, int64_t e) const {
    if (w2_global == nullptr) return;
    const float d = w2_global[e];
    for (int64_t c = 0; c < rows * H; ++c) y[c] /= d;
  }
};

template <typename T, typename Experts>
void fused_moe_typed(const FusedMoeArgs& args, const T* x, Experts& experts, const float* topk_weights,
                     const int32_t* topk_ids, const T* w13_bias, const T* w2_bias, T* out) {
  const int64_t H = args.hidden, I = args.intermediate, E = args.num_experts, k = args.top_k;
  const int64_t num_slots = args.num_tokens * k;
  // Counting sort of the slots by expert (ascending slot within an expert); -1 slots are dropped.
  std::vector<int64_t> first(static_cast<size_t>(E) + 1, 0);
  for (int64_t s = 0; s < num_slots; ++s)
    if (topk_ids[s] >= 0) ++first[topk_ids[s] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  std::vector<int64_t> sorted_slot(static_cast<size_t>(first[E])), row_of_slot(static_cast<size_t>(num_slots), -1);
  {
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t s = 0; s < num_slots; ++s)
      if (topk_ids[s] >= 0) {
        row_of_slot[s] = next[topk_ids[s]];
        sorted_slot[next[topk_ids[s]]++] = s;
      }
  }
  // y of every routed slot in expert order [slots, H]; the rest is per expert, reused.
  std::vector<float> y(static_cast<size_t>(first[E] * H));
  int64_t max_rows = 0;
  for (int64_t e = 0; e < E; ++e) max_rows = std::max(max_rows, first[e + 1] - first[e]);
  std::vector<float> xs(static_cast<size_t>(max_rows * H)), h(static_cast<size_t>(max_rows * 2 * I)),
      a(static_cast<size_t>(max_rows * I));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t row0 = first[e], rows = first[e + 1] - row0;
    if (rows == 0) continue;
    torch::stable::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* src = x + sorted_slot[row0 + r] / k * H;
        for (int64_t c = 0; c < H; ++c) xs[r * H + c] = static_cast<float>(src[c]);
      }
    });
    experts.quantize_rows(xs.data(), rows, H);
    // H and I are multiples of 8 (validated): the rows need no padding for the GEMM.
    const ExpertMatrix w13 = experts.gate_up(e);
    batch_invariant_mm_f32_rows(xs.data(), rows, w13.data, w13.dtype, 2 * I, H, h.data());
    experts.finish_gate_up(h.data(), rows, e);
    torch::stable::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < I; ++i) {
          float gate = h[r * 2 * I + i], up = h[r * 2 * I + I + i];
          if (w13_bias != nullptr) {
            gate += static_cast<float>(w13_bias[e * 2 * I + i]);
            up += static_cast<float>(w13_bias[e * 2 * I + I + i]);
          }
          // rounded to the activation dtype: the second GEMM's input, as the kernel's
          a[r * I + i] = static_cast<float>(static_cast<T>(expert_activation(args, gate, up)));
        }
    });
    experts.quantize_act_rows(a.data(), rows, I);
    const ExpertMatrix w2 = experts.down(e);
    batch_invariant_mm_f32_rows(a.data(), rows, w2.data, w2.dtype, H, I, y.data() + row0 * H);
    experts.finish_down(y.data() + row0 * H, rows, e);
  }
  torch::stable::parallel_for(0, args.num_tokens, grain_rows(H * k), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {  // slot order: the sum does not depend on the batch
        const int64_t s = t * k + j, e = topk_ids[s];
        if (e < 0) continue;
        const float w = topk_weights[s];
        const float* ys = y.data() + row_of_slot[s] * H;
        // y (+ its bias) rounded to the activation dtype, as the kernel stores it
        if (w2_bias != nullptr) {
          const T* b = w2_bias + e * H;
          for (int64_t c = 0; c < H; ++c) acc[c] += w * static_cast<float>(static_cast<T>(ys[c] + static_cast<float>(b[c])));
        } else {
          for (int64_t c = 0; c < H; ++c) acc[c] += w * static_cast<float>(static_cast<T>(ys[c]));
        }
      }
      for (int64_t c = 0; c < H; ++c) out[t * H + c] = static_cast<T>(acc[c]);
    }
  });
}

// make_experts(scalar_t tag) builds the variant's experts for the activation dtype.
template <typename MakeExperts>
Tensor fused_moe_cpu_with(const FusedMoeArgs& args, const Tensor& x, MakeExperts&& make_experts,
                          const Tensor& topk_weights, const Tensor& topk_ids, const std::optional<Tensor>& w13_bias,
                          const std::optional<Tensor>& w2_bias, const char* op) {
  auto out = empty_on(x, {args.num_tokens, args.hidden});
  if (args.num_tokens == 0) return out;
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), op, [&] {
    auto experts = make_experts(scalar_t{});
    fused_moe_typed<scalar_t>(args, x.const_data_ptr<scalar_t>(), experts, topk_weights.const_data_ptr<float>(),
                              topk_ids.const_data_ptr<int32_t>(),
                              w13_bias.has_value() ? w13_bias->const_data_ptr<scalar_t>() : nullptr,
                              w2_bias.has_value() ? w2_bias->const_data_ptr<scalar_t>() : nullptr,
                              out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

Tensor fused_moe_cpu(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& topk_weights,
                     const Tensor& topk_ids, std::string_view activation, std::optional<double> swiglu_alpha,
                     std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                     const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe";
  const FusedMoeArgs args = validate_fused_moe(op, x, w13, w2, topk_weights, topk_ids, activation, swiglu_alpha,
                                               swiglu_limit, w13_bias, w2_bias, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  const auto make = [&](auto) {
    return FloatExperts{w13.const_data_ptr(), w2.const_data_ptr(), x.scalar_type(), args.hidden, args.intermediate};
  };
  return fused_moe_cpu_with(args, x, make, topk_weights, topk_ids, w13_bias, w2_bias, op);
}

Tensor fused_moe_fp8_cpu(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scale,
                         const Tensor& w2_scale, const Tensor& topk_weights, const Tensor& topk_ids,
                         std::string_view activation, std::optional<double> swiglu_alpha,
                         std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                         const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_fp8";
  const auto [args, blockwise] =
      validate_fused_moe_fp8(op, x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, activation, swiglu_alpha,
                             swiglu_limit, w13_bias, w2_bias, /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  const auto make = [&](auto) {
    return Fp8Experts{static_cast<const uint8_t*>(w13.const_data_ptr()),
                      static_cast<const uint8_t*>(w2.const_data_ptr()),
                      w13_scale.const_data_ptr<float>(),
                      w2_scale.const_data_ptr<float>(),
                      blockwise,
                      args.hidden,
                      args.intermediate,
                      {},
                      {}};
  };
  return fused_moe_cpu_with(args, x, make, topk_weights, topk_ids, w13_bias, w2_bias, op);
}

Tensor fused_moe_int4_cpu(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
                          const Tensor& w2_scales, const std::optional<Tensor>& w13_zeros,
                          const std::optional<Tensor>& w2_zeros, const Tensor& topk_weights, const Tensor& topk_ids,
                          int64_t group_size, std::string_view activation, std::optional<double> swiglu_alpha,
                          std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                          const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_int4";
  const FusedMoeArgs args =
      validate_fused_moe_int4(op, x, w13, w2, w13_scales, w2_scales, w13_zeros, w2_zeros, topk_weights, topk_ids,
                              group_size, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias,
                              /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  const auto make = [&](auto tag) {
    using T = decltype(tag);
    return Int4Experts<T>{w13.const_data_ptr<int32_t>(),
                          w2.const_data_ptr<int32_t>(),
                          w13_scales.const_data_ptr<T>(),
                          w2_scales.const_data_ptr<T>(),
                          zero_points_of(w13_zeros),
                          zero_points_of(w2_zeros),
                          args.hidden,
                          args.intermediate,
                          group_size,
                          {},
                          {}};
  };
  return fused_moe_cpu_with(args, x, make, topk_weights, topk_ids, w13_bias, w2_bias, op);
}

Tensor fused_moe_fp4_cpu(const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
                         const Tensor& w2_scales, const std::optional<Tensor>& w13_global_scale,
                         const std::optional<Tensor>& w2_global_scale, const Tensor& topk_weights,
                         const Tensor& topk_ids, std::string_view format, std::string_view activation,
                         std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit,
                         const std::optional<Tensor>& w13_bias, const std::optional<Tensor>& w2_bias) {
  const char* op = "fused_moe_fp4";
  const auto [args, weights] =
      validate_fused_moe_fp4(op, x, w13, w2, w13_scales, w2_scales, w13_global_scale, w2_global_scale, topk_weights,
                             topk_ids, format, activation, swiglu_alpha, swiglu_limit, w13_bias, w2_bias,
                             /*allow_fp32=*/true);
  check_on_cpu(x, op, "x");
  const auto make = [&](auto tag) {
    using T = decltype(tag);
    return Fp4Experts<T>{w13.const_data_ptr<int32_t>(),
                         w2.const_data_ptr<int32_t>(),
                         w13_scales.const_data_ptr<uint8_t>(),
                         w2_scales.const_data_ptr<uint8_t>(),
                         w13_global_scale.has_value() ? w13_global_scale->const_data_ptr<float>() : nullptr,
                         w2_global_scale.has_value() ? w2_global_scale->const_data_ptr<float>() : nullptr,
                         weights == MoeWeightFormat::kNvfp4,
                         args.hidden,
                         args.intermediate,
                         {},
                         {}};
  };
  return fused_moe_cpu_with(args, x, make, topk_weights, topk_ids, w13_bias, w2_bias, op);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("moe_topk", TORCH_BOX(&fastinfer::binding::moe_topk_cpu));
  m.impl("moe_align", TORCH_BOX(&fastinfer::binding::moe_align_cpu));
  m.impl("fused_moe", TORCH_BOX(&fastinfer::binding::fused_moe_cpu));
  m.impl("fused_moe_fp8", TORCH_BOX(&fastinfer::binding::fused_moe_fp8_cpu));
  m.impl("fused_moe_int4", TORCH_BOX(&fastinfer::binding::fused_moe_int4_cpu));
  m.impl("fused_moe_fp4", TORCH_BOX(&fastinfer::binding::fused_moe_fp4_cpu));
}
