// A kernel with a shared-memory race (a __syncthreads is missing between the write and the
// neighbour's read). Its output depends on the schedule: run it with two FASTINFER_SIMT_SEED
// values and the printed checksums differ. Always exits 0.
#include "common.cuh"

__global__ void racy(int* out) {
  __shared__ int buf[128];
  buf[threadIdx.x] = -1;
  __syncthreads();
  buf[threadIdx.x] = (int)(threadIdx.x * 3 + blockIdx.x);
  // missing __syncthreads() here
  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}

int main() {
  const int blocks = 4, threads = 128;
  int* out = dalloc<int>(blocks * threads);
  CHECK_CUDA(fastinfer::launch_kernel(racy, dim3(blocks), dim3(threads), 0, nullptr, out));
  CHECK_CUDA(cudaDeviceSynchronize());
  unsigned long long h = 1469598103934665603ull;
  int stale = 0;
  for (int i = 0; i < blocks * threads; ++i) {
    h = (h ^ (unsigned)out[i]) * 1099511628211ull;
    stale += out[i] == -1;
  }
  std::printf("race checksum %016llx stale %d\n", h, stale);
  return 0;
}
