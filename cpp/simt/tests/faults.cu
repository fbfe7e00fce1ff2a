// Every class of kernel fault the emulator detects; each launch must fail with the right error
// code and a message naming the kernel, and the next launch must work again. Exits 0 when all
// behave as expected.
#include <fastinfer/common/ptx.cuh>
#include <fastinfer/common/smem.cuh>

#include <cstring>

#include "common.cuh"

__global__ void shfl_missing_lane(int* out) {
  if (threadIdx.x % 32 >= 16) return;  // half the warp leaves
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void shfl_partial_warp(int* out) {  // launched with 48 threads: warp 1 has 16 lanes
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void shfl_vs_barrier(int* out) {
  if (threadIdx.x == 5) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
    __syncthreads();
  }
}
__global__ void different_barriers(int* out) {
  if (threadIdx.x < 32) {
    out[threadIdx.x] = 1;
    __syncthreads();
  } else {
    __syncthreads();
  }
}
__global__ void smem_overflow(int* out) {
  float* s = fastinfer::dynamic_smem<float>();
  s[threadIdx.x] = 1.f;  // launched with 64 threads but 128 bytes of dynamic smem
  __syncthreads();
  out[threadIdx.x] = (int)s[0];
}
__global__ void traps(int* out) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = 1;
}
__global__ void asserts(int* out) {
  FASTINFER_DEVICE_ASSERT(threadIdx.x != 7);
  out[threadIdx.x] = 1;
}
__global__ void ldmatrix_diverged(int* out) {
  __shared__ __align__(16) uint16_t s[256];
  uint32_t r[4];
  if (threadIdx.x == 31) return;
  fastinfer::ptx::ldmatrix_x4(r, s + 8 * threadIdx.x);
  out[threadIdx.x] = (int)r[0];
}
__global__ void fine(int* out) { out[threadIdx.x] = (int)threadIdx.x; }

static int check(const char* name, cudaError_t e, cudaError_t want, const char* needle, const char* kname) {
  const char* msg = cudaGetErrorString(e);
  const bool ok = e == want && std::strstr(msg, needle) != nullptr && std::strstr(msg, kname) != nullptr;
  std::printf("%-22s %-32s %s\n    %s\n", name, cudaGetErrorName(e), ok ? "ok" : "UNEXPECTED", msg);
  return ok ? 0 : 1;
}

int main() {
  int* out = dalloc<int>(1024);
  int bad = 0;
  using fastinfer::launch_kernel;
  bad += check("missing lane (exited)", launch_kernel(shfl_missing_lane, dim3(1), dim3(64), 0, nullptr, out),
               cudaErrorLaunchFailure, "lane", "shfl_missing_lane");
  bad += check("missing lane (partial)", launch_kernel(shfl_partial_warp, dim3(1), dim3(48), 0, nullptr, out),
               cudaErrorLaunchFailure, "does not exist", "shfl_partial_warp");
  bad += check("shfl vs barrier", launch_kernel(shfl_vs_barrier, dim3(1), dim3(32), 0, nullptr, out),
               cudaErrorLaunchFailure, "deadlock", "shfl_vs_barrier");
  bad += check("different barriers", launch_kernel(different_barriers, dim3(1), dim3(64), 0, nullptr, out),
               cudaErrorLaunchFailure, "barrier divergence", "different_barriers");
  bad += check("smem overflow", launch_kernel(smem_overflow, dim3(1), dim3(64), 128, nullptr, out),
               cudaErrorIllegalAddress, "overflow", "smem_overflow");
  bad += check("trap", launch_kernel(traps, dim3(2), dim3(32), 0, nullptr, out), cudaErrorLaunchFailure, "__trap",
               "traps");
  bad += check("assert", launch_kernel(asserts, dim3(1), dim3(32), 0, nullptr, out), cudaErrorAssert,
               "threadIdx.x != 7", "asserts");
  bad += check("ldmatrix missing lane", launch_kernel(ldmatrix_diverged, dim3(1), dim3(32), 0, nullptr, out),
               cudaErrorLaunchFailure, "ldmatrix", "ldmatrix_diverged");
  bad += check("block too large", launch_kernel(fine, dim3(1), dim3(2048), 0, nullptr, out),
               cudaErrorInvalidConfiguration, "invalid launch configuration", "fine");
  bad += check("block.z > 64", launch_kernel(fine, dim3(1), dim3(1, 1, 65), 0, nullptr, out),
               cudaErrorInvalidConfiguration, "invalid launch configuration", "fine");
  bad += check("zero grid", launch_kernel(fine, dim3(0), dim3(32), 0, nullptr, out), cudaErrorInvalidConfiguration,
               "invalid launch configuration", "fine");
  // the sticky-once error of the last fault is reported by cudaDeviceSynchronize, then cleared
  cudaError_t s1 = cudaDeviceSynchronize();
  cudaError_t s2 = cudaDeviceSynchronize();
  std::printf("synchronize after faults: %s then %s\n", cudaGetErrorName(s1), cudaGetErrorName(s2));
  bad += s2 != cudaSuccess;
  // recovery: a correct kernel still runs
  CHECK_CUDA(launch_kernel(fine, dim3(1), dim3(32), 0, nullptr, out));
  for (int i = 0; i < 32; ++i) bad += out[i] != i;
  std::printf("faults: %s\n", bad ? "FAIL" : "OK");
  return bad ? 1 : 0;
}
