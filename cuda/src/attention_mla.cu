// Multi-head latent attention launchers and instantiations: the cache write {fp16, bf16} x {same
// dtype, fp8 e4m3}; the decode {fp16, bf16} x {same dtype, fp8 e4m3} x {64, 32 rows} x {direct,
// split partials}, and prefill_merge_splits_kernel at 512 columns for the splits.
#include "fastinfer/attention/mla.cuh"
#include "fastinfer/attention/split_fold.cuh"
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"

namespace fastinfer {
namespace {

constexpr int32_t kMaxAutoSplits = 64;
constexpr int64_t kMinKeysPerSplit = 256;  // a split reads at least this many latent rows
// The deterministic mode's partials per launch: at most this many bytes (further chunks are folded
// by further launches, the fold continuing from an fp32 running state: the same bits).
constexpr int64_t kMaxPartialBytes = int64_t{256} << 20;

int64_t work_items(const MlaDecodeParams& p, int rows) {
  // sum over sequences of ceil(q_len * H / rows) <= (T * H + nonempty * (rows - 1)) / rows, and
  // <= T * ceil(H / rows) (ceil(q H / R) <= q ceil(H / R)): exact for decode, one token each
  const int64_t nonempty = p.num_q_tokens < p.batch_size ? p.num_q_tokens : p.batch_size;
  const int64_t by_rows = (p.num_q_tokens * p.num_heads + nonempty * (rows - 1)) / rows;
  const int64_t by_tokens = p.num_q_tokens * ((p.num_heads + rows - 1) / rows);
  return by_rows < by_tokens ? by_rows : by_tokens;
}

int64_t key_bound(const MlaDecodeParams& p) { return p.block_table_stride * p.block_size; }

int64_t partial_bytes_per_part(const MlaDecodeParams& p) {
  return p.num_q_tokens * p.num_heads * static_cast<int64_t>((kMlaLatentDim + 1) * sizeof(float));
}

// Splits (default mode) or chunks (deterministic mode) of the call, and how many per launch.
struct SplitPlan {
  int64_t parts = 1;
  int64_t per_launch = 1;
  bool split = false;
};

SplitPlan split_plan(const MlaDecodeParams& p, const MlaDecodeOverrides& o) {
  SplitPlan plan;
  if (p.fixed_split_size > 0) {
    plan.split = true;
    plan.parts = (key_bound(p) + p.fixed_split_size - 1) / p.fixed_split_size;
    if (plan.parts < 1) plan.parts = 1;
    const int64_t per_part = partial_bytes_per_part(p);
    const int64_t budget = o.fixed_split_partial_bytes > 0 ? o.fixed_split_partial_bytes : kMaxPartialBytes;
    const int64_t fit = budget / (per_part > 0 ? per_part : 1);
    plan.per_launch = fit < 1 ? 1 : (fit < plan.parts ? fit : plan.parts);
    if (plan.per_launch > 65535) plan.per_launch = 65535;
  } else if (p.num_splits > 1) {
    plan.split = true;
    plan.parts = plan.per_launch = p.num_splits;
  }
  return plan;
}

bool shape_ok(const MlaDecodeParams& p) {
  if (p.num_heads <= 0 || p.batch_size < 0 || p.num_q_tokens < 0 || p.block_table_stride < 0) return false;
  if (p.block_size < 8 || p.block_size > 256 || (p.block_size & (p.block_size - 1)) != 0) return false;
  if (p.fixed_split_size < 0 || p.fixed_split_size % 64 != 0) return false;
  return p.num_splits >= 0 && p.num_splits <= 65535;
}

template <typename Traits>
cudaError_t launch_typed(const MlaDecodeParams& p, const MlaDecodeOverrides& o, cudaStream_t stream) {
  using T = typename Traits::T;
  const int64_t items = work_items(p, Traits::kRows);
  if (items <= 0) return cudaSuccess;
  if (items > 0x7fffffff) return cudaErrorInvalidValue;
  const SplitPlan plan = split_plan(p, o);
  if (!plan.split)
    return launch_kernel(attention::mla::mla_decode_kernel<Traits, false>, dim3(static_cast<unsigned>(items)),
                         dim3(Traits::kThreads), Traits::kSmemBytes, stream, p,
                         attention::mla::MlaSplitState{nullptr, nullptr, 0});
  // Workspace: partials [per_launch][rows][512] | their lse [per_launch][rows] | (several launches)
  // the running state [rows][512] | its lse [rows].
  const int64_t rows = p.num_q_tokens * p.num_heads;
  float* split_out = static_cast<float*>(p.workspace);
  float* split_lse = split_out + plan.per_launch * rows * kMlaLatentDim;
  float* running_out = split_lse + plan.per_launch * rows;
  float* running_lse = running_out + rows * kMlaLatentDim;
  PrefillAttentionParams mp;  // what the split merge reads
  mp.out = p.out;
  mp.lse = p.lse;
  mp.num_q_tokens = p.num_q_tokens;
  mp.num_q_heads = p.num_heads;
  mp.out_token_stride = p.out_token_stride;
  mp.sinks = nullptr;
  attention::PrefillLaunchState ls{};
  ls.split_out = split_out;
  ls.split_lse = split_lse;
  const dim3 merge_grid(static_cast<unsigned>((rows + attention::kSplitMergeWarps - 1) / attention::kSplitMergeWarps));
  for (int64_t begin = 0; begin < plan.parts; begin += plan.per_launch) {
    const int64_t n = plan.parts - begin < plan.per_launch ? plan.parts - begin : plan.per_launch;
    cudaError_t err = launch_kernel(attention::mla::mla_decode_kernel<Traits, true>,
                                    dim3(static_cast<unsigned>(items), 1, static_cast<unsigned>(n)),
                                    dim3(Traits::kThreads), Traits::kSmemBytes, stream, p,
                                    attention::mla::MlaSplitState{split_out, split_lse, static_cast<int32_t>(begin)});
    if (err != cudaSuccess) return err;
    err = launch_kernel(attention::prefill_merge_splits_kernel<T, kMlaLatentDim>, merge_grid,
                        dim3(attention::kSplitMergeWarps * 32), 0, stream, mp, ls, running_out, running_lse,
                        static_cast<int>(n), begin == 0, begin + n >= plan.parts);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T, typename CacheT>
cudaError_t dispatch_rows(const MlaDecodeParams& p, int rows, const MlaDecodeOverrides& o, cudaStream_t stream) {
  if (rows == 64) return launch_typed<attention::mla::MlaTraits<T, CacheT, 64>>(p, o, stream);
  return launch_typed<attention::mla::MlaTraits<T, CacheT, 32>>(p, o, stream);
}

}  // namespace

int32_t mla_decode_rows_per_cta(const DeviceDescription& device, const MlaDecodeOverrides& o) {
  if (o.rows_per_cta == 64 || o.rows_per_cta == 32) return o.rows_per_cta;
  const int cc = device.cc_major * 10 + device.cc_minor;
  return cc == 80 || cc == 90 || cc == 100 || cc == 103 ? 64 : 32;
}

// Without a split, a CTA per work item; when those leave SMs idle (small batch), each CTA's key
// tiles are cut into parts so that about one wave of CTAs runs (one CTA per SM: the 64-row kernel
// takes 144 KiB of shared memory), each part at least kMinKeysPerSplit keys of the key bound.
int32_t mla_decode_num_splits(const MlaDecodeParams& p, const DeviceDescription& device,
                              const MlaDecodeOverrides& o) {
  if (!shape_ok(p) || p.num_q_tokens <= 0 || p.batch_size <= 0) return 1;
  const int64_t items = work_items(p, mla_decode_rows_per_cta(device, o));
  const int64_t sms = device.num_sms > 0 ? device.num_sms : 1;
  if (items <= 0 || items >= sms) return 1;
  int64_t cap = key_bound(p) / kMinKeysPerSplit;
  if (cap > kMaxAutoSplits) cap = kMaxAutoSplits;
  int64_t s = sms / items;
  if (s > cap) s = cap;
  return s < 1 ? 1 : static_cast<int32_t>(s);
}

size_t mla_decode_workspace_size(const MlaDecodeParams& p, const MlaDecodeOverrides& o) {
  if (!shape_ok(p)) return 0;
  const SplitPlan plan = split_plan(p, o);
  if (!plan.split) return 0;
  const int64_t rows = p.num_q_tokens * p.num_heads;
  const int64_t floats = plan.per_launch * rows * (kMlaLatentDim + 1) +
                         (plan.per_launch < plan.parts ? rows * (kMlaLatentDim + 1) : 0);
  return static_cast<size_t>((floats * static_cast<int64_t>(sizeof(float)) + 15) / 16 * 16);
}

cudaError_t launch_mla_decode(const MlaDecodeParams& p, const DeviceDescription& device, const MlaDecodeOverrides& o,
                              cudaStream_t stream) {
  if (!shape_ok(p) || p.num_splits < 1) return cudaErrorInvalidValue;
  if (p.num_q_tokens == 0 || p.batch_size == 0) return cudaSuccess;
  if (p.q == nullptr || p.kv_cache == nullptr || p.out == nullptr || p.block_table == nullptr ||
      p.seq_lens == nullptr || p.cu_seqlens_q == nullptr || (p.custom_mask != nullptr && p.mask_offsets == nullptr))
    return cudaErrorInvalidValue;
  // 16-byte cp.async chunks of q and the cache; 4-byte stores of out.
  if (p.q_token_stride % 8 != 0 || p.out_token_stride % 2 != 0 || !is_aligned(p.q, 16) || !is_aligned(p.out, 4) ||
      !is_aligned(p.kv_cache, 16))
    return cudaErrorInvalidValue;
  if (split_plan(p, o).split && (p.workspace == nullptr || !is_aligned(p.workspace, 16))) return cudaErrorInvalidValue;
  const int rows = mla_decode_rows_per_cta(device, o);
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.cache_dtype == p.dtype) return dispatch_rows<T, T>(p, rows, o, stream);
    if (p.cache_dtype == DType::kFloat8E4M3) {
      if (p.kv_scale == nullptr) return cudaErrorInvalidValue;
      return dispatch_rows<T, __nv_fp8_e4m3>(p, rows, o, stream);
    }
    return cudaErrorInvalidValue;
  });
}

cudaError_t launch_mla_cache_write(const MlaCacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  if (p.num_tokens < 0 || p.kv_c == nullptr || p.k_pe == nullptr || p.kv_cache == nullptr || p.slot_mapping == nullptr)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.num_tokens + attention::mla::kWriteWarps - 1) / attention::mla::kWriteWarps));
  const dim3 block(attention::mla::kWriteWarps * 32);
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.cache_dtype == p.dtype)
      return launch_kernel(attention::mla::mla_cache_write_kernel<T, T>, grid, block, 0, stream, p);
    if (p.cache_dtype == DType::kFloat8E4M3) {
      if (p.kv_scale == nullptr) return cudaErrorInvalidValue;
      return launch_kernel(attention::mla::mla_cache_write_kernel<T, __nv_fp8_e4m3>, grid, block, 0, stream, p);
    }
    return cudaErrorInvalidValue;
  });
}

}  // namespace fastinfer
