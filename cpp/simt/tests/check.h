// The checking macros of every standalone test program: the simt self-tests (cpp/simt/tests) and
// the kernel test programs (tests/kernels). Host code only; builds with the simt runner and with
// nvcc. One program = one translation unit, so the failure counter is a plain static.
//
//   CHECK_CUDA(call)       a CUDA runtime call that must succeed: prints the error and exits 2
//   EXPECT(cond, fmt, ...) a check that may fail: counts the failure in g_failures and prints the
//                          first 30 ("FAIL file:line: message"); the program decides its exit code
#pragma once
#include <fastinfer/common/platform.cuh>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                                                     \
  do {                                                                                                    \
    cudaError_t e_ = (x);                                                                                 \
    if (e_ != cudaSuccess) {                                                                              \
      std::printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
      std::exit(2);                                                                                       \
    }                                                                                                     \
  } while (0)

static int g_failures = 0;
#define EXPECT(cond, ...)                                \
  do {                                                   \
    if (!(cond)) {                                       \
      if (g_failures++ < 30) {                           \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                        \
        std::printf("\n");                               \
      }                                                  \
    }                                                    \
  } while (0)
