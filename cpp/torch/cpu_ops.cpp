// CPU implementations (C++ row loops or ATen, fp32 inside) of the fastinfer ops: they make the runner usable on a
// CPU-only machine and accept float32 as well as float16/bfloat16.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "validate.h"

namespace fastinfer::binding {
namespace {

// Row kernels: one pass over each row, fp32 math (the sum of squares in 16 partial sums added in
// fp64, so float32 inputs keep full accuracy), one rounding on store; rows are spread over ATen's
// CPU thread pool.
constexpr int64_t kGrainElems = 1 << 15;
constexpr int kLanes = 16;

std::vector<float> to_float_vector(const at::Tensor& t) {
  const auto f = t.to(at::kFloat).contiguous();
  return {f.data_ptr<float>(), f.data_ptr<float>() + f.numel()};
}

// out may alias x (each row is fully read before it is written).
template <typename T>
void rms_norm_rows(T* out, const T* x, const float* w, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElems / h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      float lanes[kLanes] = {};  // independent partial sums: vectorisable and accurate
      int64_t i = 0;
      for (; i + kLanes <= h; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          lanes[j] += v * v;
        }
      double sum_sq = 0;
      for (; i < h; ++i) sum_sq += static_cast<double>(static_cast<float>(xr[i])) * static_cast<float>(xr[i]);
      for (int j = 0; j < kLanes; ++j) sum_sq += lanes[j];
      const float inv_rms = 1.0f / std::sqrt(static_cast<float>(sum_sq / h) + eps);
      T* o = out + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv_rms * w[i]);
    }
  });
}

void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t h = x.size(-1);
  if (x.numel() == 0 || h == 0) return;
  const auto w = to_float_vector(weight);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), w.data(), x.numel() / h, h,
                  static_cast<float>(eps));
  });
}

void check_rms_norm_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor* other,
                           const char* other_name) {
  check_on_cpu(x, op, "x");
  check_on_cpu(weight, op, "weight");
  if (other != nullptr) check_on_cpu(*other, op, other_name);
  check_rms_norm_layout(op, x, weight, other, other_name);
}

void rms_norm_out_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm_out", x, weight, eps, true);
  validate_like("rms_norm_out", out, "out", x, "x");
  check_rms_norm_inputs("rms_norm_out", x, weight, &out, "out");
  rms_norm_into(out, x, weight, eps);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  validate_rms_norm("rms_norm", x, weight, eps, true);
  check_rms_norm_inputs("rms_norm", x, weight, nullptr, nullptr);
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_into(out, x, weight, eps);
  return out;
}

void fused_add_rms_norm_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm";
  validate_rms_norm(op, x, weight, eps, true);
  validate_like(op, residual, "residual", x, "x");
  check_rms_norm_inputs(op, x, weight, &residual, "residual");
  const int64_t h = x.size(-1);
  if (x.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel() / h, std::max<int64_t>(1, kGrainElems / h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)  // residual <- round(x + residual)
        for (int64_t i = r * h; i < (r + 1) * h; ++i)
          rp[i] = static_cast<scalar_t>(static_cast<float>(xp[i]) + static_cast<float>(rp[i]));
    });
  });
  rms_norm_into(x, residual, weight, eps);  // normalise the rounded residual
}

// ATen's vectorised silu beats a scalar row loop here (exp dominates).
void silu_and_mul_into(at::Tensor& out, const at::Tensor& x) {
  const int64_t f = x.size(-1) / 2;
  if (out.numel() == 0) return;
  out.copy_(at::silu(x.narrow(-1, 0, f).to(at::kFloat)) * x.narrow(-1, f, f).to(at::kFloat));
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  validate_silu_and_mul("silu_and_mul", x, true);
  check_on_cpu(x, "silu_and_mul", "x");
  check_silu_and_mul_layout("silu_and_mul", x, nullptr);
  auto out = at::empty_symint(silu_and_mul_out_shape(x), x.options());
  silu_and_mul_into(out, x);
  return out;
}

void silu_and_mul_out_cpu(at::Tensor& out, const at::Tensor& x) {
  const char* op = "silu_and_mul_out";
  validate_silu_and_mul_out(op, out, x, true);
  check_on_cpu(x, op, "x");
  check_on_cpu(out, op, "out");
  check_silu_and_mul_layout(op, x, &out);
  silu_and_mul_into(out, x);
}

void rotate_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rot, bool is_neox) {
  // x: [T, H, D]; cos, sin: [T, 1, rot / 2] float32.
  const int64_t half = rot / 2;
  auto xr = x.narrow(-1, 0, rot);
  at::Tensor x1, x2;
  if (is_neox) {
    x1 = xr.narrow(-1, 0, half);
    x2 = xr.narrow(-1, half, half);
  } else {
    x1 = xr.slice(-1, 0, rot, 2);
    x2 = xr.slice(-1, 1, rot, 2);
  }
  // copies (not aliases, even for float32 x): x1 is overwritten before x2 is computed
  const auto a = x1.to(at::kFloat, false, true), b = x2.to(at::kFloat, false, true);
  x1.copy_(a * cos - b * sin);
  x2.copy_(b * cos + a * sin);
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& q, at::Tensor& k,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  const char* op = "rotary_embedding";
  validate_rotary_embedding(op, positions, q, k, cos_sin_cache, true);
  for (const auto& [t, name] : {std::pair{&positions, "positions"}, {&q, "q"}, {&k, "k"}, {&cos_sin_cache, "cos_sin_cache"}})
    check_on_cpu(*t, op, name);
  check_rotary_embedding_layout(op, positions, q, k, cos_sin_cache);
  check_index_range(positions, 0, cos_sin_cache.size(0), op, "positions", "rows of cos_sin_cache");
  const int64_t rot = cos_sin_cache.size(1);
  const auto rows = cos_sin_cache.index_select(0, positions.to(at::kLong)).to(at::kFloat).unsqueeze(1);
  const auto cos = rows.narrow(-1, 0, rot / 2), sin = rows.narrow(-1, rot / 2, rot / 2);
  rotate_(q, cos, sin, rot, is_neox);
  rotate_(k, cos, sin, rot, is_neox);
}

void reshape_and_cache_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  validate_reshape_and_cache(op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, true);
  for (const auto& [t, name] : {std::pair{&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&slot_mapping, "slot_mapping"}})
    check_on_cpu(*t, op, name);
  check_reshape_and_cache_layout(op, k, v, k_cache, v_cache, slot_mapping);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(slot_mapping, -1, num_slots, op, "slot_mapping", "-1 or a slot < num_blocks * block_size");
  const auto slots = slot_mapping.to(at::kLong);
  const auto keep = slots.ge(0);
  const auto dst = slots.masked_select(keep);
  auto store = [&](const at::Tensor& src, at::Tensor& cache, const std::optional<at::Tensor>& scale) {
    auto rows = src.index({keep});
    if (scale.has_value()) rows = (rows.to(at::kFloat) / scale->to(at::kFloat)).clamp(-448.0, 448.0);
    cache.view({num_slots, cache.size(2), cache.size(3)}).index_put_({dst}, rows.to(cache.scalar_type()));
  };
  store(k, k_cache, k_scale);
  store(v, v_cache, v_scale);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(FASTINFER_NS, CPU, m) {
  using namespace fastinfer::binding;
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_out", &rms_norm_out_cpu);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
  m.impl("silu_and_mul_out", &silu_and_mul_out_cpu);
  m.impl("rotary_embedding", &rotary_embedding_cpu);
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
}
