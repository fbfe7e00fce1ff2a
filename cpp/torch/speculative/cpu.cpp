// CPU implementation of tree_verify: the walk of speculative/tree_verify.h per sequence on ATen's
// thread pool, computed in float64 from the stored logits (it then agrees with the fp64 reference
// except for summation order). Dense residual vectors (p, q) per sequence, renormalised after
// every rejection.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "speculative/contract.h"

namespace fastinfer::binding {
namespace {

// Smallest t with cumsum(r)[t] > u * sum(r); else the largest t with r[t] > 0; else 0.
int64_t inverse_cdf(const std::vector<double>& r, double u) {
  double total = 0.0;
  for (double x : r) total += x;
  const double thr = u * total;
  double c = 0.0;
  int64_t last = -1;
  for (size_t t = 0; t < r.size(); ++t) {
    c += r[t];
    if (r[t] > 0.0) last = static_cast<int64_t>(t);
    if (c > thr) return static_cast<int64_t>(t);
  }
  return last < 0 ? 0 : last;
}

void normalise(std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  if (s > 0.0)
    for (double& x : v) x /= s;
}

template <typename T>
void tree_verify_rows(const int64_t* tokens, const int64_t* parents, const T* logits, const float* draft_probs,
                      const float* temperature, const float* uniforms, bool greedy, int64_t B, int64_t N, int64_t V,
                      int64_t* accepted, int64_t* num_accepted, int64_t* next_token) {
  torch::stable::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> p(static_cast<size_t>(V)), q;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t* tok = tokens + b * N;
      const int64_t* par = parents + b * N;
      const float* u = uniforms + b * (N + 1);
      int64_t* path = accepted + b * N;
      std::fill(path, path + N, int64_t{-1});
      path[0] = 0;
      int64_t cur = 0, depth = 0, next = 0;
      for (;;) {
        const T* row = logits + (b * N + cur) * V;
        int64_t chosen = -1;
        if (greedy) {
          int64_t best = 0;
          double best_v = static_cast<double>(row[0]);
          for (int64_t v = 1; v < V; ++v)
            if (static_cast<double>(row[v]) > best_v) {
              best_v = static_cast<double>(row[v]);
              best = v;
            }
          for (int64_t c = cur + 1; c < N && chosen < 0; ++c)
            if (par[c] == cur && tok[c] == best) chosen = c;
          if (chosen < 0) next = best;
        } else {
          const double inv_t = 1.0 / static_cast<double>(temperature[b]);
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]) * inv_t);
          for (int64_t v = 0; v < V; ++v) p[v] = std::exp(static_cast<double>(row[v]) * inv_t - mx);
          normalise(p);
          const float* qrow = draft_probs != nullptr ? draft_probs + (b * N + cur) * V : nullptr;
          bool have_q = false;  // q loaded (as given) at the first rejection
          for (int64_t c = cur + 1; c < N && chosen < 0; ++c) {
            if (par[c] != cur) continue;
            const int64_t x = tok[c];
            const bool valid = x >= 0 && x < V;
            const double px = valid ? p[x] : 0.0;
            if (qrow != nullptr) {
              const double qx = valid ? (have_q ? q[x] : static_cast<double>(qrow[x])) : 0.0;
              if (static_cast<double>(u[c]) * qx < px) {
                chosen = c;
              } else if (valid) {
                if (!have_q) {
                  q.assign(qrow, qrow + V);
                  have_q = true;
                }
                for (int64_t v = 0; v < V; ++v) p[v] = std::max(p[v] - q[v], 0.0);
                normalise(p);
                q[x] = 0.0;
                normalise(q);
              }
            } else {
              if (static_cast<double>(u[c]) < px) {
                chosen = c;
              } else if (px > 0.0) {
                p[x] = 0.0;
                normalise(p);
              }
            }
          }
          if (chosen < 0) next = inverse_cdf(p, static_cast<double>(u[N]));
        }
        if (chosen < 0) break;
        cur = chosen;
        path[++depth] = cur;
      }
      num_accepted[b] = depth;
      next_token[b] = next;
    }
  });
}

std::tuple<Tensor, Tensor, Tensor> tree_verify_cpu(const Tensor& draft_tokens,
                                                               const Tensor& parents,
                                                               const Tensor& target_logits,
                                                               const std::optional<Tensor>& draft_probs,
                                                               const Tensor& temperature,
                                                               const Tensor& uniforms, bool greedy) {
  const char* op = "tree_verify";
  validate_tree_verify(op, draft_tokens, parents, target_logits, draft_probs, temperature, uniforms);
  check_on_cpu(draft_tokens, op, "draft_tokens");
  check_tree_verify_layout(op, draft_tokens, parents, target_logits, draft_probs, temperature, uniforms);
  const int64_t B = draft_tokens.size(0), N = draft_tokens.size(1), V = target_logits.size(2);
  check_tree_verify_values(op, draft_tokens, parents, V, temperature, uniforms, greedy);
  check_tree_verify_logits(op, target_logits);
  const auto tokens = contiguous_as(draft_tokens, kLong);
  const auto par = contiguous_as(parents, kLong);
  auto accepted = empty_on(draft_tokens, {B, N}, kLong);
  auto num = empty_on(draft_tokens, {B}, kLong);
  auto next = empty_on(draft_tokens, {B}, kLong);
  if (B > 0) {
    const float* dp = draft_probs.has_value() && !greedy ? draft_probs->const_data_ptr<float>() : nullptr;
    FASTINFER_DISPATCH_FLOAT_TYPES(target_logits.scalar_type(), "tree_verify", [&] {
      tree_verify_rows<scalar_t>(tokens.const_data_ptr<int64_t>(), par.const_data_ptr<int64_t>(),
                                 target_logits.const_data_ptr<scalar_t>(), dp, temperature.const_data_ptr<float>(),
                                 uniforms.const_data_ptr<float>(), greedy, B, N, V, accepted.mutable_data_ptr<int64_t>(),
                                 num.mutable_data_ptr<int64_t>(), next.mutable_data_ptr<int64_t>());
    });
  }
  const auto dt = draft_tokens.scalar_type();
  return {to_dtype_of(accepted, dt), to_dtype_of(num, dt), to_dtype_of(next, dt)};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  m.impl("tree_verify", TORCH_BOX(&fastinfer::binding::tree_verify_cpu));
}
