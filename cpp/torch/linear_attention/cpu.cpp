// CPU implementations of the linear-attention ops.
// causal_conv1d (contract: cuda/include/fastinfer/linear_attention/causal_conv1d.h): the kernels'
// arithmetic (fp32 from the bias, std::fma over the taps in order, silu as x / (1 + exp(-x)), one
// rounding), sequences on ATen's thread pool; each sequence's outputs first, then its new state
// (its old rows read before they are overwritten).
// gated_delta_rule (contract: gated_delta_rule.h): (sequence, value head) pairs on ATen's thread
// pool, each with its fp32 state [Dk, Dv] in a local buffer; the per-token recurrence, or for a
// sequence longer than one chunk (unless deterministic or state_history asks for the per-token
// order) the chunked form.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_simd.h"
#include "linear_attention/contract.h"

namespace fastinfer::binding {
namespace {

template <typename T>
void conv_sequences(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, Tensor& out,
                    Tensor& conv_states, const std::vector<int64_t>& cu, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& initial, bool silu) {
  const int64_t D = x.size(1), W = weight.size(1), hist = W - 1, xs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = weight.const_data_ptr<T>();
  const T* bp = bias.has_value() ? bias->const_data_ptr<T>() : nullptr;
  T* op = out.mutable_data_ptr<T>();
  T* sp = conv_states.mutable_data_ptr<T>();
  const int64_t B = static_cast<int64_t>(slots.size());
  torch::stable::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> pad;  // the sequence's padded input, [hist + L][D] in fp32
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = cu[b], len = cu[b + 1] - start;
      const bool from_state = initial.empty() || initial[b] != 0;
      T* state = sp + slots[b] * hist * D;
      pad.assign(static_cast<size_t>((hist + len) * D), 0.f);
      if (from_state)
        for (int64_t i = 0; i < hist * D; ++i) pad[i] = static_cast<float>(state[i]);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t c = 0; c < D; ++c) pad[(hist + t) * D + c] = static_cast<float>(xp[(start + t) * xs + c]);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t c = 0; c < D; ++c) {
          float acc = bp != nullptr ? static_cast<float>(bp[c]) : 0.f;
          for (int64_t i = 0; i < W; ++i) acc = std::fma(static_cast<float>(wp[c * W + i]), pad[(t + i) * D + c], acc);
          if (silu) acc = acc / (1.f + std::exp(-acc));
          op[(start + t) * D + c] = static_cast<T>(acc);
        }
      for (int64_t i = 0; i < hist * D; ++i) state[i] = static_cast<T>(pad[len * D + i]);
    }
  });
}

Tensor causal_conv1d_cpu(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const Tensor& cu_seqlens, Tensor& conv_states, const Tensor& state_indices,
                         const std::optional<Tensor>& has_initial_state, std::string_view activation) {
  const char* op = "causal_conv1d";
  validate_causal_conv1d(op, x, weight, bias, cu_seqlens, conv_states, state_indices, has_initial_state);
  const bool silu = conv_activation_is_silu(op, activation);
  check_on_cpu(x, op, "x");
  check_causal_conv1d_layout(op, x, weight, bias, conv_states);
  check_causal_conv1d_indices(op, x, cu_seqlens, conv_states, state_indices);
  auto out = empty_on(x, {x.size(0), x.size(1)});
  const auto cu = host_indices(cu_seqlens);
  const auto slots = host_indices(state_indices);
  std::vector<int64_t> initial;
  if (has_initial_state.has_value()) initial = host_indices(*has_initial_state);
  if (slots.empty() || x.size(1) == 0) return out;
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), op, [&] {
    conv_sequences<scalar_t>(x, weight, bias, out, conv_states, cu, slots, initial, silu);
  });
  return out;
}

// ---- gated_delta_rule ----------------------------------------------------------------------------

// Tokens per chunk of the chunked form (FLA's and transformers' chunk size).
constexpr int64_t kGdnChunk = 64;

struct GdnArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const void* beta;
  bool beta_fp32;
  void* out;
  float* history;  // [T, Hv, Dk, Dv] or nullptr
  int64_t qs, ks, vs;  // token strides
  int64_t Hk, Hv, Dk, Dv;
  float scale;
  bool l2norm;
};

// One (sequence, value head): its inputs in fp32, and the two forms of the recurrence on its state.
template <typename T>
struct GdnHead {
  const GdnArgs& a;
  int64_t hv, hk;

  // Token t's q (l2-normalised when asked, then times scale) and k (l2-normalised when asked).
  FASTINFER_CPU_INLINE void load_qk(int64_t t, float* q, float* k) const {
    const T* qp = static_cast<const T*>(a.q) + t * a.qs + hk * a.Dk;
    const T* kp = static_cast<const T*>(a.k) + t * a.ks + hk * a.Dk;
    for (int64_t i = 0; i < a.Dk; ++i) q[i] = static_cast<float>(qp[i]), k[i] = static_cast<float>(kp[i]);
    float q_mul = a.scale, k_mul = 1.f;
    if (a.l2norm) {
      float qq = 0.f, kk = 0.f;
      for (int64_t i = 0; i < a.Dk; ++i) qq = std::fma(q[i], q[i], qq), kk = std::fma(k[i], k[i], kk);
      const float inv_q = 1.f / std::sqrt(qq + 1e-6f);
      k_mul = 1.f / std::sqrt(kk + 1e-6f);
      for (int64_t i = 0; i < a.Dk; ++i) q[i] *= inv_q;
    }
    for (int64_t i = 0; i < a.Dk; ++i) q[i] *= q_mul, k[i] *= k_mul;
  }
  FASTINFER_CPU_INLINE float g(int64_t t) const { return a.g[t * a.Hv + hv]; }
  FASTINFER_CPU_INLINE float beta(int64_t t) const {
    return a.beta_fp32 ? static_cast<const float*>(a.beta)[t * a.Hv + hv]
                       : static_cast<float>(static_cast<const T*>(a.beta)[t * a.Hv + hv]);
  }
  FASTINFER_CPU_INLINE const T* v(int64_t t) const { return static_cast<const T*>(a.v) + t * a.vs + hv * a.Dv; }
  FASTINFER_CPU_INLINE T* out(int64_t t) const { return static_cast<T*>(a.out) + (t * a.Hv + hv) * a.Dv; }

  // Tokens [start, end) one at a time: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q.
  FASTINFER_CPU_INLINE void recurrent(int64_t start, int64_t end, float* S) const {
    const int64_t Dk = a.Dk, Dv = a.Dv;
    std::vector<float> q(Dk), k(Dk), kv(Dv), o(Dv);
    for (int64_t t = start; t < end; ++t) {
      load_qk(t, q.data(), k.data());
      const float decay = std::exp(g(t)), b = beta(t);
      const T* vt = v(t);
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] *= decay;
          kv[j] = std::fma(k[i], row[j], kv[j]);
        }
      }
      for (int64_t j = 0; j < Dv; ++j) kv[j] = b * (static_cast<float>(vt[j]) - kv[j]);  // u
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t i = 0; i < Dk; ++i) {
        float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
          row[j] = std::fma(k[i], kv[j], row[j]);
          o[j] = std::fma(q[i], row[j], o[j]);
        }
      }
      T* ot = out(t);
      for (int64_t j = 0; j < Dv; ++j) ot[j] = static_cast<T>(o[j]);
      if (a.history != nullptr) std::copy(S, S + Dk * Dv, a.history + (t * a.Hv + hv) * Dk * Dv);
    }
  }

  // Tokens [start, end) in chunks of kGdnChunk (the WY / UT-transform form). Within a chunk, with
  // c_i the cumulative log decay up to token i and A[i][j] = beta_i (k_i . k_j) exp(c_i - c_j)
  // (j < i), the unit lower-triangular system (I + A) gives U = (I + A)^-1 (beta v) and
  // W = (I + A)^-1 (beta exp(c) k); the tokens' state corrections are V' = U - W S, their outputs
  // o_i = exp(c_i) S^T q_i + sum_{j <= i} (q_i . k_j) exp(c_i - c_j) V'_j, and the state becomes
  // exp(c_last) S + sum_j exp(c_last - c_j) k_j V'_j^T. The c_i are summed in double, so that
  // c_i - c_j of two large cumulative decays keeps its precision wherever the pair sits in the chunk.
  FASTINFER_CPU_INLINE void chunked(int64_t start, int64_t end, float* S) const {
    const int64_t Dk = a.Dk, Dv = a.Dv, C = kGdnChunk;
    // K^T [Dk][C] makes the Gram rows k_i . k_j and q_i . k_j vector loops over j; P [C][C] holds
    // (q_i . k_j) exp(c_i - c_j); O [C][Dv] the outputs.
    std::vector<float> Q(C * Dk), K(C * Dk), KT(Dk * C), U(C * Dv), W(C * Dk), O(C * Dv), P(C * C), kk(C), tail(C);
    std::vector<double> c(C);
    for (int64_t c0 = start; c0 < end; c0 += C) {
      const int64_t n = std::min(C, end - c0);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = c0 + i;
        load_qk(t, &Q[i * Dk], &K[i * Dk]);
        for (int64_t d = 0; d < Dk; ++d) KT[d * C + i] = K[i * Dk + d];
        c[i] = (i == 0 ? 0.0 : c[i - 1]) + g(t);
      }
      for (int64_t i = 0; i < n; ++i) {
        const float b = beta(c0 + i), bd = b * static_cast<float>(std::exp(c[i]));
        const T* vt = v(c0 + i);
        float* u = &U[i * Dv];
        float* w = &W[i * Dk];
        float* pi = &P[i * C];
        for (int64_t e = 0; e < Dv; ++e) u[e] = b * static_cast<float>(vt[e]);
        for (int64_t d = 0; d < Dk; ++d) w[d] = bd * K[i * Dk + d];
        std::fill(kk.begin(), kk.begin() + i + 1, 0.f);
        std::fill(pi, pi + i + 1, 0.f);
        for (int64_t d = 0; d < Dk; ++d) {
          const float kd = K[i * Dk + d], qd = Q[i * Dk + d];
          const float* kt = &KT[d * C];
          for (int64_t j = 0; j <= i; ++j) {
            kk[j] = std::fma(kd, kt[j], kk[j]);
            pi[j] = std::fma(qd, kt[j], pi[j]);
          }
        }
        for (int64_t j = 0; j <= i; ++j) pi[j] *= static_cast<float>(std::exp(c[i] - c[j]));
        for (int64_t j = 0; j < i; ++j) {  // row i of the forward substitution through (I + A)
          const float aij = b * kk[j] * static_cast<float>(std::exp(c[i] - c[j]));
          const float* uj = &U[j * Dv];
          const float* wj = &W[j * Dk];
          for (int64_t e = 0; e < Dv; ++e) u[e] = std::fma(-aij, uj[e], u[e]);
          for (int64_t d = 0; d < Dk; ++d) w[d] = std::fma(-aij, wj[d], w[d]);
        }
      }
      // V' = U - W S (in place of U) and O = Q S, one state row at a time for all the chunk's tokens
      std::fill(O.begin(), O.begin() + n * Dv, 0.f);
      for (int64_t d = 0; d < Dk; ++d) {
        const float* row = S + d * Dv;
        for (int64_t i = 0; i < n; ++i) {
          const float wd = W[i * Dk + d], qd = Q[i * Dk + d];
          float* u = &U[i * Dv];
          float* o = &O[i * Dv];
          for (int64_t e = 0; e < Dv; ++e) {
            u[e] = std::fma(-wd, row[e], u[e]);
            o[e] = std::fma(qd, row[e], o[e]);
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {  // o_i = exp(c_i) (S^T q_i) + sum_{j <= i} P[i][j] V'_j
        float* o = &O[i * Dv];
        const float ci = static_cast<float>(std::exp(c[i]));
        for (int64_t e = 0; e < Dv; ++e) o[e] *= ci;
        for (int64_t j = 0; j <= i; ++j) {
          const float f = P[i * C + j];
          const float* uj = &U[j * Dv];
          for (int64_t e = 0; e < Dv; ++e) o[e] = std::fma(f, uj[e], o[e]);
        }
        T* ot = out(c0 + i);
        for (int64_t e = 0; e < Dv; ++e) ot[e] = static_cast<T>(o[e]);
      }
      const float chunk_decay = static_cast<float>(std::exp(c[n - 1]));
      for (int64_t j = 0; j < n; ++j) tail[j] = static_cast<float>(std::exp(c[n - 1] - c[j]));
      for (int64_t d = 0; d < Dk; ++d) {
        float* row = S + d * Dv;
        for (int64_t e = 0; e < Dv; ++e) row[e] *= chunk_decay;
        for (int64_t j = 0; j < n; ++j) {
          const float f = KT[d * C + j] * tail[j];
          const float* uj = &U[j * Dv];
          for (int64_t e = 0; e < Dv; ++e) row[e] = std::fma(f, uj[e], row[e]);
        }
      }
    }
  }

};

// One ISA-cloned entry per dtype (target_clones does not apply to templates): one (sequence,
// value head) over tokens [start, end), per token or chunked. std::fma everywhere it matters, so
// every clone rounds alike.
template <typename T>
FASTINFER_CPU_INLINE void gdn_head(const GdnArgs& a, int64_t hv, int64_t start, int64_t end, float* S, bool chunked) {
  const GdnHead<T> h{a, hv, hv / (a.Hv / a.Hk)};
  if (chunked)
    h.chunked(start, end, S);
  else
    h.recurrent(start, end, S);
}
using GdnEntry = void (*)(const GdnArgs&, int64_t, int64_t, int64_t, float*, bool);
#define FASTINFER_GDN_ENTRY(NAME, T)                                                                \
  FASTINFER_CPU_CLONES void NAME(const GdnArgs& a, int64_t hv, int64_t start, int64_t end, float* S, \
                                 bool chunked) {                                                     \
    gdn_head<T>(a, hv, start, end, S, chunked);                                                     \
  }
FASTINFER_GDN_ENTRY(gdn_head_f32, float)
FASTINFER_GDN_ENTRY(gdn_head_f16, Half)
FASTINFER_GDN_ENTRY(gdn_head_bf16, BFloat16)
#undef FASTINFER_GDN_ENTRY

void gdn_sequences(GdnEntry run, const GdnArgs& a, float* states, const std::vector<int64_t>& cu,
                   const std::vector<int64_t>& slots, const std::vector<int64_t>& initial, bool per_token) {
  const int64_t B = static_cast<int64_t>(slots.size()), head = a.Dk * a.Dv;
  torch::stable::parallel_for(0, B * a.Hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> S(static_cast<size_t>(head));
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / a.Hv, hv = w % a.Hv;
      float* slot = states + (slots[b] * a.Hv + hv) * head;
      if (initial.empty() || initial[b] != 0)
        std::copy(slot, slot + head, S.begin());
      else
        std::fill(S.begin(), S.end(), 0.f);
      run(a, hv, cu[b], cu[b + 1], S.data(), !per_token && cu[b + 1] - cu[b] > kGdnChunk);
      std::copy(S.begin(), S.end(), slot);
    }
  });
}

Tensor gated_delta_rule_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& cu_seqlens, Tensor& states, const Tensor& state_indices,
                            const std::optional<Tensor>& has_initial_state, std::optional<double> scale,
                            bool use_qk_l2norm, const std::optional<Tensor>& state_history, bool deterministic) {
  const char* op = "gated_delta_rule";
  const auto shape = validate_gated_delta_rule(op, q, k, v, g, beta, cu_seqlens, states, state_indices,
                                               has_initial_state, scale, state_history);
  check_on_cpu(q, op, "q");
  check_gated_delta_rule_layout(op, q, k, v, g, beta, states, state_history);
  check_gated_delta_rule_indices(op, q, cu_seqlens, states, state_indices);
  auto out = empty_on(q, {shape.T, shape.Hv, shape.Dv});
  const auto cu = host_indices(cu_seqlens);
  const auto slots = host_indices(state_indices);
  std::vector<int64_t> initial;
  if (has_initial_state.has_value()) initial = host_indices(*has_initial_state);
  if (slots.empty() || shape.Hv == 0) return out;
  const GdnArgs a{q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(), g.const_data_ptr<float>(),
                  beta.const_data_ptr(), beta.scalar_type() == kFloat, out.mutable_data_ptr(),
                  state_history.has_value() ? state_history->mutable_data_ptr<float>() : nullptr,
                  token_stride_of(q), token_stride_of(k), token_stride_of(v), shape.Hk, shape.Hv, shape.Dk, shape.Dv,
                  shape.scale, use_qk_l2norm};
  const bool per_token = deterministic || state_history.has_value();
  const GdnEntry run = q.scalar_type() == kFloat  ? gdn_head_f32
                       : q.scalar_type() == kHalf ? gdn_head_f16
                                                  : gdn_head_bf16;
  gdn_sequences(run, a, states.mutable_data_ptr<float>(), cu, slots, initial, per_token);
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("causal_conv1d", TORCH_BOX(&fastinfer::binding::causal_conv1d_cpu));
  m.impl("gated_delta_rule", TORCH_BOX(&fastinfer::binding::gated_delta_rule_cpu));
}
