// CUDA implementations of the int4 (W4A16) ops (also built for simt, see kernel_backend.h).
// int4_pack / int4_repack are layout conversions done with ATen ops on the tensors' device;
// int4_gemm launches the W4A16 kernel (split-K with workspace and zeroed tile counters from the
// caching allocator; no host sync), or for M >= the dense threshold dequantises W to the
// activation dtype and calls ATen's matmul (cuBLAS on a GPU). deterministic=True: always the W4A16
// kernel with int4_gemm_deterministic_num_splits (a function of N and K alone), launched over row
// chunks of kDeterministicRows when it splits (bounded workspace; rows are independent).
#include <algorithm>
#include <string>

#include "kernel_backend.h"
#include "overrides.h"
#include "gemm_int4/contract.h"

namespace fastinfer::binding {
namespace {

constexpr int64_t kDeterministicRows = 256;

Tensor int4_pack_kernel(const Tensor& w_q) {
  const char* op = "int4_pack";
  validate_int4_pack(op, w_q);
  check_device(w_q, op, "w_q");
  check_index_range(w_q, 0, 16, op, "w_q", "4-bit values 0..15");
  return int4_pack_impl(w_q);
}

std::tuple<Tensor, Tensor, Tensor> int4_repack_kernel(const Tensor& qweight, const Tensor& qzeros,
                                                                  std::string_view fmt,
                                                                  const std::optional<Tensor>& g_idx) {
  const char* op = "int4_repack";
  validate_int4_repack(op, qweight, qzeros, fmt, g_idx);
  check_device(qweight, op, "qweight");
  if (g_idx.has_value()) check_index_range(*g_idx, 0, qzeros.size(0), op, "g_idx", "group indices < K / group_size");
  return int4_repack_impl(op, qweight, qzeros, fmt, g_idx);
}

Tensor int4_gemm_kernel(const Tensor& a_in, const Tensor& packed, const Tensor& scales,
                            const std::optional<Tensor>& zeros, int64_t group_size,
                            const std::optional<Tensor>& perm, bool deterministic) {
  const char* op = "int4_gemm";
  validate_int4_gemm(op, a_in, packed, scales, zeros, group_size, perm, /*allow_fp32=*/false);
  check_device(a_in, op, "a");
  check_int4_gemm_layout(op, a_in, packed, scales, zeros, perm);
  check_int4_gemm_values(op, a_in, zeros, perm);
  check_aligned16(packed, op, "packed");
  check_aligned16(scales, op, "scales");
  if (zeros.has_value()) check_aligned16(*zeros, op, "zeros");
  KernelScope scope(op, a_in);
  const auto a = perm.has_value() ? torch::stable::index_select(a_in, 1, *perm) : a_in;
  check_aligned16(a, op, "a");
  const int64_t m = a.size(0), k = a.size(1), n = packed.size(1) / 8;
  const DType dtype = to_dtype(a.scalar_type());
  const uint8_t* zp = zeros.has_value() ? zeros->mutable_data_ptr<uint8_t>() : nullptr;
  if (m >= int4_dense_min_m() && !deterministic) {
    auto w = empty_on(a, {n, k});
    Int4DequantizeParams d;
    d.packed = reinterpret_cast<const uint32_t*>(packed.mutable_data_ptr<int32_t>());
    d.scales = scales.data_ptr();
    d.zeros = zp;
    d.w = w.data_ptr();
    d.n = static_cast<int32_t>(n);
    d.k = static_cast<int32_t>(k);
    d.group_size = static_cast<int32_t>(group_size);
    d.dtype = dtype;
    check_launch(launch_int4_dequantize(d, scope.stream()), op);
    return matmul_nt(a, w);
  }
  auto out = empty_on(a, {m, n});
  if (m == 0) return out;
  Int4GemmParams p;
  p.a = a.data_ptr();
  p.packed = reinterpret_cast<const uint32_t*>(packed.mutable_data_ptr<int32_t>());
  p.scales = scales.data_ptr();
  p.zeros = zp;
  p.out = out.data_ptr();
  p.m = m;
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.group_size = static_cast<int32_t>(group_size);
  p.a_row_stride = a.stride(0);
  p.out_row_stride = out.stride(0);
  p.dtype = dtype;
  p.num_splits = deterministic ? int4_gemm_deterministic_num_splits(p.n, p.k) : int4_gemm_num_splits(p, num_sms(a));
  // Row chunks (deterministic split-K only): each launch is the same kernel on fewer rows.
  const int64_t rows_per_launch = deterministic && p.num_splits > 1 ? kDeterministicRows : m;
  Int4GemmParams chunk = p;
  chunk.m = std::min(m, rows_per_launch);
  Tensor workspace, counters;
  if (p.num_splits > 1) {
    workspace = empty_on(a, {static_cast<int64_t>(int4_gemm_workspace_size(chunk))}, kByte);
    counters = zeros_on(a, {static_cast<int64_t>(int4_gemm_num_counters(chunk))}, kInt);
    chunk.workspace = workspace.data_ptr();
    chunk.counters = counters.mutable_data_ptr<int32_t>();
  }
  for (int64_t r0 = 0; r0 < m; r0 += rows_per_launch) {
    chunk.m = std::min(rows_per_launch, m - r0);
    chunk.a = static_cast<const char*>(p.a) + r0 * p.a_row_stride * a.element_size();
    chunk.out = static_cast<char*>(p.out) + r0 * p.out_row_stride * out.element_size();
    check_launch(launch_int4_gemm(chunk, scope.stream()), op);
  }
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("int4_pack", TORCH_BOX(&int4_pack_kernel));
  m.impl("int4_repack", TORCH_BOX(&int4_repack_kernel));
  m.impl("int4_gemm", TORCH_BOX(&int4_gemm_kernel));
}
