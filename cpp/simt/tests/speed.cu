// Fiber switch throughput of the emulator (barrier-heavy kernel); prints switches per second.
#include <chrono>

#include "common.cuh"

__global__ void barrier_loop(int iters, int* out) {
  int s = 0;
  for (int i = 0; i < iters; ++i) {
    s += i ^ (int)threadIdx.x;
    __syncthreads();
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void shuffle_loop(int iters, int* out) {
  int v = threadIdx.x;
  for (int i = 0; i < iters; ++i) v += __shfl_xor_sync(0xffffffffu, v, i & 31);
  out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 500;
  int* out = dalloc<int>(8 * 256);
  for (int k = 0; k < 2; ++k) {
    auto s0 = fastinfer::simt::stats();
    auto t0 = std::chrono::steady_clock::now();
    if (k == 0) CHECK_CUDA(fastinfer::launch_kernel(barrier_loop, dim3(8), dim3(256), 0, nullptr, iters, out));
    else CHECK_CUDA(fastinfer::launch_kernel(shuffle_loop, dim3(8), dim3(256), 0, nullptr, iters, out));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto s1 = fastinfer::simt::stats();
    const double n = (double)(s1.switches - s0.switches);
    std::printf("%s: %.0f switches in %.3f s = %.1f M switches/s\n", k == 0 ? "barrier" : "shuffle", n, dt, n / dt / 1e6);
  }
  return 0;
}
