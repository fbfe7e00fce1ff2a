#pragma once
// Torch-free description of tensors crossing the C++ API: element types and index types.
#include <cstdint>

namespace fastinfer {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,  // OCP e4m3 "fn" (no infinities; max finite 448)
};

enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "unknown";
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

}  // namespace fastinfer
