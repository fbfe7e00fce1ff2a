// CUDA implementations of the attention ops (also built for simt, see kernel_backend.h):
// validate, allocate outputs and workspaces through the caching allocator (no host sync, so the
// calls can be captured in CUDA graphs), fill the Params structs, launch.
#include "kernel_backend.h"
#include "overrides.h"
#include "attention/contract.h"

namespace fastinfer::binding {
namespace {

// The kernels move rows with 16-byte loads: base 16-byte aligned, token stride a multiple of 8.
void check_vector_aligned(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0, op, name,
           " must start 16-byte aligned and have a token stride that is a multiple of 8 elements (the kernels use "
           "16-byte loads), got stride(0) = ", t.stride(0), " (call .contiguous())");
}

std::tuple<Tensor, Tensor> allocate_outputs(const Tensor& q, bool return_lse) {
  auto out = empty_as(q);
  auto lse = return_lse ? empty_on(q, {q.size(0), q.size(1)}, kFloat)
                        : empty_on(q, {0}, kFloat);
  return {out, lse};
}

void fill_common(PrefillAttentionParams& p, const Tensor& q, Tensor& out, Tensor& lse, int64_t batch,
                 int64_t max_seqlen_q, double scale, bool causal, int64_t window_left, double softcap,
                 const std::optional<Tensor>& sinks) {
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.numel() > 0 ? lse.mutable_data_ptr<float>() : nullptr;
  p.batch_size = static_cast<int32_t>(batch);
  p.num_q_heads = static_cast<int32_t>(q.size(1));
  p.head_dim = static_cast<int32_t>(q.size(2));
  p.max_seqlen_q = static_cast<int32_t>(max_seqlen_q);
  p.q_token_stride = q.stride(0);
  p.out_token_stride = out.stride(0);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.window_left = static_cast<int32_t>(window_left);
  p.softcap = static_cast<float>(softcap);
  p.dtype = to_dtype(q.scalar_type());
  p.sinks = sinks ? sinks->const_data_ptr<float>() : nullptr;
}

// Plans the launch (launch_plan.h), allocates its workspace from the caching allocator (alive until
// the launch is enqueued) and launches.
void launch_planned(PrefillAttentionParams& p, const Tensor& q, const KernelScope& scope, const char* op) {
  const PrefillLaunchPlan plan = plan_prefill_launch(p, device_description(q), prefill_overrides());
  Tensor workspace;
  if (plan.workspace_bytes > 0) {
    workspace = empty_on(q, {static_cast<int64_t>(plan.workspace_bytes)}, kByte);
    p.workspace = workspace.data_ptr();
  }
  check_launch(launch_prefill_attention(p, plan, scope.stream()), op);
}

std::tuple<Tensor, Tensor> prefill_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                                     const Tensor& cu_seqlens_q_in, const Tensor& cu_seqlens_k_in,
                                                     int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                                     bool causal, int64_t window_left, double softcap,
                                                     bool return_lse, int64_t fixed_split_size,
                                                     const std::optional<Tensor>& sinks) {
  const Tensor cu_seqlens_q = index_layout(cu_seqlens_q_in);
  const Tensor cu_seqlens_k = index_layout(cu_seqlens_k_in);
  const char* op = "prefill_attention";
  validate_prefill_attention(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, false, fixed_split_size, sinks);
  validate_attention_options(op, scale, window_left, softcap);
  validate_max_seqlen(op, max_seqlen_k, "max_seqlen_k");
  check_device(q, op, "q");
  check_packed_heads(q, op, "q");
  check_packed_heads(k, op, "k");
  check_packed_heads(v, op, "v");
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_vector_aligned(*t, op, name);
  if (check_indices_enabled(q)) {
    check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
    check_cu_seqlens(op, cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k");
  }
  auto [out, lse] = allocate_outputs(q, return_lse);
  if (q.numel() == 0) return {out, lse};
  KernelScope scope(op, q);
  PrefillAttentionParams p;
  fill_common(p, q, out, lse, cu_seqlens_q.size(0) - 1, max_seqlen_q, scale, causal, window_left, softcap, sinks);
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.mutable_data_ptr<int32_t>();
  p.cu_seqlens_k = cu_seqlens_k.mutable_data_ptr<int32_t>();
  p.num_kv_heads = static_cast<int32_t>(k.size(1));
  p.k_token_stride = k.stride(0);
  p.v_token_stride = v.stride(0);
  p.num_q_tokens = q.size(0);
  p.max_seqlen_k = static_cast<int32_t>(max_seqlen_k);
  p.fixed_split_size = static_cast<int32_t>(fixed_split_size);
  launch_planned(p, q, scope, op);
  return {out, lse};
}

void check_paged_kernel_inputs(const char* op, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache) {
  check_device(q, op, "q");
  check_packed_heads(q, op, "q");
  check_vector_aligned(q, op, "q");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
}

// An fp8 cache's scales (validate_kv_cache_scales: 1 element or one per KV head) into the decode or
// prefill params.
template <typename Params>
void set_cache_scales(Params& p, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  p.k_scale = k_scale ? k_scale->const_data_ptr<float>() : nullptr;
  p.v_scale = v_scale ? v_scale->const_data_ptr<float>() : nullptr;
  p.k_scale_stride = k_scale && k_scale->numel() > 1 ? 1 : 0;
  p.v_scale_stride = v_scale && v_scale->numel() > 1 ? 1 : 0;
}

// The paged K/V of the prefill kernel's launch (paged_prefill_attention and fixed-mode decode).
void fill_paged(PrefillAttentionParams& p, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                const Tensor& block_table, const Tensor& cu_seqlens_q, const Tensor& seq_lens_k,
                const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale) {
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.mutable_data_ptr<int32_t>();
  p.seq_lens_k = seq_lens_k.mutable_data_ptr<int32_t>();
  p.block_table = block_table.mutable_data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.block_size = static_cast<int32_t>(k_cache.size(1));
  p.num_kv_heads = static_cast<int32_t>(k_cache.size(2));
  p.num_q_tokens = q.size(0);
  p.cache_dtype = to_dtype(k_cache.scalar_type());
  set_cache_scales(p, k_scale, v_scale);
}

std::tuple<Tensor, Tensor> paged_prefill_attention(
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
                                   custom_mask, packed_custom_mask, false, fixed_split_size, sinks, k_scale, v_scale);
  validate_attention_options(op, scale, window_left, softcap);
  check_paged_kernel_inputs(op, q, k_cache, v_cache);
  if (custom_mask.has_value()) check_contiguous(*custom_mask, op, "custom_mask");
  if (packed_custom_mask.has_value()) check_contiguous(*packed_custom_mask, op, "packed_custom_mask");
  if (check_indices_enabled(q)) {
    check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
    check_paged_indices(op, block_table, seq_lens_k, "seq_lens_k", k_cache.size(0), k_cache.size(1), &cu_seqlens_q);
    if (custom_mask.has_value()) check_custom_mask_size(op, *custom_mask, cu_seqlens_q);
    if (packed_custom_mask.has_value()) check_packed_custom_mask_size(op, *packed_custom_mask, cu_seqlens_q);
  }
  auto [out, lse] = allocate_outputs(q, return_lse);
  if (q.numel() == 0) return {out, lse};
  KernelScope scope(op, q);
  const bool has_mask = custom_mask.has_value() || packed_custom_mask.has_value();
  Tensor mask_offsets;
  if (has_mask) {  // prefix sums of q_len^2 (entries, both forms), computed on the device (no sync)
    const auto q_lens = to_dtype_of(aten_call("aten::diff", "", cu_seqlens_q, int64_t{1}, int64_t{0},
                                              std::optional<Tensor>(), std::optional<Tensor>())[0], kLong);
    const auto entries = aten_call("aten::mul", "Tensor", q_lens, q_lens)[0];
    mask_offsets = zeros_on(q_lens, {q_lens.size(0) + 1}, kLong);
    auto tail = slice(mask_offsets, 0, 1, q_lens.size(0));
    torch::stable::copy_(tail, aten_call("aten::cumsum", "", entries, int64_t{0}, std::optional<ScalarType>(kLong))[0]);
  }
  PrefillAttentionParams p;
  fill_common(p, q, out, lse, seq_lens_k.size(0), max_seqlen_q, scale, causal, window_left, softcap, sinks);
  fill_paged(p, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, k_scale, v_scale);
  if (has_mask) {
    if (custom_mask.has_value()) p.custom_mask = custom_mask->mutable_data_ptr<bool>();
    if (packed_custom_mask.has_value()) p.packed_custom_mask = packed_custom_mask->mutable_data_ptr<uint8_t>();
    p.mask_offsets = mask_offsets.mutable_data_ptr<int64_t>();
  }
  p.fixed_split_size = static_cast<int32_t>(fixed_split_size);
  launch_planned(p, q, scope, op);
  return {out, lse};
}

// paged_decode_attention in the deterministic mode: the prefill kernel on q_len = 1 rows (the query
// is the last of seq_lens[b] keys: causal, bottom-right aligned), so decode and prefill of a row
// share one arithmetic (attention.h).
void decode_fixed_split(const char* op, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& block_table, const Tensor& seq_lens, double scale, int64_t window_left,
                        double softcap, int64_t fixed_split_size, const std::optional<Tensor>& sinks,
                        const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale, Tensor& out,
                        Tensor& lse, const KernelScope& scope) {
  // [0, 1, ..., B] on the device without a host copy: the cumulative sum of [0, 1, 1, ..., 1].
  auto ones = full_on(q, {q.size(0) + 1}, 1.0, kInt);
  auto first = slice(ones, 0, 0, 1);
  torch::stable::zero_(first);
  const auto cu_seqlens_q = aten_call("aten::cumsum", "", ones, int64_t{0}, std::optional<ScalarType>(kInt))[0];
  PrefillAttentionParams p;
  fill_common(p, q, out, lse, q.size(0), 1, scale, /*causal=*/true, window_left, softcap, sinks);
  fill_paged(p, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, k_scale, v_scale);
  p.fixed_split_size = static_cast<int32_t>(fixed_split_size);
  p.split_parallel = true;  // a CTA per chunk: decode's parallelism over the keys
  launch_planned(p, q, scope, op);
}

std::tuple<Tensor, Tensor> paged_decode_attention(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table_in,
    const Tensor& seq_lens_in, double scale, int64_t window_left, double softcap, int64_t num_splits,
    bool return_lse, const std::optional<Tensor>& k_scale, const std::optional<Tensor>& v_scale,
    int64_t fixed_split_size, const std::optional<Tensor>& sinks) {
  const Tensor block_table = index_layout(block_table_in);
  const Tensor seq_lens = index_layout(seq_lens_in);
  const char* op = "paged_decode_attention";
  validate_paged_decode_attention(op, q, k_cache, v_cache, block_table, seq_lens, num_splits, k_scale, v_scale, false,
                                  fixed_split_size, sinks);
  validate_attention_options(op, scale, window_left, softcap);
  check_paged_kernel_inputs(op, q, k_cache, v_cache);
  if (check_indices_enabled(q))
    check_paged_indices(op, block_table, seq_lens, "seq_lens", k_cache.size(0), k_cache.size(1), nullptr);
  auto [out, lse] = allocate_outputs(q, return_lse);
  if (q.numel() == 0) return {out, lse};
  KernelScope scope(op, q);
  if (fixed_split_size > 0) {
    decode_fixed_split(op, q, k_cache, v_cache, block_table, seq_lens, scale, window_left, softcap, fixed_split_size,
                       sinks, k_scale, v_scale, out, lse, scope);
    return {out, lse};
  }
  DecodeAttentionParams p;
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.numel() > 0 ? lse.mutable_data_ptr<float>() : nullptr;
  p.block_table = block_table.mutable_data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.mutable_data_ptr<int32_t>();
  set_cache_scales(p, k_scale, v_scale);
  p.sinks = sinks ? sinks->const_data_ptr<float>() : nullptr;
  p.batch_size = static_cast<int32_t>(q.size(0));
  p.num_q_heads = static_cast<int32_t>(q.size(1));
  p.num_kv_heads = static_cast<int32_t>(k_cache.size(2));
  p.head_dim = static_cast<int32_t>(q.size(2));
  p.block_size = static_cast<int32_t>(k_cache.size(1));
  p.q_token_stride = q.stride(0);
  p.out_token_stride = out.stride(0);
  p.scale = static_cast<float>(scale);
  p.window_left = static_cast<int32_t>(window_left);
  p.softcap = static_cast<float>(softcap);
  p.dtype = to_dtype(q.scalar_type());
  p.cache_dtype = to_dtype(k_cache.scalar_type());
  p.num_splits = num_splits > 0 ? static_cast<int32_t>(num_splits) : decode_attention_num_splits(p, num_sms(q));
  Tensor workspace;
  if (p.num_splits > 1) {
    workspace = empty_on(q, {static_cast<int64_t>(decode_attention_workspace_size(p))}, kByte);
    p.workspace = workspace.data_ptr();
  }
  check_launch(launch_decode_attention(p, scope.stream()), op);
  return {out, lse};
}

std::tuple<Tensor, Tensor> merge_attention_states(const Tensor& v_a, const Tensor& lse_a,
                                                          const Tensor& v_b, const Tensor& lse_b,
                                                          const std::optional<Tensor>& mask) {
  const char* op = "merge_attention_states";
  validate_merge_attention_states(op, v_a, lse_a, v_b, lse_b, mask);
  check_device(v_a, op, "v_a");
  for (const auto& [t, name] : {std::pair{&v_a, "v_a"}, {&lse_a, "lse_a"}, {&v_b, "v_b"}, {&lse_b, "lse_b"}})
    check_contiguous(*t, op, name);
  if (mask.has_value()) check_contiguous(*mask, op, "mask");
  auto v = empty_as(v_a);
  auto lse = empty_as(lse_a);
  if (v_a.numel() == 0) return {v, lse};
  KernelScope scope(op, v_a);
  MergeAttentionStatesParams p;
  p.v_a = v_a.data_ptr();
  p.lse_a = lse_a.mutable_data_ptr<float>();
  p.v_b = v_b.data_ptr();
  p.lse_b = lse_b.mutable_data_ptr<float>();
  p.v_out = v.data_ptr();
  p.lse_out = lse.mutable_data_ptr<float>();
  p.mask = mask.has_value() ? mask->const_data_ptr<bool>() : nullptr;
  p.num_tokens = v_a.size(0);
  p.num_heads = static_cast<int32_t>(v_a.size(1));
  p.head_dim = static_cast<int32_t>(v_a.size(2));
  p.dtype = to_dtype(v_a.scalar_type());
  check_launch(launch_merge_attention_states(p, scope.stream()), op);
  return {v, lse};
}

void move_kv_slots(Tensor& k_cache, Tensor& v_cache, const Tensor& src_slots, const Tensor& dst_slots) {
  const char* op = "move_kv_slots";
  validate_move_kv_slots(op, k_cache, v_cache, src_slots, dst_slots);
  check_device(k_cache, op, "k_cache");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  check_contiguous(src_slots, op, "src_slots");
  check_contiguous(dst_slots, op, "dst_slots");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(src_slots, 0, num_slots, op, "src_slots", "slots < num_blocks * block_size");
  check_index_range(dst_slots, 0, num_slots, op, "dst_slots", "slots < num_blocks * block_size");
  if (src_slots.numel() == 0) return;
  KernelScope scope(op, k_cache);
  MoveKvSlotsParams p;
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.src_slots = src_slots.data_ptr();
  p.dst_slots = dst_slots.data_ptr();
  p.slot_type = to_index_type(src_slots.scalar_type());
  p.num_moves = src_slots.size(0);
  p.row_bytes = k_cache.size(2) * k_cache.size(3) * k_cache.element_size();
  auto workspace = empty_on(k_cache, {static_cast<int64_t>(move_kv_slots_workspace_size(p))}, kByte);
  p.workspace = workspace.data_ptr();
  check_launch(launch_move_kv_slots(p, scope.stream()), op);
}

void mla_cache_write(const Tensor& kv_c, const Tensor& k_pe, Tensor& kv_cache, const Tensor& slot_mapping,
                     const std::optional<Tensor>& kv_scale) {
  const char* op = "mla_cache_write";
  validate_mla_cache_write(op, kv_c, k_pe, kv_cache, slot_mapping, kv_scale, false);
  check_device(kv_c, op, "kv_c");
  check_mla_cache_write_layout(op, kv_c, k_pe, kv_cache, slot_mapping);
  check_index_range(slot_mapping, -1, kv_cache.size(0) * kv_cache.size(1), op, "slot_mapping",
                    "-1 or a slot < num_blocks * block_size");
  if (kv_c.size(0) == 0) return;
  KernelScope scope(op, kv_c);
  MlaCacheWriteParams p;
  p.kv_c = kv_c.data_ptr();
  p.k_pe = k_pe.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_type = to_index_type(slot_mapping.scalar_type());
  p.kv_scale = kv_scale.has_value() ? kv_scale->mutable_data_ptr<float>() : nullptr;
  p.scale_per_token = mla_scale_per_token(kv_scale);
  p.num_tokens = kv_c.size(0);
  p.kv_c_stride = row_stride_of(kv_c);
  p.k_pe_stride = row_stride_of(k_pe);
  p.dtype = to_dtype(kv_c.scalar_type());
  p.cache_dtype = to_dtype(kv_cache.scalar_type());
  check_launch(launch_mla_cache_write(p, scope.stream()), op);
}

std::tuple<Tensor, Tensor> mla_decode_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& block_table_in,
                                                const Tensor& seq_lens_in, const Tensor& cu_seqlens_q_in, double scale,
                                                bool causal, const std::optional<Tensor>& custom_mask,
                                                int64_t num_splits, bool return_lse,
                                                const std::optional<Tensor>& kv_scale, int64_t fixed_split_size) {
  const Tensor block_table = index_layout(block_table_in);
  const Tensor seq_lens = index_layout(seq_lens_in);
  const Tensor cu_seqlens_q = index_layout(cu_seqlens_q_in);
  const char* op = "mla_decode_attention";
  validate_mla_decode_attention(op, q, kv_cache, block_table, seq_lens, cu_seqlens_q, custom_mask, num_splits, kv_scale,
                                fixed_split_size, false);
  validate_attention_options(op, scale, -1, 0.0);
  check_device(q, op, "q");
  check_packed_heads(q, op, "q");
  check_vector_aligned(q, op, "q");
  check_contiguous(kv_cache, op, "kv_cache");
  check_aligned16(kv_cache, op, "kv_cache");
  if (custom_mask.has_value()) check_contiguous(*custom_mask, op, "custom_mask");
  if (check_indices_enabled(q)) {
    check_cu_seqlens(op, cu_seqlens_q, "cu_seqlens_q", q.size(0), 0, nullptr);
    check_paged_indices(op, block_table, seq_lens, "seq_lens", kv_cache.size(0), kv_cache.size(1), &cu_seqlens_q);
    if (custom_mask.has_value()) check_custom_mask_size(op, *custom_mask, cu_seqlens_q);
  }
  auto out = empty_on(q, {q.size(0), q.size(1), kMlaLatentDim});
  auto lse = return_lse ? empty_on(q, {q.size(0), q.size(1)}, kFloat) : empty_on(q, {0}, kFloat);
  if (q.numel() == 0) return {out, lse};
  KernelScope scope(op, q);
  Tensor mask_offsets;
  if (custom_mask.has_value()) {  // prefix sums of q_len^2, on the device (no sync)
    const auto q_lens = to_dtype_of(aten_call("aten::diff", "", cu_seqlens_q, int64_t{1}, int64_t{0},
                                              std::optional<Tensor>(), std::optional<Tensor>())[0], kLong);
    const auto entries = aten_call("aten::mul", "Tensor", q_lens, q_lens)[0];
    mask_offsets = zeros_on(q_lens, {q_lens.size(0) + 1}, kLong);
    auto tail = slice(mask_offsets, 0, 1, q_lens.size(0));
    torch::stable::copy_(tail, aten_call("aten::cumsum", "", entries, int64_t{0}, std::optional<ScalarType>(kLong))[0]);
  }
  MlaDecodeParams p;
  p.q = q.data_ptr();
  p.kv_cache = kv_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = return_lse ? lse.mutable_data_ptr<float>() : nullptr;
  p.block_table = block_table.mutable_data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.block_size = static_cast<int32_t>(kv_cache.size(1));
  p.seq_lens = seq_lens.mutable_data_ptr<int32_t>();
  p.cu_seqlens_q = cu_seqlens_q.mutable_data_ptr<int32_t>();
  if (custom_mask.has_value()) {
    p.custom_mask = custom_mask->const_data_ptr<bool>();
    p.mask_offsets = mask_offsets.mutable_data_ptr<int64_t>();
  }
  p.kv_scale = kv_scale.has_value() ? kv_scale->const_data_ptr<float>() : nullptr;
  p.scale_per_token = mla_scale_per_token(kv_scale);
  p.batch_size = static_cast<int32_t>(seq_lens.size(0));
  p.num_heads = static_cast<int32_t>(q.size(1));
  p.num_q_tokens = q.size(0);
  p.q_token_stride = q.stride(0);
  p.out_token_stride = out.stride(0);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = to_dtype(q.scalar_type());
  p.cache_dtype = to_dtype(kv_cache.scalar_type());
  p.fixed_split_size = static_cast<int32_t>(fixed_split_size);
  const DeviceDescription device = device_description(q);
  const MlaDecodeOverrides overrides = mla_decode_overrides();
  p.num_splits = num_splits > 0 ? static_cast<int32_t>(num_splits) : mla_decode_num_splits(p, device, overrides);
  Tensor workspace;
  if (const size_t bytes = mla_decode_workspace_size(p, overrides); bytes > 0) {
    workspace = empty_on(q, {static_cast<int64_t>(bytes)}, kByte);
    p.workspace = workspace.data_ptr();
  }
  check_launch(launch_mla_decode(p, device, overrides, scope.stream()), op);
  return {out, lse};
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("prefill_attention", TORCH_BOX(&prefill_attention));
  m.impl("paged_prefill_attention", TORCH_BOX(&paged_prefill_attention));
  m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention));
  m.impl("merge_attention_states", TORCH_BOX(&merge_attention_states));
  m.impl("move_kv_slots", TORCH_BOX(&move_kv_slots));
  m.impl("mla_cache_write", TORCH_BOX(&mla_cache_write));
  m.impl("mla_decode_attention", TORCH_BOX(&mla_decode_attention));
}
