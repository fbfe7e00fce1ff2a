#pragma once
// What the fp8 and int8 W8A8 kernel bindings (kernel_fp8_ops.cpp, kernel_int8_ops.cpp) share: the
// Params fields both scaled-mm ops have. Each op fills its own scale flags and extras after.
#include "kernel_backend.h"

namespace fastinfer::binding {

// Operands, scales, bias, sizes and out_dtype of a validated scaled mm (a [M, K], b [N, K], out [M, N]).
template <typename Params>
Params w8a8_mm_params(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, const at::Tensor& scale_a,
                      const at::Tensor& scale_b, const std::optional<at::Tensor>& bias) {
  Params p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.out = out.data_ptr();
  p.scale_a = scale_a.data_ptr<float>();
  p.scale_b = scale_b.data_ptr<float>();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.m = a.size(0);
  p.n = b.size(0);
  p.k = a.size(1);
  p.out_dtype = to_dtype(out.scalar_type());
  return p;
}

}  // namespace fastinfer::binding
