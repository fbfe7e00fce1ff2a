#pragma once
// Shape/dtype/device rules of tree_verify (shared by the CPU and CUDA impls) and
// the host-side value checks of its inputs (tree structure, token ids, temperature, uniforms),
// which run on CPU tensors always and on CUDA tensors when FASTINFER_CHECK_INDICES=1.
#include <cmath>
#include <optional>

#include "elementwise/contract.h"

namespace fastinfer::binding {

// The schemas of the speculative ops (schema.cpp registers them for every module).
inline void define_speculative_ops(StableLibrary& m) {
  // Speculative decoding (docs/design.md "Speculative decoding").
  m.def("tree_verify(Tensor draft_tokens, Tensor parents, Tensor target_logits, Tensor? draft_probs, "
        "Tensor temperature, Tensor uniforms, bool greedy) -> (Tensor accepted_nodes, Tensor num_accepted, "
        "Tensor next_token)");
}

// Most draft nodes per sequence (the kernels keep a per-node list in shared memory).
inline constexpr int64_t kTreeVerifyMaxNodes = 4096;

inline void validate_tree_verify(const char* op, const Tensor& draft_tokens, const Tensor& parents,
                                 const Tensor& target_logits, const std::optional<Tensor>& draft_probs,
                                 const Tensor& temperature, const Tensor& uniforms) {
  check_dim(draft_tokens, 2, op, "draft_tokens", "[batch, num_nodes] (node 0 = the root, the last committed token)");
  check_dtype_in(draft_tokens, {kInt, kLong}, op, "draft_tokens");
  const auto B = draft_tokens.size(0);
  const auto N = draft_tokens.size(1);
  FI_CHECK(N >= 1 && N <= kTreeVerifyMaxNodes, op, "draft_tokens must have 1 <= num_nodes <= ", kTreeVerifyMaxNodes,
           " (node 0 is the root), got shape ", shape_str(draft_tokens));
  check_dim(parents, 2, op, "parents", "[batch, num_nodes]");
  FI_CHECK(parents.size(0) == B && parents.size(1) == N, op, "parents must have the shape of draft_tokens [",
           B, ", ", N, "], got ", shape_str(parents));
  check_same_dtype(parents, draft_tokens, op, "parents", "draft_tokens");
  check_same_device(parents, draft_tokens, op, "parents", "draft_tokens");

  check_dim(target_logits, 3, op, "target_logits", "[batch, num_nodes, vocab]");
  check_dtype_in(target_logits, {kFloat, kHalf, kBFloat16}, op, "target_logits");
  FI_CHECK(target_logits.size(0) == B && target_logits.size(1) == N && target_logits.size(2) >= 1, op,
           "target_logits must have shape [", B, ", ", N, ", vocab >= 1] (one row of logits per node), got ",
           shape_str(target_logits));
  FI_CHECK(target_logits.size(2) < (int64_t{1} << 31), op, "target_logits must have vocab < 2^31, got ",
           shape_str(target_logits));
  check_same_device(target_logits, draft_tokens, op, "target_logits", "draft_tokens");
  if (draft_probs.has_value()) {
    check_dim(*draft_probs, 3, op, "draft_probs", "[batch, num_nodes, vocab] (the draft distribution at each node)");
    FI_CHECK(draft_probs->scalar_type() == kFloat, op, "draft_probs must be float32, got ",
             draft_probs->scalar_type());
    FI_CHECK(draft_probs->size(0) == B && draft_probs->size(1) == N &&
                 draft_probs->size(2) == target_logits.size(2),
             op, "draft_probs must have the shape of target_logits ", shape_str(target_logits), ", got ",
             shape_str(*draft_probs));
    check_same_device(*draft_probs, draft_tokens, op, "draft_probs", "draft_tokens");
  }
  check_dim(temperature, 1, op, "temperature", "[batch]");
  FI_CHECK(temperature.scalar_type() == kFloat, op, "temperature must be float32, got ", temperature.scalar_type());
  FI_CHECK(temperature.size(0) == B, op, "temperature must have batch = ", B, " entries, got ",
           shape_str(temperature));
  check_same_device(temperature, draft_tokens, op, "temperature", "draft_tokens");
  check_dim(uniforms, 2, op, "uniforms", "[batch, num_nodes + 1]");
  FI_CHECK(uniforms.scalar_type() == kFloat, op, "uniforms must be float32, got ", uniforms.scalar_type());
  FI_CHECK(uniforms.size(0) == B && uniforms.size(1) == N + 1, op, "uniforms must have shape [", B, ", ",
           N + 1, "] (one per node to test children, the last for the final sample), got ", shape_str(uniforms));
  check_same_device(uniforms, draft_tokens, op, "uniforms", "draft_tokens");
}

// Layout rule of the CPU and CUDA impls: everything contiguous.
inline void check_tree_verify_layout(const char* op, const Tensor& draft_tokens, const Tensor& parents,
                                     const Tensor& target_logits, const std::optional<Tensor>& draft_probs,
                                     const Tensor& temperature, const Tensor& uniforms) {
  check_contiguous(draft_tokens, op, "draft_tokens");
  check_contiguous(parents, op, "parents");
  check_contiguous(target_logits, op, "target_logits");
  if (draft_probs.has_value()) check_contiguous(*draft_probs, op, "draft_probs");
  check_contiguous(temperature, op, "temperature");
  check_contiguous(uniforms, op, "uniforms");
}

// Values (one host copy each; no per-element ATen ops): parents form a tree rooted at node 0 in
// topological order, token ids of the draft nodes are in [0, V), temperatures > 0 when sampling,
// uniforms in [0, 1).
inline void check_tree_verify_values(const char* op, const Tensor& draft_tokens, const Tensor& parents,
                                     int64_t vocab, const Tensor& temperature, const Tensor& uniforms,
                                     bool greedy) {
  if (draft_tokens.numel() == 0 || !check_indices_enabled(draft_tokens)) return;
  const auto par_t = to_cpu(parents, kLong);
  const auto tok_t = to_cpu(draft_tokens, kLong);
  const int64_t* par = par_t.const_data_ptr<int64_t>();
  const int64_t* tok = tok_t.const_data_ptr<int64_t>();
  const int64_t B = par_t.size(0), N = par_t.size(1);
  for (int64_t b = 0; b < B; ++b) {
    FI_CHECK(par[b * N] == -1, op, "parents[", b, ", 0] must be -1 (node 0 is the root), got ", par[b * N]);
    for (int64_t i = 1; i < N; ++i) {
      const int64_t pi = par[b * N + i];
      FI_CHECK(pi >= 0 && pi < i, op, "parents[", b, ", ", i, "] = ", pi, " must be in [0, ", i,
               "): nodes must be in topological order (parent index < child index) forming a tree rooted at node 0");
      const int64_t t = tok[b * N + i];
      FI_CHECK(t >= 0 && t < vocab, op, "draft_tokens[", b, ", ", i, "] = ", t, " is not a token id in [0, ", vocab,
               ") (vocab = target_logits.size(2))");
    }
  }
  if (!greedy) {
    const auto temp_t = to_cpu(temperature, kFloat);
    const float* temp = temp_t.const_data_ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      FI_CHECK(std::isfinite(temp[b]) && temp[b] > 0.f, op, "temperature[", b, "] = ", temp[b],
               " must be a finite number > 0 when sampling (use greedy=True for temperature 0)");
  }
  const auto u_t = to_cpu(uniforms, kFloat);
  const float* u = u_t.const_data_ptr<float>();
  for (int64_t i = 0; i < u_t.numel(); ++i)
    FI_CHECK(u[i] >= 0.f && u[i] < 1.f, op, "uniforms must be in [0, 1), got ", u[i], " at flat index ", i,
             " (e.g. torch.rand)");
}

// target_logits holds finite values or -inf (masked tokens): its largest value (one ATen max, which
// propagates NaN) must be neither NaN nor +inf. Checked where the index values are.
inline void check_tree_verify_logits(const char* op, const Tensor& target_logits) {
  if (target_logits.numel() == 0 || !check_indices_enabled(target_logits)) return;
  const float top = scalar_value(aten_call("aten::max", "", target_logits)[0]);
  FI_CHECK(!std::isnan(top) && top != INFINITY, op, "target_logits must be finite or -inf, got ",
           std::isnan(top) ? "a NaN" : "+inf");
}

}  // namespace fastinfer::binding
