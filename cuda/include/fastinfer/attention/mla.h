#pragma once
// Multi-head latent attention (DeepSeek-V3 / R1 / V3.2, Kimi K2, GLM-5), torch-free C++ API.
//
// The latent cache per layer is [num_blocks, block_size, 576], contiguous: per token the
// compressed latent kv_c (512 values) then the roped key part k_pe (64), shared by every query
// head; slot = block * block_size + offset. In the absorbed form query head h of a token is
// [q_nope W_UK[h] | q_pe] (576): the score of key j is scale * q . row_j over all 576 values and
// its value is row_j[0:512], so the output stays in latent space (the caller applies W_UV).
// An fp8 e4m3 cache holds e4m3(clamp(x / scale, -448, 448)) with a float32 scale per tensor or
// per token (slot s's at kv_scale[s]; the cache write computes max(amax of the 576 values,
// 1e-12) / 448 first, fp8_quantize's rule).
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "fastinfer/attention/launch_plan.h"
#include "fastinfer/common/types.h"

namespace fastinfer {

constexpr int kMlaLatentDim = 512;
constexpr int kMlaRopeDim = 64;
constexpr int kMlaRowDim = kMlaLatentDim + kMlaRopeDim;

// Token t's [kv_c[t] | k_pe[t]] into cache row slot_mapping[t] (-1: skipped).
struct MlaCacheWriteParams {
  const void* kv_c = nullptr;   // [num_tokens, 512], row stride kv_c_stride (elements)
  const void* k_pe = nullptr;   // [num_tokens, 64], row stride k_pe_stride
  void* kv_cache = nullptr;     // [num_slots, 576]
  const void* slot_mapping = nullptr;  // [num_tokens] int32 or int64
  IndexType slot_type = IndexType::kInt64;
  // fp8 cache: kv_scale[0] (per tensor, read) or kv_scale[slot] (per token, written).
  float* kv_scale = nullptr;
  bool scale_per_token = false;
  int64_t num_tokens = 0;
  int64_t kv_c_stride = 0, k_pe_stride = 0;
  DType dtype = DType::kBFloat16;        // kv_c, k_pe: float16 or bfloat16
  DType cache_dtype = DType::kBFloat16;  // dtype or kFloat8E4M3
};

cudaError_t launch_mla_cache_write(const MlaCacheWriteParams& params, cudaStream_t stream);

// Decode / speculative verification: the q_len query tokens of sequence b are rows
// cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q, its last q_len tokens of seq_lens[b], already in
// the cache; causal bottom-right aligned, or a custom (tree) mask over the trailing keys as the
// prefill kernel takes it (mask.cuh). lse as attention.h.
//
// Kernel: a CTA owns up to kMlaRowsPerCta (token, head) rows of one sequence, token-major (the
// heads of a token adjacent, as the prefill kernel's GQA packing), so every latent tile it loads
// serves all of them; mma.sync m16n8k16 for S = Q K^T (576 deep) and O += P V (V the first 512
// columns of the same shared-memory tile). Split-KV (num_splits > 1, or the deterministic mode's
// chunks) writes fp32 partials into the workspace, folded left to right by
// prefill_merge_splits_kernel (split_fold.cuh).
struct MlaDecodeParams {
  const void* q = nullptr;         // [num_q_tokens, num_heads, 576], heads packed, token stride q_token_stride
  const void* kv_cache = nullptr;  // [NB, block_size, 576], dtype or fp8 e4m3
  void* out = nullptr;             // [num_q_tokens, num_heads, 512], token stride out_token_stride
  float* lse = nullptr;            // [num_q_tokens, num_heads] or nullptr
  const int32_t* block_table = nullptr;  // [B, block_table_stride]
  int64_t block_table_stride = 0;
  int32_t block_size = 0;                // power of two in [8, 256]
  const int32_t* seq_lens = nullptr;     // [B]
  const int32_t* cu_seqlens_q = nullptr; // [B + 1]
  const bool* custom_mask = nullptr;     // bool [sum of q_len^2], or nullptr
  const int64_t* mask_offsets = nullptr; // [B + 1] prefix sums of q_len^2 (with custom_mask)
  const float* kv_scale = nullptr;       // fp8 cache: [1] or [NB * block_size]
  bool scale_per_token = false;

  int32_t batch_size = 0;
  int32_t num_heads = 0;
  int64_t num_q_tokens = 0;
  int64_t q_token_stride = 0;
  int64_t out_token_stride = 0;
  float scale = 1.0f;
  bool causal = true;
  DType dtype = DType::kBFloat16;        // q and out
  DType cache_dtype = DType::kBFloat16;  // dtype or kFloat8E4M3

  // 0: resolve with mla_decode_num_splits; 1: no split. Ignored in the deterministic mode.
  int32_t num_splits = 1;
  // Deterministic mode: F > 0, a multiple of 64. Every row's keys in chunks [c F, (c + 1) F) from
  // key 0, a CTA per chunk, folded left to right: a row's bits do not depend on the batch.
  int32_t fixed_split_size = 0;
  void* workspace = nullptr;  // mla_decode_workspace_size(params) bytes, 16-byte aligned
};

// Test overrides of the launcher's own choices (the bindings fill them from FASTINFER_TEST_*; every
// choice gives a correct result, and in the deterministic mode the same bits).
struct MlaDecodeOverrides {
  int32_t rows_per_cta = 0;               // 64 or 32; 0: by device
  int64_t fixed_split_partial_bytes = 0;  // deterministic mode: partials per launch; 0: 256 MiB
};

// Rows per CTA on a device: 64 (about 150 KiB of shared memory: sm_80, sm_90, sm_100), 32 where
// a block has 99 KiB (sm_86, sm_89, sm_120) or the compute capability is unknown.
int32_t mla_decode_rows_per_cta(const DeviceDescription& device, const MlaDecodeOverrides& overrides = {});
// The automatic split count for num_splits = 0: CTAs enough for about one wave (one CTA per SM).
int32_t mla_decode_num_splits(const MlaDecodeParams& params, const DeviceDescription& device,
                              const MlaDecodeOverrides& overrides = {});
size_t mla_decode_workspace_size(const MlaDecodeParams& params, const MlaDecodeOverrides& overrides = {});
cudaError_t launch_mla_decode(const MlaDecodeParams& params, const DeviceDescription& device,
                              const MlaDecodeOverrides& overrides, cudaStream_t stream);

}  // namespace fastinfer
