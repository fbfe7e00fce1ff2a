#pragma once
// fused_moe: the expert MLPs of a mixture-of-experts layer (torch-free C++ API). The CUDA kernels
// (moe/fused_moe.cuh), the CPU implementation (cpp/torch/moe/cpu.cpp) and the fp64 reference
// (python/fastinfer/reference/moe.py) follow this contract.
//
// For token t and each of its k slots j with e = topk_ids[t, j] (e = -1: the slot contributes
// nothing, as with expert parallelism):
//   h = x[t] @ w13[e]^T (+ w13_bias[e])   [2I] in fp32: the gate half (rows 0..I-1), then up
//   a = act(gate, up)                      [I] in fp32, then rounded to x's dtype (the input of the
//                                          second GEMM, as vLLM's intermediate cache)
//   y = a @ w2[e]^T (+ w2_bias[e])         [H] in fp32, then rounded to x's dtype (stored by slot
//                                          for the sum, as vLLM's third intermediate cache)
//   out[t] = sum over j = 0..k-1, in that order, of topk_weights[t, j] * y, in fp32, rounded once
//            to x's dtype.
// Every product accumulates in fp32 in an order fixed by H or I alone, so a token's output does not
// depend on the other tokens of the batch.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/common/types.h"

namespace fastinfer {

enum class MoeActivation : int32_t {
  kSilu = 0,       // silu(gate) * up (Mixtral, Qwen-MoE, OLMoE)
  kSwigluOai = 1,  // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
                   // (u + 1) * g * sigmoid(alpha * g)
};

// The experts' weights: as the activations, or e4m3 with fp32 scales (fused_moe_fp8). With e4m3
// weights x and a (in the dtype) are quantised to e4m3 before their GEMM (gemm/fp8.h's rule): x per
// row (per channel) or per row and 128-group (blockwise), a per row and 64-group with either
// format (a row's last group shorter where I % 64 != 0). h = (xq sx) (wq sw)^T accumulated in fp32, the products of each group of k with an x or
// a group scale summed alone, scaled, then added in k order; likewise y from aq; everything else
// as above. e4m3 needs sm_89+.
enum class MoeWeightFormat : int32_t {
  kFloat = 0,          // w13, w2 in the activation dtype
  kFp8PerChannel = 1,  // e4m3; w13_scale [E, 2I], w2_scale [E, H]; H, I % 16 == 0
  kFp8Blockwise = 2,   // e4m3; w13_scale [E, 2I/128, H/128], w2_scale [E, H/128, I/128]; H, I % 128 == 0
  kInt4 = 3,           // int4_pack's layout per expert (gemm/int4.h): w13 [E, H/64, 16 I], w2 [E, I/64, 8 H]
                       // int32; group scales (the dtype) and zero points (uint8, or none: z = 8),
                       // dequantised as int4_gemm's; x and a as they are; H, I % 64 == 0 and % group_size
  kNvfp4 = 4,          // fp4_gemm's layout per expert (gemm/fp4.h): w13 [E, H/64, 16 I], w2 [E, I/64, 8 H]
                       // int32 of e2m1 codes; e4m3 scale bits [E, H/16, 2I] and [E, I/16, H]; optional
                       // fp32 global divisors [E, 2] (gate, up) and [E]; H, I % 64 == 0
  kMxfp4 = 5,          // the same with e8m0 scale bits [E, H/32, 2I] and [E, I/32, H], no global divisors
};
// FP4 experts: each weight as fp4_gemm's (e2m1 * s rounded to the dtype, s the scale converted to
// the dtype), h and y accumulated in fp32 and divided by the half's global divisor in fp32 before
// the bias; x and a as they are.

struct FusedMoeParams {
  const void* x = nullptr;             // [T, H] row-major, 16-byte aligned
  const void* w13 = nullptr;           // [E, 2I, H], 16-byte aligned (the dtype, or e4m3)
  const void* w2 = nullptr;            // [E, H, I], 16-byte aligned
  const float* w13_scale = nullptr;    // e4m3 weights: their scales (MoeWeightFormat)
  const float* w2_scale = nullptr;
  const void* w13_group_scales = nullptr;  // int4 weights: [E, H / G, 2I] and [E, I / G, H], the dtype;
                                           // fp4 weights: the scale bits (kNvfp4, kMxfp4)
  const void* w2_group_scales = nullptr;
  const uint8_t* w13_zeros = nullptr;      // int4 weights: the same shapes, 0..15, or both nullptr
  const uint8_t* w2_zeros = nullptr;
  int32_t group_size = 128;                // int4 weights: a multiple of 32 dividing H and I
  // NVFP4 weights: the global divisors w13_global_scale [E, 2] (gate, up) and w2_global_scale [E],
  // or both nullptr (1)
  const float* w13_global_scale = nullptr;
  const float* w2_global_scale = nullptr;
  const void* w13_bias = nullptr;      // [E, 2I] or nullptr
  const void* w2_bias = nullptr;       // [E, H] or nullptr
  const float* topk_weights = nullptr;  // [T, k]
  const int32_t* topk_ids = nullptr;   // [T, k] in [-1, E); other ids are skipped like -1
  void* out = nullptr;                 // [T, H], 4-byte aligned
  void* workspace = nullptr;           // fused_moe_workspace_size(params) bytes, 16-byte aligned
  int64_t num_tokens = 0;              // T * k < 2^31
  int32_t hidden = 0;                  // H, a multiple of 8
  int32_t intermediate = 0;            // I, a multiple of 8
  int32_t num_experts = 0;             // 1 <= E <= kMoeAlignMaxExperts (moe/routing.h)
  int32_t top_k = 0;                   // >= 1
  MoeActivation activation = MoeActivation::kSilu;
  float swiglu_alpha = 0.f, swiglu_limit = 0.f;  // kSwigluOai only
  DType dtype = DType::kBFloat16;      // x, biases, out (and kFloat weights): float16 or bfloat16
  MoeWeightFormat weights = MoeWeightFormat::kFloat;
};

// Bytes of scratch the launch needs (a function of the shapes only): the activations a of every
// routed slot [T k, I] in the dtype, their expert outputs y [T k, H] in fp32 (the per-token sum
// runs in slot order over them, which is what makes the result independent of the batch), the
// moe_align layout, and with e4m3 weights the quantised x and a with their scales.
size_t fused_moe_workspace_size(const FusedMoeParams& params);

// moe_align, the gate/up GEMM with the activation, the down GEMM, the per-token weighted sum: four
// kernels on `stream` (six with e4m3 weights: x and a quantised first), no host sync.
// mma.sync.m16n8k16 (sm_80+) / m16n8k32 e4m3 (sm_89+): cudaErrorNotSupported before.
cudaError_t launch_fused_moe(const FusedMoeParams& params, cudaStream_t stream);

}  // namespace fastinfer
