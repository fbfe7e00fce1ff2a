// Paged decode attention launcher, split heuristic and instantiations:
// {fp16, bf16} x {same-dtype, fp8 e4m3 cache} x head_dim {64, 128, 256} x group chunk {1, 2, 4, 8}.
#include "fastinfer/attention/decode.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"

namespace fastinfer {
namespace {

constexpr int32_t kMaxAutoSplits = 64;  // cap of the heuristic (explicit num_splits may exceed it)
constexpr int32_t kMaxSplits = 65535;   // grid.z limit

int head_chunks_for(const DecodeAttentionParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int g = attention::decode::group_chunk_for(group);
  return (group + g - 1) / g;
}

template <typename T, typename CacheT, int D, int G>
cudaError_t launch_decode_typed(const DecodeAttentionParams& p, cudaStream_t stream) {
  using Cfg = attention::decode::Config<D, G>;
  const int head_chunks = head_chunks_for(p);
  const dim3 grid(static_cast<unsigned>(p.batch_size), static_cast<unsigned>(p.num_kv_heads * head_chunks),
                  static_cast<unsigned>(p.num_splits));
  cudaError_t err = launch_kernel(attention::decode::paged_decode_attention_kernel<T, CacheT, D, G>, grid,
                                  dim3(attention::decode::kNumThreads), Cfg::kSmemBytes, stream, p, head_chunks);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  constexpr int kRows = attention::decode::kMergeRowsPerCta;
  const int64_t rows = static_cast<int64_t>(p.batch_size) * p.num_q_heads;
  return launch_kernel(attention::decode::decode_merge_splits_kernel<T>,
                       dim3(static_cast<unsigned>((rows + kRows - 1) / kRows)), dim3(kRows * 32), 0, stream, p,
                       p.num_splits);
}

template <typename T, typename CacheT>
cudaError_t dispatch_shape(const DecodeAttentionParams& p, cudaStream_t stream) {
  const int g = attention::decode::group_chunk_for(p.num_q_heads / p.num_kv_heads);
  return FASTINFER_DISPATCH_HEAD_DIM(p.head_dim, D, [&] {
    return FASTINFER_DISPATCH_GROUP(g, G, [&] { return launch_decode_typed<T, CacheT, D, G>(p, stream); });
  });
}

bool shape_ok(const DecodeAttentionParams& p) {
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) return false;
  if (p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0) return false;
  if (p.block_size < 8 || p.block_size > 256 || (p.block_size & (p.block_size - 1)) != 0) return false;
  return p.batch_size >= 0 && p.block_table_stride >= 0;
}

}  // namespace

// Split heuristic. base = B * Hkv * head_chunks CTAs; slots = num_sms * the CTAs a kernel keeps
// resident per SM (ctas_per_sm_for: 4 for group chunks 1-2, 3 for 4, 2 for 8). With plenty of
// CTAs (>= 4 full waves) no split. Otherwise the lower bound s_lo = ceil(2 * num_sms / base) (two
// waves of num_sms CTAs) and, among s in [s_lo, max(2 * s_lo, 4)], the s whose last wave is the
// fullest (fraction of the slots busy over ceil(base * s / slots) waves; ties to the smaller s).
// A split is a whole number of granules, so s splits of the longest sequence (max keys) are only
// e(s) = ceil(max keys / per(s)) non-empty ones: candidates are judged, and returned, by e(s)
// (12 requested splits of 4096 keys were 11 real ones plus an empty CTA per (sequence, head)).
// B = 64, Hkv = 8, group 4 on 132 SMs gives 3 splits (1536 CTAs in 3.9 waves of 396 instead of
// 512 CTAs in 1.3 waves); B = 1 at 32k keys 47 (376 CTAs, 0.95 of a wave; the former cap of 32
// left 256 CTAs, 0.65 of a wave, simt profile / bench/model.py). Always within
// [1, min(64, ceil(max keys / split granule))]. Short contexts stay below a wave on purpose: at
// B = 1 and 512 keys the 64-key granule allows 8 splits (64 CTAs on 132 SMs); finer splits would
// write and re-read more fp32 partials than the 256 KB of K/V per head they split (an explicit
// num_splits can still go finer).
int32_t decode_attention_num_splits(const DecodeAttentionParams& p, int32_t num_sms) {
  if (!shape_ok(p) || p.batch_size <= 0 || num_sms <= 0) return 1;
  const int g = attention::decode::group_chunk_for(p.num_q_heads / p.num_kv_heads);
  const int64_t base = static_cast<int64_t>(p.batch_size) * p.num_kv_heads * head_chunks_for(p);
  const int64_t slots = static_cast<int64_t>(num_sms) * attention::decode::ctas_per_sm_for(g);
  const int granule = attention::decode::split_granule(p.head_dim, g);
  const int64_t max_keys = p.block_table_stride * p.block_size;
  int64_t cap = (max_keys + granule - 1) / granule;
  if (cap > kMaxAutoSplits) cap = kMaxAutoSplits;
  if (cap <= 1 || base >= 4 * slots) return 1;
  int64_t lo = (2 * static_cast<int64_t>(num_sms) + base - 1) / base;
  if (lo > cap) lo = cap;
  if (lo < 1) lo = 1;
  int64_t hi = 2 * lo > 4 ? 2 * lo : 4;
  if (hi > cap) hi = cap;
  int64_t best = 1;
  double best_eff = -1.0;
  for (int64_t s = lo; s <= hi; ++s) {
    int64_t per = (max_keys + s - 1) / s;
    per = (per + granule - 1) / granule * granule;
    const int64_t e = (max_keys + per - 1) / per;  // non-empty splits of the longest sequence
    const int64_t total = base * e;
    const int64_t waves = (total + slots - 1) / slots;
    const double eff = static_cast<double>(total) / static_cast<double>(waves * slots);
    if (eff > best_eff + 0.02) {
      best_eff = eff;
      best = e;
    }
  }
  return static_cast<int32_t>(best);
}

size_t decode_attention_workspace_size(const DecodeAttentionParams& p) {
  if (p.num_splits <= 1 || p.batch_size <= 0 || p.num_q_heads <= 0 || p.head_dim <= 0) return 0;
  const size_t rows = static_cast<size_t>(p.num_splits) * p.batch_size * p.num_q_heads;
  const size_t bytes = rows * p.head_dim * sizeof(float) + rows * sizeof(float);
  return (bytes + 15) / 16 * 16;
}

cudaError_t launch_decode_attention(const DecodeAttentionParams& p, cudaStream_t stream) {
  if (p.batch_size == 0) return cudaSuccess;
  if (!shape_ok(p)) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.num_splits > 1 && (p.workspace == nullptr || !is_aligned(p.workspace, 16))) return cudaErrorInvalidValue;
  if (p.num_kv_heads * static_cast<int64_t>(head_chunks_for(p)) > 65535) return cudaErrorInvalidValue;
  if (p.q == nullptr || p.k_cache == nullptr || p.v_cache == nullptr || p.out == nullptr ||
      p.block_table == nullptr || p.seq_lens == nullptr)
    return cudaErrorInvalidValue;
  // 16-byte slices of q/K/V rows and 8-byte stores of out.
  if (p.q_token_stride % 8 != 0 || p.out_token_stride % 4 != 0 || !is_aligned(p.q, 16) ||
      !is_aligned(p.out, 8) || !is_aligned(p.k_cache, 16) || !is_aligned(p.v_cache, 16))
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.cache_dtype == p.dtype) return dispatch_shape<T, T>(p, stream);
    if (p.cache_dtype == DType::kFloat8E4M3) {
      if (p.k_scale == nullptr || p.v_scale == nullptr) return cudaErrorInvalidValue;
      return dispatch_shape<T, __nv_fp8_e4m3>(p, stream);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace fastinfer
