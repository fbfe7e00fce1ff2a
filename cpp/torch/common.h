#pragma once
// Shared by every binding file: the LibTorch stable ABI types, argument checks with messages that
// name the argument and say how to fix the call, dtype mapping to the torch-free API, tensor
// allocation, and op registration.
//
// The bindings use only the stable ABI (torch/csrc/stable, torch/headeronly) at the version
// TORCH_TARGET_VERSION (CMakeLists.txt), so one build loads under every torch from that version
// on. What the stable surface lacks is written here or in the files that need it (docs/cpp.md,
// "The stable ABI"): shapes are checked on real tensors only (the fake impls are Python, next to
// each op's wrapper: python/fastinfer/ops/_fake.py), tensor arithmetic is plain loops, and ATen ops without a stable
// wrapper are called by name through the dispatcher (aten_call below).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Float8_e4m3fn.h>
#include <torch/headeronly/util/Half.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "fastinfer/common/types.h"

#define FASTINFER_STR2(x) #x
#define FASTINFER_STR(x) FASTINFER_STR2(x)
#define FASTINFER_CAT2(a, b) a##b
#define FASTINFER_CAT(a, b) FASTINFER_CAT2(a, b)

namespace fastinfer::binding {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;
using Float8_e4m3fn = torch::headeronly::Float8_e4m3fn;
using Shape = std::vector<int64_t>;

inline constexpr ScalarType kFloat = ScalarType::Float;
inline constexpr ScalarType kHalf = ScalarType::Half;
inline constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
inline constexpr ScalarType kFloat8_e4m3fn = ScalarType::Float8_e4m3fn;
inline constexpr ScalarType kInt = ScalarType::Int;
inline constexpr ScalarType kLong = ScalarType::Long;
inline constexpr ScalarType kByte = ScalarType::Byte;
inline constexpr ScalarType kChar = ScalarType::Char;
inline constexpr ScalarType kBool = ScalarType::Bool;

// The op namespace of the module this code is linked into: fastinfer (fastinfer._C), or
// fastinfer_sim / fastinfer_simprof (one compile of the sim bindings linked into both sim modules),
// defined by the module.cpp it is linked with.
const char* library_namespace();

// ---- messages ----
inline Shape shape_of(const Tensor& t) {
  const auto s = t.sizes();
  return Shape(s.begin(), s.end());
}
inline Shape strides_of(const Tensor& t) {
  const auto s = t.strides();
  return Shape(s.begin(), s.end());
}

inline void put(std::ostringstream& s, ScalarType t) { s << torch::headeronly::toString(t); }
inline void put(std::ostringstream& s, const Shape& v) {
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
}
inline void put(std::ostringstream& s, const Device& d) {
  using torch::headeronly::DeviceType;
  switch (d.type()) {
    case DeviceType::CPU: s << "cpu"; break;
    case DeviceType::CUDA: s << "cuda:" << static_cast<int>(d.index()); break;
    case DeviceType::Meta: s << "meta"; break;
    default: s << "device type " << static_cast<int>(d.type()) << ":" << static_cast<int>(d.index());
  }
}
inline void put(std::ostringstream& s, bool b) { s << (b ? "True" : "False"); }
template <typename T>
void put(std::ostringstream& s, const T& v) {
  s << v;
}

template <typename... A>
std::string str(const A&... parts) {
  std::ostringstream s;
  (put(s, parts), ...);
  return s.str();
}

// "fastinfer.rms_norm: " (or "fastinfer_sim.rms_norm: ") prefixed to every message; raised in
// Python as RuntimeError.
template <typename... A>
[[noreturn]] void fail(const char* op, const A&... parts) {
  throw std::runtime_error(str(library_namespace(), ".", op, ": ", parts...));
}
#define FI_CHECK(cond, op, ...)                                  \
  do {                                                           \
    if (!(cond)) ::fastinfer::binding::fail((op), __VA_ARGS__); \
  } while (0)

inline std::string shape_str(const Tensor& t) { return str(shape_of(t)); }

// ---- dtypes ----
inline bool is_half_dtype(ScalarType t) { return t == kHalf || t == kBFloat16; }

inline DType to_dtype(ScalarType t) {
  switch (t) {
    case kFloat: return DType::kFloat32;
    case kHalf: return DType::kFloat16;
    case kBFloat16: return DType::kBFloat16;
    case kFloat8_e4m3fn: return DType::kFloat8E4M3;
    default: throw std::runtime_error(str("fastinfer: unsupported dtype ", t));
  }
}

inline IndexType to_index_type(ScalarType t) { return t == kInt ? IndexType::kInt32 : IndexType::kInt64; }

// A switch over the activation dtypes of the contract (float32, float16, bfloat16; _FLOAT_TYPES:
// float64 too), the body a lambda that sees the element type as scalar_t.
#define FASTINFER_DISPATCH_CASE_(ST, T, ...) \
  case ST: {                                 \
    using scalar_t = T;                      \
    return __VA_ARGS__();                    \
  }
#define FASTINFER_DISPATCH_ACT_TYPES(TYPE, NAME, ...)                                                      \
  [&] {                                                                                                    \
    switch (TYPE) {                                                                                        \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kFloat, float, __VA_ARGS__)                          \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kHalf, ::fastinfer::binding::Half, __VA_ARGS__)      \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kBFloat16, ::fastinfer::binding::BFloat16, __VA_ARGS__) \
      default: throw std::runtime_error(::fastinfer::binding::str(NAME, ": unsupported dtype ", TYPE));   \
    }                                                                                                      \
  }()
#define FASTINFER_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                                                    \
  [&] {                                                                                                    \
    switch (TYPE) {                                                                                        \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kFloat, float, __VA_ARGS__)                          \
      FASTINFER_DISPATCH_CASE_(torch::headeronly::ScalarType::Double, double, __VA_ARGS__)                \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kHalf, ::fastinfer::binding::Half, __VA_ARGS__)      \
      FASTINFER_DISPATCH_CASE_(::fastinfer::binding::kBFloat16, ::fastinfer::binding::BFloat16, __VA_ARGS__) \
      default: throw std::runtime_error(::fastinfer::binding::str(NAME, ": unsupported dtype ", TYPE));   \
    }                                                                                                      \
  }()

// ---- allocation (on the device of `like`) ----
inline Tensor empty_on(const Tensor& like, const Shape& shape, std::optional<ScalarType> dtype = std::nullopt) {
  return torch::stable::new_empty(like, shape, dtype);
}
inline Tensor zeros_on(const Tensor& like, const Shape& shape, std::optional<ScalarType> dtype = std::nullopt) {
  return torch::stable::new_zeros(like, shape, dtype);
}
inline Tensor full_on(const Tensor& like, const Shape& shape, double value, ScalarType dtype) {
  return torch::stable::full(shape, value, dtype, std::nullopt, like.device());
}
inline Tensor empty_as(const Tensor& t) { return empty_on(t, shape_of(t)); }
inline Tensor cpu_empty(const Shape& shape, ScalarType dtype) {
  return torch::stable::empty(shape, dtype, std::nullopt, Device(torch::headeronly::DeviceType::CPU));
}
// A copy on the CPU in `dtype`, contiguous (a no-op view when it already is one).
inline Tensor to_cpu(const Tensor& t, ScalarType dtype) {
  return torch::stable::contiguous(torch::stable::to(t, dtype, std::nullopt, Device(torch::headeronly::DeviceType::CPU)));
}
inline Tensor to_dtype_of(const Tensor& t, ScalarType dtype) { return torch::stable::to(t, dtype); }
// t in `dtype` (same device), contiguous; t itself when it already is both.
inline Tensor contiguous_as(const Tensor& t, ScalarType dtype) {
  return torch::stable::contiguous(t.scalar_type() == dtype ? t : torch::stable::to(t, dtype));
}

// t.narrow(dim, start, length) (a view; torch::stable::narrow takes a non-const tensor).
inline Tensor slice(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  Tensor view = t;
  return torch::stable::narrow(view, dim, start, length);
}

// a [M, K] @ b[N, K]^T through ATen's matmul (BLAS on the CPU, cuBLAS on a GPU).
inline Tensor matmul_nt(const Tensor& a, const Tensor& b) {
  return torch::stable::matmul(a, torch::stable::transpose(b, 0, 1));
}

// acc [M, N] float32 contiguous += bias [N] (any float dtype, converted to fp32 first).
inline void add_bias_f32(Tensor& acc, const Tensor& bias) {
  const auto b = to_cpu(bias, kFloat);
  const int64_t N = acc.size(1), M = acc.size(0);
  const float* bp = b.const_data_ptr<float>();
  float* o = acc.mutable_data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) o[m * N + n] += bp[n];
}

// An ATen op without a stable wrapper, called by name through the dispatcher (arguments of the
// types the stable ABI converts: tensors, int64_t, double, bool, ScalarType, optionals, int
// lists); returns its first `N` outputs, which must be tensors.
template <size_t N = 1, typename... A>
std::array<Tensor, N> aten_call(const char* name, const char* overload, const A&... args) {
  constexpr size_t n = sizeof...(A) > N ? sizeof...(A) : N;
  std::array<StableIValue, n> stack{};
  size_t i = 0;
  ((stack[i++] = torch::stable::detail::from(args)), ...);
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  std::array<Tensor, N> out;
  for (size_t k = 0; k < N; ++k) out[k] = torch::stable::detail::to<Tensor>(stack[k]);
  return out;
}

// ---- argument checks ----
inline void check_dim(const Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  FI_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D ", layout, ", got shape ", shape_str(t));
}

inline void check_dtype_in(const Tensor& t, std::initializer_list<ScalarType> allowed, const char* op,
                           const char* name) {
  bool ok = false;
  for (auto a : allowed) ok = ok || t.scalar_type() == a;
  if (!ok) {
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(torch::headeronly::toString(a));
    fail(op, name, " must have dtype in {", list, "}, got ", t.scalar_type());
  }
}

inline void check_same_dtype(const Tensor& t, const Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  FI_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " must have the dtype of ", ref_name, " (",
           ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_same_device(const Tensor& t, const Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  FI_CHECK(t.device() == ref.device(), op, name, " must be on the device of ", ref_name, " (", ref.device(),
           "), got ", t.device());
}

inline void check_on_cpu(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.is_cpu(), op, name, " must be a CPU tensor for this implementation, got ", t.device());
}

inline void check_contiguous(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.is_contiguous(), op, name, " must be contiguous (call .contiguous() first), got strides ",
           strides_of(t), " for shape ", shape_of(t));
}

// The distance in elements between the rows of t [..., W] when its last dim is contiguous and its
// leading dims are evenly spaced rows at least W apart (a contiguous tensor: W; a column slice of a
// wider buffer, such as a view into a fused qkv or gate/up output: the buffer's row); -1 otherwise.
inline int64_t row_stride_of(const Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0) return 1;
  const int64_t w = t.size(nd - 1);
  if (t.numel() == 0) return w;  // nothing is read: any strides
  if (w > 1 && t.stride(nd - 1) != 1) return -1;
  int64_t row = -1, next = 0;  // next: the stride an outer dim must have to continue the rows
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (row < 0) {
      row = t.stride(d);
      if (row < w) return -1;
    } else if (t.stride(d) != next) {
      return -1;
    }
    next = t.stride(d) * t.size(d);
  }
  return row < 0 ? w : row;
}

// Rows as row_stride_of describes them, or an error naming the argument; returns the row stride.
inline int64_t check_rows(const Tensor& t, const char* op, const char* name) {
  const int64_t stride = row_stride_of(t);
  FI_CHECK(stride >= 0, op, name,
           " must have a contiguous last dim and evenly spaced rows (any row stride >= the last dim, as a "
           "column slice of a wider buffer), got strides ", strides_of(t), " for shape ", shape_of(t));
  return stride;
}

// [T, H, D] tensors whose heads are packed (stride(-1) == 1, stride(-2) == D) but whose token
// stride is free: views into a fused qkv projection output are accepted without a copy.
inline void check_packed_heads(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)), op, name,
           " must have contiguous heads (stride(-1) == 1 and stride(-2) == head_dim; any token stride), got "
           "strides ",
           strides_of(t), " for shape ", shape_of(t));
}

inline void check_activation_dtype(const Tensor& t, bool allow_fp32, const char* op, const char* name) {
  if (allow_fp32)
    check_dtype_in(t, {kHalf, kBFloat16, kFloat}, op, name);
  else
    check_dtype_in(t, {kHalf, kBFloat16}, op, name);
}

inline void validate_same_shape(const char* op, const Tensor& t, const char* name, const Tensor& ref,
                                const char* ref_name) {
  FI_CHECK(shape_of(t) == shape_of(ref), op, name, " must have the shape of ", ref_name, " ",
               shape_str(ref), ", got ", shape_str(t));
}

// Same shape, dtype and device as ref (an out= buffer, the residual stream).
inline void validate_like(const char* op, const Tensor& t, const char* name, const Tensor& ref,
                          const char* ref_name) {
  validate_same_shape(op, t, name, ref, ref_name);
  check_same_dtype(t, ref, op, name, ref_name);
  check_same_device(t, ref, op, name, ref_name);
}

// A small integer tensor (any device, int32 or int64) as host values.
inline std::vector<int64_t> host_indices(const Tensor& t) {
  const auto c = to_cpu(t, kLong);
  const int64_t* p = c.const_data_ptr<int64_t>();
  return {p, p + c.numel()};
}

// The value of a 1-element float32 tensor (a per-layer scale), on any device.
inline float scalar_value(const Tensor& t) { return *to_cpu(t, kFloat).const_data_ptr<float>(); }

// Index tensors (positions, slots) are validated on the host when that costs no device sync (CPU
// tensors) or when the user asks for it with FASTINFER_CHECK_INDICES=1.
inline bool check_indices_enabled(const Tensor& t) {
  static const bool env = [] {
    const char* v = std::getenv("FASTINFER_CHECK_INDICES");
    return v != nullptr && std::string(v) != "0" && std::string(v) != "";
  }();
  return env || t.is_cpu();
}

inline void check_index_range(const Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name,
                              const char* what) {
  if (idx.numel() == 0 || !check_indices_enabled(idx)) return;
  const auto v = host_indices(idx);
  int64_t mn = v[0], mx = v[0];
  for (int64_t x : v) {
    mn = x < mn ? x : mn;
    mx = x > mx ? x : mx;
  }
  FI_CHECK(mn >= lo && mx < hi, op, name, " values must be in [", lo, ", ", hi, ") (", what, "), got min ", mn,
           " max ", mx);
}

// ---- registration ----
// STABLE_TORCH_LIBRARY pastes a literal namespace; the sim modules pick theirs at load time, so
// every module registers through the same init object with library_namespace().
using StableLibrary = torch::stable::detail::StableLibrary;
using StableLibraryInit = torch::stable::detail::StableTorchLibraryInit;

}  // namespace fastinfer::binding

#define FASTINFER_LIBRARY_(kind, key, m, uid)                                                             \
  static void FASTINFER_CAT(fastinfer_library_init_, uid)(::fastinfer::binding::StableLibrary&);         \
  static const ::fastinfer::binding::StableLibraryInit FASTINFER_CAT(fastinfer_library_static_init_, uid)( \
      ::fastinfer::binding::StableLibrary::Kind::kind, &FASTINFER_CAT(fastinfer_library_init_, uid),       \
      ::fastinfer::binding::library_namespace(), key, __FILE__, __LINE__);                                 \
  void FASTINFER_CAT(fastinfer_library_init_, uid)(::fastinfer::binding::StableLibrary & m)
// The op schemas (schema.cpp) and each backend's implementations (TORCH_BOX(&fn)).
#define FASTINFER_LIBRARY(m) FASTINFER_LIBRARY_(DEF, nullptr, m, __COUNTER__)
#define FASTINFER_LIBRARY_IMPL(key, m) FASTINFER_LIBRARY_(IMPL, FASTINFER_STR(key), m, __COUNTER__)
