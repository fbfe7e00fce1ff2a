// fastinfer simt: the subset of the CUDA runtime API that standalone programs and the sim build use.
// Compiled with hidden visibility: the definitions link into a program or extension, but are not
// exported from a shared object (so they never interpose on a real libcudart in the same process).
#include <fastinfer/simt/device.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "internal.h"

struct CUstream_st {
  int dummy;
};
struct CUevent_st {
  double ms;
};

namespace fastinfer::simt::internal {
namespace {
thread_local cudaError_t tls_last_error = cudaSuccess;   // cudaGetLastError / cudaPeekAtLastError
thread_local cudaError_t tls_async_error = cudaSuccess;  // reported once by the synchronize calls
thread_local int tls_device = 0;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) tls_last_error = e;
  return e;
}
cudaError_t take_async() {
  cudaError_t e = tls_async_error;
  tls_async_error = cudaSuccess;
  return e;
}
}  // namespace

void record_async_error(cudaError_t e) {
  tls_async_error = e;
}

}  // namespace fastinfer::simt::internal

using namespace fastinfer::simt::internal;

extern "C" {

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (!devPtr) return set_error(cudaErrorInvalidValue);
  size_t n = (size + 255) / 256 * 256;
  if (n == 0) n = 256;
  void* p = aligned_alloc(256, n);
  if (!p) {
    *devPtr = nullptr;
    return set_error(cudaErrorMemoryAllocation);
  }
  std::memset(p, 0xFF, n);  // device memory is not zeroed: poison like uninitialized memory
  *devPtr = p;
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t) { return cudaMalloc(devPtr, size); }
cudaError_t cudaMallocHost(void** ptr, size_t size) { return cudaMalloc(ptr, size); }
cudaError_t cudaFree(void* devPtr) {
  free(devPtr);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t) { return cudaFree(devPtr); }
cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  if (free_bytes) *free_bytes = (size_t)64 << 30;
  if (total) *total = (size_t)141 << 30;
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind) {
  if (count && (!dst || !src)) return set_error(cudaErrorInvalidValue);
  if (count) std::memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, count, kind);
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  if (count && !devPtr) return set_error(cudaErrorInvalidValue);
  if (count) std::memset(devPtr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t) {
  return cudaMemset(devPtr, value, count);
}

cudaError_t cudaDeviceSynchronize(void) { return set_error(take_async()); }
cudaError_t cudaDeviceReset(void) {
  tls_last_error = cudaSuccess;
  tls_async_error = cudaSuccess;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  cudaError_t e = tls_last_error;
  tls_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return tls_last_error; }

#define FI_SIMT_ERRORS(X)                                                                   \
  X(cudaSuccess, "no error")                                                                \
  X(cudaErrorInvalidValue, "invalid argument")                                              \
  X(cudaErrorMemoryAllocation, "out of memory")                                             \
  X(cudaErrorInitializationError, "initialization error")                                   \
  X(cudaErrorInvalidConfiguration, "invalid configuration argument")                        \
  X(cudaErrorInvalidDevice, "invalid device ordinal")                                       \
  X(cudaErrorInvalidDevicePointer, "invalid device pointer")                                \
  X(cudaErrorInvalidMemcpyDirection, "invalid copy direction for memcpy")                   \
  X(cudaErrorInvalidDeviceFunction, "invalid device function")                              \
  X(cudaErrorLaunchFailure, "unspecified launch failure")                                   \
  X(cudaErrorLaunchOutOfResources, "too many resources requested for launch")               \
  X(cudaErrorLaunchTimeout, "the launch timed out and was terminated")                      \
  X(cudaErrorIllegalAddress, "an illegal memory access was encountered")                    \
  X(cudaErrorMisalignedAddress, "misaligned address")                                       \
  X(cudaErrorAssert, "device-side assert triggered")                                        \
  X(cudaErrorNotSupported, "operation not supported")                                       \
  X(cudaErrorNotReady, "device not ready")                                                  \
  X(cudaErrorInvalidResourceHandle, "invalid resource handle")                              \
  X(cudaErrorNoDevice, "no CUDA-capable device is detected")                                \
  X(cudaErrorUnknown, "unknown error")

const char* cudaGetErrorString(cudaError_t error) {
  if (const char* m = fault_message_for(error)) return m;
#define X(code, text) \
  case code:          \
    return text;
  switch (error) {
    FI_SIMT_ERRORS(X)
    default:
      return "unrecognized error code";
  }
#undef X
}
const char* cudaGetErrorName(cudaError_t error) {
#define X(code, text) \
  case code:          \
    return #code;
  switch (error) {
    FI_SIMT_ERRORS(X)
    default:
      return "cudaErrorUnknown";
  }
#undef X
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  if (!pStream) return set_error(cudaErrorInvalidValue);
  *pStream = new CUstream_st{0};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int) { return cudaStreamCreate(pStream); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return set_error(take_async()); }
cudaError_t cudaStreamQuery(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (!event) return set_error(cudaErrorInvalidValue);
  *event = new CUevent_st{0.0};
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) { return cudaEventCreate(event); }
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  if (!event) return set_error(cudaErrorInvalidResourceHandle);
  event->ms = now_ms();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return set_error(take_async()); }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!ms || !start || !end) return set_error(cudaErrorInvalidValue);
  *ms = (float)(end->ms - start->ms);
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return set_error(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  if (!device) return set_error(cudaErrorInvalidValue);
  *device = tls_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return set_error(cudaErrorInvalidDevice);
  tls_device = device;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  if (v) *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (v) *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (!value) return set_error(cudaErrorInvalidValue);
  if (device != 0) return set_error(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 232448; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 49152; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 233472; break;
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = 2048; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = 65536; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = 65536; break;
    case cudaDevAttrL2CacheSize: *value = 50331648; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = 6144; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = 32; break;
    default: *value = 0; break;
  }
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  if (!prop) return set_error(cudaErrorInvalidValue);
  if (device != 0) return set_error(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "fastinfer simt (emulated sm_90)");
  prop->totalGlobalMem = (size_t)141 << 30;
  prop->sharedMemPerBlock = 49152;
  prop->sharedMemPerBlockOptin = 232448;
  prop->sharedMemPerMultiprocessor = 233472;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->l2CacheSize = 50331648;
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void*, enum cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize && (value < 0 || value > 232448))
    return set_error(cudaErrorInvalidValue);
  return cudaSuccess;
}

}  // extern "C"
