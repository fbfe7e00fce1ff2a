#pragma once
// Shape/dtype/device rules of the int4 (W4A16) ops, shared by the CPU and CUDA/sim impls, plus the
// packed-layout conversions: host loops over a CPU copy, the result moved to the input's device
// (weights are converted once, at load time). Layout: cuda/include/fastinfer/gemm/int4.h.
#include <algorithm>
#include <string>

#include "common.h"

namespace fastinfer::binding {

// The schemas of the gemm int4 ops (schema.cpp registers them for every module).
inline void define_gemm_int4_ops(StableLibrary& m) {
  // INT4 W4A16 GEMM (docs/design.md "GEMM"; layout in cuda/include/fastinfer/gemm/int4.h). Extensions:
  // int4_repack takes g_idx (GPTQ act-order) and also returns perm (int64 [K], empty without g_idx);
  // int4_gemm takes perm and multiplies a[:, perm].
  m.def("int4_pack(Tensor w_q) -> Tensor");
  m.def("int4_repack(Tensor qweight, Tensor qzeros, str fmt, Tensor? g_idx=None) -> (Tensor packed, Tensor zeros, "
        "Tensor perm)");
  m.def("int4_gemm(Tensor a, Tensor packed, Tensor scales, Tensor? zeros, int group_size=128, Tensor? perm=None, "
        "bool deterministic=False) -> Tensor");
}

inline constexpr int64_t kInt4MinN = 16;  // minimum tile of the packed layout: 16 columns x 64 k
inline constexpr int64_t kInt4MinK = 64;

inline void check_int4_nk(const char* op, const int64_t& n, const int64_t& k, const char* what) {
  FI_CHECK(n % kInt4MinN == 0 && n > 0, op, what, ": N (output features) must be a positive multiple of 16 (the int4 "
           "kernel's minimum tile is 16 columns x 64 k), got N = ", n);
  FI_CHECK(k % kInt4MinK == 0 && k > 0, op, what, ": K (input features) must be a positive multiple of 64 (the int4 "
           "kernel's minimum tile is 16 columns x 64 k), got K = ", k);
}

inline void check_int4_group_size(const char* op, int64_t group_size, const int64_t& k) {
  FI_CHECK(group_size > 0 && group_size % 16 == 0, op,
           "group_size must be a positive multiple of 16 (16, 32, 64, 128 (default), ..., K), got ", group_size);
  FI_CHECK(k % group_size == 0, op, "K = ", k, " (a.size(1)) must be a multiple of group_size = ", group_size);
}

// w_q [N, K] uint8 -> packed int32 [K / 64, 8 N].
inline void validate_int4_pack(const char* op, const Tensor& w_q) {
  check_dim(w_q, 2, op, "w_q", "[N, K] (the quantised weight, values 0..15)");
  check_dtype_in(w_q, {kByte}, op, "w_q");
  check_int4_nk(op, w_q.size(0), w_q.size(1), "w_q");
}

inline std::vector<int64_t> int4_packed_shape(const int64_t& n, const int64_t& k) {
  return {k / kInt4MinK, n * 8};
}

// fmt "awq": qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8];
// fmt "gptq": qweight int32 [K / 8, N], qzeros int32 [K / G, N / 8]; g_idx [K] optional (gptq only).
struct Int4RepackShape {
  int64_t n, k, groups;
};

inline Int4RepackShape validate_int4_repack(const char* op, const Tensor& qweight, const Tensor& qzeros,
                                            std::string_view fmt, const std::optional<Tensor>& g_idx) {
  const bool awq = fmt == "awq", gptq = fmt == "gptq";
  FI_CHECK(awq || gptq, op, "fmt must be 'awq' or 'gptq', got '", std::string(fmt), "'");
  check_dim(qweight, 2, op, "qweight", awq ? "[K, N / 8] int32 (AutoAWQ)" : "[K / 8, N] int32 (AutoGPTQ)");
  check_dtype_in(qweight, {kInt}, op, "qweight");
  check_dim(qzeros, 2, op, "qzeros", "[K / group_size, N / 8] int32");
  check_dtype_in(qzeros, {kInt}, op, "qzeros");
  check_same_device(qzeros, qweight, op, "qzeros", "qweight");
  Int4RepackShape s{awq ? qweight.size(1) * 8 : qweight.size(1),
                    awq ? qweight.size(0) : qweight.size(0) * 8, qzeros.size(0)};
  check_int4_nk(op, s.n, s.k, "qweight");
  FI_CHECK(qzeros.size(1) * 8 == s.n, op, "qzeros must have shape [K / group_size, N / 8] with N / 8 = ",
           s.n / 8, ", got ", shape_str(qzeros));
  FI_CHECK(s.groups > 0 && s.k % s.groups == 0 && (s.k / s.groups) % 32 == 0, op,
           "qzeros.size(0) must be K / group_size with group_size a multiple of 32 dividing K = ", s.k,
           ", got qzeros.size(0) = ", s.groups);
  if (g_idx.has_value()) {
    FI_CHECK(gptq, op, "g_idx (act-order) is only defined for fmt='gptq'");
    check_dim(*g_idx, 1, op, "g_idx", "[K] (the group of each input feature)");
    check_dtype_in(*g_idx, {kInt, kLong}, op, "g_idx");
    check_same_device(*g_idx, qweight, op, "g_idx", "qweight");
    FI_CHECK(g_idx->size(0) == s.k, op, "g_idx must have K = ", s.k, " entries, got ", shape_str(*g_idx));
  }
  return s;
}

// a [M, K], packed [K / 64, 8 N], scales [K / G, N] (dtype of a), zeros uint8 [K / G, N] or None,
// perm [K] int32/int64 or None (act-order: a's columns are gathered a[:, perm] first).
inline void validate_int4_gemm(const char* op, const Tensor& a, const Tensor& packed, const Tensor& scales,
                               const std::optional<Tensor>& zeros, int64_t group_size,
                               const std::optional<Tensor>& perm, bool allow_fp32) {
  check_dim(a, 2, op, "a", "[M, K]");
  if (allow_fp32)
    check_dtype_in(a, {kHalf, kBFloat16, kFloat}, op, "a");
  else
    check_dtype_in(a, {kHalf, kBFloat16}, op, "a");
  check_dim(packed, 2, op, "packed", "[K / 64, 8 * N] int32 (from int4_pack / int4_repack)");
  check_dtype_in(packed, {kInt}, op, "packed");
  check_same_device(packed, a, op, "packed", "a");
  const auto k = a.size(1);
  FI_CHECK(packed.size(1) % (8 * kInt4MinN) == 0, op,
           "packed must have shape [K / 64, 8 * N] with N a multiple of 16 (the int4 kernel's minimum tile is 16 "
           "columns x 64 k), got ", shape_str(packed));
  const auto n = packed.size(1) / 8;
  check_int4_nk(op, n, k, "a / packed");
  FI_CHECK(packed.size(0) * kInt4MinK == k, op, "packed must have shape [K / 64, 8 * N] = [", k / kInt4MinK,
           ", ", n * 8, "] for K = ", k, " (a.size(1)), got ", shape_str(packed));
  check_int4_group_size(op, group_size, k);
  check_dim(scales, 2, op, "scales", "[K / group_size, N]");
  check_same_dtype(scales, a, op, "scales", "a");
  check_same_device(scales, a, op, "scales", "a");
  FI_CHECK(scales.size(0) == k / group_size && scales.size(1) == n, op, "scales must have shape [K / group_size, N] = [",
           k / group_size, ", ", n, "], got ", shape_str(scales));
  if (zeros.has_value()) {
    check_dim(*zeros, 2, op, "zeros", "[K / group_size, N] uint8 (0..15), or None for symmetric weights");
    check_dtype_in(*zeros, {kByte}, op, "zeros");
    check_same_device(*zeros, a, op, "zeros", "a");
    FI_CHECK(zeros->size(0) == k / group_size && zeros->size(1) == n, op,
             "zeros must have shape [K / group_size, N] = [", k / group_size, ", ", n, "], got ", shape_str(*zeros));
  }
  if (perm.has_value()) {
    check_dim(*perm, 1, op, "perm", "[K] (the act-order permutation returned by int4_repack)");
    check_dtype_in(*perm, {kInt, kLong}, op, "perm");
    check_same_device(*perm, a, op, "perm", "a");
    FI_CHECK(perm->size(0) == k, op, "perm must have K = ", k, " entries, got ", shape_str(*perm));
  }
}

inline void check_int4_gemm_layout(const char* op, const Tensor& a, const Tensor& packed,
                                   const Tensor& scales, const std::optional<Tensor>& zeros,
                                   const std::optional<Tensor>& perm) {
  check_contiguous(a, op, "a");
  check_contiguous(packed, op, "packed");
  check_contiguous(scales, op, "scales");
  if (zeros.has_value()) check_contiguous(*zeros, op, "zeros");
  if (perm.has_value()) check_contiguous(*perm, op, "perm");
}

// Values of zeros (0..15) and perm (a permutation range) checked on the host for CPU tensors or
// with FASTINFER_CHECK_INDICES=1 (no device sync otherwise).
inline void check_int4_gemm_values(const char* op, const Tensor& a, const std::optional<Tensor>& zeros,
                                   const std::optional<Tensor>& perm) {
  if (zeros.has_value()) check_index_range(*zeros, 0, 16, op, "zeros", "4-bit zero points");
  if (perm.has_value()) check_index_range(*perm, 0, a.size(1), op, "perm", "indices into a's K columns");
}

// ---- layout conversions (host loops; the result on the input's device) --------------------------

// Packs W [N, K] (nibbles, w(n, k) in 0..15) into int32 words [K / 64, 8 N] (gemm/int4.h): nibble
// i = 4 e + 2 h + kh of word (kt, nt, lane = 4 g + t, j) holds W[16 nt + 8 h + g][64 kt + 16 j + 8 kh + 2 t + e].
template <typename W>
Tensor int4_pack_host(int64_t n, int64_t k, const W& w) {
  auto packed = cpu_empty({k / 64, 8 * n}, kInt);
  uint32_t* out = static_cast<uint32_t*>(packed.mutable_data_ptr());
  torch::stable::parallel_for(0, k / 64, 1, [&](int64_t kt0, int64_t kt1) {
    for (int64_t kt = kt0; kt < kt1; ++kt)
      for (int64_t nt = 0; nt < n / 16; ++nt)
        for (int64_t g = 0; g < 8; ++g)
          for (int64_t t = 0; t < 4; ++t)
            for (int64_t j = 0; j < 4; ++j) {
              uint32_t word = 0;
              for (int64_t e = 0; e < 2; ++e)
                for (int64_t h = 0; h < 2; ++h)
                  for (int64_t kh = 0; kh < 2; ++kh)
                    word |= static_cast<uint32_t>(w(16 * nt + 8 * h + g, 64 * kt + 16 * j + 8 * kh + 2 * t + e) & 15)
                            << (4 * (4 * e + 2 * h + kh));
              out[kt * 8 * n + nt * 128 + g * 16 + t * 4 + j] = word;
            }
  });
  return packed;
}

// w_q [N, K] (0..15) -> packed int32 [K / 64, 8 N] on w_q's device.
inline Tensor int4_pack_impl(const Tensor& w_q) {
  const int64_t n = w_q.size(0), k = w_q.size(1);
  const auto host = to_cpu(w_q, kByte);
  const uint8_t* q = host.const_data_ptr<uint8_t>();
  const auto packed = int4_pack_host(n, k, [&](int64_t r, int64_t c) { return q[r * k + c]; });
  return w_q.is_cpu() ? packed : torch::stable::to(packed, w_q.device());
}

// Nibble i of a packed int32 word.
inline uint8_t nibble(int32_t word, int i) { return static_cast<uint8_t>((static_cast<uint32_t>(word) >> (4 * i)) & 15); }

// (packed, zeros uint8 [K / G, N], perm int64 [K] or [0]), on qweight's device.
inline std::tuple<Tensor, Tensor, Tensor> int4_repack_impl(const char* op, const Tensor& qweight, const Tensor& qzeros,
                                                           std::string_view fmt, const std::optional<Tensor>& g_idx) {
  const bool awq = fmt == "awq";
  const int64_t cols = qweight.size(1);
  const int64_t n = awq ? cols * 8 : cols;
  const int64_t k = awq ? qweight.size(0) : qweight.size(0) * 8;
  const int64_t groups = qzeros.size(0);
  // AutoAWQ GEMM packs nibble i of word [k, j] with column 8 j + pack[i], pack = 0 2 4 6 1 3 5 7
  // (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: order_map), so column c is nibble
  // unpack[c], unpack = 0 4 1 5 2 6 3 7 (awq/utils/packing_utils.py: AWQ_REVERSE_ORDER, used by
  // reverse_awq_order / dequantize_gemm). The same for qzeros.
  static constexpr int kAwqUnpack[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  const auto qw_t = to_cpu(qweight, kInt), qz_t = to_cpu(qzeros, kInt);
  const int32_t* qw = qw_t.const_data_ptr<int32_t>();
  const int32_t* qz = qz_t.const_data_ptr<int32_t>();
  // The weight as W[n][k]: AWQ rows are k, 8 consecutive columns per word (permuted by unpack);
  // GPTQ nibble i of word (j, n) holds row 8 j + i (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py: pack).
  auto w_at = [&](int64_t col, int64_t row) -> uint8_t {
    return awq ? nibble(qw[row * cols + col / 8], kAwqUnpack[col % 8]) : nibble(qw[(row / 8) * cols + col], row % 8);
  };
  // Zero points: AWQ as stored (interleaved like qweight); GPTQ v1 plain order, stored as zero - 1.
  auto zeros = cpu_empty({groups, n}, kByte);
  uint8_t* z = zeros.mutable_data_ptr<uint8_t>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < n; ++c) {
      const int32_t word = qz[g * (n / 8) + c / 8];
      z[g * n + c] = awq ? nibble(word, kAwqUnpack[c % 8]) : static_cast<uint8_t>((nibble(word, c % 8) + 1) & 15);
    }
  Tensor perm = cpu_empty({0}, kLong);
  Tensor packed;
  if (g_idx.has_value()) {
    const int64_t group_size = k / groups;
    const auto gi = host_indices(*g_idx);
    // Each group must have exactly group_size members (then a stable sort by group makes groups
    // contiguous): perm lists the input features group by group, in index order within a group.
    std::vector<int64_t> count(static_cast<size_t>(groups) + 1, 0);
    bool ok = true;
    for (int64_t x : gi) {
      ok = ok && x >= 0 && x < groups;
      if (ok) ++count[static_cast<size_t>(x) + 1];
    }
    for (int64_t g = 0; ok && g < groups; ++g) ok = count[static_cast<size_t>(g) + 1] == group_size;
    FI_CHECK(ok, op, "g_idx must assign exactly group_size = K / qzeros.size(0) = ", group_size,
             " input features to each group 0..", groups - 1, " (GPTQ act-order)");
    perm = cpu_empty({k}, kLong);
    int64_t* p = perm.mutable_data_ptr<int64_t>();
    for (int64_t g = 0; g < groups; ++g) count[static_cast<size_t>(g) + 1] += count[static_cast<size_t>(g)];
    for (int64_t i = 0; i < k; ++i) p[count[static_cast<size_t>(gi[static_cast<size_t>(i)])]++] = i;
    packed = int4_pack_host(n, k, [&](int64_t c, int64_t r) { return w_at(c, p[r]); });
  } else {
    packed = int4_pack_host(n, k, w_at);
  }
  if (qweight.is_cpu()) return {packed, zeros, perm};
  const auto dev = qweight.device();
  return {torch::stable::to(packed, dev), torch::stable::to(zeros, dev), torch::stable::to(perm, dev)};
}

}  // namespace fastinfer::binding
