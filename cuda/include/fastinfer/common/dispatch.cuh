#pragma once
// Dispatch macros for launchers: map a runtime DType / IndexType / vector width to a template
// argument. An unsupported value makes the launcher return cudaErrorInvalidValue.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/types.h"

// Activation types the kernels are built for: fp16 and bf16 (fp32 lives in the CPU impls).
#define FASTINFER_DISPATCH_HALF(dtype, T, ...)                        \
  [&]() -> cudaError_t {                                              \
    switch (dtype) {                                                  \
      case ::fastinfer::DType::kFloat16: {                            \
        using T = __half;                                             \
        return __VA_ARGS__();                                         \
      }                                                               \
      case ::fastinfer::DType::kBFloat16: {                           \
        using T = __nv_bfloat16;                                      \
        return __VA_ARGS__();                                         \
      }                                                               \
      default:                                                        \
        return cudaErrorInvalidValue;                                 \
    }                                                                 \
  }()

#define FASTINFER_DISPATCH_INDEX(itype, I, ...)                       \
  [&]() -> cudaError_t {                                              \
    if ((itype) == ::fastinfer::IndexType::kInt32) {                  \
      using I = int32_t;                                              \
      return __VA_ARGS__();                                           \
    }                                                                 \
    using I = int64_t;                                                \
    return __VA_ARGS__();                                             \
  }()

// Vector width in elements: the 16-byte width when `vectorizable`, else 1.
#define FASTINFER_DISPATCH_VEC(vectorizable, T, VEC, ...)             \
  [&]() -> cudaError_t {                                              \
    if (vectorizable) {                                               \
      constexpr int VEC = 16 / sizeof(T);                             \
      return __VA_ARGS__();                                           \
    }                                                                 \
    constexpr int VEC = 1;                                            \
    return __VA_ARGS__();                                             \
  }()
