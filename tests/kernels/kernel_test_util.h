// Host helpers shared by the standalone kernel test programs in tests/kernels (emulator or nvcc);
// the checking macros come from cpp/simt/tests/check.h, shared with the simt self-tests.
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../../cpp/simt/tests/check.h"  // CHECK_CUDA, EXPECT, g_failures

// Device buffer holding a host vector (plus 16 spare bytes so odd sizes stay in bounds).
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : n(count) {
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&ptr), count * sizeof(T) + 16));
    CHECK_CUDA(cudaMemset(ptr, 0, count * sizeof(T) + 16));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  void upload(const std::vector<T>& h) {
    CHECK_CUDA(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    CHECK_CUDA(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

inline float kt_to_float(float x) { return x; }
inline float kt_to_float(__half x) { return __half2float(x); }
inline float kt_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float kt_to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

template <typename T> inline T kt_from_float(float x);
template <> inline float kt_from_float<float>(float x) { return x; }
template <> inline __half kt_from_float<__half>(float x) { return __float2half_rn(x); }
template <> inline __nv_bfloat16 kt_from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> inline __nv_fp8_e4m3 kt_from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }

// FNV-1a over raw bytes: bit-identity across schedule seeds.
struct Checksum {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
};
