// CUDA implementation of dense_mm (also built for simt, see kernel_backend.h): validate, allocate
// out through the caching allocator, fill DenseMmParams, launch. No host synchronisation.
#include "kernel_backend.h"
#include "gemm_dense/contract.h"

namespace fastinfer::binding {
namespace {

Tensor dense_mm_kernel(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias) {
  const char* op = "dense_mm";
  validate_dense_mm(op, a, b, bias, /*allow_fp32=*/false);
  check_device(a, op, "a");
  check_dense_mm_layout(op, a, b, bias);
  if (a.numel() > 0) check_aligned16(a, op, "a");
  if (b.numel() > 0) check_aligned16(b, op, "b");
  const int64_t M = a.size(0), N = b.size(0);
  auto out = empty_on(a, {M, N});
  if (out.numel() == 0) return out;
  KernelScope scope(op, a);
  DenseMmParams p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.m = M;
  p.n = N;
  p.k = a.size(1);
  p.dtype = to_dtype(a.scalar_type());
  const cudaError_t err = launch_dense_mm(p, scope.stream());
  FI_CHECK(err != cudaErrorNotSupported, op,
           "requires sm_80+ (bf16 tensor-core mma: Ampere or later); on an older GPU use torch.matmul");
  check_launch(err, op);
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("dense_mm", TORCH_BOX(&dense_mm_kernel));
}
