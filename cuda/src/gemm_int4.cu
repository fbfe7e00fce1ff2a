// W4A16 GEMM launchers, split-K heuristic and instantiations: {fp16, bf16} x BM {16, 32, 64} x
// scale rows per unit {2 (G % 32 == 0), 4 (G % 16 == 0)}, plus the dequantisation kernel of the
// large-M path.
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/int4_gemm.cuh"

namespace fastinfer {
namespace {

namespace i4 = gemm::int4;

constexpr int32_t kMaxSplits = 64;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool shape_ok(int64_t m, int32_t n, int32_t k, int32_t group_size) {
  return m >= 0 && n > 0 && k > 0 && n % kInt4TileN == 0 && k % kInt4TileK == 0 && group_size > 0 &&
         group_size % 16 == 0 && k % group_size == 0;
}

// Splits actually launched for a requested count: every split gets at least one unit.
void resolve_splits(const Int4GemmParams& p, int32_t* units_per_split, int32_t* splits) {
  const int32_t units = p.k / kInt4TileK;
  int32_t s = p.num_splits < 1 ? 1 : p.num_splits;
  if (s > units) s = units;
  *units_per_split = static_cast<int32_t>(ceil_div(units, s));
  *splits = static_cast<int32_t>(ceil_div(units, *units_per_split));
}

template <typename T, int BM, int kRows>
cudaError_t launch_typed(const Int4GemmParams& p, cudaStream_t stream) {
  int32_t ups = 0, splits = 0;
  resolve_splits(p, &ups, &splits);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, i4::kBlockN)), static_cast<unsigned>(ceil_div(p.m, BM)),
                  static_cast<unsigned>(splits));
  return launch_kernel(i4::int4_gemm_kernel<T, BM, kRows>, grid, dim3(i4::kThreads), i4::Config<BM, kRows>::kSmemBytes,
                       stream, p, ups, splits);
}

template <typename T, int kRows>
cudaError_t launch_rows(const Int4GemmParams& p, cudaStream_t stream) {
  switch (int4_gemm_block_m(p.m)) {
    case 16: return launch_typed<T, 16, kRows>(p, stream);
    case 32: return launch_typed<T, 32, kRows>(p, stream);
    default: return launch_typed<T, 64, kRows>(p, stream);
  }
}

}  // namespace

int32_t int4_gemm_block_m(int64_t m) { return m <= 16 ? 16 : (m <= 32 ? 32 : 64); }

size_t int4_gemm_num_counters(const Int4GemmParams& p) {
  if (p.m <= 0 || p.n <= 0) return 0;
  return static_cast<size_t>(ceil_div(p.n, i4::kBlockN) * ceil_div(p.m, int4_gemm_block_m(p.m)));
}

namespace {
// s splits of `units` k-units, s at most cap (at least 1, at most units and kMaxSplits), then the
// count recomputed from the units per split so that no split is empty.
int32_t clamp_splits(int64_t s, int64_t cap, int64_t units) {
  if (cap > units) cap = units;
  if (cap > kMaxSplits) cap = kMaxSplits;
  if (cap < 1) cap = 1;
  if (s > cap) s = cap;
  const int64_t ups = ceil_div(units, s);
  return static_cast<int32_t>(ceil_div(units, ups));
}
}  // namespace

// Splits so that about two CTAs per SM are resident (the 16/32-row kernels fit two per SM),
// capped by: at least one 64-wide unit of K per split; the fp32 partials no larger than half of the
// weight bytes per row block (splits * rows * N * 4 <= N * K / 2, i.e. splits <= K / (16 * rows));
// and 64. The partials are written and read once, expected to stay in the 50 MB L2 of a Hopper
// GPU; if they did not, M = 16 on a 4096 x 4096 layer (8 splits: 2 MB of partials written and
// read against 8 MB of weights) would move 1.47x the ideal bytes (bench/model.py counts them as
// DRAM traffic: it cannot see L2 hits). Unmeasured: the constants are a first guess to be tuned
// on a GPU.
int32_t int4_gemm_num_splits(const Int4GemmParams& p, int32_t num_sms) {
  if (!shape_ok(p.m, p.n, p.k, p.group_size) || p.m <= 0 || num_sms <= 0) return 1;
  const int64_t tiles = static_cast<int64_t>(int4_gemm_num_counters(p));
  const int64_t target = 2 * static_cast<int64_t>(num_sms);
  if (tiles >= target) return 1;
  int64_t s = ceil_div(target, tiles);
  const int64_t units = p.k / kInt4TileK;
  const int64_t rows = p.m < 64 ? p.m : 64;
  return clamp_splits(s, p.k / (16 * rows), units);
}

int32_t int4_gemm_deterministic_num_splits(int32_t n, int32_t k) {
  if (!shape_ok(1, n, k, kInt4TileK)) return 1;
  const int64_t tiles = ceil_div(n, i4::kBlockN);
  const int64_t units = k / kInt4TileK;
  return clamp_splits(ceil_div(kInt4DeterministicCtas, tiles), k / 256, units);
}

size_t int4_gemm_workspace_size(const Int4GemmParams& p) {
  if (p.num_splits <= 1 || p.m <= 0 || p.n <= 0) return 0;
  return static_cast<size_t>(p.num_splits) * static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * sizeof(float);
}

cudaError_t launch_int4_gemm(const Int4GemmParams& p, cudaStream_t stream) {
  if (!shape_ok(p.m, p.n, p.k, p.group_size)) return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  if (p.a == nullptr || p.packed == nullptr || p.scales == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || p.num_splits > 65535) return cudaErrorInvalidValue;
  if (ceil_div(p.m, int4_gemm_block_m(p.m)) > 65535) return cudaErrorInvalidValue;
  // 16-byte cp.async of a, packed, scales and zeros rows; 4-byte stores of out pairs.
  if (!aligned(p.a, 16) || p.a_row_stride % 8 != 0 || p.a_row_stride < p.k || !aligned(p.packed, 16) ||
      !aligned(p.scales, 16) || (p.zeros != nullptr && !aligned(p.zeros, 16)) || !aligned(p.out, 4) ||
      p.out_row_stride % 2 != 0 || p.out_row_stride < p.n)
    return cudaErrorInvalidValue;
  int32_t ups = 0, splits = 0;
  resolve_splits(p, &ups, &splits);
  if (splits > 1 && (p.workspace == nullptr || !aligned(p.workspace, 16) || p.counters == nullptr))
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return p.group_size % 32 == 0 ? launch_rows<T, 2>(p, stream) : launch_rows<T, 4>(p, stream);
  });
}

cudaError_t launch_int4_dequantize(const Int4DequantizeParams& p, cudaStream_t stream) {
  if (!shape_ok(1, p.n, p.k, p.group_size)) return cudaErrorInvalidValue;
  if (p.packed == nullptr || p.scales == nullptr || p.w == nullptr || !aligned(p.w, 4) || !aligned(p.scales, 2))
    return cudaErrorInvalidValue;
  const int64_t words = static_cast<int64_t>(p.n) * p.k / 8;
  const int64_t blocks = ceil_div(words, i4::kDequantThreads);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return launch_kernel(i4::int4_dequantize_kernel<T>, dim3(static_cast<unsigned>(blocks)),
                         dim3(i4::kDequantThreads), 0, stream, p);
  });
}

}  // namespace fastinfer
