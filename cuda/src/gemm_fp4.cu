// FP4 W4A16 launchers and instantiations: {fp16, bf16} x BM {16, 32, 64} x {NVFP4, MXFP4}. The
// split-K counts, workspace and counters are int4_gemm's (the same tiles and k units).
#include "fastinfer/common/dispatch.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/gemm/fp4_gemm.cuh"

namespace fastinfer {
namespace {

namespace f4 = gemm::fp4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

bool shape_ok(int64_t m, int32_t n, int32_t k) {
  return m >= 0 && n > 0 && k > 0 && n % kInt4TileN == 0 && k % kInt4TileK == 0;
}

// The int4_gemm parameters of the same shape (its split-K rule and sizes read only these).
Int4GemmParams as_int4(const Fp4GemmParams& p) {
  Int4GemmParams q;
  q.m = p.m;
  q.n = p.n;
  q.k = p.k;
  q.group_size = kInt4TileK;
  q.num_splits = p.num_splits;
  return q;
}

void resolve_splits(const Fp4GemmParams& p, int32_t* units_per_split, int32_t* splits) {
  const int32_t units = p.k / kInt4TileK;
  int32_t s = p.num_splits < 1 ? 1 : p.num_splits;
  if (s > units) s = units;
  *units_per_split = static_cast<int32_t>(ceil_div(units, s));
  *splits = static_cast<int32_t>(ceil_div(units, *units_per_split));
}

template <typename T, int BM, Fp4Format F>
cudaError_t launch_typed(const Fp4GemmParams& p, cudaStream_t stream) {
  int32_t ups = 0, splits = 0;
  resolve_splits(p, &ups, &splits);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.n, f4::kBlockN)), static_cast<unsigned>(ceil_div(p.m, BM)),
                  static_cast<unsigned>(splits));
  return launch_kernel(f4::fp4_gemm_kernel<T, BM, F>, grid, dim3(f4::kThreads), f4::Config<BM, F>::kSmemBytes,
                       stream, p, ups, splits);
}

template <typename T, Fp4Format F>
cudaError_t launch_format(const Fp4GemmParams& p, cudaStream_t stream) {
  switch (int4_gemm_block_m(p.m)) {
    case 16: return launch_typed<T, 16, F>(p, stream);
    case 32: return launch_typed<T, 32, F>(p, stream);
    default: return launch_typed<T, 64, F>(p, stream);
  }
}

}  // namespace

int32_t fp4_gemm_num_splits(const Fp4GemmParams& p, int32_t num_sms) {
  return int4_gemm_num_splits(as_int4(p), num_sms);
}

int32_t fp4_gemm_deterministic_num_splits(int32_t n, int32_t k) { return int4_gemm_deterministic_num_splits(n, k); }

size_t fp4_gemm_workspace_size(const Fp4GemmParams& p) { return int4_gemm_workspace_size(as_int4(p)); }

size_t fp4_gemm_num_counters(const Fp4GemmParams& p) { return int4_gemm_num_counters(as_int4(p)); }

cudaError_t launch_fp4_gemm(const Fp4GemmParams& p, cudaStream_t stream) {
  if (!shape_ok(p.m, p.n, p.k)) return cudaErrorInvalidValue;
  if (p.m == 0) return cudaSuccess;
  if (p.a == nullptr || p.packed == nullptr || p.scales == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  if (p.format != Fp4Format::kNvfp4 && p.format != Fp4Format::kMxfp4) return cudaErrorInvalidValue;
  if (p.format == Fp4Format::kMxfp4 && p.global_scale != nullptr) return cudaErrorInvalidValue;
  if (p.num_splits < 1 || p.num_splits > 65535) return cudaErrorInvalidValue;
  if (ceil_div(p.m, int4_gemm_block_m(p.m)) > 65535) return cudaErrorInvalidValue;
  // 16-byte cp.async of a, packed and scale rows; 4-byte stores of out pairs.
  if (!aligned(p.a, 16) || p.a_row_stride % 8 != 0 || p.a_row_stride < p.k || !aligned(p.packed, 16) ||
      !aligned(p.scales, 16) || !aligned(p.out, 4) || p.out_row_stride % 2 != 0 || p.out_row_stride < p.n)
    return cudaErrorInvalidValue;
  int32_t ups = 0, splits = 0;
  resolve_splits(p, &ups, &splits);
  if (splits > 1 && (p.workspace == nullptr || !aligned(p.workspace, 16) || p.counters == nullptr))
    return cudaErrorInvalidValue;
  return FASTINFER_DISPATCH_HALF(p.dtype, T, [&] {
    return p.format == Fp4Format::kNvfp4 ? launch_format<T, Fp4Format::kNvfp4>(p, stream)
                                         : launch_format<T, Fp4Format::kMxfp4>(p, stream);
  });
}

}  // namespace fastinfer
