// CPU implementations of the int4 (W4A16) ops: int4_pack / int4_repack (the layout conversions
// shared with the CUDA/sim bindings, contract.h) and int4_gemm. int4_gemm dequantises with the kernels'
// rounding (w = (q - z) * s rounded once to a's dtype) and accumulates in fp32:
//  - M <= kFusedMaxM (decode): a loop over 16-column tiles on torch's thread pool that decodes each
//    64 x 16 unit of the packed weight once (through per-group tables of the 16 possible values)
//    and applies it to every row of a (no weight copy);
//  - larger M: 256-column chunks of W dequantised to fp32 and multiplied with ATen's matmul (its GEMM:
//    a row's bits depend on M), except with deterministic=True, which keeps the fused loop for
//    every M (each row's sums run in the same order whatever the other rows: batch invariant).

#include <algorithm>

#include <cstring>
#include <vector>

#include "gemm_int4/contract.h"
#include "gemm_int4/dequantize_cpu.h"

namespace fastinfer::binding {
namespace {

constexpr int64_t kFusedMaxM = 16;
constexpr int64_t kChunkN = 256;

// Decode path: per 16-column tile (torch's thread pool), each 64 x 16 unit is decoded once into a
// small fp32 buffer and dotted with the 64 matching activations of every row (no weight copy).
template <typename T>
void int4_gemm_fused(const Tensor& a, const Tensor& packed, const Tensor& scales, const uint8_t* zp,
                     int64_t group_size, Tensor& out) {
  const int64_t m = a.size(0), k = a.size(1), n = out.size(1);
  const auto af = contiguous_as(a, kFloat);
  const float* ap = af.mutable_data_ptr<float>();
  const int32_t* pp = packed.mutable_data_ptr<int32_t>();
  const T* sp = scales.mutable_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  torch::stable::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(m) * 16);
    std::vector<float> lut;
    float w[16][64];
    for (int64_t nt = begin; nt < end; ++nt) {
      build_lut<T>(sp, zp, n, k / group_size, nt, lut);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t kt = 0; kt < k / 64; ++kt) {
        decode_unit(pp, lut, n, group_size, kt, nt, w);
        for (int64_t r = 0; r < m; ++r) {
          const float* arow = ap + r * k + 64 * kt;
          float* accr = acc.data() + r * 16;
          for (int c = 0; c < 16; ++c) {
            float part[8] = {};  // 8 independent partial sums (vectorisable without reassociation)
            for (int kk = 0; kk < 64; kk += 8)
              for (int l = 0; l < 8; ++l) part[l] += arow[kk + l] * w[c][kk + l];
            accr[c] += ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
          }
        }
      }
      for (int64_t r = 0; r < m; ++r)
        for (int c = 0; c < 16; ++c) op[r * n + 16 * nt + c] = static_cast<T>(acc[r * 16 + c]);
    }
  });
}

// w[n0 : n0 + rows, :] as fp32 (values rounded to T), rows a multiple of 16.
template <typename T>
Tensor dequantize_rows(const Tensor& packed, const Tensor& scales, const uint8_t* zeros, int64_t n,
                           int64_t k, int64_t group_size, int64_t n0, int64_t rows) {
  auto w = empty_on(scales, {rows, k}, kFloat);
  dequantize_int4_rows<T>(packed.const_data_ptr<int32_t>(), scales.const_data_ptr<T>(), zeros, n, k, group_size, n0,
                          rows, w.mutable_data_ptr<float>());
  return w;
}

template <typename T>
void int4_gemm_chunked(const Tensor& a, const Tensor& packed, const Tensor& scales, const uint8_t* zeros,
                       int64_t group_size, Tensor& out) {
  const int64_t k = a.size(1), n = out.size(1);
  const auto af = to_dtype_of(a, kFloat);
  for (int64_t n0 = 0; n0 < n; n0 += kChunkN) {
    const int64_t rows = std::min(kChunkN, n - n0);
    const auto w = dequantize_rows<T>(packed, scales, zeros, n, k, group_size, n0, rows);
    auto cols = slice(out, 1, n0, rows);
    torch::stable::copy_(cols, matmul_nt(af, w));
  }
}

Tensor int4_pack_cpu(const Tensor& w_q) {
  const char* op = "int4_pack";
  validate_int4_pack(op, w_q);
  check_on_cpu(w_q, op, "w_q");
  check_index_range(w_q, 0, 16, op, "w_q", "4-bit values 0..15");
  return int4_pack_impl(w_q);
}

std::tuple<Tensor, Tensor, Tensor> int4_repack_cpu(const Tensor& qweight, const Tensor& qzeros,
                                                               std::string_view fmt,
                                                               const std::optional<Tensor>& g_idx) {
  const char* op = "int4_repack";
  validate_int4_repack(op, qweight, qzeros, fmt, g_idx);
  check_on_cpu(qweight, op, "qweight");
  if (g_idx.has_value()) check_index_range(*g_idx, 0, qzeros.size(0), op, "g_idx", "group indices < K / group_size");
  return int4_repack_impl(op, qweight, qzeros, fmt, g_idx);
}

Tensor int4_gemm_cpu(const Tensor& a_in, const Tensor& packed, const Tensor& scales,
                         const std::optional<Tensor>& zeros, int64_t group_size,
                         const std::optional<Tensor>& perm, bool deterministic) {
  const char* op = "int4_gemm";
  validate_int4_gemm(op, a_in, packed, scales, zeros, group_size, perm, /*allow_fp32=*/true);
  check_on_cpu(a_in, op, "a");
  check_int4_gemm_layout(op, a_in, packed, scales, zeros, perm);
  check_int4_gemm_values(op, a_in, zeros, perm);
  const auto a = perm.has_value() ? torch::stable::index_select(a_in, 1, *perm) : a_in;
  const int64_t m = a.size(0), n = packed.size(1) / 8;
  auto out = empty_on(a, {m, n});
  if (m == 0) return out;
  const uint8_t* zp = zeros.has_value() ? zeros->mutable_data_ptr<uint8_t>() : nullptr;
  FASTINFER_DISPATCH_FLOAT_TYPES(a.scalar_type(), "int4_gemm_cpu", [&] {
    if (m <= kFusedMaxM || deterministic)
      int4_gemm_fused<scalar_t>(a, packed, scales, zp, group_size, out);
    else
      int4_gemm_chunked<scalar_t>(a, packed, scales, zp, group_size, out);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("int4_pack", TORCH_BOX(&int4_pack_cpu));
  m.impl("int4_repack", TORCH_BOX(&int4_repack_cpu));
  m.impl("int4_gemm", TORCH_BOX(&int4_gemm_cpu));
}
