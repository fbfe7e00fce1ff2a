// Some threads return before a __syncthreads: the launch must fail quickly with a barrier
// divergence message (exit code 1 and the message on stdout), never hang.
#include "common.cuh"

__global__ void early_exit(const int* n, float* out) {
  if ((int)threadIdx.x >= *n) return;  // BUG: threads leave before the barrier
  __shared__ float s[256];
  s[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % *n];
}

int main() {
  int* n = dalloc<int>(1);
  *n = 100;
  float* out = dalloc<float>(256);
  cudaError_t e = fastinfer::launch_kernel(early_exit, dim3(2), dim3(256), 0, nullptr, n, out);
  std::printf("launch: %s\n%s\n", cudaGetErrorName(e), cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
