// THE op catalogue: every schema of fastinfer, in one place, with mutation annotations.
// Compiled into fastinfer._C as namespace `fastinfer` and into fastinfer._sim / fastinfer._simprof
// as `fastinfer_sim` / `fastinfer_simprof` (same schemas; the sim namespaces run the CUDA kernels on
// CPU tensors through cpp/simt). The fake impls (output shapes for torch.compile and opcheck) are
// Python: python/fastinfer/ops/_fake.py, one per schema here.
#include "common.h"

FASTINFER_LIBRARY(m) {
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
