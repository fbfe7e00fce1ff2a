// Known-answer kernels for the simt memory-access profiler (tests/test_simt_profile.py checks the
// counters of `python -m fastinfer.simt profile` on this program). One kernel per pattern, one
// warp-level access of each kind per loop iteration, so the expected counts per request are exact:
//
//   copy_f32          coalesced 4-byte loads / stores        4 sectors per request (ideal 4)
//   copy_16b          coalesced 16-byte loads / stores      16 sectors per request (ideal 16)
//   load_stride2      float loads with a stride of 2         8 sectors per request (ideal 4)
//   broadcast         every lane reads the same float        1 sector / 1 wavefront per request
//   transpose_naive   32x32 float tile, column read         32 wavefronts per request (32-way)
//   transpose_padded  the same tile padded to 33 columns     1 wavefront per request
//   shared_wide       float2 rows: 2 wavefronts (ideal 2); float4 rows: 4 (ideal 4);
//                     float4 at a 32-byte stride: 8 (ideal 4, 2-way within each quarter warp)
//   ldmatrix_tiles    ldmatrix.x4 of a 128-byte-row bf16 tile: unswizzled 32 wavefronts (8-way per
//                     matrix), XOR-swizzled 4 (ideal 4)
//   cp_async_copy     16-byte cp.async: 16 sectors (source), 4 wavefronts (destination) per request
//   atomics           all lanes atomicAdd one global word (1 sector) / one shared word (32 serialised)
//   mma_once          one mma.sync per warp (the tensor-FLOP count)
//
// Also runs (and checks results) without the profiler: `python -m fastinfer.simt run` this file.
#include "fastinfer/common/launch.cuh"
#include "fastinfer/common/ptx.cuh"
#include "fastinfer/common/smem.cuh"

#include <cstdio>
#include <cstring>
#include <vector>

#include "check.h"

using fastinfer::launch_kernel;

__global__ void copy_f32(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}

__global__ void copy_16b(const uint4* in, uint4* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i];
}

__global__ void load_stride2(const float* in, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[2 * i];
}

__global__ void broadcast(const float* in, float* out) {
  __shared__ float s[32];
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = s[0] + in[0];
}

__global__ void transpose_naive(const float* in, float* out) {
  __shared__ float tile[32][32];
  const int x = threadIdx.x, y = threadIdx.y;
  tile[y][x] = in[y * 32 + x];
  __syncthreads();
  out[y * 32 + x] = tile[x][y];
}

__global__ void transpose_padded(const float* in, float* out) {
  __shared__ float tile[32][33];
  const int x = threadIdx.x, y = threadIdx.y;
  tile[y][x] = in[y * 32 + x];
  __syncthreads();
  out[y * 32 + x] = tile[x][y];
}

__global__ void shared_wide(float* out) {
  float* s = fastinfer::dynamic_smem<float>();
  const int l = threadIdx.x;
  for (int i = l; i < 512; i += 32) s[i] = static_cast<float>(i);
  __syncthreads();
  const float2 a = reinterpret_cast<const float2*>(s)[l];          // 256 contiguous bytes
  const float4 b = reinterpret_cast<const float4*>(s)[l];          // 512 contiguous bytes
  const float4 c = reinterpret_cast<const float4*>(s)[2 * l];      // 16 bytes every 32
  out[l] = a.x + a.y + b.x + b.w + c.x + c.z;
}

// 64 rows x 64 bf16 (128-byte rows). Matrix m of the x4 load takes rows 8(m & 1) .. + 7 and the
// 16-byte chunk (m >> 1), the A-fragment pattern of the GEMM kernels.
__global__ void ldmatrix_tiles(uint32_t* out) {
  unsigned char* s = fastinfer::dynamic_smem<unsigned char>();
  const int l = threadIdx.x;
  for (int i = l; i < 64 * 128 / 4; i += 32) reinterpret_cast<uint32_t*>(s)[i] = static_cast<uint32_t>(i);
  __syncthreads();
  const int row = (l & 7) + 8 * ((l >> 3) & 1), chunk = l >> 4;
  uint32_t r[4], q[4];
  fastinfer::ptx::ldmatrix_x4(r, s + row * 128 + chunk * 16);                   // unswizzled
  fastinfer::ptx::ldmatrix_x4(q, s + row * 128 + ((chunk ^ (row & 7)) * 16));   // swizzled
  out[l] = r[0] + r[1] + r[2] + r[3] + q[0] + q[1] + q[2] + q[3];
}

__global__ void cp_async_copy(const uint4* in, uint4* out) {
  uint4* s = fastinfer::dynamic_smem<uint4>();
  const int l = threadIdx.x;
  fastinfer::ptx::cp_async_cg_16(s + l, in + l, true);
  fastinfer::ptx::cp_async_commit();
  fastinfer::ptx::cp_async_wait<0>();
  __syncwarp();
  out[l] = s[l];
}

__global__ void atomics(int* counter) {
  __shared__ int s_count;
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();
  atomicAdd(&s_count, 1);
  atomicAdd(counter, 1);
  __syncthreads();
  if (threadIdx.x == 0) counter[1] = s_count;
}

__global__ void mma_once(float* out) {
  uint32_t a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b[2] = {0x3f803f80u, 0x3f803f80u};
  float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
  fastinfer::ptx::mma_m16n8k16_bf16(d, a, b, c);
  out[threadIdx.x] = d[0];
}

// Blocks 1, 3, 5, 7 read and return before storing (the early exit of a work-item grid past its
// last item): blocks_storing = 4 of blocks_run = 8.
__global__ void early_exit(const float* in, float* out) {
  const float x = in[blockIdx.x * 32 + threadIdx.x];
  if (blockIdx.x % 2 == 1) return;
  out[blockIdx.x * 32 + threadIdx.x] = x;
}


template <typename T>
T* dalloc(size_t n) {
  void* p = nullptr;
  cudaMalloc(&p, n * sizeof(T));
  cudaMemset(p, 0, n * sizeof(T));
  return static_cast<T*>(p);
}

int main() {
  const int n = 4096;
  std::vector<float> h(2 * n);
  for (int i = 0; i < 2 * n; ++i) h[i] = static_cast<float>(i);
  float* in = dalloc<float>(2 * n);
  float* out = dalloc<float>(2 * n);
  cudaMemcpy(in, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice);

  EXPECT(launch_kernel(copy_f32, dim3(n / 128), dim3(128), 0, nullptr, in, out, n) == cudaSuccess, "copy_f32");
  EXPECT(launch_kernel(copy_16b, dim3(n / 4 / 128), dim3(128), 0, nullptr, reinterpret_cast<const uint4*>(in),
                       reinterpret_cast<uint4*>(out), n / 4) == cudaSuccess, "copy_16b");
  EXPECT(launch_kernel(load_stride2, dim3(n / 128), dim3(128), 0, nullptr, in, out, n) == cudaSuccess, "stride2");
  std::vector<float> r(n);
  cudaMemcpy(r.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT(r[5] == 10.f, "stride2 result %f", r[5]);

  EXPECT(launch_kernel(broadcast, dim3(1), dim3(32), 0, nullptr, in, out) == cudaSuccess, "broadcast");
  EXPECT(launch_kernel(transpose_naive, dim3(1), dim3(32, 32), 0, nullptr, in, out) == cudaSuccess, "transpose");
  cudaMemcpy(r.data(), out, 1024 * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT(r[1] == 32.f && r[32] == 1.f, "transpose result %f %f", r[1], r[32]);
  EXPECT(launch_kernel(transpose_padded, dim3(1), dim3(32, 32), 0, nullptr, in, out) == cudaSuccess, "padded");
  cudaMemcpy(r.data(), out, 1024 * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT(r[1] == 32.f && r[33] == 33.f, "padded transpose result %f %f", r[1], r[33]);

  EXPECT(launch_kernel(shared_wide, dim3(1), dim3(32), 512 * sizeof(float), nullptr, out) == cudaSuccess, "wide");
  uint32_t* uout = dalloc<uint32_t>(32);
  EXPECT(launch_kernel(ldmatrix_tiles, dim3(1), dim3(32), 64 * 128, nullptr, uout) == cudaSuccess, "ldmatrix");
  uint4* o4 = dalloc<uint4>(32);
  EXPECT(launch_kernel(cp_async_copy, dim3(1), dim3(32), 32 * 16, nullptr, reinterpret_cast<const uint4*>(in), o4) ==
             cudaSuccess, "cp.async");
  std::vector<float> c4(128);
  cudaMemcpy(c4.data(), o4, 512, cudaMemcpyDeviceToHost);
  EXPECT(c4[127] == 127.f, "cp.async result %f", c4[127]);
  int* counter = dalloc<int>(2);
  EXPECT(launch_kernel(atomics, dim3(2), dim3(32), 0, nullptr, counter) == cudaSuccess, "atomics");
  int hc[2];
  cudaMemcpy(hc, counter, sizeof hc, cudaMemcpyDeviceToHost);
  EXPECT(hc[0] == 64 && hc[1] == 32, "atomics result %d %d", hc[0], hc[1]);
  EXPECT(launch_kernel(mma_once, dim3(1), dim3(64), 0, nullptr, out) == cudaSuccess, "mma");
  cudaMemcpy(r.data(), out, 64 * sizeof(float), cudaMemcpyDeviceToHost);
  EXPECT(r[0] == 16.f, "mma result %f", r[0]);

  EXPECT(launch_kernel(early_exit, dim3(8), dim3(32), 0, nullptr, in, out) == cudaSuccess, "early_exit");

  std::printf(g_failures ? "profile_rules: %d FAILURES\n" : "profile_rules: OK\n", g_failures);
  return g_failures ? 1 : 0;
}
