// CPU implementations of the fp4 (W4A16) ops: fp4_repack (the layout conversion shared with the
// CUDA/sim bindings, contract.h) and fp4_gemm. fp4_gemm decodes 256-column chunks of W from the
// packed layout into fp32 with the kernels' rounding (the scale rounded to a's dtype, then
// e2m1 * scale rounded to it), multiplies them with ATen's matmul in fp32 (exact products of two
// values of a's dtype, fp32 sums), divides by the global scale in fp32 and rounds once. ATen's
// GEMM makes a row's bits depend on M; deterministic=True multiplies one row at a time instead
// (the same call for every row: batch invariant).
#include <algorithm>
#include <cmath>
#include <vector>

#include "gemm_fp4/contract.h"
#include "gemm_fp4/decode_cpu.h"

namespace fastinfer::binding {
namespace {

constexpr int64_t kChunkN = 256;

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
    decode_fp4_rows<T>(words, sp, nvfp4, n, k, n0, rows, w.mutable_data_ptr<float>());
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
