#pragma once
// Shared by every binding file: argument checks with messages that name the argument and say
// how to fix the call, dtype mapping to the torch-free API, and the NVTX op scope.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "fastinfer/common/types.h"

#define FASTINFER_STR2(x) #x
#define FASTINFER_STR(x) FASTINFER_STR2(x)
#if defined(FASTINFER_RUNTIME_NS)
// One compile of the sim bindings (registration.cpp + kernel_*.cpp) is linked into two modules:
// fastinfer._sim (namespace fastinfer_sim) and fastinfer._simprof (fastinfer_simprof, the profile
// build of the kernels). The namespace is the module's: library_namespace() is defined by the
// module.cpp it is linked with. Same registration as TORCH_LIBRARY / TORCH_LIBRARY_IMPL.
#include <torch/library.h>
namespace fastinfer::binding {
const char* library_namespace();
}
#define FASTINFER_NS_STR ::fastinfer::binding::library_namespace()
#define FASTINFER_RT_LIBRARY_(kind, key, m, uid)                                                              \
  static void C10_CONCATENATE(fastinfer_library_init_, uid)(torch::Library&);                               \
  static const torch::detail::TorchLibraryInit C10_CONCATENATE(fastinfer_library_static_init_, uid)(          \
      kind, &C10_CONCATENATE(fastinfer_library_init_, uid), ::fastinfer::binding::library_namespace(), key,     \
      __FILE__, __LINE__);                                                                                   \
  void C10_CONCATENATE(fastinfer_library_init_, uid)(torch::Library & m)
#define FASTINFER_LIBRARY(ns, m) FASTINFER_RT_LIBRARY_(torch::Library::DEF, std::nullopt, m, C10_UID)
#define FASTINFER_LIBRARY_IMPL(ns, key, m) \
  FASTINFER_RT_LIBRARY_(torch::Library::IMPL, std::make_optional(c10::DispatchKey::key), m, C10_UID)
#else
#define FASTINFER_NS_STR FASTINFER_STR(FASTINFER_NS)
// TORCH_LIBRARY pastes its namespace argument: expand our macro first.
#define FASTINFER_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define FASTINFER_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#endif

namespace fastinfer::binding {

// "fastinfer.rms_norm: " (or "fastinfer_sim.rms_norm: ") prefixed to every message.
#define FI_CHECK(cond, op, ...) \
  TORCH_CHECK((cond), FASTINFER_NS_STR, ".", op, ": ", __VA_ARGS__)

inline bool is_half_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

inline DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat8_e4m3fn: return DType::kFloat8E4M3;
    default: TORCH_CHECK(false, "fastinfer: unsupported dtype ", t);
  }
}

inline IndexType to_index_type(at::ScalarType t) { return t == at::kInt ? IndexType::kInt32 : IndexType::kInt64; }

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sym_sizes()); }

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  FI_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D ", layout, ", got shape ", shape_str(t));
}

inline void check_dtype_in(const at::Tensor& t, std::initializer_list<at::ScalarType> allowed, const char* op,
                           const char* name) {
  bool ok = false;
  for (auto a : allowed) ok = ok || t.scalar_type() == a;
  if (!ok) {
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(c10::toString(a));
    FI_CHECK(false, op, name, " must have dtype in {", list, "}, got ", t.scalar_type());
  }
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  FI_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " must have the dtype of ", ref_name, " (",
           ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  FI_CHECK(t.device() == ref.device(), op, name, " must be on the device of ", ref_name, " (", ref.device(),
           "), got ", t.device());
}

inline void check_on_cpu(const at::Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor for this implementation, got ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.is_contiguous(), op, name, " must be contiguous (call .contiguous() first), got strides ",
           t.strides(), " for shape ", t.sizes());
}

// [T, H, D] tensors whose heads are packed (stride(-1) == 1, stride(-2) == D) but whose token
// stride is free: views into a fused qkv projection output are accepted without a copy.
inline void check_packed_heads(const at::Tensor& t, const char* op, const char* name) {
  FI_CHECK(t.stride(2) == 1 && (t.size(1) <= 1 || t.stride(1) == t.size(2)), op, name,
           " must have contiguous heads (stride(-1) == 1 and stride(-2) == head_dim; any token stride), got "
           "strides ",
           t.strides(), " for shape ", t.sizes());
}

// Index tensors (positions, slots) are validated on the host when that costs no device sync (CPU
// tensors) or when the user asks for it with FASTINFER_CHECK_INDICES=1.
inline bool check_indices_enabled(const at::Tensor& t) {
  static const bool env = [] {
    const char* v = std::getenv("FASTINFER_CHECK_INDICES");
    return v != nullptr && std::string(v) != "0" && std::string(v) != "";
  }();
  return env || t.device().is_cpu();
}

inline void check_index_range(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name,
                              const char* what) {
  if (idx.numel() == 0 || !check_indices_enabled(idx)) return;
  const int64_t mn = idx.min().item<int64_t>();
  const int64_t mx = idx.max().item<int64_t>();
  FI_CHECK(mn >= lo && mx < hi, op, name, " values must be in [", lo, ", ", hi, ") (", what, "), got min ", mn,
           " max ", mx);
}

}  // namespace fastinfer::binding
