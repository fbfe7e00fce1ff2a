// The only place that launches kernels (`<<<>>>`). Under FASTINFER_SIMT the launch is a
// synchronous emulation on the calling CPU thread; the result is returned as a cudaError_t.
#pragma once

#include "fastinfer/common/platform.cuh"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fastinfer {

template <typename... KArgs, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t dynamic_smem,
                                 cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "launch_kernel: wrong number of kernel arguments");
#if defined(FASTINFER_SIMT)
  // Arguments are converted to the kernel's parameter types once (as CUDA copies them into the
  // parameter buffer); every emulated thread then receives its own by-value copy.
  using Params = std::tuple<std::decay_t<KArgs>...>;
  Params params(std::forward<Args>(args)...);
  struct Ctx {
    void (*kernel)(KArgs...);
    Params* params;
  } ctx{kernel, &params};
  auto thunk = [](void* p) {
    Ctx* c = static_cast<Ctx*>(p);
    std::apply(c->kernel, *c->params);
  };
  return ::fastinfer::simt::detail::launch(reinterpret_cast<const void*>(kernel), grid, block, dynamic_smem, stream,
                                           +thunk, &ctx);
#else
  if (dynamic_smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(dynamic_smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, block, dynamic_smem, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
#endif
}

// cudaSuccess when the code the driver loaded for kKernel on the current device was compiled for
// sm_<min_arch> or newer; cudaErrorNotSupported when it is the trapping stub of an older target
// (FASTINFER_PTX's floor: a GPU newer than the architectures built JIT-compiles the sm_80 PTX).
// Checked once per kernel and device (cudaFuncGetAttributes is a driver call); the emulator runs
// every kernel.
template <auto kKernel>
inline cudaError_t require_kernel_arch(int min_arch) {
#if defined(FASTINFER_SIMT)
  (void)min_arch;
  return cudaSuccess;
#else
  constexpr int kMaxDevices = 64;
  static std::atomic<int8_t> usable[kMaxDevices] = {};  // 0 unknown, 1 yes, -1 no
  int dev = 0;
  if (cudaError_t err = cudaGetDevice(&dev); err != cudaSuccess) return err;
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  if (usable[dev].load(std::memory_order_relaxed) == 0) {
    cudaFuncAttributes attr{};
    if (cudaError_t err = cudaFuncGetAttributes(&attr, kKernel); err != cudaSuccess) return err;
    usable[dev].store(attr.ptxVersion >= min_arch && attr.binaryVersion >= min_arch ? 1 : -1,
                      std::memory_order_relaxed);
  }
  return usable[dev].load(std::memory_order_relaxed) > 0 ? cudaSuccess : cudaErrorNotSupported;
#endif
}

}  // namespace fastinfer
