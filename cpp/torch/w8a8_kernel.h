#pragma once
// What the fp8 and int8 W8A8 kernel bindings (gemm_fp8/kernel.cpp, gemm_int8/kernel.cpp) share: the
// given scale and workspace of the quantize ops, and the Params fields both scaled-mm ops have.
#include "kernel_backend.h"

namespace fastinfer::binding {

// Tensors a *_quantize launch reads through its Params: keep them alive until the launch returns.
struct QuantizeBuffers {
  Tensor given_scale, workspace;
};

// Points p.given_scale at the caller's scale (if any), then p.workspace at a caching-allocator
// buffer of workspace_size(p) bytes (the per-tensor amax partials; none when 0).
template <typename Params>
QuantizeBuffers attach_quantize_buffers(Params& p, const std::optional<Tensor>& scale, const Tensor& x,
                                        size_t (*workspace_size)(const Params&)) {
  QuantizeBuffers buf;
  if (scale.has_value()) {
    buf.given_scale = torch::stable::contiguous(*scale);
    p.given_scale = buf.given_scale.mutable_data_ptr<float>();
  }
  if (const size_t bytes = workspace_size(p); bytes > 0) {
    buf.workspace = empty_on(x, {static_cast<int64_t>(bytes)}, kByte);
    p.workspace = buf.workspace.data_ptr();
  }
  return buf;
}

// Operands, scales, bias, sizes and out_dtype of a validated scaled mm (a [M, K], b [N, K], out [M, N]).
template <typename Params>
Params w8a8_mm_params(const Tensor& a, const Tensor& b, const Tensor& out, const Tensor& scale_a,
                      const Tensor& scale_b, const std::optional<Tensor>& bias) {
  Params p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.out = out.data_ptr();
  p.scale_a = scale_a.mutable_data_ptr<float>();
  p.scale_b = scale_b.mutable_data_ptr<float>();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.m = a.size(0);
  p.n = b.size(0);
  p.k = a.size(1);
  p.lda = a.size(0) > 1 && a.numel() > 0 ? a.stride(0) : 0;  // check_w8a8_layout: a multiple of 16, >= k
  p.out_dtype = to_dtype(out.scalar_type());
  return p;
}

}  // namespace fastinfer::binding
