// The CUDA implementations: validate, fill the Params struct, call the torch-free launcher, check
// the returned error. Built twice from this one file:
//   FASTINFER_KERNEL_BACKEND_CUDA: fastinfer._C, CUDA tensors, the current CUDA stream;
//   FASTINFER_KERNEL_BACKEND_SIMT: fastinfer._sim, CPU tensors, the kernels run in cpp/simt.
#include "elementwise/contract.h"
#include "kernel_backend.h"

namespace fastinfer::binding {
namespace {

// ---------------------------------------------------------------------------------------------
// gate: gated_rms_norm's (checked like out), or nullptr.
void rms_norm_out_impl(const char* op, Tensor& out, const Tensor& x, const Tensor* gate,
                       const std::optional<Tensor>& weight, double eps, double weight_offset) {
  check_device(x, op, "x");
  check_rms_norm_layout(op, x, weight, &out, "out");
  if (gate != nullptr) check_rms_norm_layout(op, x, weight, gate, "gate");
  KernelScope scope(op, x);
  RmsNormParams p;
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  p.gate = gate != nullptr ? gate->data_ptr() : nullptr;
  p.hidden = x.size(-1);
  p.num_rows = p.hidden == 0 ? 0 : x.numel() / p.hidden;
  p.x_row_stride = row_stride(x);
  p.out_row_stride = row_stride(out);
  p.gate_row_stride = gate != nullptr ? row_stride(*gate) : 0;
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  p.dtype = to_dtype(x.scalar_type());
  if (p.hidden == 0) return;
  check_launch(launch_rms_norm(p, scope.stream()), op);
}

Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps, double weight_offset) {
  validate_rms_norm("rms_norm", x, weight, eps, weight_offset, false);
  auto out = empty_as(x);
  rms_norm_out_impl("rms_norm", out, x, nullptr, weight, eps, weight_offset);
  return out;
}

void rms_norm_out(Tensor& out, const Tensor& x, const std::optional<Tensor>& weight, double eps, double weight_offset) {
  validate_rms_norm("rms_norm_out", x, weight, eps, weight_offset, false);
  validate_like("rms_norm_out", out, "out", x, "x");
  rms_norm_out_impl("rms_norm_out", out, x, nullptr, weight, eps, weight_offset);
}

Tensor gated_rms_norm(const Tensor& x, const Tensor& gate, const std::optional<Tensor>& weight, double eps,
                      double weight_offset) {
  validate_gated_rms_norm("gated_rms_norm", x, gate, weight, eps, weight_offset, false);
  auto out = empty_as(x);
  rms_norm_out_impl("gated_rms_norm", out, x, &gate, weight, eps, weight_offset);
  return out;
}

void fused_add_rms_norm(Tensor& x, Tensor& residual, const std::optional<Tensor>& weight, double eps,
                        double weight_offset) {
  const char* op = "fused_add_rms_norm";
  validate_rms_norm(op, x, weight, eps, weight_offset, false);
  validate_like(op, residual, "residual", x, "x");
  check_device(x, op, "x");
  check_rms_norm_layout(op, x, weight, &residual, "residual");
  if (x.numel() == 0) return;
  KernelScope scope(op, x);
  FusedAddRmsNormParams p;
  p.x = x.data_ptr();
  p.residual = residual.data_ptr();
  p.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  p.hidden = x.size(-1);
  p.num_rows = x.numel() / p.hidden;
  p.x_row_stride = row_stride(x);
  p.residual_row_stride = row_stride(residual);
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  p.dtype = to_dtype(x.scalar_type());
  check_launch(launch_fused_add_rms_norm(p, scope.stream()), op);
}

// residual: fused_add_rms_norm_quant's (residual <- x + residual, then its norm), or nullptr.
std::tuple<Tensor, Tensor> rms_norm_quant_impl(const char* op, const Tensor& x, Tensor* residual,
                                               const std::optional<Tensor>& weight, double eps, ScalarType out_dtype,
                                               const std::optional<Tensor>& scale, double weight_offset) {
  validate_rms_norm_quant(op, x, residual, weight, eps, out_dtype, scale, weight_offset, false);
  check_device(x, op, "x");
  check_rms_norm_layout(op, x, weight, residual, "residual");
  const int64_t hidden = x.size(-1), num_rows = x.numel() / hidden;
  auto out = empty_on(x, shape_of(x), out_dtype);
  auto out_scale = scale.has_value() ? empty_on(x, {1}, kFloat) : empty_on(x, {num_rows}, kFloat);
  if (num_rows == 0)  // nothing to launch: the given scale's copy is read on the host
    return {out, scale.has_value() ? full_on(x, {1}, scalar_value(*scale), kFloat) : out_scale};
  KernelScope scope(op, x);
  RmsNormQuantParams p;
  p.out = out.data_ptr();
  p.scale = out_scale.mutable_data_ptr<float>();
  p.given_scale = scale.has_value() ? scale->const_data_ptr<float>() : nullptr;
  p.x = x.data_ptr();
  p.residual = residual != nullptr ? residual->data_ptr() : nullptr;
  p.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  p.num_rows = num_rows;
  p.hidden = hidden;
  p.x_row_stride = row_stride(x);
  p.residual_row_stride = residual != nullptr ? row_stride(*residual) : 0;
  p.eps = static_cast<float>(eps);
  p.weight_offset = static_cast<float>(weight_offset);
  p.dtype = to_dtype(x.scalar_type());
  p.format = out_dtype == kFloat8_e4m3fn ? NormQuantFormat::kE4m3 : NormQuantFormat::kInt8;
  check_launch(launch_rms_norm_quant(p, scope.stream()), op);
  return {out, out_scale};
}

std::tuple<Tensor, Tensor> rms_norm_quant(const Tensor& x, const std::optional<Tensor>& weight, double eps,
                                          ScalarType out_dtype, const std::optional<Tensor>& scale,
                                          double weight_offset) {
  return rms_norm_quant_impl("rms_norm_quant", x, nullptr, weight, eps, out_dtype, scale, weight_offset);
}

std::tuple<Tensor, Tensor> fused_add_rms_norm_quant(const Tensor& x, Tensor& residual,
                                                    const std::optional<Tensor>& weight, double eps,
                                                    ScalarType out_dtype, const std::optional<Tensor>& scale,
                                                    double weight_offset) {
  return rms_norm_quant_impl("fused_add_rms_norm_quant", x, &residual, weight, eps, out_dtype, scale, weight_offset);
}

// ---------------------------------------------------------------------------------------------
using GatedLauncher = cudaError_t (*)(const GatedActivationParams&, cudaStream_t);

void gated_and_mul_impl(const char* op, GatedLauncher launch, Tensor& out, const Tensor& x) {
  check_device(x, op, "x");
  check_gated_and_mul_layout(op, x, &out);
  if (out.numel() == 0) return;
  KernelScope scope(op, x);
  GatedActivationParams p;
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.width = x.size(-1) / 2;
  p.num_rows = out.numel() / p.width;
  p.x_row_stride = row_stride(x);
  p.out_row_stride = row_stride(out);
  p.dtype = to_dtype(x.scalar_type());
  check_launch(launch(p, scope.stream()), op);
}

template <GatedLauncher kLaunch>
Tensor gated_and_mul(const Tensor& x, const char* op) {
  validate_gated_and_mul(op, x, false);
  auto out = empty_on(x, gated_and_mul_out_shape(x));
  gated_and_mul_impl(op, kLaunch, out, x);
  return out;
}

template <GatedLauncher kLaunch>
void gated_and_mul_out(Tensor& out, const Tensor& x, const char* op) {
  validate_gated_and_mul_out(op, out, x, false);
  gated_and_mul_impl(op, kLaunch, out, x);
}

Tensor silu_and_mul(const Tensor& x) { return gated_and_mul<launch_silu_and_mul>(x, "silu_and_mul"); }
void silu_and_mul_out(Tensor& out, const Tensor& x) {
  gated_and_mul_out<launch_silu_and_mul>(out, x, "silu_and_mul_out");
}
Tensor gelu_and_mul(const Tensor& x) { return gated_and_mul<launch_gelu_and_mul>(x, "gelu_and_mul"); }
void gelu_and_mul_out(Tensor& out, const Tensor& x) { gated_and_mul_out<launch_gelu_and_mul>(out, x, "gelu_and_mul_out"); }
Tensor gelu_tanh_and_mul(const Tensor& x) { return gated_and_mul<launch_gelu_tanh_and_mul>(x, "gelu_tanh_and_mul"); }
void gelu_tanh_and_mul_out(Tensor& out, const Tensor& x) {
  gated_and_mul_out<launch_gelu_tanh_and_mul>(out, x, "gelu_tanh_and_mul_out");
}

void activation_impl(const char* op, Tensor& out, const Tensor& x, std::string_view activation) {
  check_device(x, op, "x");
  check_activation_layout(op, x, &out);
  if (out.numel() == 0) return;
  KernelScope scope(op, x);
  ActivationParams p;
  p.out = out.data_ptr();
  p.x = x.data_ptr();
  p.width = x.dim() == 0 ? 1 : x.size(-1);
  p.num_rows = out.numel() / p.width;
  p.x_row_stride = row_stride(x);
  p.out_row_stride = row_stride(out);
  p.activation = parse_activation(op, activation);
  p.dtype = to_dtype(x.scalar_type());
  check_launch(launch_activation(p, scope.stream()), op);
}

Tensor activation(const Tensor& x, std::string_view activation) {
  validate_activation("activation", x, activation, false);
  auto out = empty_as(x);
  activation_impl("activation", out, x, activation);
  return out;
}

void activation_out(Tensor& out, const Tensor& x, std::string_view activation) {
  validate_activation_out("activation_out", out, x, activation, false);
  activation_impl("activation_out", out, x, activation);
}

// ---------------------------------------------------------------------------------------------
void rotary_embedding(const Tensor& positions, Tensor& q, Tensor& k, const Tensor& cos_sin_cache,
                      bool is_neox) {
  const char* op = "rotary_embedding";
  validate_rotary_embedding(op, positions, q, k, cos_sin_cache, false);
  check_device(q, op, "q");
  check_rotary_embedding_layout(op, positions, q, k, cos_sin_cache);
  check_index_range(positions, 0, cos_sin_cache.size(0), op, "positions", "rows of cos_sin_cache");
  if (q.size(0) == 0) return;
  KernelScope scope(op, q);
  RotaryEmbeddingParams p;
  p.positions = positions.data_ptr();
  p.position_type = to_index_type(positions.scalar_type());
  p.q = q.data_ptr();
  p.k = k.numel() > 0 ? k.data_ptr() : nullptr;
  p.cos_sin_cache = cos_sin_cache.data_ptr();
  p.cache_dtype = to_dtype(cos_sin_cache.scalar_type());
  p.num_tokens = q.size(0);
  p.num_q_heads = q.size(1);
  p.num_kv_heads = k.size(1);
  p.head_dim = q.size(2);
  p.rotary_dim = cos_sin_cache.size(1);
  p.q_token_stride = q.stride(0);
  p.k_token_stride = k.stride(0);
  p.is_neox = is_neox;
  p.dtype = to_dtype(q.scalar_type());
  if (p.num_q_heads == 0) return;
  check_launch(launch_rotary_embedding(p, scope.stream()), op);
}

// ---------------------------------------------------------------------------------------------
void reshape_and_cache(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                       const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                       const std::optional<Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  validate_reshape_and_cache(op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, false);
  check_device(k, op, "k");
  check_reshape_and_cache_layout(op, k, v, k_cache, v_cache, slot_mapping);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(slot_mapping, -1, num_slots, op, "slot_mapping", "-1 or a slot < num_blocks * block_size");
  if (k.numel() == 0) return;
  KernelScope scope(op, k);
  ReshapeAndCacheParams p;
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_type = to_index_type(slot_mapping.scalar_type());
  p.k_scale = k_scale ? k_scale->mutable_data_ptr<float>() : nullptr;
  p.v_scale = v_scale ? v_scale->mutable_data_ptr<float>() : nullptr;
  p.k_scale_stride = k_scale && k_scale->numel() > 1 ? 1 : 0;
  p.v_scale_stride = v_scale && v_scale->numel() > 1 ? 1 : 0;
  p.num_tokens = k.size(0);
  p.num_kv_heads = k.size(1);
  p.head_dim = k.size(2);
  p.k_token_stride = k.stride(0);
  p.v_token_stride = v.stride(0);
  p.num_slots = num_slots;
  p.dtype = to_dtype(k.scalar_type());
  p.cache_dtype = to_dtype(k_cache.scalar_type());
  check_launch(launch_reshape_and_cache(p, scope.stream()), op);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_KERNEL_KEY, m) {
  using namespace fastinfer::binding;
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("rms_norm_out", TORCH_BOX(&rms_norm_out));
  m.impl("fused_add_rms_norm", TORCH_BOX(&fused_add_rms_norm));
  m.impl("gated_rms_norm", TORCH_BOX(&gated_rms_norm));
  m.impl("rms_norm_quant", TORCH_BOX(&rms_norm_quant));
  m.impl("fused_add_rms_norm_quant", TORCH_BOX(&fused_add_rms_norm_quant));
  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  m.impl("silu_and_mul_out", TORCH_BOX(&silu_and_mul_out));
  m.impl("gelu_and_mul", TORCH_BOX(&gelu_and_mul));
  m.impl("gelu_and_mul_out", TORCH_BOX(&gelu_and_mul_out));
  m.impl("gelu_tanh_and_mul", TORCH_BOX(&gelu_tanh_and_mul));
  m.impl("gelu_tanh_and_mul_out", TORCH_BOX(&gelu_tanh_and_mul_out));
  m.impl("activation", TORCH_BOX(&activation));
  m.impl("activation_out", TORCH_BOX(&activation_out));
  m.impl("rotary_embedding", TORCH_BOX(&rotary_embedding));
  m.impl("reshape_and_cache", TORCH_BOX(&reshape_and_cache));
}
