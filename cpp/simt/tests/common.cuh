// Helpers shared by the simt self-test programs (checks: check.h, shared with tests/kernels).
#pragma once
#include <fastinfer/common/launch.cuh>

#include "check.h"

template <typename T>
T* dalloc(size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, n * sizeof(T) + 16));
  return static_cast<T*>(p);
}
