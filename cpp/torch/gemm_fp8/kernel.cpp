// CUDA implementations of fp8_quantize and fp8_scaled_mm (also built for simt, see kernel_backend.h):
// validate, allocate outputs (and the per-tensor reduction workspace) through the caching allocator,
// fill the Params, launch. No host synchronisation (CUDA-graph capturable).
#include "w8a8_kernel.h"
#include "overrides.h"
#include "gemm_fp8/contract.h"

namespace fastinfer::binding {
namespace {

std::tuple<Tensor, Tensor> fp8_quantize(const Tensor& x, std::string_view mode_str, int64_t group_size,
                                                const std::optional<Tensor>& scale) {
  const char* op = "fp8_quantize";
  const Fp8Mode mode = validate_fp8_quantize(op, x, mode_str, group_size, scale, /*allow_fp32=*/false);
  check_device(x, op, "x");
  const int64_t x_row_stride = check_quantize_layout(op, x);
  if (x.numel() > 0) check_aligned16(x, op, "x");
  auto q = empty_on(x, shape_of(x), kFloat8_e4m3fn);
  auto s = empty_on(x, fp8_quantize_scale_shape(x, mode, group_size), kFloat);
  if (mode != Fp8Mode::kTensor && x.numel() == 0) {
    if (scale.has_value()) return {q, torch::stable::clone(*scale)};  // the given scales, as they are
    if (s.numel() > 0) torch::stable::fill_(s, 1e-12f / 448.0f);  // K == 0: rows with no data get the amax-0 scale
    return {q, s};
  }
  KernelScope scope(op, x);
  Fp8QuantizeParams p;
  p.x = x.data_ptr();
  p.out = q.data_ptr();
  p.scale = s.mutable_data_ptr<float>();
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.x_row_stride = x_row_stride;
  p.group_size = static_cast<int32_t>(group_size);
  p.mode = to_fp8_quant_mode(mode);
  p.dtype = to_dtype(x.scalar_type());
  const QuantizeBuffers buffers = attach_quantize_buffers(p, scale, x, &fp8_quantize_workspace_size);
  check_launch(launch_fp8_quantize(p, scope.stream()), op);
  return {q, s};
}

Tensor fp8_scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                         ScalarType out_dtype, const std::optional<Tensor>& bias, bool deterministic) {
  const char* op = "fp8_scaled_mm";
  const bool blockwise = validate_fp8_scaled_mm(op, a, b, scale_a, scale_b, out_dtype, bias, /*allow_fp32=*/false);
  check_device(a, op, "a");
  check_w8a8_layout(op, a, b, scale_a, scale_b, bias);
  if (a.numel() > 0) check_aligned16(a, op, "a");
  if (b.numel() > 0) check_aligned16(b, op, "b");
  const int64_t M = a.size(0), N = b.size(0);
  auto out = empty_on(a, {M, N}, out_dtype);
  if (out.numel() == 0) return out;
  KernelScope scope(op, a);
  auto p = w8a8_mm_params<Fp8ScaledMmParams>(a, b, out, scale_a, scale_b, bias);
  p.scale_mode = blockwise ? Fp8ScaleMode::kBlockwise : Fp8ScaleMode::kTensorOrChannel;
  p.scale_a_per_row = !blockwise && scale_a.size(0) == M && M > 1;
  p.scale_b_per_col = !blockwise && scale_b.size(0) == N;
  p.deterministic = deterministic;
  const cudaError_t err = launch_fp8_scaled_mm(p, scope.stream(), fp8_gemm_overrides());
  FI_CHECK(err != cudaErrorNotSupported, op,
           "requires sm_89+ (e4m3 tensor cores: Ada or Hopper) and a build with code for this GPU "
           "(FASTINFER_CUDA_ARCHS); on an older GPU dequantise and call torch.matmul, or use the CPU implementation");
  check_launch(err, op);
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("fp8_quantize", TORCH_BOX(&fp8_quantize));
  m.impl("fp8_scaled_mm", TORCH_BOX(&fp8_scaled_mm));
}
