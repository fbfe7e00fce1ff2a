// The first header every fastinfer kernel header includes.
//  - nvcc:            CUDA runtime + fp16/bf16/fp8 headers.
//  - FASTINFER_SIMT:  the host emulator (cpp/simt), which defines the CUDA keywords and builtins
//                     and then includes the same CUDA headers for the types.
#pragma once

#if defined(FASTINFER_SIMT)
#include <fastinfer/simt/device.h>
#else
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

#include <cstddef>
#include <cstdint>

// Architecture the device code is compiled for (0 in host code under nvcc).
#if defined(FASTINFER_SIMT)
#define FASTINFER_ARCH FASTINFER_SIMT_ARCH
#elif defined(__CUDA_ARCH__)
#define FASTINFER_ARCH __CUDA_ARCH__
#else
#define FASTINFER_ARCH 0
#endif

// Device-side assertion: a kernel fault (cudaErrorAssert) in both builds; compiled out with NDEBUG
// on the GPU like assert().
#if defined(FASTINFER_SIMT)
#define FASTINFER_DEVICE_ASSERT(cond) \
  ((cond) ? (void)0 : ::fastinfer::simt::detail::assert_fail(#cond, __FILE__, __LINE__))
#else
#include <cassert>
#define FASTINFER_DEVICE_ASSERT(cond) assert(cond)
#endif
