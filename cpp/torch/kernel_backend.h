#pragma once
// The backend of the CUDA implementations, shared by every family's kernel.cpp. Built twice:
//   FASTINFER_KERNEL_BACKEND_CUDA: fastinfer._C, CUDA tensors, the current CUDA stream;
//   FASTINFER_KERNEL_BACKEND_SIMT: fastinfer._sim, CPU tensors, the kernels run in cpp/simt.
#include "fastinfer/fastinfer.h"
#include "common.h"

#if defined(FASTINFER_KERNEL_BACKEND_CUDA)
#include <nvtx3/nvToolsExt.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // aoti_torch_get_current_cuda_stream (USE_CUDA)
#include <torch/csrc/stable/accelerator.h>
#define FASTINFER_KERNEL_KEY CUDA
#elif defined(FASTINFER_KERNEL_BACKEND_SIMT)
#define FASTINFER_KERNEL_KEY CPU
#else
#error "define FASTINFER_KERNEL_BACKEND_CUDA or FASTINFER_KERNEL_BACKEND_SIMT"
#endif

namespace fastinfer::binding {

#if defined(FASTINFER_KERNEL_BACKEND_CUDA)
inline constexpr const char* kKernelDevice = "a CUDA tensor";
inline bool on_kernel_device(const Tensor& t) { return t.is_cuda(); }

inline cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// Device guard + current stream of the op's first tensor, and an NVTX range named after the op
// when FASTINFER_NVTX=1 (one cached getenv otherwise: free when off).
class KernelScope {
 public:
  KernelScope(const char* op, const Tensor& anchor)
      : guard_(anchor.get_device_index()), stream_(current_stream(anchor.get_device_index())) {
    if (nvtx_enabled()) nvtxRangePushA(op);
  }
  ~KernelScope() {
    if (nvtx_enabled()) nvtxRangePop();
  }
  cudaStream_t stream() const { return stream_; }

 private:
  static bool nvtx_enabled() {
    static const bool on = [] {
      const char* v = std::getenv("FASTINFER_NVTX");
      return v != nullptr && std::string(v) == "1";
    }();
    return on;
  }
  torch::stable::accelerator::DeviceGuard guard_;
  cudaStream_t stream_;
};
#else
inline constexpr const char* kKernelDevice = "a CPU tensor (the sim namespace runs the CUDA kernels on the CPU)";
inline bool on_kernel_device(const Tensor& t) { return t.is_cpu(); }

class KernelScope {
 public:
  KernelScope(const char*, const Tensor&) {}
  cudaStream_t stream() const { return nullptr; }
};
#endif

inline void check_device(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(on_kernel_device(t), op, name, " must be ", kKernelDevice, ", got ", t.device());
}

// The kernels read operands with 16-byte loads (vectors, cp.async): a view at an odd offset fails.
inline void check_aligned16(const Tensor& t, const char* op, const char* name) {
  FI_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, name,
           " must start 16-byte aligned (the kernels use 16-byte loads; call .contiguous() or .clone())");
}

inline void check_launch(cudaError_t err, const char* op) {
  FI_CHECK(err == cudaSuccess, op, "kernel failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

// The description of the tensor's device (launch_plan.h: SM count, compute capability; 132 SMs under
// simt), queried once per device; empty when the query fails.
inline DeviceDescription device_description(const Tensor& anchor) {
  struct Entry {
    bool queried;
    DeviceDescription device;
  };
  static Entry cached[64] = {};
  const int dev = anchor.is_cuda() ? anchor.get_device_index() : 0;
  if (dev < 0 || dev >= 64) return {};
  if (!cached[dev].queried) {
    DeviceDescription d;
    if (query_device_description(dev, &d) != cudaSuccess) d = {};
    cached[dev] = {true, d};
  }
  return cached[dev].device;
}

// Multiprocessor count of the tensor's device, at least 1.
inline int32_t num_sms(const Tensor& anchor) {
  const int32_t n = device_description(anchor).num_sms;
  return n > 0 ? n : 1;
}

}  // namespace fastinfer::binding
