#pragma once
// Shape/dtype/device rules of the FP4 (W4A16) ops, shared by the CPU and CUDA/sim impls, plus the
// checkpoint-to-kernel conversion (a host loop over a CPU copy, the result on the input's device;
// weights are converted once, at load time). Layout: cuda/include/fastinfer/gemm/fp4.h.
#include <string>

#include "common.h"
#include "gemm_int4/contract.h"

namespace fastinfer::binding {

// The schemas of the gemm fp4 ops (schema.cpp registers them for every module).
inline void define_gemm_fp4_ops(StableLibrary& m) {
  // FP4 W4A16 GEMM (docs/design.md "GEMM"; layout in cuda/include/fastinfer/gemm/fp4.h).
  m.def("fp4_repack(Tensor weight_packed, Tensor weight_scale) -> (Tensor packed, Tensor scales)");
  m.def("fp4_gemm(Tensor a, Tensor packed, Tensor scales, Tensor? global_scale, str format, "
        "bool deterministic=False) -> Tensor");
}

// Input features per scale of a format name ("nvfp4": 16, "mxfp4": 32), 0 for any other name.
inline int64_t fp4_group_of(std::string_view format) {
  return format == "nvfp4" ? 16 : (format == "mxfp4" ? 32 : 0);
}

// weight_packed uint8 [N, K / 2] (two e2m1 codes per byte, the even element in the low nibble),
// weight_scale uint8 [N, K / G] (the scale bits), G = 16 or 32.
inline void validate_fp4_repack(const char* op, const Tensor& weight_packed, const Tensor& weight_scale) {
  check_dim(weight_packed, 2, op, "weight_packed", "[N, K / 2] uint8 (two e2m1 codes per byte)");
  check_dtype_in(weight_packed, {kByte}, op, "weight_packed");
  check_dim(weight_scale, 2, op, "weight_scale", "[N, K / G] uint8 (e4m3 bits, G = 16, or e8m0, G = 32)");
  check_dtype_in(weight_scale, {kByte}, op, "weight_scale");
  check_same_device(weight_scale, weight_packed, op, "weight_scale", "weight_packed");
  const int64_t n = weight_packed.size(0), k = weight_packed.size(1) * 2;
  check_int4_nk(op, n, k, "weight_packed");
  FI_CHECK(weight_scale.size(0) == n && (weight_scale.size(1) * 16 == k || weight_scale.size(1) * 32 == k), op,
           "weight_scale must have shape [N, K / 16] (NVFP4) or [N, K / 32] (MXFP4) = [", n, ", ", k / 16, "] or [", n,
           ", ", k / 32, "] for K = ", k, ", got ", shape_str(weight_scale));
}

// a [M, K], packed int32 [K / 64, 8 N], scales uint8 [K / G, N], global_scale float32 [1] or None
// (nvfp4 only), G from the format.
inline void validate_fp4_gemm(const char* op, const Tensor& a, const Tensor& packed, const Tensor& scales,
                              const std::optional<Tensor>& global_scale, std::string_view format, bool allow_fp32) {
  const int64_t group = fp4_group_of(format);
  FI_CHECK(group != 0, op, "format must be 'nvfp4' or 'mxfp4', got '", std::string(format), "'");
  check_dim(a, 2, op, "a", "[M, K]");
  check_activation_dtype(a, allow_fp32, op, "a");
  check_dim(packed, 2, op, "packed", "[K / 64, 8 * N] int32 (from fp4_repack)");
  check_dtype_in(packed, {kInt}, op, "packed");
  check_same_device(packed, a, op, "packed", "a");
  const auto k = a.size(1);
  FI_CHECK(packed.size(1) % (8 * kInt4MinN) == 0, op,
           "packed must have shape [K / 64, 8 * N] with N a multiple of 16 (the fp4 kernel's minimum tile is 16 "
           "columns x 64 k), got ", shape_str(packed));
  const auto n = packed.size(1) / 8;
  check_int4_nk(op, n, k, "a / packed");
  FI_CHECK(packed.size(0) * kInt4MinK == k, op, "packed must have shape [K / 64, 8 * N] = [", k / kInt4MinK, ", ",
           n * 8, "] for K = ", k, " (a.size(1)), got ", shape_str(packed));
  check_dim(scales, 2, op, "scales", "[K / G, N] uint8 (from fp4_repack)");
  check_dtype_in(scales, {kByte}, op, "scales");
  check_same_device(scales, a, op, "scales", "a");
  FI_CHECK(scales.size(0) == k / group && scales.size(1) == n, op, "scales must have shape [K / ", group, ", N] = [",
           k / group, ", ", n, "] for format '", std::string(format), "', got ", shape_str(scales));
  if (global_scale.has_value()) {
    FI_CHECK(format == "nvfp4", op, "global_scale is only defined for format='nvfp4' (MXFP4 has none), got one for '",
             std::string(format), "'");
    check_dtype_in(*global_scale, {kFloat}, op, "global_scale");
    check_same_device(*global_scale, a, op, "global_scale", "a");
    FI_CHECK(global_scale->numel() == 1 && global_scale->dim() <= 1, op,
             "global_scale must have shape [1] (one fp32 divisor per weight), got ", shape_str(*global_scale));
  }
}

inline void check_fp4_gemm_layout(const char* op, const Tensor& a, const Tensor& packed, const Tensor& scales) {
  check_contiguous(a, op, "a");
  check_contiguous(packed, op, "packed");
  check_contiguous(scales, op, "scales");
}

// e8m0 scale 255 (the MX spec's NaN) refused; checked on the host for CPU tensors or with
// FASTINFER_CHECK_INDICES=1 (no device sync otherwise).
inline void check_fp4_gemm_values(const char* op, const Tensor& scales, std::string_view format) {
  if (format == "mxfp4") check_index_range(scales, 0, 255, op, "scales", "e8m0 exponents; 255 is the MX spec's NaN");
}

// (packed int32 [K / 64, 8 N] in int4_pack's layout with the e2m1 codes as nibbles, scales uint8
// [K / G, N]: weight_scale transposed), on weight_packed's device.
inline std::tuple<Tensor, Tensor> fp4_repack_impl(const Tensor& weight_packed, const Tensor& weight_scale) {
  const int64_t n = weight_packed.size(0), kb = weight_packed.size(1), k = 2 * kb;
  const auto host = to_cpu(weight_packed, kByte);
  const uint8_t* b = host.const_data_ptr<uint8_t>();
  // element k of row r: byte k / 2, the even element in the low nibble
  auto packed = int4_pack_host(n, k, [&](int64_t r, int64_t c) {
    return static_cast<uint8_t>((b[r * kb + c / 2] >> (4 * (c & 1))) & 15);
  });
  const auto st = to_cpu(weight_scale, kByte);
  const uint8_t* s = st.const_data_ptr<uint8_t>();
  const int64_t groups = weight_scale.size(1);
  auto scales = cpu_empty({groups, n}, kByte);
  uint8_t* out = scales.mutable_data_ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < groups; ++g) out[g * n + r] = s[r * groups + g];
  if (weight_packed.is_cpu()) return {packed, scales};
  const auto dev = weight_packed.device();
  return {torch::stable::to(packed, dev), torch::stable::to(scales, dev)};
}

}  // namespace fastinfer::binding
