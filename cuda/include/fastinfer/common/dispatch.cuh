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

// Attention head dim and GQA group chunk -> the kernels' compile-time D and G: the one pair of
// macros every attention launcher dispatches through. Head dims 64, 128 and 256 (a launcher whose
// kernels have fewer discards the others with `if constexpr`), group chunks 1, 2, 4 and 8.
#define FASTINFER_DISPATCH_HEAD_DIM(head_dim, D, ...)                 \
  [&]() -> cudaError_t {                                              \
    switch (head_dim) {                                               \
      case 64: {                                                      \
        constexpr int D = 64;                                         \
        return __VA_ARGS__();                                         \
      }                                                               \
      case 128: {                                                     \
        constexpr int D = 128;                                        \
        return __VA_ARGS__();                                         \
      }                                                               \
      case 256: {                                                     \
        constexpr int D = 256;                                        \
        return __VA_ARGS__();                                         \
      }                                                               \
      default:                                                        \
        return cudaErrorInvalidValue;                                 \
    }                                                                 \
  }()

#define FASTINFER_DISPATCH_GROUP(group_chunk, G, ...)                 \
  [&]() -> cudaError_t {                                              \
    switch (group_chunk) {                                            \
      case 1: {                                                       \
        constexpr int G = 1;                                          \
        return __VA_ARGS__();                                         \
      }                                                               \
      case 2: {                                                       \
        constexpr int G = 2;                                          \
        return __VA_ARGS__();                                         \
      }                                                               \
      case 4: {                                                       \
        constexpr int G = 4;                                          \
        return __VA_ARGS__();                                         \
      }                                                               \
      case 8: {                                                       \
        constexpr int G = 8;                                          \
        return __VA_ARGS__();                                         \
      }                                                               \
      default:                                                        \
        return cudaErrorInvalidValue;                                 \
    }                                                                 \
  }()
