// CPU implementations (C++ row loops, fp32 inside) of the fastinfer ops: they make the runner usable on a
// CPU-only machine and accept float32 as well as float16/bfloat16.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "elementwise/contract.h"
#include "gemm_fp8/e4m3_cpu.h"
#include "gemm_int8/int8_cpu.h"

namespace fastinfer::binding {
namespace {

// Row kernels: one pass over each row, fp32 math (the sum of squares in 16 partial sums added in
// fp64, so float32 inputs keep full accuracy), one rounding on store; rows are spread over torch's
// CPU thread pool.
constexpr int64_t kGrainElems = 1 << 15;
constexpr int kLanes = 16;

std::vector<float> to_float_vector(const Tensor& t) {
  const auto f = contiguous_as(t, kFloat);
  return {f.mutable_data_ptr<float>(), f.mutable_data_ptr<float>() + f.numel()};
}

// The RMSNorm weight plus weight_offset in float32 (the zero-centred weights' 1 + w is formed in
// fp32, as transformers' Gemma and Qwen3.5 norms do); None (the weightless norm, offset 0) is a
// weight of ones, exactly: the product by 1.0f rounds nothing.
std::vector<float> norm_weight(const std::optional<Tensor>& weight, int64_t hidden, double weight_offset) {
  if (!weight.has_value()) return std::vector<float>(hidden, 1.0f);
  auto w = to_float_vector(*weight);
  for (auto& v : w) v += static_cast<float>(weight_offset);
  return w;
}

// silu(z) = z / (1 + exp(-z)) with torch's fp32 exp (the gated activations' SiluGate below).
FASTINFER_CPU_INLINE float silu_of(float z) { return z / (1.0f + cpu::sleef_exp(-z)); }

// Row r of x starts at x + r * xs, of out at out + r * os (strided rows: slices of wider buffers).
// out may alias x (each row is fully read before it is written). With a gate (row stride gs) the
// output is also multiplied by silu(gate), in fp32 before the one rounding.
template <typename T>
FASTINFER_CPU_INLINE void rms_norm_range(T* out, int64_t os, const T* x, int64_t xs, const T* gate, int64_t gs,
                                         const float* w, int64_t begin, int64_t end, int64_t h, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * xs;
    float lanes[kLanes] = {};  // independent partial sums: vectorisable and accurate
    int64_t i = 0;
    for (; i + kLanes <= h; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float v = static_cast<float>(xr[i + j]);
        lanes[j] += v * v;
      }
    double sum_sq = 0;
    for (; i < h; ++i) sum_sq += static_cast<double>(static_cast<float>(xr[i])) * static_cast<float>(xr[i]);
    sum_sq += cpu::tree_sum<kLanes>(lanes);
    const float inv_rms = 1.0f / std::sqrt(static_cast<float>(sum_sq / h) + eps);
    T* o = out + r * os;
    if (gate == nullptr) {
      for (int64_t i = 0; i < h; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv_rms * w[i]);
    } else {
      const T* zr = gate + r * gs;
      for (int64_t i = 0; i < h; ++i)
        o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv_rms * w[i] * silu_of(static_cast<float>(zr[i])));
    }
  }
}

// residual <- round(x + residual), then x <- rms_norm(residual) (of the rounded residual).
template <typename T>
FASTINFER_CPU_INLINE void add_rms_norm_range(T* x, int64_t xs, T* residual, int64_t rs, const float* w, int64_t begin,
                                             int64_t end, int64_t h, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    T* xr = x + r * xs;
    T* rr = residual + r * rs;
    for (int64_t i = 0; i < h; ++i) rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
  }
  rms_norm_range(x, xs, residual, rs, static_cast<const T*>(nullptr), 0, w, begin, end, h, eps);
}

// residual <- round(x + residual) on rows [begin, end) (add_rms_norm_range's first loop; x is
// only read): fused_add_rms_norm_quant's add.
template <typename T>
FASTINFER_CPU_INLINE void add_residual_range(const T* x, int64_t xs, T* residual, int64_t rs, int64_t begin,
                                             int64_t end, int64_t h) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * xs;
    T* rr = residual + r * rs;
    for (int64_t i = 0; i < h; ++i) rr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
  }
}

// fp8_quantize's / int8_quantize's arithmetic on n dense rows of h values of T (gemm_fp8/e4m3_cpu.h,
// gemm_int8/int8_cpu.h): per row the scale from the amax (or the given one; then scales is null)
// and the codes. row: h floats of scratch.
template <typename T>
FASTINFER_CPU_INLINE void quantize_rows(const T* src, int64_t n, int64_t h, bool e4m3, void* codes, float* scales,
                                        float given_scale, float* row) {
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < h; ++i) row[i] = static_cast<float>(src[r * h + i]);
    if (e4m3) {
      const float s = scales == nullptr ? given_scale : scale_from_amax(cpu::abs_max(row, h));
      Float8_e4m3fn* q = static_cast<Float8_e4m3fn*>(codes) + r * h;
      for (int64_t i = 0; i < h; ++i) q[i] = to_e4m3(row[i], s);
      if (scales != nullptr) scales[r] = s;
    } else {
      const float s = scales == nullptr ? given_scale : int8_scale_from_amax(cpu::abs_max(row, h));
      int8_t* q = static_cast<int8_t*>(codes) + r * h;
      for (int64_t i = 0; i < h; ++i) q[i] = int8_symmetric_code(row[i] / s);
      if (scales != nullptr) scales[r] = s;
    }
  }
}

// The gated activations (gate then up halves of each row): silu (SwiGLU) and gelu's tanh
// approximation (GeGLU, torch.nn.functional.gelu(approximate="tanh")). silu is torch's CPU formula
// with torch's exp, so float32 silu_and_mul equals F.silu(gate) * up bit for bit (tests/
// test_elementwise_ops.py says on which elements).
struct SiluGate {
  FASTINFER_CPU_INLINE float operator()(float g) const { return silu_of(g); }
};
struct GeluErfGate {
  FASTINFER_CPU_INLINE float operator()(float g) const { return 0.5f * g * (1.0f + std::erf(g * 0.7071067811865476f)); }
};
// Also transformers' gelu_new (NewGELUActivation): the same formula.
struct GeluTanhGate {
  FASTINFER_CPU_INLINE float operator()(float g) const {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    return 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
  }
};
// transformers' FastGELUActivation and QuickGELUActivation (the kernels' GeluFast, QuickGelu).
struct GeluFast {
  FASTINFER_CPU_INLINE float operator()(float g) const {
    return 0.5f * g * (1.0f + std::tanh(g * 0.7978845608f * (1.0f + 0.044715f * g * g)));
  }
};
struct QuickGelu {
  FASTINFER_CPU_INLINE float operator()(float g) const { return g / (1.0f + cpu::sleef_exp(-1.702f * g)); }
};

// Rows of x start xs elements apart, rows of out os apart (slices of wider buffers).
template <typename Act, typename T>
FASTINFER_CPU_INLINE void gated_and_mul_range(T* out, int64_t os, const T* x, int64_t xs, int64_t begin, int64_t end,
                                              int64_t f) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * xs;
    const T* up = gate + f;
    T* o = out + r * os;
    for (int64_t i = 0; i < f; ++i)
      o[i] = static_cast<T>(Act()(static_cast<float>(gate[i])) * static_cast<float>(up[i]));
  }
}

template <typename Act, typename T>
FASTINFER_CPU_INLINE void activation_range(T* out, int64_t os, const T* x, int64_t xs, int64_t begin, int64_t end,
                                           int64_t w) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * xs;
    T* o = out + r * os;
    for (int64_t i = 0; i < w; ++i) o[i] = static_cast<T>(Act()(static_cast<float>(xr[i])));
  }
}

// Rotate the first `rot` dims of every head of rows [begin, end) of x [T, H, D] (token stride
// `stride`); cache rows are float32 [cos(rot / 2), sin(rot / 2)].
template <typename T>
FASTINFER_CPU_INLINE void rotary_range(T* x, int64_t stride, int64_t heads, int64_t d, const int64_t* positions,
                                       const float* cache, int64_t rot, bool is_neox, int64_t begin, int64_t end) {
  const int64_t half = rot / 2;
  for (int64_t t = begin; t < end; ++t) {
    const float* cos = cache + positions[t] * rot;
    const float* sin = cos + half;
    for (int64_t h = 0; h < heads; ++h) {
      T* xh = x + t * stride + h * d;
      if (is_neox) {
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(xh[i]), b = static_cast<float>(xh[i + half]);
          xh[i] = static_cast<T>(a * cos[i] - b * sin[i]);
          xh[i + half] = static_cast<T>(b * cos[i] + a * sin[i]);
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const float a = static_cast<float>(xh[2 * i]), b = static_cast<float>(xh[2 * i + 1]);
          xh[2 * i] = static_cast<T>(a * cos[i] - b * sin[i]);
          xh[2 * i + 1] = static_cast<T>(b * cos[i] + a * sin[i]);
        }
      }
    }
  }
}

// One ISA-cloned entry per dtype (target_clones does not apply to templates; see cpu_simd.h).
#define FASTINFER_ROW_ENTRIES(SUFFIX, T)                                                                    \
  FASTINFER_CPU_CLONES void rms_norm_##SUFFIX(T* out, int64_t os, const T* x, int64_t xs, const T* z,       \
                                              int64_t zs, const float* w, int64_t b, int64_t e, int64_t h,   \
                                              float eps) {                                                   \
    rms_norm_range(out, os, x, xs, z, zs, w, b, e, h, eps);                                                  \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void add_rms_norm_##SUFFIX(T* x, int64_t xs, T* r, int64_t rs, const float* w,        \
                                                  int64_t b, int64_t e, int64_t h, float eps) {              \
    add_rms_norm_range(x, xs, r, rs, w, b, e, h, eps);                                                       \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void add_residual_##SUFFIX(const T* x, int64_t xs, T* r, int64_t rs, int64_t b, int64_t e, \
                                                  int64_t h) {                                               \
    add_residual_range(x, xs, r, rs, b, e, h);                                                               \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void quantize_rows_##SUFFIX(const T* src, int64_t n, int64_t h, bool e4m3, void* q,   \
                                                   float* scales, float given, float* row) {                 \
    quantize_rows(src, n, h, e4m3, q, scales, given, row);                                                   \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void silu_and_mul_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e,       \
                                                  int64_t f) {                                               \
    gated_and_mul_range<SiluGate>(out, os, x, s, b, e, f);                                                       \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void gelu_and_mul_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e,       \
                                                  int64_t f) {                                               \
    gated_and_mul_range<GeluErfGate>(out, os, x, s, b, e, f);                                                    \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void gelu_tanh_and_mul_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e,  \
                                                       int64_t f) {                                          \
    gated_and_mul_range<GeluTanhGate>(out, os, x, s, b, e, f);                                                   \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void gelu_new_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e, int64_t w) { \
    activation_range<GeluTanhGate>(out, os, x, s, b, e, w);                                                      \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void gelu_fast_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e, int64_t w) { \
    activation_range<GeluFast>(out, os, x, s, b, e, w);                                                          \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void quick_gelu_##SUFFIX(T* out, int64_t os, const T* x, int64_t s, int64_t b, int64_t e, int64_t w) { \
    activation_range<QuickGelu>(out, os, x, s, b, e, w);                                                         \
  }                                                                                                          \
  FASTINFER_CPU_CLONES void rotary_##SUFFIX(T* x, int64_t stride, int64_t heads, int64_t d, const int64_t* pos, \
                                            const float* cache, int64_t rot, bool neox, int64_t b, int64_t e) { \
    rotary_range(x, stride, heads, d, pos, cache, rot, neox, b, e);                                          \
  }
FASTINFER_ROW_ENTRIES(f32, float)
FASTINFER_ROW_ENTRIES(f16, Half)
FASTINFER_ROW_ENTRIES(bf16, BFloat16)
#undef FASTINFER_ROW_ENTRIES

// The entries for dtype T, picked at compile time inside AT_DISPATCH.
template <typename T> struct RowEntries;
#define FASTINFER_ROW_TABLE(SUFFIX, T)                                   \
  template <> struct RowEntries<T> {                                     \
    static constexpr auto rms_norm = rms_norm_##SUFFIX;                  \
    static constexpr auto add_rms_norm = add_rms_norm_##SUFFIX;          \
    static constexpr auto add_residual = add_residual_##SUFFIX;          \
    static constexpr auto quantize_rows = quantize_rows_##SUFFIX;        \
    static constexpr auto silu_and_mul = silu_and_mul_##SUFFIX;          \
    static constexpr auto gelu_and_mul = gelu_and_mul_##SUFFIX;          \
    static constexpr auto gelu_tanh_and_mul = gelu_tanh_and_mul_##SUFFIX; \
    static constexpr auto gelu_new = gelu_new_##SUFFIX;                  \
    static constexpr auto gelu_fast = gelu_fast_##SUFFIX;                \
    static constexpr auto quick_gelu = quick_gelu_##SUFFIX;              \
    static constexpr auto rotary = rotary_##SUFFIX;                      \
  };
FASTINFER_ROW_TABLE(f32, float)
FASTINFER_ROW_TABLE(f16, Half)
FASTINFER_ROW_TABLE(bf16, BFloat16)
#undef FASTINFER_ROW_TABLE

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1)); }

// gate: gated_rms_norm's, or nullptr.
void rms_norm_into(Tensor& out, const Tensor& x, const Tensor* gate, const std::optional<Tensor>& weight, double eps,
                   double weight_offset) {
  const int64_t h = x.size(-1);
  if (x.numel() == 0 || h == 0) return;
  const auto w = norm_weight(weight, h, weight_offset);
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), "rms_norm", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* zp = gate != nullptr ? gate->const_data_ptr<scalar_t>() : nullptr;
    const int64_t os = row_stride(out), xs = row_stride(x), zs = gate != nullptr ? row_stride(*gate) : 0;
    torch::stable::parallel_for(0, x.numel() / h, grain_rows(h), [&](int64_t b, int64_t e) {
      RowEntries<scalar_t>::rms_norm(o, os, xp, xs, zp, zs, w.data(), b, e, h, static_cast<float>(eps));
    });
  });
}

void check_rms_norm_inputs(const char* op, const Tensor& x, const std::optional<Tensor>& weight, const Tensor* other,
                           const char* other_name) {
  check_on_cpu(x, op, "x");
  if (weight.has_value()) check_on_cpu(*weight, op, "weight");
  if (other != nullptr) check_on_cpu(*other, op, other_name);
  check_rms_norm_layout(op, x, weight, other, other_name);
}

void rms_norm_out_cpu(Tensor& out, const Tensor& x, const std::optional<Tensor>& weight, double eps,
                      double weight_offset) {
  validate_rms_norm("rms_norm_out", x, weight, eps, weight_offset, true);
  validate_like("rms_norm_out", out, "out", x, "x");
  check_rms_norm_inputs("rms_norm_out", x, weight, &out, "out");
  rms_norm_into(out, x, nullptr, weight, eps, weight_offset);
}

Tensor rms_norm_cpu(const Tensor& x, const std::optional<Tensor>& weight, double eps, double weight_offset) {
  validate_rms_norm("rms_norm", x, weight, eps, weight_offset, true);
  check_rms_norm_inputs("rms_norm", x, weight, nullptr, nullptr);
  auto out = empty_as(x);
  rms_norm_into(out, x, nullptr, weight, eps, weight_offset);
  return out;
}

Tensor gated_rms_norm_cpu(const Tensor& x, const Tensor& gate, const std::optional<Tensor>& weight, double eps,
                          double weight_offset) {
  const char* op = "gated_rms_norm";
  validate_gated_rms_norm(op, x, gate, weight, eps, weight_offset, true);
  check_rms_norm_inputs(op, x, weight, &gate, "gate");
  auto out = empty_as(x);
  rms_norm_into(out, x, &gate, weight, eps, weight_offset);
  return out;
}

void fused_add_rms_norm_cpu(Tensor& x, Tensor& residual, const std::optional<Tensor>& weight, double eps,
                            double weight_offset) {
  const char* op = "fused_add_rms_norm";
  validate_rms_norm(op, x, weight, eps, weight_offset, true);
  validate_like(op, residual, "residual", x, "x");
  check_rms_norm_inputs(op, x, weight, &residual, "residual");
  const int64_t h = x.size(-1);
  if (x.numel() == 0 || h == 0) return;
  const auto w = norm_weight(weight, h, weight_offset);
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.mutable_data_ptr<scalar_t>();
    scalar_t* rp = residual.mutable_data_ptr<scalar_t>();
    const int64_t xs = row_stride(x), rs = row_stride(residual);
    torch::stable::parallel_for(0, x.numel() / h, grain_rows(h), [&](int64_t b, int64_t e) {
      RowEntries<scalar_t>::add_rms_norm(xp, xs, rp, rs, w.data(), b, e, h, static_cast<float>(eps));
    });
  });
}

// rms_norm_quant (residual nullptr) and fused_add_rms_norm_quant: per block of rows, the residual
// add as add_rms_norm_range does it, the norm by the rms_norm entry into a block buffer of x's
// dtype (the rounded values rms_norm returns), then fp8_quantize's / int8_quantize's arithmetic
// on each row (quantize_rows). The add and the quantisation are exact elementwise operations and
// maxima, so their ISA clones all give the same bits.
std::tuple<Tensor, Tensor> rms_norm_quant_into(const char* op, const Tensor& x, Tensor* residual,
                                               const std::optional<Tensor>& weight, double eps, ScalarType out_dtype,
                                               const std::optional<Tensor>& scale, double weight_offset) {
  validate_rms_norm_quant(op, x, residual, weight, eps, out_dtype, scale, weight_offset, true);
  check_rms_norm_inputs(op, x, weight, residual, "residual");
  if (scale.has_value()) check_on_cpu(*scale, op, "scale");
  const int64_t h = x.size(-1), rows = x.numel() / h;
  auto out = empty_on(x, shape_of(x), out_dtype);
  const bool given = scale.has_value();
  const float given_scale = given ? scalar_value(*scale) : 0.0f;
  auto out_scale = given ? full_on(x, {1}, given_scale, kFloat) : empty_on(x, {rows}, kFloat);
  if (rows == 0) return {out, out_scale};
  const auto w = norm_weight(weight, h, weight_offset);
  float* sp = given ? nullptr : out_scale.mutable_data_ptr<float>();
  const bool e4m3 = out_dtype == kFloat8_e4m3fn;
  auto* codes = static_cast<uint8_t*>(out.data_ptr());  // 1 byte per code
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), op, [&] {
    using E = RowEntries<scalar_t>;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* rp = residual != nullptr ? residual->mutable_data_ptr<scalar_t>() : nullptr;
    const int64_t xs = row_stride(x), rs = residual != nullptr ? row_stride(*residual) : 0;
    const int64_t block = grain_rows(h);  // rows per pass: the normalised block stays in cache
    torch::stable::parallel_for(0, rows, block, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> normed(std::min(block, end - begin) * h);
      std::vector<float> row(h);
      for (int64_t b = begin; b < end; b += block) {
        const int64_t e = std::min(b + block, end);
        if (rp != nullptr) E::add_residual(xp, xs, rp, rs, b, e, h);
        const scalar_t* src = rp != nullptr ? rp + b * rs : xp + b * xs;
        E::rms_norm(normed.data(), h, src, rp != nullptr ? rs : xs, static_cast<const scalar_t*>(nullptr), 0,
                    w.data(), 0, e - b, h, static_cast<float>(eps));
        E::quantize_rows(normed.data(), e - b, h, e4m3, codes + b * h, sp != nullptr ? sp + b : nullptr, given_scale,
                         row.data());
      }
    });
  });
  return {out, out_scale};
}

std::tuple<Tensor, Tensor> rms_norm_quant_cpu(const Tensor& x, const std::optional<Tensor>& weight, double eps,
                                              ScalarType out_dtype, const std::optional<Tensor>& scale,
                                              double weight_offset) {
  return rms_norm_quant_into("rms_norm_quant", x, nullptr, weight, eps, out_dtype, scale, weight_offset);
}

std::tuple<Tensor, Tensor> fused_add_rms_norm_quant_cpu(const Tensor& x, Tensor& residual,
                                                        const std::optional<Tensor>& weight, double eps,
                                                        ScalarType out_dtype, const std::optional<Tensor>& scale,
                                                        double weight_offset) {
  return rms_norm_quant_into("fused_add_rms_norm_quant", x, &residual, weight, eps, out_dtype, scale, weight_offset);
}

enum class Gate { kSilu, kGeluErf, kGeluTanh };

void gated_and_mul_into(Tensor& out, const Tensor& x, Gate gate) {
  const int64_t f = x.size(-1) / 2;
  if (out.numel() == 0) return;
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), "gated_and_mul", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    using E = RowEntries<scalar_t>;
    const auto rows = gate == Gate::kSilu ? E::silu_and_mul : gate == Gate::kGeluErf ? E::gelu_and_mul : E::gelu_tanh_and_mul;
    const int64_t os = row_stride(out), xs = row_stride(x);
    torch::stable::parallel_for(0, out.numel() / f, grain_rows(2 * f),
                                [&](int64_t b, int64_t e) { rows(o, os, xp, xs, b, e, f); });
  });
}

Tensor gated_and_mul_cpu(const char* op, const Tensor& x, Gate gate) {
  validate_gated_and_mul(op, x, true);
  check_on_cpu(x, op, "x");
  check_gated_and_mul_layout(op, x, nullptr);
  auto out = empty_on(x, gated_and_mul_out_shape(x));
  gated_and_mul_into(out, x, gate);
  return out;
}

void gated_and_mul_out_cpu(const char* op, Tensor& out, const Tensor& x, Gate gate) {
  validate_gated_and_mul_out(op, out, x, true);
  check_on_cpu(x, op, "x");
  check_on_cpu(out, op, "out");
  check_gated_and_mul_layout(op, x, &out);
  gated_and_mul_into(out, x, gate);
}

Tensor silu_and_mul_cpu(const Tensor& x) { return gated_and_mul_cpu("silu_and_mul", x, Gate::kSilu); }
void silu_and_mul_out_cpu(Tensor& out, const Tensor& x) {
  gated_and_mul_out_cpu("silu_and_mul_out", out, x, Gate::kSilu);
}
Tensor gelu_and_mul_cpu(const Tensor& x) { return gated_and_mul_cpu("gelu_and_mul", x, Gate::kGeluErf); }
void gelu_and_mul_out_cpu(Tensor& out, const Tensor& x) { gated_and_mul_out_cpu("gelu_and_mul_out", out, x, Gate::kGeluErf); }
Tensor gelu_tanh_and_mul_cpu(const Tensor& x) { return gated_and_mul_cpu("gelu_tanh_and_mul", x, Gate::kGeluTanh); }
void gelu_tanh_and_mul_out_cpu(Tensor& out, const Tensor& x) {
  gated_and_mul_out_cpu("gelu_tanh_and_mul_out", out, x, Gate::kGeluTanh);
}

void activation_into(Tensor& out, const Tensor& x, Activation activation) {
  const int64_t w = x.dim() == 0 ? 1 : x.size(-1);
  if (out.numel() == 0) return;
  FASTINFER_DISPATCH_ACT_TYPES(x.scalar_type(), "activation", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    using E = RowEntries<scalar_t>;
    const auto rows = activation == Activation::kGeluNew    ? E::gelu_new
                      : activation == Activation::kGeluFast ? E::gelu_fast
                                                            : E::quick_gelu;
    const int64_t os = row_stride(out), xs = row_stride(x);
    torch::stable::parallel_for(0, out.numel() / w, grain_rows(w),
                                [&](int64_t b, int64_t e) { rows(o, os, xp, xs, b, e, w); });
  });
}

Tensor activation_cpu(const Tensor& x, std::string_view activation) {
  const char* op = "activation";
  validate_activation(op, x, activation, true);
  check_on_cpu(x, op, "x");
  check_activation_layout(op, x, nullptr);
  auto out = empty_as(x);
  activation_into(out, x, parse_activation(op, activation));
  return out;
}

void activation_out_cpu(Tensor& out, const Tensor& x, std::string_view activation) {
  const char* op = "activation_out";
  validate_activation_out(op, out, x, activation, true);
  check_on_cpu(x, op, "x");
  check_on_cpu(out, op, "out");
  check_activation_layout(op, x, &out);
  activation_into(out, x, parse_activation(op, activation));
}

void rotary_embedding_cpu(const Tensor& positions, Tensor& q, Tensor& k,
                          const Tensor& cos_sin_cache, bool is_neox) {
  const char* op = "rotary_embedding";
  validate_rotary_embedding(op, positions, q, k, cos_sin_cache, true);
  for (const auto& [t, name] : {std::pair{&positions, "positions"}, {&q, "q"}, {&k, "k"}, {&cos_sin_cache, "cos_sin_cache"}})
    check_on_cpu(*t, op, name);
  check_rotary_embedding_layout(op, positions, q, k, cos_sin_cache);
  check_index_range(positions, 0, cos_sin_cache.size(0), op, "positions", "rows of cos_sin_cache");
  const int64_t rot = cos_sin_cache.size(1), T = q.size(0);
  if (T == 0) return;
  const auto cache = contiguous_as(cos_sin_cache, kFloat);
  const auto pos = contiguous_as(positions, kLong);
  FASTINFER_DISPATCH_ACT_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    const int64_t d = q.size(2);
    torch::stable::parallel_for(0, T, grain_rows((q.size(1) + k.size(1)) * d), [&](int64_t b, int64_t e) {
      for (Tensor* x : {&q, &k})
        RowEntries<scalar_t>::rotary(x->mutable_data_ptr<scalar_t>(), x->stride(0), x->size(1), d, pos.const_data_ptr<int64_t>(),
                                     cache.const_data_ptr<float>(), rot, is_neox, b, e);
    });
  });
}

void reshape_and_cache_cpu(const Tensor& k, const Tensor& v, Tensor& k_cache, Tensor& v_cache,
                           const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                           const std::optional<Tensor>& v_scale) {
  const char* op = "reshape_and_cache";
  validate_reshape_and_cache(op, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, true);
  for (const auto& [t, name] : {std::pair{&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"},
                                {&slot_mapping, "slot_mapping"}})
    check_on_cpu(*t, op, name);
  check_reshape_and_cache_layout(op, k, v, k_cache, v_cache, slot_mapping);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  check_index_range(slot_mapping, -1, num_slots, op, "slot_mapping", "-1 or a slot < num_blocks * block_size");
  const int64_t T = k.size(0), row = k_cache.size(2) * k_cache.size(3);
  if (T == 0) return;
  const auto slots_t = contiguous_as(slot_mapping, kLong);
  const int64_t* slots = slots_t.const_data_ptr<int64_t>();
  auto store = [&](const Tensor& src, Tensor& cache, const std::optional<Tensor>& scale) {
    const int64_t stride = src.stride(0), el = cache.element_size();
    if (cache.scalar_type() == src.scalar_type()) {  // rows [Hkv * D] are contiguous: one memcpy each
      const auto* s = static_cast<const char*>(src.const_data_ptr());
      auto* c = static_cast<char*>(cache.data_ptr());
      torch::stable::parallel_for(0, T, grain_rows(row), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t)
          if (slots[t] >= 0) std::memcpy(c + slots[t] * row * el, s + t * stride * el, row * el);
      });
      return;
    }
    // fp8 e4m3 cache: x / scale (divided, as the kernel does: rounded once), saturated to the
    // finite range, rounded to nearest; scale per tensor or per KV head (element i is head i / D).
    const float* sc = scale->const_data_ptr<float>();
    const int64_t head_dim = cache.size(3), scale_stride = scale->numel() == 1 ? 0 : 1;
    auto* c = static_cast<Float8_e4m3fn*>(cache.data_ptr());
    FASTINFER_DISPATCH_ACT_TYPES(src.scalar_type(), "reshape_and_cache", [&] {
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      torch::stable::parallel_for(0, T, grain_rows(row), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          if (slots[t] < 0) continue;
          for (int64_t i = 0; i < row; ++i)
            c[slots[t] * row + i] = static_cast<Float8_e4m3fn>(std::clamp(
                static_cast<float>(s[t * stride + i]) / sc[i / head_dim * scale_stride], -448.0f, 448.0f));
        }
      });
    });
  };
  store(k, k_cache, k_scale);
  store(v, v_cache, v_scale);
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("rms_norm", TORCH_BOX(&rms_norm_cpu));
  m.impl("rms_norm_out", TORCH_BOX(&rms_norm_out_cpu));
  m.impl("fused_add_rms_norm", TORCH_BOX(&fused_add_rms_norm_cpu));
  m.impl("gated_rms_norm", TORCH_BOX(&gated_rms_norm_cpu));
  m.impl("rms_norm_quant", TORCH_BOX(&rms_norm_quant_cpu));
  m.impl("fused_add_rms_norm_quant", TORCH_BOX(&fused_add_rms_norm_quant_cpu));
  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul_cpu));
  m.impl("silu_and_mul_out", TORCH_BOX(&silu_and_mul_out_cpu));
  m.impl("gelu_and_mul", TORCH_BOX(&gelu_and_mul_cpu));
  m.impl("gelu_and_mul_out", TORCH_BOX(&gelu_and_mul_out_cpu));
  m.impl("gelu_tanh_and_mul", TORCH_BOX(&gelu_tanh_and_mul_cpu));
  m.impl("gelu_tanh_and_mul_out", TORCH_BOX(&gelu_tanh_and_mul_out_cpu));
  m.impl("activation", TORCH_BOX(&activation_cpu));
  m.impl("activation_out", TORCH_BOX(&activation_out_cpu));
  m.impl("rotary_embedding", TORCH_BOX(&rotary_embedding_cpu));
  m.impl("reshape_and_cache", TORCH_BOX(&reshape_and_cache_cpu));
}
