// CUDA implementations of int8_quantize and int8_scaled_mm (also built for simt, see
// kernel_backend.h): validate, allocate outputs (and the per-tensor reduction workspace) through
// the caching allocator, fill the Params, launch. No host synchronisation (CUDA-graph capturable).
#include "w8a8_kernel.h"
#include "overrides.h"
#include "gemm_int8/contract.h"

namespace fastinfer::binding {
namespace {

std::tuple<Tensor, Tensor, Tensor> int8_quantize(const Tensor& x, std::string_view mode_str,
                                                             const std::optional<Tensor>& scale, bool symmetric,
                                                             const std::optional<Tensor>& given_azp) {
  const char* op = "int8_quantize";
  const Int8Mode mode = validate_int8_quantize(op, x, mode_str, scale, symmetric, given_azp, /*allow_fp32=*/false);
  check_device(x, op, "x");
  const int64_t x_row_stride = check_quantize_layout(op, x);
  if (x.numel() > 0) check_aligned16(x, op, "x");
  auto q = empty_on(x, shape_of(x), kChar);
  auto s = empty_on(x, int8_quantize_scale_shape(x, mode), kFloat);
  auto azp = empty_on(x, {symmetric ? 0 : (mode == Int8Mode::kTensor ? 1 : x.size(0))}, kInt);
  if (mode == Int8Mode::kToken && x.numel() == 0) {
    if (s.numel() > 0) torch::stable::fill_(s, 1e-12f / (symmetric ? 127.0f : 255.0f));  // K == 0: the range-0 scale
    if (azp.numel() > 0) torch::stable::fill_(azp, -128);
    return {q, s, azp};
  }
  KernelScope scope(op, x);
  Int8QuantizeParams p;
  p.x = x.data_ptr();
  p.out = q.data_ptr();
  p.scale = s.mutable_data_ptr<float>();
  p.azp = symmetric ? nullptr : azp.mutable_data_ptr<int32_t>();
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.x_row_stride = x_row_stride;
  p.mode = mode == Int8Mode::kTensor ? Int8QuantMode::kTensor : Int8QuantMode::kToken;
  p.symmetric = symmetric;
  p.dtype = to_dtype(x.scalar_type());
  const QuantizeBuffers buffers = attach_quantize_buffers(p, scale, x, &int8_quantize_workspace_size);
  Tensor azp_in;  // kept alive until the launch returns
  if (given_azp.has_value()) {
    azp_in = torch::stable::contiguous(*given_azp);
    p.given_azp = azp_in.mutable_data_ptr<int32_t>();
  }
  check_launch(launch_int8_quantize(p, scope.stream()), op);
  return {q, s, azp};
}

Tensor int8_scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                          ScalarType out_dtype, const std::optional<Tensor>& bias,
                          const std::optional<Tensor>& azp_adj, const std::optional<Tensor>& azp,
                          bool deterministic) {
  const char* op = "int8_scaled_mm";
  validate_int8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, azp_adj, azp, /*allow_fp32=*/false);
  check_device(a, op, "a");
  check_int8_scaled_mm_layout(op, a, b, scale_a, scale_b, bias, azp_adj, azp);
  if (a.numel() > 0) check_aligned16(a, op, "a");
  if (b.numel() > 0) check_aligned16(b, op, "b");
  const int64_t M = a.size(0), N = b.size(0);
  auto out = empty_on(a, {M, N}, out_dtype);
  if (out.numel() == 0) return out;
  KernelScope scope(op, a);
  auto p = w8a8_mm_params<Int8ScaledMmParams>(a, b, out, scale_a, scale_b, bias);
  p.azp = azp.has_value() ? azp->mutable_data_ptr<int32_t>() : nullptr;
  p.azp_adj = azp_adj.has_value() ? azp_adj->mutable_data_ptr<int32_t>() : nullptr;
  p.scale_a_per_row = scale_a.size(0) == M && M > 1;
  p.scale_b_per_col = scale_b.size(0) == N;
  p.azp_per_row = azp.has_value() && azp->size(0) == M && M > 1;
  p.deterministic = deterministic;
  const cudaError_t err = launch_int8_scaled_mm(p, scope.stream(), int8_gemm_overrides());
  FI_CHECK(err != cudaErrorNotSupported, op,
           "requires sm_80+ (int8 tensor-core mma: Ampere or later); on an older GPU use the CPU implementation");
  check_launch(err, op);
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("int8_quantize", TORCH_BOX(&int8_quantize));
  m.impl("int8_scaled_mm", TORCH_BOX(&int8_scaled_mm));
}
