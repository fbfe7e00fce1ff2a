#pragma once
// gated_delta_rule recurrent kernel (contract in gated_delta_rule.h). Grid (sequence, value head,
// head_dim_v / 32), 128 threads: warp w holds value columns 8w .. 8w + 7 of the CTA's 32, each
// column over 4 lanes (lane = 8 * row_lane + column): row_lane r holds the state rows r, r + 4,
// r + 8, ... (Dk / 4 of them, in registers), so a warp's loads of one state row are 4 runs of 8
// consecutive floats (full 32-byte sectors) and its shared-memory reads of q and k hit 4 banks.
// Per token: the CTA stages q and k of its key head (loaded a token ahead, with v, g and beta) in
// shared memory in fp32 (l2-normalised by warps 0 and 1, q times scale), then each thread decays
// its rows, the column's S^T k is its 4 lanes' fma chains summed by two xor shuffles (a + b and
// b + a round alike, so every lane holds the same bits), u = beta (v - S^T k), the rows take k u,
// and o = S^T q the same way. The order of every sum depends on nothing but the token, so a
// sequence split across calls (prefill in chunks, decode) gives the bits of one call.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/vec.cuh"
#include "fastinfer/linear_attention/gated_delta_rule.h"

namespace fastinfer::linear_attention {

constexpr int kGdnThreads = 128;
constexpr int kGdnRowLanes = 4;                         // lanes per value column
constexpr int kGdnColsPerWarp = 32 / kGdnRowLanes;      // 8
constexpr int kGdnCols = kGdnColsPerWarp * (kGdnThreads / 32);  // 32 value columns per CTA

__device__ __forceinline__ int64_t gdn_slot_of(const GatedDeltaRuleParams& p, int64_t seq) {
  return p.index_type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p.state_indices)[seq])
                                           : static_cast<const int64_t*>(p.state_indices)[seq];
}

// The sum over one warp's lanes of v (xor butterfly: every lane gets the same bits).
__device__ __forceinline__ float gdn_warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

template <typename T, int DK>
__global__ void __launch_bounds__(kGdnThreads) gated_delta_rule_kernel(const GatedDeltaRuleParams p) {
  constexpr int kRows = DK / kGdnRowLanes;  // state rows per thread
  const int64_t seq = blockIdx.x;
  const int hv = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row_lane = lane / kGdnColsPerWarp;
  const int col = blockIdx.z * kGdnCols + warp * kGdnColsPerWarp + lane % kGdnColsPerWarp;
  const int hk = hv / (p.num_v_heads / p.num_k_heads);
  const int Hv = p.num_v_heads, Dv = p.head_dim_v;
  __shared__ float s_q[DK], s_k[DK];
  __shared__ float s_inv[2];

  const int64_t start = p.cu_seqlens[seq], end = p.cu_seqlens[seq + 1];
  const bool from_state = p.has_initial_state == nullptr || p.has_initial_state[seq];
  const int64_t slot = gdn_slot_of(p, seq);
  float* state = p.states + (slot * Hv + hv) * static_cast<int64_t>(DK) * Dv + col;
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    S[r] = from_state ? state[static_cast<int64_t>(r * kGdnRowLanes + row_lane) * Dv] : 0.f;

  const T* qp = static_cast<const T*>(p.q);
  const T* kp = static_cast<const T*>(p.k);
  const T* vp = static_cast<const T*>(p.v);
  // The next token's inputs are loaded one token ahead (thread i < DK: q[i] and k[i]; every
  // thread: its v, g and beta), so their latency overlaps the current token's arithmetic.
  static_assert(DK <= kGdnThreads, "one q and one k element per thread");
  const int i_qk = threadIdx.x;
  float q_next = 0.f, k_next = 0.f, v_next = 0.f, g_next = 0.f, beta_next = 0.f;
  auto load_token = [&](int64_t t) {
    if (i_qk < DK) {
      q_next = to_float(qp[t * p.q_token_stride + hk * DK + i_qk]);
      k_next = to_float(kp[t * p.k_token_stride + hk * DK + i_qk]);
    }
    v_next = to_float(vp[t * p.v_token_stride + static_cast<int64_t>(hv) * Dv + col]);
    g_next = p.g[t * Hv + hv];
    beta_next = p.beta_fp32 ? static_cast<const float*>(p.beta)[t * Hv + hv]
                            : to_float(static_cast<const T*>(p.beta)[t * Hv + hv]);
  };
  if (start < end) load_token(start);
  for (int64_t t = start; t < end; ++t) {
    __syncthreads();  // the previous token's reads of s_q / s_k are done
    const float q_mul = p.use_qk_l2norm ? 1.f : p.scale;
    if (i_qk < DK) {
      s_q[i_qk] = q_next * q_mul;
      s_k[i_qk] = k_next;
    }
    const float vc = v_next, decay = expf(g_next), beta = beta_next;
    if (t + 1 < end) load_token(t + 1);
    __syncthreads();
    if (p.use_qk_l2norm) {
      if (warp < 2) {
        const float* x = warp == 0 ? s_q : s_k;
        float ss = 0.f;
        for (int i = lane; i < DK; i += 32) ss = fmaf(x[i], x[i], ss);
        ss = gdn_warp_sum(ss);
        if (lane == 0) s_inv[warp] = 1.f / sqrtf(ss + 1e-6f);
      }
      __syncthreads();
      const float inv_q = s_inv[0], inv_k = s_inv[1];
      for (int i = threadIdx.x; i < DK; i += kGdnThreads) {
        s_q[i] = s_q[i] * inv_q * p.scale;
        s_k[i] = s_k[i] * inv_k;
      }
      __syncthreads();
    }
    float kv = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] *= decay;
      kv = fmaf(s_k[r * kGdnRowLanes + row_lane], S[r], kv);
    }
    kv += __shfl_xor_sync(0xffffffffu, kv, kGdnColsPerWarp);
    kv += __shfl_xor_sync(0xffffffffu, kv, 2 * kGdnColsPerWarp);
    const float u = beta * (vc - kv);
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] = fmaf(s_k[r * kGdnRowLanes + row_lane], u, S[r]);
      o = fmaf(s_q[r * kGdnRowLanes + row_lane], S[r], o);
    }
    o += __shfl_xor_sync(0xffffffffu, o, kGdnColsPerWarp);
    o += __shfl_xor_sync(0xffffffffu, o, 2 * kGdnColsPerWarp);
    if (row_lane == 0) static_cast<T*>(p.out)[(t * Hv + hv) * Dv + col] = from_float<T>(o);
    if (p.state_history != nullptr) {
      float* h = p.state_history + (t * Hv + hv) * static_cast<int64_t>(DK) * Dv + col;
#pragma unroll
      for (int r = 0; r < kRows; ++r) h[static_cast<int64_t>(r * kGdnRowLanes + row_lane) * Dv] = S[r];
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) state[static_cast<int64_t>(r * kGdnRowLanes + row_lane) * Dv] = S[r];
}

}  // namespace fastinfer::linear_attention
