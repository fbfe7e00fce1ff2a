// THE op catalogue: every schema of fastinfer, in one place, with mutation annotations.
// Compiled into fastinfer._C as namespace `fastinfer` and into fastinfer._sim as `fastinfer_sim`
// (same schemas; the sim namespace runs the CUDA kernels on CPU tensors through cpp/simt).
// Also the Meta kernels (fake impls), so torch.compile and opcheck trace through every op.
#include <torch/library.h>

#include "validate.h"

namespace fastinfer::binding {
namespace {

// Meta kernels: same shape/dtype rules as the real ones (symbolic sizes), outputs allocated empty.
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm", x, weight, eps, /*allow_fp32=*/true);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

void rms_norm_out_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm_out", x, weight, eps, true);
  validate_like("rms_norm_out", out, "out", x, "x");
}

void fused_add_rms_norm_meta(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  validate_rms_norm("fused_add_rms_norm", x, weight, eps, true);
  validate_like("fused_add_rms_norm", residual, "residual", x, "x");
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  validate_silu_and_mul("silu_and_mul", x, true);
  return at::empty_symint(silu_and_mul_out_shape(x), x.options());
}

void silu_and_mul_out_meta(at::Tensor& out, const at::Tensor& x) {
  validate_silu_and_mul_out("silu_and_mul_out", out, x, true);
}

void rotary_embedding_meta(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                           const at::Tensor& cos_sin_cache, bool is_neox) {
  validate_rotary_embedding("rotary_embedding", positions, q, k, cos_sin_cache, true);
}

void reshape_and_cache_meta(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                            const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale) {
  validate_reshape_and_cache("reshape_and_cache", k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, true);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY(FASTINFER_NS, m) {
  // Fused elementwise ops around the big kernels (DESIGN.md "Fused elementwise").
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_out(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("silu_and_mul_out(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache, bool is_neox=True) -> ()");
  // Attention-side cache maintenance.
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, Meta, m) {
  using namespace fastinfer::binding;
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("rms_norm_out", &rms_norm_out_meta);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("silu_and_mul_out", &silu_and_mul_out_meta);
  m.impl("rotary_embedding", &rotary_embedding_meta);
  m.impl("reshape_and_cache", &reshape_and_cache_meta);
}
