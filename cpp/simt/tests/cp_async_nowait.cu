// cp.async strictness: a kernel that forgets cp_async_wait reads the 0xFF poison of dynamic shared
// memory (the copy has not landed), while the correct kernel reads the data. Exits 0 when both
// behave so (emulator semantics: on a GPU the first kernel is a race with unspecified result).
#include <fastinfer/common/ptx.cuh>
#include <fastinfer/common/smem.cuh>

#include "common.cuh"

template <bool kWait>
__global__ void copy_through_smem(const uint4* in, uint4* out, int n) {
  uint4* s = fastinfer::dynamic_smem<uint4>();
  const int i = threadIdx.x;
  fastinfer::ptx::cp_async_cg_16(s + i, in + i, i < n);  // i >= n: zero-fill, nothing read
  fastinfer::ptx::cp_async_commit();
  if (kWait) fastinfer::ptx::cp_async_wait<0>();
  __syncthreads();
  out[i] = s[(i + 1) % blockDim.x];
}

int main() {
  const int T = 64, n = 60;
  uint4* in = dalloc<uint4>(T);
  uint4* out = dalloc<uint4>(T);
  for (int i = 0; i < T; ++i) in[i] = make_uint4(i, i + 1, i + 2, i + 3);
  int bad = 0;
  CHECK_CUDA(fastinfer::launch_kernel(copy_through_smem<true>, dim3(1), dim3(T), T * 16, nullptr, in, out, n));
  for (int i = 0; i < T; ++i) {
    const int j = (i + 1) % T;
    const unsigned x = j < n ? (unsigned)j : 0u;
    bad += out[i].x != x || out[i].w != (j < n ? x + 3 : 0u);
  }
  std::printf("with wait: %s\n", bad ? "FAIL" : "data ok (zero-fill for !pred)");
  int poison = 0;
  CHECK_CUDA(fastinfer::launch_kernel(copy_through_smem<false>, dim3(1), dim3(T), T * 16, nullptr, in, out, n));
  for (int i = 0; i < T; ++i) poison += out[i].x == 0xffffffffu && out[i].w == 0xffffffffu;
  std::printf("without wait: %d/%d reads saw the 0xFF poison\n", poison, T);
  bad += poison != T;
  return bad ? 1 : 0;
}
