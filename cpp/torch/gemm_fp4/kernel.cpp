// CUDA implementations of the fp4 (W4A16) ops (also built for simt, see kernel_backend.h).
// fp4_repack is a layout conversion on the host (contract.h), the result on the input's device;
// fp4_gemm launches the FP4 W4A16 kernel for every M (split-K with workspace and zeroed tile
// counters from the caching allocator; no host sync). deterministic=True: the split count of
// fp4_gemm_deterministic_num_splits (N and K alone), launched over row chunks of
// kDeterministicRows when it splits (bounded workspace; rows are independent).
#include <algorithm>
#include <string>

#include "kernel_backend.h"
#include "gemm_fp4/contract.h"

namespace fastinfer::binding {
namespace {

constexpr int64_t kDeterministicRows = 256;

std::tuple<Tensor, Tensor> fp4_repack_kernel(const Tensor& weight_packed, const Tensor& weight_scale) {
  const char* op = "fp4_repack";
  validate_fp4_repack(op, weight_packed, weight_scale);
  check_device(weight_packed, op, "weight_packed");
  return fp4_repack_impl(weight_packed, weight_scale);
}

Tensor fp4_gemm_kernel(const Tensor& a, const Tensor& packed, const Tensor& scales,
                       const std::optional<Tensor>& global_scale, std::string_view format, bool deterministic) {
  const char* op = "fp4_gemm";
  validate_fp4_gemm(op, a, packed, scales, global_scale, format, /*allow_fp32=*/false);
  check_device(a, op, "a");
  check_fp4_gemm_layout(op, a, packed, scales);
  check_fp4_gemm_values(op, scales, format);
  check_aligned16(a, op, "a");
  check_aligned16(packed, op, "packed");
  check_aligned16(scales, op, "scales");
  KernelScope scope(op, a);
  const int64_t m = a.size(0), k = a.size(1), n = packed.size(1) / 8;
  auto out = empty_on(a, {m, n});
  if (m == 0) return out;
  Fp4GemmParams p;
  p.a = a.data_ptr();
  p.packed = reinterpret_cast<const uint32_t*>(packed.mutable_data_ptr<int32_t>());
  p.scales = scales.mutable_data_ptr<uint8_t>();
  p.global_scale = global_scale.has_value() ? global_scale->mutable_data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.m = m;
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.a_row_stride = a.stride(0);
  p.out_row_stride = out.stride(0);
  p.format = format == "nvfp4" ? Fp4Format::kNvfp4 : Fp4Format::kMxfp4;
  p.dtype = to_dtype(a.scalar_type());
  p.num_splits = deterministic ? fp4_gemm_deterministic_num_splits(p.n, p.k) : fp4_gemm_num_splits(p, num_sms(a));
  const int64_t rows_per_launch = deterministic && p.num_splits > 1 ? kDeterministicRows : m;
  Fp4GemmParams chunk = p;
  chunk.m = std::min(m, rows_per_launch);
  Tensor workspace, counters;
  if (p.num_splits > 1) {
    workspace = empty_on(a, {static_cast<int64_t>(fp4_gemm_workspace_size(chunk))}, kByte);
    counters = zeros_on(a, {static_cast<int64_t>(fp4_gemm_num_counters(chunk))}, kInt);
    chunk.workspace = workspace.data_ptr();
    chunk.counters = counters.mutable_data_ptr<int32_t>();
  }
  for (int64_t r0 = 0; r0 < m; r0 += rows_per_launch) {
    chunk.m = std::min(rows_per_launch, m - r0);
    chunk.a = static_cast<const char*>(p.a) + r0 * p.a_row_stride * a.element_size();
    chunk.out = static_cast<char*>(p.out) + r0 * p.out_row_stride * out.element_size();
    check_launch(launch_fp4_gemm(chunk, scope.stream()), op);
  }
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("fp4_repack", TORCH_BOX(&fp4_repack_kernel));
  m.impl("fp4_gemm", TORCH_BOX(&fp4_gemm_kernel));
}
