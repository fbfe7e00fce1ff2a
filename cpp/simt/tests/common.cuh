// Helpers shared by the simt self-test programs.
#pragma once
#include <fastinfer/common/launch.cuh>

#include <cstdio>
#include <cstdlib>

#define SIMT_CHECK(x)                                                                                 \
  do {                                                                                                \
    cudaError_t e_ = (x);                                                                             \
    if (e_ != cudaSuccess) {                                                                          \
      std::printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

static int g_failures = 0;
#define EXPECT(cond, ...)                              \
  do {                                                 \
    if (!(cond)) {                                     \
      if (g_failures++ < 30) {                         \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                      \
        std::printf("\n");                             \
      }                                                \
    }                                                  \
  } while (0)

template <typename T>
T* dalloc(size_t n) {
  void* p = nullptr;
  SIMT_CHECK(cudaMalloc(&p, n * sizeof(T) + 16));
  return static_cast<T*>(p);
}
