// fused_moe launcher: moe_align, then the two grouped GEMMs and the combine (moe/fused_moe.cuh);
// with e4m3 weights x is quantised first (gemm/fp8_quantize.cuh's launcher), and a by the gate/up
// epilogue where its tile is one group of a (the medium tier), else by that launcher too. Three tile tiers
// by the average rows per expert, T k / E, x {fp16, bf16} x {float, e4m3 per channel, e4m3
// blockwise, int4, nvfp4, mxfp4} weights (e4m3 and the 4-bit formats without the 128-row tier: e4m3
// needs more than 255 registers there, per channel as blockwise with its partial accumulators, and
// would spill; the 4-bit kernel is gemm/int4_gemm.cuh's, whose tiles stop at 64 rows).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/fp8.h"
#include "fastinfer/moe/fused_moe.cuh"
#include "fastinfer/moe/fused_moe_w4.cuh"
#include "fastinfer/moe/routing.h"

#include <algorithm>
#include <type_traits>

namespace fastinfer {
namespace {

using moe::MoeGemm;
using moe::MoeGemmConfig;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// A tier: the gate/up and down configurations of one block_m (moe_align's, shared by both GEMMs).
//  - small (decode; at most ~16 rows per expert): 16-row blocks; gate/up 32 columns (64 weight
//    rows) and down 32 columns on 2 warps, deep rings (6 and 8 stages, 60 and 48 KiB) so that the
//    weight stream has bytes in flight;
//  - medium (up to ~64 rows per expert): 64-row blocks, 8 warps, 4 stages (96 KiB); the gate/up
//    warps stacked 4 x 2, so that each warp's 16 rows are padding (skipped) or not, which at
//    Qwen3-30B-A3B shapes and 4096 tokens (256 rows an expert) saves a fifth of its mmas;
//  - large: 128-row blocks, 8 warps, 3 stages (96 KiB), where those blocks still fill the SMs.
// The gate/up tiles cover half the columns of the down tiles: each column costs two weight rows.
struct TierSmall {
  static constexpr int kBlockM = 16;
  using GateUp = MoeGemmConfig<16, 32, 1, 2, 6, MoeGemm::kGateUp>;
  using Down = MoeGemmConfig<16, 32, 1, 2, 8, MoeGemm::kDown>;
};
struct TierMedium {
  static constexpr int kBlockM = 64;
  using GateUp = MoeGemmConfig<64, 64, 4, 2, 4, MoeGemm::kGateUp>;
  using Down = MoeGemmConfig<64, 128, 2, 4, 4, MoeGemm::kDown>;
};
struct TierLarge {
  static constexpr int kBlockM = 128;
  using GateUp = MoeGemmConfig<128, 64, 2, 4, 3, MoeGemm::kGateUp>;
  using Down = MoeGemmConfig<128, 128, 2, 4, 3, MoeGemm::kDown>;
};
constexpr int kMinBlockM = TierSmall::kBlockM, kMaxBlockM = TierLarge::kBlockM;

struct WorkspaceLayout {
  size_t act, y, sorted, experts, total, x_q, x_scale, act_q, act_scale, bytes;
};

bool is_fp8(const FusedMoeParams& p) {
  return p.weights == MoeWeightFormat::kFp8PerChannel || p.weights == MoeWeightFormat::kFp8Blockwise;
}

// Scales per row of x quantised; a has ceil(I / kActGroup).
int64_t x_scales_per_row(const FusedMoeParams& p) {
  return p.weights == MoeWeightFormat::kFp8Blockwise ? ceil_div(p.hidden, moe::kScaleBlock) : 1;
}

// The workspace is sized for every tier (the longest sorted_token_ids, the most blocks), so that
// its size depends on the shapes alone.
WorkspaceLayout workspace_layout(const FusedMoeParams& p) {
  const int64_t slots = p.num_tokens * p.top_k;
  const int64_t sorted = moe_align_sorted_size(slots, p.num_experts, kMaxBlockM);
  WorkspaceLayout l{};
  l.act = 0;
  l.y = l.act + round_up(static_cast<size_t>(slots * p.intermediate) * 2);
  l.sorted = l.y + round_up(static_cast<size_t>(slots * p.hidden) * 2);
  l.experts = l.sorted + round_up(static_cast<size_t>(sorted) * sizeof(int32_t));
  l.total = l.experts + round_up(static_cast<size_t>(ceil_div(sorted, kMinBlockM)) * sizeof(int32_t));
  l.x_q = l.total + round_up(sizeof(int32_t));
  const bool fp8 = is_fp8(p);
  l.x_scale = l.x_q + (fp8 ? round_up(static_cast<size_t>(p.num_tokens * p.hidden)) : 0);
  l.act_q = l.x_scale + (fp8 ? round_up(static_cast<size_t>(p.num_tokens * x_scales_per_row(p)) * 4) : 0);
  l.act_scale = l.act_q + (fp8 ? round_up(static_cast<size_t>(slots * p.intermediate)) : 0);
  l.bytes = l.act_scale + (fp8 ? round_up(static_cast<size_t>(slots * ceil_div(p.intermediate, moe::kActGroup)) * 4) : 0);
  return l;
}

constexpr bool is_w4(MoeWeightFormat f) {
  return f == MoeWeightFormat::kInt4 || f == MoeWeightFormat::kNvfp4 || f == MoeWeightFormat::kMxfp4;
}

// The 4-bit grouped GEMM of a tier's block_m (moe/fused_moe_w4.cuh) with the format's decoder.
template <int kBlockM, MoeGemm kGemm, typename T, MoeWeightFormat kWeights>
cudaError_t launch_w4_gemm(const FusedMoeParams& p, const moe::FusedMoeWorkspace& w, int64_t row_blocks,
                           cudaStream_t stream) {
  using Shape = moe::MoeW4Shape<kBlockM, kGemm>;
  using Weights = std::conditional_t<
      kWeights == MoeWeightFormat::kInt4, moe::Int4Weights<T, Shape>,
      moe::Fp4Weights<T, Shape, kWeights == MoeWeightFormat::kNvfp4 ? Fp4Format::kNvfp4 : Fp4Format::kMxfp4>>;
  using Cfg = moe::MoeW4Config<Shape, Weights>;
  const int64_t n = kGemm == MoeGemm::kGateUp ? p.intermediate : p.hidden;
  const int64_t col_tiles = ceil_div(n, Cfg::kCols);
  if (row_blocks > 0x7fffffff || col_tiles > 65535) return cudaErrorInvalidValue;
  return launch_kernel(moe::moe_w4_gemm_kernel<Shape, Weights, T>,
                       dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_tiles)), dim3(Cfg::kThreads),
                       static_cast<size_t>(Cfg::kSmemBytes), stream, p, w);
}

template <typename Cfg, typename T, MoeWeightFormat kWeights>
cudaError_t launch_gemm(const FusedMoeParams& p, const moe::FusedMoeWorkspace& w, int64_t row_blocks,
                        cudaStream_t stream) {
  if constexpr (is_w4(kWeights)) {
    return launch_w4_gemm<Cfg::kBlockM, Cfg::kGemm, T, kWeights>(p, w, row_blocks, stream);
  } else {
    const int64_t n = Cfg::kGemm == MoeGemm::kGateUp ? p.intermediate : p.hidden;
    const int64_t col_tiles = ceil_div(n, Cfg::kBlockN);
    if (row_blocks > 0x7fffffff || col_tiles > 65535) return cudaErrorInvalidValue;
    if constexpr (kWeights != MoeWeightFormat::kFloat) {  // e4m3 mma: an sm_89+ build of the kernel
      if (cudaError_t err = require_kernel_arch<moe::moe_gemm_kernel<Cfg, T, kWeights>>(89); err != cudaSuccess)
        return err;
    }
    return launch_kernel(moe::moe_gemm_kernel<Cfg, T, kWeights>,
                         dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(col_tiles)),
                         dim3(Cfg::kThreads), static_cast<size_t>(Cfg::kSmemBytes), stream, p, w);
  }
}

// x or a [rows, cols] (the dtype) -> e4m3 and its scales, per row (group 0) or per row and group.
cudaError_t quantize_input(const FusedMoeParams& p, const void* src, void* dst, float* scale, int64_t rows,
                           int64_t cols, int group, cudaStream_t stream) {
  Fp8QuantizeParams q;
  q.x = src;
  q.out = dst;
  q.scale = scale;
  q.rows = rows;
  q.cols = cols;
  q.group_size = group;
  q.mode = group > 0 ? Fp8QuantMode::kGroup : Fp8QuantMode::kToken;
  q.dtype = p.dtype;
  return launch_fp8_quantize(q, stream);
}

template <typename Tier, typename T, MoeWeightFormat kWeights>
cudaError_t launch_tier(const FusedMoeParams& p, const WorkspaceLayout& l, cudaStream_t stream) {
  constexpr bool kFp8 = kWeights == MoeWeightFormat::kFp8PerChannel || kWeights == MoeWeightFormat::kFp8Blockwise;
  uint8_t* base = static_cast<uint8_t*>(p.workspace);
  const int64_t slots = p.num_tokens * p.top_k;
  MoeAlignParams align;
  align.topk_ids = p.topk_ids;
  align.sorted_token_ids = reinterpret_cast<int32_t*>(base + l.sorted);
  align.expert_ids = reinterpret_cast<int32_t*>(base + l.experts);
  align.num_tokens_post_padded = reinterpret_cast<int32_t*>(base + l.total);
  align.num_slots = static_cast<int32_t>(slots);
  align.num_experts = p.num_experts;
  align.block_m = Tier::kBlockM;
  align.index_type = IndexType::kInt32;
  cudaError_t err = launch_moe_align(align, stream);
  if (err == cudaSuccess && kFp8)
    err = quantize_input(p, p.x, base + l.x_q, reinterpret_cast<float*>(base + l.x_scale), p.num_tokens, p.hidden,
                         p.weights == MoeWeightFormat::kFp8Blockwise ? moe::kScaleBlock : 0, stream);
  if (err != cudaSuccess) return err;

  moe::FusedMoeWorkspace w;
  w.act = base + l.act;
  w.y = base + l.y;
  w.sorted_token_ids = align.sorted_token_ids;
  w.expert_ids = align.expert_ids;
  w.num_tokens_post_padded = align.num_tokens_post_padded;
  if (kFp8) {
    w.x_q = base + l.x_q;
    w.x_scale = reinterpret_cast<const float*>(base + l.x_scale);
    w.act_q = base + l.act_q;
    w.act_scale = reinterpret_cast<float*>(base + l.act_scale);
  }
  // Every used block holds at least one slot: at most `slots` of them.
  const int64_t row_blocks =
      std::min(ceil_div(moe_align_sorted_size(slots, p.num_experts, Tier::kBlockM), Tier::kBlockM), slots);
  err = launch_gemm<typename Tier::GateUp, T, kWeights>(p, w, row_blocks, stream);
  // a of the slots no block holds (ids outside [0, E)) is never written: quantised, never read
  if (err == cudaSuccess && kFp8 && !moe::gate_up_quantizes_act<typename Tier::GateUp>(kWeights))
    err = quantize_input(p, w.act, w.act_q, w.act_scale, slots, p.intermediate, moe::kActGroup, stream);
  if (err == cudaSuccess) err = launch_gemm<typename Tier::Down, T, kWeights>(p, w, row_blocks, stream);
  if (err == cudaSuccess)
    err = launch_kernel(moe::moe_combine_kernel<T>,
                        dim3(static_cast<unsigned>(p.num_tokens),
                             static_cast<unsigned>(ceil_div(p.hidden, moe::kCombineColumns))),
                        dim3(moe::kCombineThreads), 0, stream, p, w);
  return err;
}

}  // namespace

size_t fused_moe_workspace_size(const FusedMoeParams& p) { return workspace_layout(p).bytes; }

cudaError_t launch_fused_moe(const FusedMoeParams& p, cudaStream_t stream) {
  if (p.num_tokens < 0 || p.hidden < 8 || p.hidden % 8 != 0 || p.intermediate < 8 || p.intermediate % 8 != 0 ||
      p.num_experts < 1 || p.num_experts > kMoeAlignMaxExperts || p.top_k < 1 ||
      moe_align_sorted_size(p.num_tokens * p.top_k, p.num_experts, kMaxBlockM) > int64_t{0x7fffffff})
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.x == nullptr || p.w13 == nullptr || p.w2 == nullptr || p.topk_weights == nullptr || p.topk_ids == nullptr ||
      p.out == nullptr || p.workspace == nullptr)
    return cudaErrorInvalidValue;
  const int64_t k_multiple = p.weights == MoeWeightFormat::kFp8Blockwise   ? moe::kScaleBlock
                             : p.weights == MoeWeightFormat::kFp8PerChannel ? 16
                             : is_w4(p.weights)                            ? kInt4TileK
                                                                           : 8;
  if (p.hidden % k_multiple != 0 || p.intermediate % k_multiple != 0) return cudaErrorInvalidValue;
  if (is_fp8(p) && (p.w13_scale == nullptr || p.w2_scale == nullptr)) return cudaErrorInvalidValue;
  if (p.weights == MoeWeightFormat::kInt4 &&
      (p.w13_group_scales == nullptr || p.w2_group_scales == nullptr || (p.w13_zeros == nullptr) != (p.w2_zeros == nullptr) ||
       p.group_size <= 0 || p.group_size % 32 != 0 || p.hidden % p.group_size != 0 ||
       p.intermediate % p.group_size != 0))
    return cudaErrorInvalidValue;
  if ((p.weights == MoeWeightFormat::kNvfp4 || p.weights == MoeWeightFormat::kMxfp4) &&
      (p.w13_group_scales == nullptr || p.w2_group_scales == nullptr ||
       (p.w13_global_scale == nullptr) != (p.w2_global_scale == nullptr) ||
       (p.weights == MoeWeightFormat::kMxfp4 && p.w13_global_scale != nullptr)))
    return cudaErrorInvalidValue;
  if (!is_aligned(p.x, 16) || !is_aligned(p.w13, 16) || !is_aligned(p.w2, 16) || !is_aligned(p.out, 4) ||
      !is_aligned(p.workspace, 16) || (p.w13_bias && !is_aligned(p.w13_bias, 2)) ||
      (p.w2_bias && !is_aligned(p.w2_bias, 2)))
    return cudaErrorInvalidValue;
  int dev = 0, major = 0, minor = 0, num_sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (major < 8) return cudaErrorNotSupported;                     // mma.m16n8k16 bf16 needs sm_80
  if (is_fp8(p) && major * 10 + minor < 89) return cudaErrorNotSupported;  // e4m3 mma: sm_89
  const WorkspaceLayout layout = workspace_layout(p);
  // The tier changes with the batch, a token's result does not (moe/fused_moe.cuh).
  const int64_t slots = p.num_tokens * p.top_k;
  const int64_t rows_per_expert = ceil_div(slots, p.num_experts);
  const int64_t large_ctas = ceil_div(slots, TierLarge::kBlockM) * ceil_div(p.hidden, TierLarge::Down::kBlockN);
  const auto by_tier = [&](auto weights) {
    constexpr MoeWeightFormat kWeights = decltype(weights)::value;
    return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
      if (rows_per_expert <= 16) return launch_tier<TierSmall, T, kWeights>(p, layout, stream);
      if constexpr (kWeights == MoeWeightFormat::kFloat)
        if (rows_per_expert > 64 && large_ctas >= num_sms) return launch_tier<TierLarge, T, kWeights>(p, layout, stream);
      return launch_tier<TierMedium, T, kWeights>(p, layout, stream);
    });
  };
  switch (p.weights) {
    case MoeWeightFormat::kFloat:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kFloat>{});
    case MoeWeightFormat::kFp8PerChannel:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kFp8PerChannel>{});
    case MoeWeightFormat::kFp8Blockwise:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kFp8Blockwise>{});
    case MoeWeightFormat::kInt4:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kInt4>{});
    case MoeWeightFormat::kNvfp4:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kNvfp4>{});
    case MoeWeightFormat::kMxfp4:
      return by_tier(std::integral_constant<MoeWeightFormat, MoeWeightFormat::kMxfp4>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace fastinfer
