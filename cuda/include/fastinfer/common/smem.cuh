// Dynamic shared memory: the ONLY way kernels obtain it.
// Under FASTINFER_SIMT the buffer is 16-byte aligned, filled with 0xFF at the start of every block
// and followed by guard bytes checked at each __syncthreads and at block end (overflow = fault).
#pragma once

#include "fastinfer/common/platform.cuh"

namespace fastinfer {

template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
#if defined(FASTINFER_SIMT)
  return reinterpret_cast<T*>(::fastinfer::simt::detail::cur()->dyn_smem);
#else
  extern __shared__ __align__(16) unsigned char fastinfer_dynamic_smem_[];
  return reinterpret_cast<T*>(fastinfer_dynamic_smem_);
#endif
}

}  // namespace fastinfer
