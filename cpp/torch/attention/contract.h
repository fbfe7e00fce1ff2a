#pragma once
// Shape/dtype/device rules of the attention ops (shared by the CPU and CUDA impls)
// and the host-side value checks of their index tensors (cu_seqlens, seq_lens, block ids, mask
// sizes), which run on CPU tensors always and on CUDA tensors when FASTINFER_CHECK_INDICES=1.
#include <climits>
#include <cmath>

#include "elementwise/contract.h"

namespace fastinfer::binding {

// The schemas of the attention ops (schema.cpp registers them for every module).
inline void define_attention_ops(StableLibrary& m) {
  m.def("move_kv_slots(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src_slots, Tensor dst_slots) -> ()");
  // Attention (docs/design.md "Attention"). lse is float32 [rows, Hq] when return_lse, else empty [0].
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float scale, bool causal, int window_left=-1, float softcap=0.0, "
        "bool return_lse=False, int fixed_split_size=0, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, int max_seqlen_q, float scale, bool causal, int window_left=-1, "
        "float softcap=0.0, Tensor? custom_mask=None, bool return_lse=False, Tensor? packed_custom_mask=None, "
        "int fixed_split_size=0, Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> (Tensor out, Tensor lse)");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window_left=-1, float softcap=0.0, int num_splits=0, bool return_lse=False, "
        "Tensor? k_scale=None, Tensor? v_scale=None, int fixed_split_size=0, Tensor? sinks=None) -> (Tensor out, Tensor lse)");
  m.def("merge_attention_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b, Tensor? mask=None) -> (Tensor v, "
        "Tensor lse)");
  // Multi-head latent attention (DeepSeek-V3's MLA): one [kv_c | k_pe] row of 576 values per token.
  // kv_scale is written by the cache write when it is per token ([NB, BS]), read when per tensor.
  m.def("mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor(b!)? kv_scale=None) -> ()");
  m.def("mla_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor cu_seqlens_q, "
        "float scale, bool causal=True, Tensor? custom_mask=None, int num_splits=0, bool return_lse=False, "
        "Tensor? kv_scale=None, int fixed_split_size=0) -> (Tensor out, Tensor lse)");
}

inline bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// q [T, Hq, D] and a [*, Hkv, D] K or V source (a ragged tensor or a paged cache).
inline void validate_attention_q(const char* op, const Tensor& q, bool allow_fp32) {
  check_dim(q, 3, op, "q", "[num_tokens, num_q_heads, head_dim]");
  check_activation_dtype(q, allow_fp32, op, "q");
  const auto d = q.size(2);
  FI_CHECK(d == 64 || d == 128 || d == 256, op, "q must have head_dim 64, 128 or 256, got shape ", shape_str(q));
}

inline void validate_kv_heads(const char* op, const Tensor& q, const int64_t& num_kv_heads,
                              const int64_t& head_dim, const char* name, const Tensor& t) {
  FI_CHECK(head_dim == q.size(2), op, name, " must have head_dim ", q.size(2), " (that of q), got shape ",
           shape_str(t));
  FI_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, op, "num_q_heads (", q.size(1),
           ") must be a multiple of num_kv_heads (", num_kv_heads, ") of ", name, ", got shape ", shape_str(t));
}

inline void validate_index_vector(const char* op, const Tensor& t, const char* name, const char* layout,
                                  const Tensor& anchor) {
  check_dim(t, 1, op, name, layout);
  FI_CHECK(t.scalar_type() == kInt, op, name, " must be int32, got ", t.scalar_type());
  check_same_device(t, anchor, op, name, "q");
}

// Deterministic mode (attention.h): 0, or a positive multiple of the kernels' key tile.
constexpr int64_t kFixedSplitTile = 64;

inline void validate_fixed_split_size(const char* op, int64_t fixed_split_size) {
  FI_CHECK(fixed_split_size == 0 || (fixed_split_size > 0 && fixed_split_size % kFixedSplitTile == 0 &&
                                     fixed_split_size <= (int64_t{1} << 30)),
           op, "fixed_split_size must be 0 (default, batch-dependent splits) or a positive multiple of ",
           kFixedSplitTile, " (the kernels' key tile, at most 2^30) for the deterministic mode, got ", fixed_split_size);
}

// Attention sinks (attention.h): float32 [num_q_heads], one logit per query head.
inline void validate_sinks(const char* op, const std::optional<Tensor>& sinks, const Tensor& q) {
  if (!sinks.has_value()) return;
  FI_CHECK(sinks->scalar_type() == kFloat, op, "sinks must be float32 (one logit per query head), got ",
           sinks->scalar_type());
  FI_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), op, "sinks must have shape [num_q_heads] = [", q.size(1),
           "], got ", shape_str(*sinks));
  check_same_device(*sinks, q, op, "sinks", "q");
  check_contiguous(*sinks, op, "sinks");
}

// The attention ops' scalar options: the softmax scale a finite number, window_left >= -1 (-1: no
// sliding window), softcap finite and >= 0 (0: no soft cap). A NaN is refused, never read as "off".
inline void validate_attention_options(const char* op, double scale, int64_t window_left, double softcap) {
  FI_CHECK(std::isfinite(scale), op, "scale must be a finite number, got ", scale);
  FI_CHECK(window_left >= -1, op, "window_left must be >= -1 (-1: no sliding window), got ", window_left);
  FI_CHECK(std::isfinite(softcap) && softcap >= 0, op, "softcap must be a finite number >= 0 (0: no soft cap), got ",
           softcap);
}

// max_seqlen_q sizes the kernels' grids in 32-bit arithmetic.
inline void validate_max_seqlen(const char* op, int64_t value, const char* name) {
  FI_CHECK(value >= 0 && value <= INT32_MAX, op, name, " must be in [0, 2^31 - 1], got ", value);
}

inline void validate_prefill_attention(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                       int64_t max_seqlen_q, bool allow_fp32, int64_t fixed_split_size,
                                       const std::optional<Tensor>& sinks) {
  validate_attention_q(op, q, allow_fp32);
  check_dim(k, 3, op, "k", "[num_key_tokens, num_kv_heads, head_dim]");
  validate_kv_heads(op, q, k.size(1), k.size(2), "k", k);
  validate_like(op, v, "v", k, "k");
  check_same_dtype(k, q, op, "k", "q");
  check_same_device(k, q, op, "k", "q");
  validate_index_vector(op, cu_seqlens_q, "cu_seqlens_q", "[batch + 1]", q);
  validate_index_vector(op, cu_seqlens_k, "cu_seqlens_k", "[batch + 1]", q);
  FI_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0) && cu_seqlens_q.size(0) >= 1, op,
           "cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries, got ", shape_str(cu_seqlens_q), " and ",
           shape_str(cu_seqlens_k));
  validate_max_seqlen(op, max_seqlen_q, "max_seqlen_q");
  validate_fixed_split_size(op, fixed_split_size);
  validate_sinks(op, sinks, q);
}

inline void validate_paged_kv(const char* op, const Tensor& q, const Tensor& k_cache,
                              const Tensor& v_cache, const Tensor& block_table, bool allow_fp8) {
  check_dim(k_cache, 4, op, "k_cache", "[num_blocks, block_size, num_kv_heads, head_dim]");
  validate_kv_heads(op, q, k_cache.size(2), k_cache.size(3), "k_cache", k_cache);
  validate_like(op, v_cache, "v_cache", k_cache, "k_cache");
  check_same_device(k_cache, q, op, "k_cache", "q");
  const bool fp8 = k_cache.scalar_type() == kFloat8_e4m3fn;
  FI_CHECK(k_cache.scalar_type() == q.scalar_type() || (allow_fp8 && fp8), op, "k_cache must have the dtype of q (",
           q.scalar_type(), ")", allow_fp8 ? " or float8_e4m3fn" : "", ", got ", k_cache.scalar_type());
  const auto bs = k_cache.size(1);
  FI_CHECK(bs >= 8 && bs <= 256 && is_pow2(bs), op,
           "k_cache must have a power-of-two block_size in [8, 256] (dim 1), got shape ", shape_str(k_cache));
  check_dim(block_table, 2, op, "block_table", "[batch, max_blocks_per_seq]");
  FI_CHECK(block_table.scalar_type() == kInt, op, "block_table must be int32, got ", block_table.scalar_type());
  check_same_device(block_table, q, op, "block_table", "q");
}

inline void validate_paged_prefill_attention(const char* op, const Tensor& q, const Tensor& k_cache,
                                             const Tensor& v_cache, const Tensor& block_table,
                                             const Tensor& cu_seqlens_q, const Tensor& seq_lens_k,
                                             int64_t max_seqlen_q, const std::optional<Tensor>& custom_mask,
                                             const std::optional<Tensor>& packed_custom_mask, bool allow_fp32,
                                             int64_t fixed_split_size, const std::optional<Tensor>& sinks,
                                             const std::optional<Tensor>& k_scale,
                                             const std::optional<Tensor>& v_scale) {
  validate_attention_q(op, q, allow_fp32);
  validate_paged_kv(op, q, k_cache, v_cache, block_table, /*allow_fp8=*/true);
  validate_kv_cache_scales(op, k_cache, q, "q", k_scale, v_scale);
  validate_index_vector(op, cu_seqlens_q, "cu_seqlens_q", "[batch + 1]", q);
  validate_index_vector(op, seq_lens_k, "seq_lens_k", "[batch]", q);
  FI_CHECK(cu_seqlens_q.size(0) == seq_lens_k.size(0) + 1, op, "cu_seqlens_q must have batch + 1 = ",
           seq_lens_k.size(0) + 1, " entries (seq_lens_k has ", seq_lens_k.size(0), "), got ",
           shape_str(cu_seqlens_q));
  FI_CHECK(block_table.size(0) == seq_lens_k.size(0), op, "block_table must have batch = ",
           seq_lens_k.size(0), " rows, got shape ", shape_str(block_table));
  validate_max_seqlen(op, max_seqlen_q, "max_seqlen_q");
  if (custom_mask.has_value()) {
    check_dim(*custom_mask, 1, op, "custom_mask", "[sum of q_len^2] (per sequence a flattened [q_len, q_len] bool block)");
    FI_CHECK(custom_mask->scalar_type() == kBool, op, "custom_mask must be bool, got ", custom_mask->scalar_type());
    check_same_device(*custom_mask, q, op, "custom_mask", "q");
  }
  if (packed_custom_mask.has_value()) {
    FI_CHECK(!custom_mask.has_value(), op, "custom_mask and packed_custom_mask are two forms of the same mask: give one");
    check_dim(*packed_custom_mask, 1, op, "packed_custom_mask",
              "[ceil(sum of q_len^2 / 8)] (the flattened bool mask, 8 entries per byte, little-endian bit order)");
    FI_CHECK(packed_custom_mask->scalar_type() == kByte, op,
             "packed_custom_mask must be uint8 (8 mask entries per byte), got ", packed_custom_mask->scalar_type());
    check_same_device(*packed_custom_mask, q, op, "packed_custom_mask", "q");
  }
  validate_fixed_split_size(op, fixed_split_size);
  validate_sinks(op, sinks, q);
}

inline void validate_paged_decode_attention(const char* op, const Tensor& q, const Tensor& k_cache,
                                            const Tensor& v_cache, const Tensor& block_table,
                                            const Tensor& seq_lens, int64_t num_splits,
                                            const std::optional<Tensor>& k_scale,
                                            const std::optional<Tensor>& v_scale, bool allow_fp32,
                                            int64_t fixed_split_size, const std::optional<Tensor>& sinks) {
  validate_attention_q(op, q, allow_fp32);
  validate_paged_kv(op, q, k_cache, v_cache, block_table, /*allow_fp8=*/true);
  validate_index_vector(op, seq_lens, "seq_lens", "[batch]", q);
  FI_CHECK(seq_lens.size(0) == q.size(0), op, "seq_lens must have batch = q.size(0) = ", q.size(0),
           " entries, got ", shape_str(seq_lens));
  FI_CHECK(block_table.size(0) == q.size(0), op, "block_table must have batch = q.size(0) = ", q.size(0),
           " rows, got shape ", shape_str(block_table));
  FI_CHECK(num_splits >= 0 && num_splits <= 256, op, "num_splits must be in [0, 256] (0 = automatic), got ", num_splits);
  validate_kv_cache_scales(op, k_cache, q, "q", k_scale, v_scale);
  validate_fixed_split_size(op, fixed_split_size);
  FI_CHECK(fixed_split_size == 0 || num_splits == 0, op,
           "num_splits must be 0 when fixed_split_size > 0 (the keys are then split every fixed_split_size keys), got ",
           num_splits);
  validate_sinks(op, sinks, q);
}

// ---- multi-head latent attention (cuda/include/fastinfer/attention/mla.h) ---------------------
// A cache row is the compressed latent kv_c (kLatentDim) followed by the roped key part k_pe
// (kRopeDim): the key is the whole row, the value its latent part.
constexpr int64_t kMlaLatentDim = 512;
constexpr int64_t kMlaRopeDim = 64;
constexpr int64_t kMlaRowDim = kMlaLatentDim + kMlaRopeDim;

inline void validate_mla_cache(const char* op, const Tensor& kv_cache, const Tensor& ref, const char* ref_name) {
  check_dim(kv_cache, 3, op, "kv_cache", "[num_blocks, block_size, 576] (kv_c then k_pe per token)");
  FI_CHECK(kv_cache.size(2) == kMlaRowDim, op, "kv_cache must have ", kMlaRowDim, " values per token (",
           kMlaLatentDim, " latent + ", kMlaRopeDim, " rotary), got shape ", shape_str(kv_cache));
  const auto bs = kv_cache.size(1);
  FI_CHECK(bs >= 8 && bs <= 256 && is_pow2(bs), op,
           "kv_cache must have a power-of-two block_size in [8, 256] (dim 1), got shape ", shape_str(kv_cache));
  const bool fp8 = kv_cache.scalar_type() == kFloat8_e4m3fn;
  FI_CHECK(fp8 || kv_cache.scalar_type() == ref.scalar_type(), op, "kv_cache must have the dtype of ", ref_name, " (",
           ref.scalar_type(), ") or float8_e4m3fn, got ", kv_cache.scalar_type());
  check_same_device(kv_cache, ref, op, "kv_cache", ref_name);
}

// kv_scale of an fp8 latent cache: float32, 1 element (per tensor) or [num_blocks, block_size] (per
// token); None with a cache in the activations' dtype.
inline void validate_mla_kv_scale(const char* op, const Tensor& kv_cache, const Tensor& ref, const char* ref_name,
                                  const std::optional<Tensor>& kv_scale) {
  if (kv_cache.scalar_type() != kFloat8_e4m3fn) {
    FI_CHECK(!kv_scale.has_value(), op, "kv_scale must be None unless kv_cache is float8_e4m3fn (kv_cache dtype is ",
             kv_cache.scalar_type(), ")");
    return;
  }
  FI_CHECK(kv_scale.has_value(), op,
           "kv_scale is required with a float8_e4m3fn kv_cache (float32, 1 element per tensor or [num_blocks, "
           "block_size] per token)");
  const Tensor& s = *kv_scale;
  const bool per_tensor = s.dim() <= 1 && s.numel() == 1;
  const bool per_token = s.dim() == 2 && s.size(0) == kv_cache.size(0) && s.size(1) == kv_cache.size(1);
  FI_CHECK(s.scalar_type() == kFloat && (per_tensor || per_token), op,
           "kv_scale must be float32 with 1 element (per tensor) or shape [num_blocks, block_size] = [",
           kv_cache.size(0), ", ", kv_cache.size(1), "] (per token), got ", s.scalar_type(), " ", shape_str(s));
  check_same_device(s, ref, op, "kv_scale", ref_name);
  check_contiguous(s, op, "kv_scale");
}

inline bool mla_scale_per_token(const std::optional<Tensor>& kv_scale) {
  return kv_scale.has_value() && kv_scale->dim() == 2;
}

inline void validate_mla_cache_write(const char* op, const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                                     const Tensor& slot_mapping, const std::optional<Tensor>& kv_scale,
                                     bool allow_fp32) {
  check_dim(kv_c, 2, op, "kv_c", "[num_tokens, 512]");
  check_activation_dtype(kv_c, allow_fp32, op, "kv_c");
  FI_CHECK(kv_c.size(1) == kMlaLatentDim, op, "kv_c must have ", kMlaLatentDim, " latent values per token, got shape ",
           shape_str(kv_c));
  check_dim(k_pe, 2, op, "k_pe", "[num_tokens, 64]");
  FI_CHECK(k_pe.size(1) == kMlaRopeDim, op, "k_pe must have ", kMlaRopeDim, " rotary values per token, got shape ",
           shape_str(k_pe));
  FI_CHECK(k_pe.size(0) == kv_c.size(0), op, "k_pe must have num_tokens = ", kv_c.size(0),
           " rows (those of kv_c), got shape ", shape_str(k_pe));
  check_same_dtype(k_pe, kv_c, op, "k_pe", "kv_c");
  check_same_device(k_pe, kv_c, op, "k_pe", "kv_c");
  validate_mla_cache(op, kv_cache, kv_c, "kv_c");
  check_dim(slot_mapping, 1, op, "slot_mapping", "[num_tokens]");
  check_dtype_in(slot_mapping, {kInt, kLong}, op, "slot_mapping");
  FI_CHECK(slot_mapping.size(0) == kv_c.size(0), op, "slot_mapping must have num_tokens = ", kv_c.size(0),
           " entries (kv_c.size(0)), got ", shape_str(slot_mapping));
  check_same_device(slot_mapping, kv_c, op, "slot_mapping", "kv_c");
  validate_mla_kv_scale(op, kv_cache, kv_c, "kv_c", kv_scale);
}

// Layout rules (real strides): kv_c and k_pe rows with any row stride (slices of the fused
// projection output), the cache and the slots contiguous.
inline void check_mla_cache_write_layout(const char* op, const Tensor& kv_c, const Tensor& k_pe,
                                         const Tensor& kv_cache, const Tensor& slot_mapping) {
  check_rows(kv_c, op, "kv_c");
  check_rows(k_pe, op, "k_pe");
  check_contiguous(kv_cache, op, "kv_cache");
  check_contiguous(slot_mapping, op, "slot_mapping");
}

inline void validate_mla_decode_attention(const char* op, const Tensor& q, const Tensor& kv_cache,
                                          const Tensor& block_table, const Tensor& seq_lens,
                                          const Tensor& cu_seqlens_q, const std::optional<Tensor>& custom_mask,
                                          int64_t num_splits, const std::optional<Tensor>& kv_scale,
                                          int64_t fixed_split_size, bool allow_fp32) {
  check_dim(q, 3, op, "q", "[num_tokens, num_heads, 576] (absorbed q_nope then roped q_pe)");
  check_activation_dtype(q, allow_fp32, op, "q");
  FI_CHECK(q.size(2) == kMlaRowDim, op, "q must have ", kMlaRowDim, " values per head (", kMlaLatentDim,
           " absorbed latent + ", kMlaRopeDim, " rotary), got shape ", shape_str(q));
  FI_CHECK(q.size(1) >= 1, op, "q must have at least one head, got shape ", shape_str(q));
  validate_mla_cache(op, kv_cache, q, "q");
  validate_mla_kv_scale(op, kv_cache, q, "q", kv_scale);
  check_dim(block_table, 2, op, "block_table", "[batch, max_blocks_per_seq]");
  FI_CHECK(block_table.scalar_type() == kInt, op, "block_table must be int32, got ", block_table.scalar_type());
  check_same_device(block_table, q, op, "block_table", "q");
  validate_index_vector(op, seq_lens, "seq_lens", "[batch]", q);
  validate_index_vector(op, cu_seqlens_q, "cu_seqlens_q", "[batch + 1]", q);
  FI_CHECK(cu_seqlens_q.size(0) == seq_lens.size(0) + 1, op, "cu_seqlens_q must have batch + 1 = ",
           seq_lens.size(0) + 1, " entries (seq_lens has ", seq_lens.size(0), "), got ", shape_str(cu_seqlens_q));
  FI_CHECK(block_table.size(0) == seq_lens.size(0), op, "block_table must have batch = ", seq_lens.size(0),
           " rows, got shape ", shape_str(block_table));
  if (custom_mask.has_value()) {
    check_dim(*custom_mask, 1, op, "custom_mask", "[sum of q_len^2] (per sequence a flattened [q_len, q_len] bool block)");
    FI_CHECK(custom_mask->scalar_type() == kBool, op, "custom_mask must be bool, got ", custom_mask->scalar_type());
    check_same_device(*custom_mask, q, op, "custom_mask", "q");
  }
  FI_CHECK(num_splits >= 0 && num_splits <= 256, op, "num_splits must be in [0, 256] (0 = automatic), got ", num_splits);
  validate_fixed_split_size(op, fixed_split_size);
  FI_CHECK(fixed_split_size == 0 || num_splits == 0, op,
           "num_splits must be 0 when fixed_split_size > 0 (the keys are then split every fixed_split_size keys), got ",
           num_splits);
}

// mask: which tokens take state b (FlashInfer's merge_state_in_place mask); the others keep state a.
inline void validate_merge_attention_states(const char* op, const Tensor& v_a, const Tensor& lse_a,
                                            const Tensor& v_b, const Tensor& lse_b,
                                            const std::optional<Tensor>& mask) {
  check_dim(v_a, 3, op, "v_a", "[num_tokens, num_heads, head_dim]");
  check_dtype_in(v_a, {kHalf, kBFloat16, kFloat}, op, "v_a");
  FI_CHECK(v_a.size(2) > 0, op, "v_a must have head_dim > 0, got shape ", shape_str(v_a));
  validate_like(op, v_b, "v_b", v_a, "v_a");
  check_dim(lse_a, 2, op, "lse_a", "[num_tokens, num_heads]");
  FI_CHECK(lse_a.scalar_type() == kFloat, op, "lse_a must be float32, got ", lse_a.scalar_type());
  FI_CHECK(lse_a.size(0) == v_a.size(0) && lse_a.size(1) == v_a.size(1), op,
           "lse_a must have shape [num_tokens, num_heads] = [", v_a.size(0), ", ", v_a.size(1), "], got ",
           shape_str(lse_a));
  check_same_device(lse_a, v_a, op, "lse_a", "v_a");
  validate_like(op, lse_b, "lse_b", lse_a, "lse_a");
  if (mask.has_value()) {
    check_dim(*mask, 1, op, "mask", "[num_tokens]");
    check_dtype_in(*mask, {kBool}, op, "mask");
    FI_CHECK(mask->size(0) == v_a.size(0), op, "mask must have shape [num_tokens] = [", v_a.size(0), "], got ",
             shape_str(*mask));
    check_same_device(*mask, v_a, op, "mask", "v_a");
  }
}

inline void validate_move_kv_slots(const char* op, const Tensor& k_cache, const Tensor& v_cache,
                                   const Tensor& src_slots, const Tensor& dst_slots) {
  check_dim(k_cache, 4, op, "k_cache", "[num_blocks, block_size, num_kv_heads, head_dim]");
  validate_like(op, v_cache, "v_cache", k_cache, "k_cache");
  for (const auto& [t, name] : {std::pair{&src_slots, "src_slots"}, {&dst_slots, "dst_slots"}}) {
    check_dim(*t, 1, op, name, "[num_moves]");
    check_dtype_in(*t, {kInt, kLong}, op, name);
    check_same_device(*t, k_cache, op, name, "k_cache");
  }
  FI_CHECK(src_slots.size(0) == dst_slots.size(0), op, "dst_slots must have as many entries as src_slots (",
           src_slots.size(0), "), got ", shape_str(dst_slots));
  check_same_dtype(dst_slots, src_slots, op, "dst_slots", "src_slots");
}

// The index tensors (cu_seqlens_*, seq_lens*, block_table) may have any strides on every backend:
// a strided one is read through a contiguous copy (a few hundred bytes).
inline Tensor index_layout(const Tensor& t) { return torch::stable::contiguous(t); }

// ---- host-side value checks (CPU tensors always; CUDA with FASTINFER_CHECK_INDICES=1) ---------
inline void check_cu_seqlens(const char* op, const Tensor& cu, const char* name, int64_t total,
                             int64_t max_len, const char* max_name) {
  const auto c = to_cpu(cu, kLong);
  const int64_t* p = c.const_data_ptr<int64_t>();
  const int64_t n = c.numel();
  FI_CHECK(p[0] == 0 && p[n - 1] == total, op, name, " must start at 0 and end at the number of rows (", total,
           "), got ", p[0], " .. ", p[n - 1]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    FI_CHECK(p[b + 1] >= p[b], op, name, " must be non-decreasing, got ", p[b], " then ", p[b + 1], " at ", b);
    if (max_name != nullptr)
      FI_CHECK(p[b + 1] - p[b] <= max_len, op, max_name, " (", max_len, ") is smaller than sequence ", b, "'s length ",
               p[b + 1] - p[b]);
  }
}

// Paged: every sequence's keys fit in its block table row and use valid block ids; q_len <= k_len.
// Plain loops over host copies: this runs on every CPU decode step, so no per-sequence ATen ops.
inline void check_paged_indices(const char* op, const Tensor& block_table, const Tensor& seq_lens,
                                const char* seq_lens_name, int64_t num_blocks, int64_t block_size,
                                const Tensor* cu_seqlens_q) {
  const auto lens_t = to_cpu(seq_lens, kInt);
  const auto table_t = to_cpu(block_table, kInt);
  Tensor cu_t;
  if (cu_seqlens_q != nullptr) cu_t = to_cpu(*cu_seqlens_q, kInt);
  const int32_t* lens = lens_t.const_data_ptr<int32_t>();
  const int32_t* table = table_t.const_data_ptr<int32_t>();
  const int64_t width = table_t.size(1);
  for (int64_t b = 0; b < lens_t.numel(); ++b) {
    const int64_t len = lens[b];
    FI_CHECK(len >= 0, op, seq_lens_name, "[", b, "] = ", len, " is negative");
    FI_CHECK(len <= width * block_size, op, seq_lens_name, "[", b, "] = ", len,
             " needs more blocks than block_table has columns (", width, " x block_size ", block_size, " = ",
             width * block_size, " tokens)");
    if (cu_seqlens_q != nullptr) {
      const int32_t* cu = cu_t.const_data_ptr<int32_t>();
      const int64_t q_len = cu[b + 1] - cu[b];
      FI_CHECK(q_len <= len, op, "sequence ", b, " has ", q_len, " queries but only ", len, " keys in ",
               seq_lens_name, " (the queries must be the last q_len tokens, already in the cache)");
    }
    const int32_t* row = table + b * width;
    for (int64_t j = 0; j < (len + block_size - 1) / block_size; ++j)
      FI_CHECK(row[j] >= 0 && row[j] < num_blocks, op, "block_table[", b, "][", j, "] = ", row[j],
               " is not a block id in [0, ", num_blocks, ") (sequence ", b, " uses ", (len + block_size - 1) / block_size,
               " blocks)");
  }
}

// Entries of the custom mask of a batch: sum over sequences of q_len^2.
inline int64_t custom_mask_entries(const Tensor& cu_seqlens_q) {
  const auto cu = to_cpu(cu_seqlens_q, kLong);
  const int64_t* p = cu.const_data_ptr<int64_t>();
  int64_t entries = 0;
  for (int64_t b = 0; b + 1 < cu.numel(); ++b) entries += (p[b + 1] - p[b]) * (p[b + 1] - p[b]);
  return entries;
}

inline void check_custom_mask_size(const char* op, const Tensor& custom_mask, const Tensor& cu_seqlens_q) {
  const int64_t expected = custom_mask_entries(cu_seqlens_q);
  FI_CHECK(custom_mask.numel() == expected, op, "custom_mask must have sum over sequences of q_len^2 = ", expected,
           " entries, got ", custom_mask.numel());
}

inline void check_packed_custom_mask_size(const char* op, const Tensor& packed, const Tensor& cu_seqlens_q) {
  const int64_t entries = custom_mask_entries(cu_seqlens_q);
  FI_CHECK(packed.numel() == (entries + 7) / 8, op, "packed_custom_mask must have ceil(sum over sequences of q_len^2 / 8)",
           " = ceil(", entries, " / 8) = ", (entries + 7) / 8, " bytes, got ", packed.numel());
}

}  // namespace fastinfer::binding
