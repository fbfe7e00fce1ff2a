// THE op catalogue: every schema of fastinfer, in one place, with mutation annotations.
// Compiled into fastinfer._C as namespace `fastinfer` and into fastinfer._sim as `fastinfer_sim`
// (same schemas; the sim namespace runs the CUDA kernels on CPU tensors through cpp/simt).
// Also the Meta kernels (fake impls), so torch.compile and opcheck trace through every op.
#include <torch/library.h>

#include "validate_attention.h"
#include "validate_dense.h"
#include "validate_fp8.h"
#include "validate_tree_verify.h"
#include "validate_int4.h"
#include "validate_int8.h"

namespace fastinfer::binding {
namespace {

// Meta kernels: same shape/dtype rules as the real ones (symbolic sizes), outputs allocated empty.
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm", x, weight, eps, /*allow_fp32=*/true);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

void rms_norm_out_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm_out", x, weight, eps, true);
  validate_like("rms_norm_out", out, "out", x, "x");
}

void fused_add_rms_norm_meta(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  validate_rms_norm("fused_add_rms_norm", x, weight, eps, true);
  validate_like("fused_add_rms_norm", residual, "residual", x, "x");
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  validate_silu_and_mul("silu_and_mul", x, true);
  return at::empty_symint(silu_and_mul_out_shape(x), x.options());
}

void silu_and_mul_out_meta(at::Tensor& out, const at::Tensor& x) {
  validate_silu_and_mul_out("silu_and_mul_out", out, x, true);
}

void rotary_embedding_meta(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                           const at::Tensor& cos_sin_cache, bool is_neox) {
  validate_rotary_embedding("rotary_embedding", positions, q, k, cos_sin_cache, true);
}

void reshape_and_cache_meta(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  validate_reshape_and_cache("reshape_and_cache", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, true);
}

// Attention: out like q; lse [rows, Hq] float32 when asked for, else an empty [0] tensor.
std::tuple<at::Tensor, at::Tensor> attention_outputs_meta(const at::Tensor& q, bool return_lse) {
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto lse = return_lse ? at::empty_symint({q.sym_size(0), q.sym_size(1)}, q.options().dtype(at::kFloat))
                        : at::empty({0}, q.options().dtype(at::kFloat));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> prefill_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                          int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                          bool causal, int64_t window_left, double softcap,
                                                          bool return_lse, int64_t fixed_split_size) {
  validate_prefill_attention("prefill_attention", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, true,
                             fixed_split_size);
  return attention_outputs_meta(q, return_lse);
}

std::tuple<at::Tensor, at::Tensor> paged_prefill_attention_meta(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& custom_mask, bool return_lse,
    const std::optional<at::Tensor>& packed_custom_mask, int64_t fixed_split_size) {
  validate_paged_prefill_attention("paged_prefill_attention", q, k_cache, v_cache, block_table, cu_seqlens_q,
                                   seq_lens_k, max_seqlen_q, custom_mask, packed_custom_mask, true, fixed_split_size);
  return attention_outputs_meta(q, return_lse);
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention_meta(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
    const at::Tensor& seq_lens, double scale, int64_t window_left, double softcap, int64_t num_splits,
    bool return_lse, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    int64_t fixed_split_size) {
  validate_paged_decode_attention("paged_decode_attention", q, k_cache, v_cache, block_table, seq_lens, num_splits,
                                  k_scale, v_scale, true, fixed_split_size);
  return attention_outputs_meta(q, return_lse);
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_meta(const at::Tensor& v_a, const at::Tensor& lse_a,
                                                               const at::Tensor& v_b, const at::Tensor& lse_b) {
  validate_merge_attention_states("merge_attention_states", v_a, lse_a, v_b, lse_b);
  return {at::empty_like(v_a, at::MemoryFormat::Contiguous), at::empty_like(lse_a, at::MemoryFormat::Contiguous)};
}

void move_kv_slots_meta(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& src_slots,
                        const at::Tensor& dst_slots) {
  validate_move_kv_slots("move_kv_slots", k_cache, v_cache, src_slots, dst_slots);
}

// ---- FP8 GEMM (docs/design.md "GEMM") ----
std::tuple<at::Tensor, at::Tensor> fp8_quantize_meta(const at::Tensor& x, c10::string_view mode, int64_t group_size,
                                                     const std::optional<at::Tensor>& scale) {
  const Fp8Mode m = validate_fp8_quantize("fp8_quantize", x, mode, group_size, scale, true);
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(at::kFloat8_e4m3fn)),
          at::empty_symint(fp8_quantize_scale_shape(x, m, group_size), x.options().dtype(at::kFloat))};
}

at::Tensor fp8_scaled_mm_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                              const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                              bool deterministic) {
  validate_fp8_scaled_mm("fp8_scaled_mm", a, b, scale_a, scale_b, out_dtype, bias, true);
  return at::empty_symint({a.sym_size(0), b.sym_size(0)}, a.options().dtype(out_dtype));
}
// ---- end FP8 GEMM ----

// ---- INT8 GEMM (docs/design.md "GEMM"): azp is int32 [M] when symmetric=False, else an empty [0] ----
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_quantize_meta(const at::Tensor& x, c10::string_view mode,
                                                                  const std::optional<at::Tensor>& scale, bool symmetric) {
  const Int8Mode m = validate_int8_quantize("int8_quantize", x, mode, scale, symmetric, true);
  auto azp = symmetric ? at::empty({0}, x.options().dtype(at::kInt))
                       : at::empty_symint({x.sym_size(0)}, x.options().dtype(at::kInt));
  return {at::empty_symint(x.sym_sizes(), x.options().dtype(at::kChar)),
          at::empty_symint(int8_quantize_scale_shape(x, m), x.options().dtype(at::kFloat)), azp};
}

at::Tensor int8_scaled_mm_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, at::ScalarType out_dtype, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& azp_adj, const std::optional<at::Tensor>& azp,
                               bool deterministic) {
  validate_int8_scaled_mm("int8_scaled_mm", a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, true);
  return at::empty_symint({a.sym_size(0), b.sym_size(0)}, a.options().dtype(out_dtype));
}

// ---- dense (batch-invariant) GEMM: out [M, N] in the dtype of a ----
at::Tensor dense_mm_meta(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  validate_dense_mm("dense_mm", a, b, bias, true);
  return at::empty_symint({a.sym_size(0), b.sym_size(0)}, a.options());
}

// ---- speculative decoding (tree_verify): outputs have the index dtype of draft_tokens ----------
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_meta(const at::Tensor& draft_tokens,
                                                                const at::Tensor& parents,
                                                                const at::Tensor& target_logits,
                                                                const std::optional<at::Tensor>& draft_probs,
                                                                const at::Tensor& temperature,
                                                                const at::Tensor& uniforms, bool greedy) {
  validate_tree_verify("tree_verify", draft_tokens, parents, target_logits, draft_probs, temperature, uniforms);
  const auto B = draft_tokens.sym_size(0);
  return {at::empty_symint({B, draft_tokens.sym_size(1)}, draft_tokens.options()),
          at::empty_symint({B}, draft_tokens.options()), at::empty_symint({B}, draft_tokens.options())};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY(FASTINFER_NS, m) {
  // Fused elementwise ops around the big kernels (docs/design.md "Fused elementwise").
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, bool is_neox=True) -> ()");
  // Attention-side cache maintenance.
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.def("move_kv_slots(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src_slots, Tensor dst_slots) -> ()");
  // Attention (docs/design.md "Attention"). lse is float32 [rows, Hq] when return_lse, else empty [0].
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float scale, bool causal, int window_left=-1, float softcap=0.0, "
        "bool return_lse=False, int fixed_split_size=0) -> (Tensor out, Tensor lse)");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, int max_seqlen_q, float scale, bool causal, int window_left=-1, "
        "float softcap=0.0, Tensor? custom_mask=None, bool return_lse=False, Tensor? packed_custom_mask=None, "
        "int fixed_split_size=0) -> (Tensor out, Tensor lse)");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window_left=-1, float softcap=0.0, int num_splits=0, bool return_lse=False, "
        "Tensor? k_scale=None, Tensor? v_scale=None, int fixed_split_size=0) -> (Tensor out, Tensor lse)");
  m.def("merge_attention_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b) -> (Tensor v, Tensor lse)");
  // FP8 W8A8 (docs/design.md "GEMM"): dynamic e4m3 quantisation and the scaled e4m3 matmul.
  m.def("fp8_quantize(Tensor x, str mode='token', int group_size=128, Tensor? scale=None) -> (Tensor x_fp8, Tensor scale)");
  m.def("fp8_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, Tensor? bias=None, "
        "bool deterministic=False) -> Tensor");
  // INT8 W8A8 (docs/design.md "GEMM"): dynamic int8 quantisation (zero points when symmetric=False; azp is
  // an empty [0] tensor otherwise) and the scaled int8 matmul (int32 accumulation).
  m.def("int8_quantize(Tensor x, str mode='token', Tensor? scale=None, bool symmetric=True) -> (Tensor x_int8, "
        "Tensor scale, Tensor azp)");
  m.def("int8_scaled_mm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype, Tensor? bias=None, "
        "Tensor? azp_adj=None, Tensor? azp=None, bool deterministic=False) -> Tensor");
  // Speculative decoding (docs/design.md "Speculative decoding").
  m.def("tree_verify(Tensor draft_tokens, Tensor parents, Tensor target_logits, Tensor? draft_probs, "
        "Tensor temperature, Tensor uniforms, bool greedy) -> (Tensor accepted_nodes, Tensor num_accepted, "
        "Tensor next_token)");
  // INT4 W4A16 GEMM (docs/design.md "GEMM"; layout in cuda/include/fastinfer/gemm/int4.h). Extensions:
  // int4_repack takes g_idx (GPTQ act-order) and also returns perm (int64 [K], empty without g_idx);
  // int4_gemm takes perm and multiplies a[:, perm].
  m.def("int4_pack(Tensor w_q) -> Tensor");
  m.def("int4_repack(Tensor qweight, Tensor qzeros, str fmt, Tensor? g_idx=None) -> (Tensor packed, Tensor zeros, "
        "Tensor perm)");
  m.def("int4_gemm(Tensor a, Tensor packed, Tensor scales, Tensor? zeros, int group_size=128, Tensor? perm=None, "
        "bool deterministic=False) -> Tensor");
  // Dense fp16 / bf16 (fp32 on CPU) GEMM, b [N, K] in nn.Linear layout, fp32 accumulation: batch
  // invariant (a row's bits never depend on M), the float linears of the deterministic mode.
  m.def("dense_mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
}

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, Meta, m) {
  using namespace fastinfer::binding;
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rms_norm_out", &rms_norm_out_meta);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("silu_and_mul_out", &silu_and_mul_out_meta);
  m.impl("rotary_embedding", &rotary_embedding_meta);
  m.impl("reshape_and_cache", &reshape_and_cache_meta);
  m.impl("move_kv_slots", &move_kv_slots_meta);
  m.impl("prefill_attention", &prefill_attention_meta);
  m.impl("paged_prefill_attention", &paged_prefill_attention_meta);
  m.impl("paged_decode_attention", &paged_decode_attention_meta);
  m.impl("merge_attention_states", &merge_attention_states_meta);
  m.impl("fp8_quantize", &fp8_quantize_meta);
  m.impl("fp8_scaled_mm", &fp8_scaled_mm_meta);
  m.impl("int8_quantize", &int8_quantize_meta);
  m.impl("int8_scaled_mm", &int8_scaled_mm_meta);
  m.impl("tree_verify", &tree_verify_meta);
  m.impl("int4_pack", &int4_pack_meta);
  m.impl("int4_repack", &int4_repack_meta);
  m.impl("int4_gemm", &int4_gemm_meta);
  m.impl("dense_mm", &dense_mm_meta);
}
