#pragma once
// Shape/dtype/device rules of the int4 (W4A16) ops, shared by the Meta, CPU and CUDA/sim impls
// (symbolic sizes), plus the packed-layout conversions written as ATen tensor ops (so the same
// code packs on the CPU, on a GPU and for the sim namespace). Layout: cuda/include/fastinfer/gemm/int4.h.
#include <algorithm>
#include <string>

#include "common.h"

namespace fastinfer::binding {

inline constexpr int64_t kInt4MinN = 16;  // minimum tile of the packed layout: 16 columns x 64 k
inline constexpr int64_t kInt4MinK = 64;

inline void check_int4_nk(const char* op, const c10::SymInt& n, const c10::SymInt& k, const char* what) {
  FI_CHECK(n % kInt4MinN == 0 && n > 0, op, what, ": N (output features) must be a positive multiple of 16 (the int4 "
           "kernel's minimum tile is 16 columns x 64 k), got N = ", n);
  FI_CHECK(k % kInt4MinK == 0 && k > 0, op, what, ": K (input features) must be a positive multiple of 64 (the int4 "
           "kernel's minimum tile is 16 columns x 64 k), got K = ", k);
}

inline void check_int4_group_size(const char* op, int64_t group_size, const c10::SymInt& k) {
  FI_CHECK(group_size > 0 && group_size % 32 == 0, op,
           "group_size must be a positive multiple of 32 (32, 64, 128 (default), ..., K), got ", group_size);
  FI_CHECK(k % group_size == 0, op, "K = ", k, " (a.size(1)) must be a multiple of group_size = ", group_size);
}

// w_q [N, K] uint8 -> packed int32 [K / 64, 8 N].
inline void validate_int4_pack(const char* op, const at::Tensor& w_q) {
  check_dim(w_q, 2, op, "w_q", "[N, K] (the quantised weight, values 0..15)");
  check_dtype_in(w_q, {at::kByte}, op, "w_q");
  check_int4_nk(op, w_q.sym_size(0), w_q.sym_size(1), "w_q");
}

inline std::vector<c10::SymInt> int4_packed_shape(const c10::SymInt& n, const c10::SymInt& k) {
  return {k / kInt4MinK, n * 8};
}

// fmt "awq": qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8];
// fmt "gptq": qweight int32 [K / 8, N], qzeros int32 [K / G, N / 8]; g_idx [K] optional (gptq only).
struct Int4RepackShape {
  c10::SymInt n, k, groups;
};

inline Int4RepackShape validate_int4_repack(const char* op, const at::Tensor& qweight, const at::Tensor& qzeros,
                                            c10::string_view fmt, const std::optional<at::Tensor>& g_idx) {
  const bool awq = fmt == "awq", gptq = fmt == "gptq";
  FI_CHECK(awq || gptq, op, "fmt must be 'awq' or 'gptq', got '", std::string(fmt), "'");
  check_dim(qweight, 2, op, "qweight", awq ? "[K, N / 8] int32 (AutoAWQ)" : "[K / 8, N] int32 (AutoGPTQ)");
  check_dtype_in(qweight, {at::kInt}, op, "qweight");
  check_dim(qzeros, 2, op, "qzeros", "[K / group_size, N / 8] int32");
  check_dtype_in(qzeros, {at::kInt}, op, "qzeros");
  check_same_device(qzeros, qweight, op, "qzeros", "qweight");
  Int4RepackShape s{awq ? qweight.sym_size(1) * 8 : qweight.sym_size(1),
                    awq ? qweight.sym_size(0) : qweight.sym_size(0) * 8, qzeros.sym_size(0)};
  check_int4_nk(op, s.n, s.k, "qweight");
  FI_CHECK(qzeros.sym_size(1) * 8 == s.n, op, "qzeros must have shape [K / group_size, N / 8] with N / 8 = ",
           s.n / 8, ", got ", shape_str(qzeros));
  FI_CHECK(s.groups > 0 && s.k % s.groups == 0 && (s.k / s.groups) % 32 == 0, op,
           "qzeros.size(0) must be K / group_size with group_size a multiple of 32 dividing K = ", s.k,
           ", got qzeros.size(0) = ", s.groups);
  if (g_idx.has_value()) {
    FI_CHECK(gptq, op, "g_idx (act-order) is only defined for fmt='gptq'");
    check_dim(*g_idx, 1, op, "g_idx", "[K] (the group of each input feature)");
    check_dtype_in(*g_idx, {at::kInt, at::kLong}, op, "g_idx");
    check_same_device(*g_idx, qweight, op, "g_idx", "qweight");
    FI_CHECK(g_idx->sym_size(0) == s.k, op, "g_idx must have K = ", s.k, " entries, got ", shape_str(*g_idx));
  }
  return s;
}

// a [M, K], packed [K / 64, 8 N], scales [K / G, N] (dtype of a), zeros uint8 [K / G, N] or None,
// perm [K] int32/int64 or None (act-order: a's columns are gathered a[:, perm] first).
inline void validate_int4_gemm(const char* op, const at::Tensor& a, const at::Tensor& packed, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t group_size,
                               const std::optional<at::Tensor>& perm, bool allow_fp32) {
  check_dim(a, 2, op, "a", "[M, K]");
  if (allow_fp32)
    check_dtype_in(a, {at::kHalf, at::kBFloat16, at::kFloat}, op, "a");
  else
    check_dtype_in(a, {at::kHalf, at::kBFloat16}, op, "a");
  check_dim(packed, 2, op, "packed", "[K / 64, 8 * N] int32 (from int4_pack / int4_repack)");
  check_dtype_in(packed, {at::kInt}, op, "packed");
  check_same_device(packed, a, op, "packed", "a");
  const auto k = a.sym_size(1);
  FI_CHECK(packed.sym_size(1) % (8 * kInt4MinN) == 0, op,
           "packed must have shape [K / 64, 8 * N] with N a multiple of 16 (the int4 kernel's minimum tile is 16 "
           "columns x 64 k), got ", shape_str(packed));
  const auto n = packed.sym_size(1) / 8;
  check_int4_nk(op, n, k, "a / packed");
  FI_CHECK(packed.sym_size(0) * kInt4MinK == k, op, "packed must have shape [K / 64, 8 * N] = [", k / kInt4MinK,
           ", ", n * 8, "] for K = ", k, " (a.size(1)), got ", shape_str(packed));
  check_int4_group_size(op, group_size, k);
  check_dim(scales, 2, op, "scales", "[K / group_size, N]");
  check_same_dtype(scales, a, op, "scales", "a");
  check_same_device(scales, a, op, "scales", "a");
  FI_CHECK(scales.sym_size(0) == k / group_size && scales.sym_size(1) == n, op, "scales must have shape [K / group_size, N] = [",
           k / group_size, ", ", n, "], got ", shape_str(scales));
  if (zeros.has_value()) {
    check_dim(*zeros, 2, op, "zeros", "[K / group_size, N] uint8 (0..15), or None for symmetric weights");
    check_dtype_in(*zeros, {at::kByte}, op, "zeros");
    check_same_device(*zeros, a, op, "zeros", "a");
    FI_CHECK(zeros->sym_size(0) == k / group_size && zeros->sym_size(1) == n, op,
             "zeros must have shape [K / group_size, N] = [", k / group_size, ", ", n, "], got ", shape_str(*zeros));
  }
  if (perm.has_value()) {
    check_dim(*perm, 1, op, "perm", "[K] (the act-order permutation returned by int4_repack)");
    check_dtype_in(*perm, {at::kInt, at::kLong}, op, "perm");
    check_same_device(*perm, a, op, "perm", "a");
    FI_CHECK(perm->sym_size(0) == k, op, "perm must have K = ", k, " entries, got ", shape_str(*perm));
  }
}

inline void check_int4_gemm_layout(const char* op, const at::Tensor& a, const at::Tensor& packed,
                                   const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                                   const std::optional<at::Tensor>& perm) {
  check_contiguous(a, op, "a");
  check_contiguous(packed, op, "packed");
  check_contiguous(scales, op, "scales");
  if (zeros.has_value()) check_contiguous(*zeros, op, "zeros");
  if (perm.has_value()) check_contiguous(*perm, op, "perm");
}

// Values of zeros (0..15) and perm (a permutation range) checked on the host for CPU tensors or
// with FASTINFER_CHECK_INDICES=1 (no device sync otherwise).
inline void check_int4_gemm_values(const char* op, const at::Tensor& a, const std::optional<at::Tensor>& zeros,
                                   const std::optional<at::Tensor>& perm) {
  if (zeros.has_value()) check_index_range(*zeros, 0, 16, op, "zeros", "4-bit zero points");
  if (perm.has_value()) check_index_range(*perm, 0, a.size(1), op, "perm", "indices into a's K columns");
}

// ---- layout conversions (ATen ops: any device) --------------------------------------------------

// Bit pattern of int64 words < 2^32 as int32.
inline at::Tensor int64_to_int32_bits(const at::Tensor& x) {
  return at::where(x >= (int64_t{1} << 31), x - (int64_t{1} << 32), x).to(at::kInt);
}

// Elements of the int64 temporaries of one conversion step (bounds the memory of a layout
// conversion of a large layer to ~0.5 GB on top of its input and output).
inline constexpr int64_t kInt4ConvertChunkElems = int64_t{64} << 20;

// w_q [N, K] (0..15, any integer dtype) -> packed int32 [K / 64, 8 N] (gemm/int4.h): nibble
// i = 4 e + 2 h + kh of word (kt, nt, lane = 4 g + t, j) holds W[16 nt + 8 h + g][64 kt + 16 j + 8 kh + 2 t + e].
// Converted in chunks of K.
inline at::Tensor int4_pack_impl(const at::Tensor& w_q) {
  const int64_t n = w_q.size(0), k = w_q.size(1);
  auto packed = at::empty({k / 64, 8 * n}, w_q.options().dtype(at::kInt));
  const int64_t chunk = std::max<int64_t>(64, kInt4ConvertChunkElems / std::max<int64_t>(n, 1) / 64 * 64);
  const auto shifts = at::arange(0, 32, 4, w_q.options().dtype(at::kLong));
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t kc = std::min(chunk, k - k0);
    auto x = w_q.narrow(1, k0, kc).to(at::kLong).bitwise_and(15).reshape({n / 16, 2, 8, kc / 64, 4, 2, 4, 2});
    //                                                                  nt   h  g  kt     j  kh t  e
    x = x.permute({3, 0, 2, 6, 4, 7, 1, 5}).reshape({kc / 64, 8 * n, 8});  // kt, nt, g, t, j | e, h, kh
    packed.narrow(0, k0 / 64, kc / 64).copy_(int64_to_int32_bits(x.bitwise_left_shift(shifts).sum(-1)));
  }
  return packed;
}

// Nibble i of each int32 word, as int64 [..., 8].
inline at::Tensor unpack_nibbles(const at::Tensor& words) {
  auto shifts = at::arange(0, 32, 4, words.options().dtype(at::kLong));
  return words.to(at::kLong).unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(15);
}

// (packed, zeros uint8 [K / G, N], perm int64 [K] or [0]).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_repack_impl(const char* op, const at::Tensor& qweight,
                                                                       const at::Tensor& qzeros, c10::string_view fmt,
                                                                       const std::optional<at::Tensor>& g_idx) {
  const bool awq = fmt == "awq";
  const int64_t n = awq ? qweight.size(1) * 8 : qweight.size(1);
  const int64_t k = awq ? qweight.size(0) : qweight.size(0) * 8;
  const int64_t groups = qzeros.size(0);
  // AutoAWQ GEMM packs nibble i of word [k, j] with column 8 j + pack[i], pack = 0 2 4 6 1 3 5 7
  // (awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: order_map), so column c is nibble
  // unpack[c], unpack = 0 4 1 5 2 6 3 7 (awq/utils/packing_utils.py: AWQ_REVERSE_ORDER, used by
  // reverse_awq_order / dequantize_gemm). The same for qzeros.
  const auto unpack = at::tensor(std::vector<int64_t>{0, 4, 1, 5, 2, 6, 3, 7}, qweight.options().dtype(at::kLong));
  // q_kn uint8 [K, N], unpacked in chunks of qweight rows.
  auto q_kn = at::empty({k, n}, qweight.options().dtype(at::kByte));
  const int64_t rows = qweight.size(0);
  const int64_t chunk = std::max<int64_t>(1, kInt4ConvertChunkElems / std::max<int64_t>(8 * qweight.size(1), 1));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const int64_t rc = std::min(chunk, rows - r0);
    const auto nib = unpack_nibbles(qweight.narrow(0, r0, rc));  // [rc, cols, 8]
    if (awq)  // rows are k; nibbles (permuted by unpack) are 8 consecutive columns
      q_kn.narrow(0, r0, rc).copy_(nib.index_select(-1, unpack).reshape({rc, n}));
    else  // nibble i of word (j, n) holds row 8 j + i (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py: pack)
      q_kn.narrow(0, 8 * r0, 8 * rc).copy_(nib.permute({0, 2, 1}).reshape({8 * rc, n}));
  }
  // Zero points: AWQ as stored (interleaved like qweight); GPTQ v1 plain order, stored as zero - 1.
  const auto z = awq ? unpack_nibbles(qzeros).index_select(-1, unpack).reshape({groups, n})
                     : unpack_nibbles(qzeros).reshape({groups, n}).add(1).bitwise_and(15);
  at::Tensor perm = at::empty({0}, qweight.options().dtype(at::kLong));
  if (g_idx.has_value()) {
    const int64_t group_size = k / groups;
    const auto gi = g_idx->to(at::kLong);
    perm = std::get<1>(gi.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
    // Each group must have exactly group_size members (then sorting makes groups contiguous).
    const auto expect = at::arange(k, gi.options()).div(group_size, "floor");
    FI_CHECK(at::equal(gi.index_select(0, perm), expect), op,
             "g_idx must assign exactly group_size = K / qzeros.size(0) = ", group_size,
             " input features to each group 0..", groups - 1, " (GPTQ act-order)");
    q_kn = q_kn.index_select(0, perm);
  }
  return {int4_pack_impl(q_kn.t().contiguous()), z.to(at::kByte).contiguous(), perm};
}

// ---- Meta (fake) kernels, registered in registration.cpp ----------------------------------------

inline at::Tensor int4_pack_meta(const at::Tensor& w_q) {
  validate_int4_pack("int4_pack", w_q);
  return at::empty_symint(int4_packed_shape(w_q.sym_size(0), w_q.sym_size(1)), w_q.options().dtype(at::kInt));
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_repack_meta(const at::Tensor& qweight,
                                                                       const at::Tensor& qzeros, c10::string_view fmt,
                                                                       const std::optional<at::Tensor>& g_idx) {
  const auto s = validate_int4_repack("int4_repack", qweight, qzeros, fmt, g_idx);
  auto packed = at::empty_symint(int4_packed_shape(s.n, s.k), qweight.options().dtype(at::kInt));
  auto zeros = at::empty_symint({s.groups, s.n}, qweight.options().dtype(at::kByte));
  auto perm = g_idx.has_value() ? at::empty_symint({s.k}, qweight.options().dtype(at::kLong))
                                : at::empty({0}, qweight.options().dtype(at::kLong));
  return {packed, zeros, perm};
}

inline at::Tensor int4_gemm_meta(const at::Tensor& a, const at::Tensor& packed, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& zeros, int64_t group_size,
                                 const std::optional<at::Tensor>& perm, bool deterministic) {
  validate_int4_gemm("int4_gemm", a, packed, scales, zeros, group_size, perm, /*allow_fp32=*/true);
  return at::empty_symint({a.sym_size(0), packed.sym_size(1) / 8}, a.options());
}

}  // namespace fastinfer::binding
