#pragma once
// Shape/dtype/argument rules of the MoE routing ops (shared by the CPU and CUDA impls).
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <string_view>

#include "common.h"
#include "gemm_int4/contract.h"
#include "fastinfer/moe/fused_moe.h"
#include "fastinfer/moe/routing.h"

namespace fastinfer::binding {

// The schemas of the MoE ops (schema.cpp registers them for every module). The defaults live in
// the Python wrappers (fastinfer/ops/moe.py).
inline void define_moe_ops(StableLibrary& m) {
  // Mixture-of-experts routing (docs/design.md "Mixture of experts").
  m.def("moe_topk(Tensor router_logits, int top_k, bool renormalize, str scoring) -> (Tensor topk_weights, "
        "Tensor topk_ids)");
  m.def("moe_align(Tensor topk_ids, int num_experts, int block_m) -> (Tensor sorted_token_ids, Tensor expert_ids, "
        "Tensor num_tokens_post_padded)");
  // The expert MLPs: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], the routing of moe_topk.
  m.def("fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation, "
        "float? swiglu_alpha, float? swiglu_limit, Tensor? w13_bias, Tensor? w2_bias) -> Tensor");
  // FP8 experts: w13 / w2 float8_e4m3fn with per-channel or 128 x 128 blockwise fp32 scales, the
  // activations quantised per token (or per token and 128-group) inside.
  m.def("fused_moe_fp8(Tensor x, Tensor w13, Tensor w2, Tensor w13_scale, Tensor w2_scale, Tensor topk_weights, "
        "Tensor topk_ids, str activation, float? swiglu_alpha, float? swiglu_limit, Tensor? w13_bias, "
        "Tensor? w2_bias) -> Tensor");
  // INT4 (W4A16) experts: w13 / w2 in int4_pack's layout per expert, group scales and zero points.
  m.def("fused_moe_int4(Tensor x, Tensor w13, Tensor w2, Tensor w13_scales, Tensor w2_scales, Tensor? w13_zeros, "
        "Tensor? w2_zeros, Tensor topk_weights, Tensor topk_ids, int group_size, str activation, "
        "float? swiglu_alpha, float? swiglu_limit, Tensor? w13_bias, Tensor? w2_bias) -> Tensor");
  // FP4 (W4A16) experts: w13 / w2 in fp4_repack's layout per expert, NVFP4 (e4m3 scales, optional
  // global divisors) or MXFP4 (e8m0 scales).
  m.def("fused_moe_fp4(Tensor x, Tensor w13, Tensor w2, Tensor w13_scales, Tensor w2_scales, "
        "Tensor? w13_global_scale, Tensor? w2_global_scale, Tensor topk_weights, Tensor topk_ids, str format, "
        "str activation, float? swiglu_alpha, float? swiglu_limit, Tensor? w13_bias, Tensor? w2_bias) -> Tensor");
}

inline MoeScoring parse_moe_scoring(const char* op, std::string_view scoring) {
  if (scoring == "softmax") return MoeScoring::kSoftmax;
  if (scoring == "topk_softmax") return MoeScoring::kTopkSoftmax;
  fail(op, "scoring must be 'softmax' or 'topk_softmax', got '", std::string(scoring), "'");
}

// Checks router_logits [T, E] (contiguous), top_k, renormalize and scoring; returns the scoring.
inline MoeScoring validate_moe_topk(const char* op, const Tensor& router_logits, int64_t top_k, bool renormalize,
                                    std::string_view scoring_str) {
  const MoeScoring scoring = parse_moe_scoring(op, scoring_str);
  check_dim(router_logits, 2, op, "router_logits", "[num_tokens, num_experts]");
  check_dtype_in(router_logits, {kFloat, kHalf, kBFloat16}, op, "router_logits");
  check_contiguous(router_logits, op, "router_logits");
  const int64_t T = router_logits.size(0), E = router_logits.size(1);
  FI_CHECK(E >= 1 && E < (int64_t{1} << 31) && T < (int64_t{1} << 31), op,
           "router_logits must have 1 <= num_experts < 2^31 and num_tokens < 2^31, got shape ",
           shape_str(router_logits));
  FI_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, num_experts = ", E, "], got ", top_k);
  FI_CHECK(top_k <= kMoeTopkMaxK, op, "top_k must be <= ", kMoeTopkMaxK, " (one lane per selected expert), got ",
           top_k);
  FI_CHECK(!(renormalize && scoring == MoeScoring::kTopkSoftmax), op,
           "renormalize must be False with scoring='topk_softmax' (its k weights already sum to 1)");
  return scoring;
}

// Checks topk_ids [T, top_k] (int32/int64, contiguous), num_experts and block_m; the value check of
// the ids (in [-1, E): -1 is a slot routed to no local expert) runs on CPU tensors always and on
// CUDA tensors with FASTINFER_CHECK_INDICES=1 (the kernel skips out-of-range ids either way).
inline void validate_moe_align(const char* op, const Tensor& topk_ids, int64_t num_experts, int64_t block_m) {
  check_dim(topk_ids, 2, op, "topk_ids", "[num_tokens, top_k]");
  check_dtype_in(topk_ids, {kInt, kLong}, op, "topk_ids");
  check_contiguous(topk_ids, op, "topk_ids");
  FI_CHECK(num_experts >= 1 && num_experts <= kMoeAlignMaxExperts, op, "num_experts must be in [1, ",
           kMoeAlignMaxExperts, "] (the kernel keeps a histogram of every expert in shared memory), got ",
           num_experts);
  FI_CHECK(block_m >= 1 && block_m <= (int64_t{1} << 16) && (block_m & (block_m - 1)) == 0, op,
           "block_m must be a power of two in [1, 65536], got ", block_m);
  FI_CHECK(moe_align_sorted_size(topk_ids.numel(), num_experts, block_m) < (int64_t{1} << 31), op,
           "topk_ids.numel() + num_experts * (block_m - 1) must be < 2^31 (int32 slot ids), got shape ",
           shape_str(topk_ids), ", num_experts ", num_experts, ", block_m ", block_m);
  check_index_range(topk_ids, -1, num_experts, op, "topk_ids", "expert ids; -1 marks a slot with no local expert");
}

// ---- fused_moe ----

struct FusedMoeArgs {
  int64_t num_tokens, hidden, intermediate, num_experts, top_k;
  MoeActivation activation;
  float swiglu_alpha = 0.f, swiglu_limit = 0.f;  // kSwigluOai only
};

inline MoeActivation parse_moe_activation(const char* op, std::string_view activation) {
  if (activation == "silu") return MoeActivation::kSilu;
  if (activation == "swiglu_oai") return MoeActivation::kSwigluOai;
  fail(op, "activation must be 'silu' or 'swiglu_oai', got '", std::string(activation), "'");
}

inline void check_expert_bias(const char* op, const std::optional<Tensor>& bias, const char* name,
                              const Tensor& x, int64_t E, int64_t N, const char* layout) {
  if (!bias.has_value()) return;
  FI_CHECK(bias->dim() == 2 && bias->size(0) == E && bias->size(1) == N, op, name, " must have shape ", layout,
           " = [", E, ", ", N, "], got ", shape_str(*bias));
  check_same_dtype(*bias, x, op, name, "x");
  check_same_device(*bias, x, op, name, "x");
  check_contiguous(*bias, op, name);
}

// Checks the arguments every fused_moe variant shares (x, the routing, the activation, the biases)
// for E experts of intermediate size I; allow_fp32: float32 activations (the CPU implementation).
inline FusedMoeArgs validate_moe_routing_and_activation(const char* op, const Tensor& x, int64_t E, int64_t I,
                                                        const Tensor& topk_weights, const Tensor& topk_ids,
                                                        std::string_view activation,
                                                        std::optional<double> swiglu_alpha,
                                                        std::optional<double> swiglu_limit,
                                                        const std::optional<Tensor>& w13_bias,
                                                        const std::optional<Tensor>& w2_bias, bool allow_fp32) {
  FusedMoeArgs args{};
  args.activation = parse_moe_activation(op, activation);
  if (args.activation == MoeActivation::kSilu) {
    FI_CHECK(!swiglu_alpha.has_value(), op, "swiglu_alpha must be None with activation='silu'");
    FI_CHECK(!swiglu_limit.has_value(), op, "swiglu_limit must be None with activation='silu'");
  } else {
    FI_CHECK(swiglu_alpha.has_value() && std::isfinite(*swiglu_alpha), op,
             "swiglu_alpha must be a finite number with activation='swiglu_oai'");
    FI_CHECK(swiglu_limit.has_value() && *swiglu_limit > 0 && std::isfinite(*swiglu_limit), op,
             "swiglu_limit must be a finite number > 0 with activation='swiglu_oai'");
    args.swiglu_alpha = static_cast<float>(*swiglu_alpha);
    args.swiglu_limit = static_cast<float>(*swiglu_limit);
  }
  const int64_t T = x.size(0), H = x.size(1);
  check_dim(topk_weights, 2, op, "topk_weights", "[num_tokens, top_k]");
  check_dtype_in(topk_weights, {kFloat}, op, "topk_weights");
  check_same_device(topk_weights, x, op, "topk_weights", "x");
  check_contiguous(topk_weights, op, "topk_weights");
  FI_CHECK(topk_weights.size(0) == T && topk_weights.size(1) >= 1, op,
           "topk_weights must have shape [num_tokens, top_k] with num_tokens = ", T,
           " (x.size(0)) and top_k >= 1, got ", shape_str(topk_weights));
  check_dim(topk_ids, 2, op, "topk_ids", "[num_tokens, top_k]");
  check_dtype_in(topk_ids, {kInt}, op, "topk_ids");
  check_same_device(topk_ids, x, op, "topk_ids", "x");
  check_contiguous(topk_ids, op, "topk_ids");
  validate_same_shape(op, topk_ids, "topk_ids", topk_weights, "topk_weights");
  check_expert_bias(op, w13_bias, "w13_bias", x, E, 2 * I, "[num_experts, 2 * intermediate]");
  check_expert_bias(op, w2_bias, "w2_bias", x, E, H, "[num_experts, hidden]");
  FI_CHECK(T * topk_ids.size(1) < (int64_t{1} << 31), op, "topk_ids must have num_tokens * top_k < 2^31, got shape ",
           shape_str(topk_ids));
  check_index_range(topk_ids, -1, E, op, "topk_ids", "expert ids; -1 marks a slot with no local expert");
  args.num_tokens = T;
  args.hidden = H;
  args.intermediate = I;
  args.num_experts = E;
  args.top_k = topk_ids.size(1);
  return args;
}

// Checks x and the expert weights' shapes (w13 [E, 2I, H], w2 [E, H, I], weight_dtype, contiguous,
// on x's device); returns (E, I).
inline std::pair<int64_t, int64_t> validate_expert_weights(const char* op, const Tensor& x, const Tensor& w13,
                                                           const Tensor& w2, bool allow_fp32) {
  check_dim(x, 2, op, "x", "[num_tokens, hidden]");
  check_activation_dtype(x, allow_fp32, op, "x");
  check_contiguous(x, op, "x");
  check_dim(w13, 3, op, "w13", "[num_experts, 2 * intermediate, hidden] (gate rows, then up rows)");
  check_dim(w2, 3, op, "w2", "[num_experts, hidden, intermediate]");
  const int64_t H = x.size(1), E = w13.size(0), I = w13.size(1) / 2;
  for (const auto& [w, name] : {std::pair<const Tensor&, const char*>{w13, "w13"}, {w2, "w2"}}) {
    check_same_device(w, x, op, name, "x");
    check_contiguous(w, op, name);
  }
  FI_CHECK(E >= 1 && E < (int64_t{1} << 31), op, "w13 must have 1 <= num_experts < 2^31, got shape ",
           shape_str(w13));
  FI_CHECK(w13.size(1) % 2 == 0 && I >= 1 && w13.size(2) == H, op,
           "w13 must have shape [num_experts, 2 * intermediate, hidden] with hidden = ", H,
           " (x.size(1)) and an even, nonzero second dimension, got ", shape_str(w13));
  FI_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == I, op,
           "w2 must have shape [num_experts, hidden, intermediate] = [", E, ", ", H, ", ", I,
           "] (intermediate = w13.size(1) / 2), got ", shape_str(w2));
  return {E, I};
}

// Checks every argument of fused_moe (the value check of topk_ids: see validate_moe_align);
// allow_fp32: float32 activations (the CPU implementation).
inline FusedMoeArgs validate_fused_moe(const char* op, const Tensor& x, const Tensor& w13, const Tensor& w2,
                                       const Tensor& topk_weights, const Tensor& topk_ids,
                                       std::string_view activation, std::optional<double> swiglu_alpha,
                                       std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
                                       const std::optional<Tensor>& w2_bias, bool allow_fp32) {
  const auto [E, I] = validate_expert_weights(op, x, w13, w2, allow_fp32);
  check_same_dtype(w13, x, op, "w13", "x");
  check_same_dtype(w2, x, op, "w2", "x");
  const int64_t H = x.size(1);
  FI_CHECK(H % 8 == 0 && I % 8 == 0, op, "x and w2 must have hidden and intermediate multiples of 8 (rows move in "
           "16-byte chunks), got hidden ", H, ", intermediate ", I);
  return validate_moe_routing_and_activation(op, x, E, I, topk_weights, topk_ids, activation, swiglu_alpha,
                                             swiglu_limit, w13_bias, w2_bias, allow_fp32);
}

// ---- fused_moe_fp8 ----

// The scale block of blockwise FP8 checkpoints (DeepSeek-V3, Qwen3-FP8: weight_scale_inv).
inline constexpr int64_t kMoeFp8Block = 128;
inline constexpr int64_t kMoeActGroup = 64;  // a's e4m3 groups (moe/fused_moe.h)

// Checks every argument of fused_moe_fp8: e4m3 weights, their scales (both per channel or both
// blockwise), then as fused_moe. Returns the arguments and whether the scales are blockwise.
inline std::pair<FusedMoeArgs, bool> validate_fused_moe_fp8(
    const char* op, const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scale,
    const Tensor& w2_scale, const Tensor& topk_weights, const Tensor& topk_ids, std::string_view activation,
    std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
    const std::optional<Tensor>& w2_bias, bool allow_fp32) {
  const auto [E, I] = validate_expert_weights(op, x, w13, w2, allow_fp32);
  check_dtype_in(w13, {kFloat8_e4m3fn}, op, "w13");
  check_dtype_in(w2, {kFloat8_e4m3fn}, op, "w2");
  const int64_t H = x.size(1);
  for (const auto& [s, name] : {std::pair<const Tensor&, const char*>{w13_scale, "w13_scale"},
                                {w2_scale, "w2_scale"}}) {
    check_dtype_in(s, {kFloat}, op, name);
    check_same_device(s, x, op, name, "x");
    check_contiguous(s, op, name);
  }
  const bool blockwise = w13_scale.dim() == 3;
  const auto blocks = [](int64_t n) { return (n + kMoeFp8Block - 1) / kMoeFp8Block; };
  if (blockwise) {
    FI_CHECK(w13_scale.size(0) == E && w13_scale.size(1) == blocks(2 * I) && w13_scale.size(2) == blocks(H), op,
             "w13_scale must have shape [num_experts, ceil(2 * intermediate / 128), ceil(hidden / 128)] = [", E,
             ", ", blocks(2 * I), ", ", blocks(H), "] (128 x 128 blocks) or [num_experts, 2 * intermediate] "
             "(per channel), got ", shape_str(w13_scale));
    FI_CHECK(w2_scale.dim() == 3 && w2_scale.size(0) == E && w2_scale.size(1) == blocks(H) &&
                 w2_scale.size(2) == blocks(I), op,
             "w2_scale must have shape [num_experts, ceil(hidden / 128), ceil(intermediate / 128)] = [", E, ", ",
             blocks(H), ", ", blocks(I), "] (blockwise, as w13_scale), got ", shape_str(w2_scale));
    FI_CHECK(H % kMoeFp8Block == 0 && I % kMoeFp8Block == 0, op,
             "x and w2 must have hidden and intermediate multiples of 128 with blockwise scales (the activations "
             "are quantised in groups of 128), got hidden ", H, ", intermediate ", I);
  } else {
    FI_CHECK(w13_scale.dim() == 2 && w13_scale.size(0) == E && w13_scale.size(1) == 2 * I, op,
             "w13_scale must have shape [num_experts, 2 * intermediate] = [", E, ", ", 2 * I,
             "] (per channel) or [num_experts, ceil(2 * intermediate / 128), ceil(hidden / 128)] (blockwise), got ",
             shape_str(w13_scale));
    FI_CHECK(w2_scale.dim() == 2 && w2_scale.size(0) == E && w2_scale.size(1) == H, op,
             "w2_scale must have shape [num_experts, hidden] = [", E, ", ", H, "] (per channel, as w13_scale), got ",
             shape_str(w2_scale));
    FI_CHECK(H % 16 == 0 && I % 16 == 0, op, "x and w2 must have hidden and intermediate multiples of 16 (e4m3 rows "
             "move in 16-byte chunks), got hidden ", H, ", intermediate ", I);
  }
  return {validate_moe_routing_and_activation(op, x, E, I, topk_weights, topk_ids, activation, swiglu_alpha,
                                              swiglu_limit, w13_bias, w2_bias, allow_fp32),
          blockwise};
}

// ---- fused_moe_int4 ----

// The zero points' bytes, or nullptr for symmetric weights.
inline const uint8_t* zero_points_of(const std::optional<Tensor>& zeros) {
  return zeros.has_value() ? static_cast<const uint8_t*>(zeros->const_data_ptr()) : nullptr;
}

// One expert stack of int4 weights: packed int32 [E, K / 64, 8 N], scales [E, K / G, N] (x's dtype),
// zeros uint8 [E, K / G, N] or None.
// One expert stack of 4-bit codes in int4_pack's layout: int32 [E, K / 64, 8 N].
inline void check_w4_packed(const char* op, const Tensor& x, const Tensor& packed, const char* name, int64_t E,
                            int64_t N, int64_t K) {
  check_dim(packed, 3, op, name, "[num_experts, K / 64, 8 * N] int32 (int4_pack's layout per expert)");
  check_dtype_in(packed, {kInt}, op, name);
  check_same_device(packed, x, op, name, "x");
  check_contiguous(packed, op, name);
  FI_CHECK(packed.size(0) == E && packed.size(1) * kInt4MinK == K && packed.size(2) == 8 * N, op, name,
           " must have shape [num_experts, K / 64, 8 * N] = [", E, ", ", K / kInt4MinK, ", ", 8 * N, "], got ",
           shape_str(packed));
}

inline void check_int4_experts(const char* op, const Tensor& x, const Tensor& packed, const char* name,
                               const Tensor& scales, const char* scales_name, const std::optional<Tensor>& zeros,
                               const char* zeros_name, int64_t E, int64_t N, int64_t K, int64_t group_size) {
  check_w4_packed(op, x, packed, name, E, N, K);
  check_dim(scales, 3, op, scales_name, "[num_experts, K / group_size, N]");
  check_same_dtype(scales, x, op, scales_name, "x");
  check_same_device(scales, x, op, scales_name, "x");
  check_contiguous(scales, op, scales_name);
  FI_CHECK(scales.size(0) == E && scales.size(1) == K / group_size && scales.size(2) == N, op, scales_name,
           " must have shape [num_experts, K / group_size, N] = [", E, ", ", K / group_size, ", ", N, "], got ",
           shape_str(scales));
  if (!zeros.has_value()) return;
  check_dim(*zeros, 3, op, zeros_name, "[num_experts, K / group_size, N] uint8 (0..15), or None (symmetric)");
  check_dtype_in(*zeros, {kByte}, op, zeros_name);
  check_same_device(*zeros, x, op, zeros_name, "x");
  check_contiguous(*zeros, op, zeros_name);
  FI_CHECK(zeros->size(0) == E && zeros->size(1) == K / group_size && zeros->size(2) == N, op, zeros_name,
           " must have shape [num_experts, K / group_size, N] = [", E, ", ", K / group_size, ", ", N, "], got ",
           shape_str(*zeros));
  check_index_range(*zeros, 0, 16, op, zeros_name, "4-bit zero points");
}

// Checks x and the leading shapes of 4-bit expert stacks (w13 [E, H / 64, 16 I], w2 3-D); returns (E, I).
inline std::pair<int64_t, int64_t> validate_w4_shapes(const char* op, const Tensor& x, const Tensor& w13,
                                                      const Tensor& w2, bool allow_fp32) {
  check_dim(x, 2, op, "x", "[num_tokens, hidden]");
  check_activation_dtype(x, allow_fp32, op, "x");
  check_contiguous(x, op, "x");
  check_dim(w13, 3, op, "w13", "[num_experts, hidden / 64, 8 * 2 * intermediate] int32 (int4_pack per expert)");
  check_dim(w2, 3, op, "w2", "[num_experts, intermediate / 64, 8 * hidden] int32 (int4_pack per expert)");
  const int64_t H = x.size(1), E = w13.size(0), I = w13.size(2) / 16;
  FI_CHECK(E >= 1 && E < (int64_t{1} << 31), op, "w13 must have 1 <= num_experts < 2^31, got shape ",
           shape_str(w13));
  FI_CHECK(H % kInt4MinK == 0 && I % kInt4MinK == 0 && I > 0 && w13.size(2) == 16 * I, op,
           "x and w13 must have hidden and intermediate (w13.size(2) / 16) positive multiples of 64 (the 4-bit "
           "layout's unit is 16 columns x 64 k), got hidden ", H, ", w13 ", shape_str(w13));
  return {E, I};
}

// Checks every argument of fused_moe_int4 (w13 packs N = 2I rows of K = H, w2 N = H rows of K = I).
inline FusedMoeArgs validate_fused_moe_int4(
    const char* op, const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
    const Tensor& w2_scales, const std::optional<Tensor>& w13_zeros, const std::optional<Tensor>& w2_zeros,
    const Tensor& topk_weights, const Tensor& topk_ids, int64_t group_size, std::string_view activation,
    std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
    const std::optional<Tensor>& w2_bias, bool allow_fp32) {
  const auto [E, I] = validate_w4_shapes(op, x, w13, w2, allow_fp32);
  const int64_t H = x.size(1);
  FI_CHECK(group_size > 0 && group_size % 32 == 0 && H % group_size == 0 && I % group_size == 0, op,
           "group_size must be a positive multiple of 32 dividing hidden = ", H, " and intermediate = ", I, ", got ",
           group_size);
  FI_CHECK(w13_zeros.has_value() == w2_zeros.has_value(), op,
           "w13_zeros and w2_zeros must both be given (asymmetric) or both None (symmetric, z = 8)");
  check_int4_experts(op, x, w13, "w13", w13_scales, "w13_scales", w13_zeros, "w13_zeros", E, 2 * I, H, group_size);
  check_int4_experts(op, x, w2, "w2", w2_scales, "w2_scales", w2_zeros, "w2_zeros", E, H, I, group_size);
  return validate_moe_routing_and_activation(op, x, E, I, topk_weights, topk_ids, activation, swiglu_alpha,
                                             swiglu_limit, w13_bias, w2_bias, allow_fp32);
}

// ---- fused_moe_fp4 ----

// MoeWeightFormat of a format name ("nvfp4" | "mxfp4").
inline MoeWeightFormat parse_moe_fp4_format(const char* op, std::string_view format) {
  if (format == "nvfp4") return MoeWeightFormat::kNvfp4;
  if (format == "mxfp4") return MoeWeightFormat::kMxfp4;
  fail(op, "format must be 'nvfp4' or 'mxfp4', got '", std::string(format), "'");
}

// One expert stack of fp4 weights: packed int32 [E, K / 64, 8 N], scale bits uint8 [E, K / G, N]
// (e8m0 255, the MX spec's NaN, refused where index values are checked), global divisors float32
// `global_shape` or None.
inline void check_fp4_experts(const char* op, const Tensor& x, const Tensor& packed, const char* name,
                              const Tensor& scales, const char* scales_name, const std::optional<Tensor>& global,
                              const char* global_name, int64_t E, int64_t N, int64_t K, int64_t group,
                              bool mxfp4, int64_t halves) {
  check_w4_packed(op, x, packed, name, E, N, K);
  check_dim(scales, 3, op, scales_name, "[num_experts, K / G, N] uint8 (scale bits, fp4_repack per expert)");
  check_dtype_in(scales, {kByte}, op, scales_name);
  check_same_device(scales, x, op, scales_name, "x");
  check_contiguous(scales, op, scales_name);
  FI_CHECK(scales.size(0) == E && scales.size(1) == K / group && scales.size(2) == N, op, scales_name,
           " must have shape [num_experts, K / ", group, ", N] = [", E, ", ", K / group, ", ", N, "], got ",
           shape_str(scales));
  if (mxfp4) check_index_range(scales, 0, 255, op, scales_name, "e8m0 exponents; 255 is the MX spec's NaN");
  if (!global.has_value()) return;
  FI_CHECK(!mxfp4, op, global_name, " is only defined for format='nvfp4' (MXFP4 has no global scale)");
  check_dtype_in(*global, {kFloat}, op, global_name);
  check_same_device(*global, x, op, global_name, "x");
  check_contiguous(*global, op, global_name);
  const bool shape_ok = halves == 2 ? (global->dim() == 2 && global->size(0) == E && global->size(1) == 2)
                                    : (global->dim() == 1 && global->size(0) == E);
  FI_CHECK(shape_ok, op, global_name, " must have shape ", halves == 2 ? "[num_experts, 2] (gate, up) = [" : "[num_experts] = [",
           E, halves == 2 ? ", 2]" : "]", ", got ", shape_str(*global));
}

// Checks every argument of fused_moe_fp4 (w13 packs N = 2I rows of K = H, w2 N = H rows of K = I);
// returns the arguments and the weight format.
inline std::pair<FusedMoeArgs, MoeWeightFormat> validate_fused_moe_fp4(
    const char* op, const Tensor& x, const Tensor& w13, const Tensor& w2, const Tensor& w13_scales,
    const Tensor& w2_scales, const std::optional<Tensor>& w13_global, const std::optional<Tensor>& w2_global,
    const Tensor& topk_weights, const Tensor& topk_ids, std::string_view format, std::string_view activation,
    std::optional<double> swiglu_alpha, std::optional<double> swiglu_limit, const std::optional<Tensor>& w13_bias,
    const std::optional<Tensor>& w2_bias, bool allow_fp32) {
  const MoeWeightFormat weights = parse_moe_fp4_format(op, format);
  const bool mxfp4 = weights == MoeWeightFormat::kMxfp4;
  const int64_t group = mxfp4 ? 32 : 16;
  const auto [E, I] = validate_w4_shapes(op, x, w13, w2, allow_fp32);
  const int64_t H = x.size(1);
  FI_CHECK(w13_global.has_value() == w2_global.has_value(), op,
           "w13_global_scale and w2_global_scale must both be given or both be None");
  check_fp4_experts(op, x, w13, "w13", w13_scales, "w13_scales", w13_global, "w13_global_scale", E, 2 * I, H, group,
                    mxfp4, 2);
  check_fp4_experts(op, x, w2, "w2", w2_scales, "w2_scales", w2_global, "w2_global_scale", E, H, I, group, mxfp4, 1);
  return {validate_moe_routing_and_activation(op, x, E, I, topk_weights, topk_ids, activation, swiglu_alpha,
                                              swiglu_limit, w13_bias, w2_bias, allow_fp32),
          weights};
}

}  // namespace fastinfer::binding
