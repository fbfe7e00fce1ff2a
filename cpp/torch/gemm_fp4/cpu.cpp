// CPU implementations of the fp4 (W4A16) ops: fp4_repack (the layout conversion shared with the
// CUDA/sim bindings, contract.h) and fp4_gemm. fp4_gemm decodes 256-column chunks of W from the
// packed layout into fp32 with the kernels' rounding (the scale rounded to a's dtype, then
// e2m1 * scale rounded to it), multiplies them with ATen's matmul in fp32 (exact products of two
// values of a's dtype, fp32 sums), divides by the global scale in fp32 and rounds once. ATen's
// GEMM makes a row's bits depend on M; deterministic=True multiplies one row at a time instead
// (the same call for every row: batch invariant).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gemm_fp4/contract.h"
#include "gemm_int4/dequantize_cpu.h"

namespace fastinfer::binding {
namespace {

constexpr int64_t kChunkN = 256;

constexpr float kE2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

float bits_as_float(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The value of a scale byte: e4m3 (NVFP4; 0x7F / 0xFF NaN) or e8m0 2^(e - 127) (MXFP4).
float scale_value(uint8_t bits, bool nvfp4) {
  if (!nvfp4) return bits == 0 ? bits_as_float(0x00400000u) : (bits == 255 ? NAN : bits_as_float(uint32_t{bits} << 23));
  const uint32_t em = bits & 0x7Fu;
  float v;
  if (em == 0x7Fu)
    v = NAN;
  else if (em < 8u)
    v = static_cast<float>(em) * 0.001953125f;  // subnormal: m * 2^-9
  else
    v = std::ldexp(1.f + static_cast<float>(em & 7u) / 8.f, static_cast<int>(em >> 3) - 7);
  return (bits & 0x80u) ? -v : v;
}

// w[r][k] (fp32, rows n0 .. n0 + rows) of the packed weight: int4_pack's layout (gemm/int4.h) with
// e2m1 codes as nibbles; nibble i = 4 e + 2 h + kh of word (kt, nt, lane = 4 g + t, j) is the code
// of W[16 nt + 8 h + g][64 kt + 16 j + 8 kh + 2 t + e].
template <typename T>
void decode_rows(const uint32_t* words, const uint8_t* scales, bool nvfp4, int64_t n, int64_t k, int64_t n0,
                 int64_t rows, float* w) {
  const int64_t group = nvfp4 ? 16 : 32;
  torch::stable::parallel_for(0, rows / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t nt = n0 / 16 + tile;
      for (int64_t kt = 0; kt < k / 64; ++kt) {
        const uint32_t* unit = words + (kt * (n / 16) + nt) * 128;
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane >> 2, t = lane & 3;
          for (int j = 0; j < 4; ++j) {
            const uint32_t word = unit[4 * lane + j];
            for (int i = 0; i < 8; ++i) {
              const int e = i >> 2, h = (i >> 1) & 1, kh = i & 1;
              const int64_t col = 16 * nt + 8 * h + g, kk = 64 * kt + 16 * j + 8 * kh + 2 * t + e;
              const uint32_t code = (word >> (4 * i)) & 15u;
              const float s = round_to<T>(scale_value(scales[(kk / group) * n + col], nvfp4));
              const float mag = round_to<T>(kE2m1[code & 7u] * s);
              w[(col - n0) * k + kk] = (code & 8u) ? -mag : mag;
            }
          }
        }
      }
    }
  });
}

template <typename T>
void fp4_gemm_chunked(const Tensor& a, const Tensor& packed, const Tensor& scales, float global_scale, bool nvfp4,
                      bool deterministic, Tensor& out) {
  const int64_t m = a.size(0), k = a.size(1), n = out.size(1);
  const auto af = contiguous_as(a, kFloat);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed.const_data_ptr<int32_t>());
  const uint8_t* sp = scales.const_data_ptr<uint8_t>();
  T* op = out.mutable_data_ptr<T>();
  for (int64_t n0 = 0; n0 < n; n0 += kChunkN) {
    const int64_t rows = std::min(kChunkN, n - n0);
    auto w = cpu_empty({rows, k}, kFloat);
    decode_rows<T>(words, sp, nvfp4, n, k, n0, rows, w.mutable_data_ptr<float>());
    const int64_t step = deterministic ? 1 : m;
    for (int64_t r0 = 0; r0 < m; r0 += step) {
      const int64_t count = std::min(step, m - r0);
      const auto acc = torch::stable::contiguous(matmul_nt(slice(af, 0, r0, count), w));
      const float* ap = acc.const_data_ptr<float>();
      for (int64_t r = 0; r < count; ++r)
        for (int64_t c = 0; c < rows; ++c)
          op[(r0 + r) * n + n0 + c] = static_cast<T>(ap[r * rows + c] / global_scale);
    }
  }
}

std::tuple<Tensor, Tensor> fp4_repack_cpu(const Tensor& weight_packed, const Tensor& weight_scale) {
  const char* op = "fp4_repack";
  validate_fp4_repack(op, weight_packed, weight_scale);
  check_on_cpu(weight_packed, op, "weight_packed");
  return fp4_repack_impl(weight_packed, weight_scale);
}

Tensor fp4_gemm_cpu(const Tensor& a, const Tensor& packed, const Tensor& scales,
                    const std::optional<Tensor>& global_scale, std::string_view format, bool deterministic) {
  const char* op = "fp4_gemm";
  validate_fp4_gemm(op, a, packed, scales, global_scale, format, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_fp4_gemm_layout(op, a, packed, scales);
  check_fp4_gemm_values(op, scales, format);
  const int64_t m = a.size(0), n = packed.size(1) / 8;
  auto out = empty_on(a, {m, n});
  if (m == 0) return out;
  const float gs = global_scale.has_value() ? scalar_value(*global_scale) : 1.f;
  const bool nvfp4 = format == "nvfp4";
  FASTINFER_DISPATCH_FLOAT_TYPES(a.scalar_type(), "fp4_gemm_cpu", [&] {
    fp4_gemm_chunked<scalar_t>(a, packed, scales, gs, nvfp4, deterministic, out);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("fp4_repack", TORCH_BOX(&fp4_repack_cpu));
  m.impl("fp4_gemm", TORCH_BOX(&fp4_gemm_cpu));
}
