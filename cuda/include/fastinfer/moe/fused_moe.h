#pragma once
// fused_moe: the expert MLPs of a mixture-of-experts layer (torch-free C++ API). The CUDA kernel is
// not written yet; the CPU implementation (cpp/torch/moe/cpu.cpp) and the fp64 reference
// (python/fastinfer/reference/moe.py) follow this contract, which the kernel will keep.
//
// For token t and each of its k slots j with e = topk_ids[t, j] (e = -1: the slot contributes
// nothing, as with expert parallelism):
//   h = x[t] @ w13[e]^T (+ w13_bias[e])   [2I] in fp32: the gate half (rows 0..I-1), then up
//   a = act(gate, up)                      [I] in fp32, then rounded to x's dtype (the input of the
//                                          second GEMM, as vLLM's intermediate cache)
//   y = a @ w2[e]^T (+ w2_bias[e])         [H] in fp32
//   out[t] = sum over j = 0..k-1, in that order, of topk_weights[t, j] * y, in fp32, rounded once
//            to x's dtype.
// Every product accumulates in fp32 in an order fixed by H or I alone, so a token's output does not
// depend on the other tokens of the batch.
#include <cstdint>

namespace fastinfer {

enum class MoeActivation : int32_t {
  kSilu = 0,       // silu(gate) * up (Mixtral, Qwen-MoE, OLMoE)
  kSwigluOai = 1,  // gpt-oss: g = min(gate, limit), u = clamp(up, -limit, limit),
                   // (u + 1) * g * sigmoid(alpha * g)
};

}  // namespace fastinfer
