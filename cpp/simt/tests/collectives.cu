// Shuffles (all four, with width, several types), votes, match/reduce, atomics (global + shared),
// barriers with predicates, 3D indexing and dynamic shared memory.
#include <fastinfer/common/smem.cuh>

#include <cstring>

#include "common.cuh"

// out[i][tid] for several shuffle flavours; block of 64 threads (2 warps)
__global__ void shuffles(int* oi, float* of, double* od, long long* ol, float* oh, float* ob, float* oh2) {
  const int t = threadIdx.x, lane = t % 32;
  const unsigned full = 0xffffffffu;
  oi[0 * 64 + t] = __shfl_sync(full, t * 10, (lane + 5) % 32);
  oi[1 * 64 + t] = __shfl_up_sync(full, t, 3);
  oi[2 * 64 + t] = __shfl_down_sync(full, t, 3);
  oi[3 * 64 + t] = __shfl_xor_sync(full, t, 5);
  oi[4 * 64 + t] = __shfl_sync(full, t, 2, 8);        // width 8: lane 2 of each segment
  oi[5 * 64 + t] = __shfl_up_sync(full, t, 2, 8);
  oi[6 * 64 + t] = __shfl_down_sync(full, t, 2, 8);
  oi[7 * 64 + t] = __shfl_xor_sync(full, t, 9, 8);    // crosses segments
  oi[8 * 64 + t] = __shfl_sync(full, t, -1);          // srcLane modulo width
  of[t] = __shfl_xor_sync(full, 0.5f * t, 1);
  od[t] = __shfl_down_sync(full, 0.25 * t, 1);
  ol[t] = __shfl_sync(full, (long long)t << 40, 31);
  oh[t] = __half2float(__shfl_xor_sync(full, __float2half((float)t), 2));
  ob[t] = __bfloat162float(__shfl_up_sync(full, __float2bfloat16((float)t), 1));
  half2 h2 = __floats2half2_rn((float)t, (float)(t + 100));
  half2 r2 = __shfl_sync(full, h2, 7);
  oh2[t] = __low2float(r2) + __high2float(r2);
  // partial masks: only the even lanes shuffle among themselves
  if (lane % 2 == 0) oi[9 * 64 + t] = __shfl_xor_sync(0x55555555u, t, 2);
  else oi[9 * 64 + t] = -1;
}

__global__ void votes(unsigned* out) {
  const int t = threadIdx.x, lane = t % 32;
  const unsigned full = 0xffffffffu;
  out[0 * 64 + t] = __ballot_sync(full, lane % 3 == 0);
  out[1 * 64 + t] = __any_sync(full, t == 40);
  out[2 * 64 + t] = __all_sync(full, t < 32);
  out[3 * 64 + t] = __match_any_sync(full, lane / 4);
  out[4 * 64 + t] = __reduce_add_sync(full, (unsigned)lane);
  out[5 * 64 + t] = (unsigned)__reduce_max_sync(full, (int)(lane * 7 % 32) - 10);
  out[6 * 64 + t] = lane < 16 ? __ballot_sync(0x0000ffffu, lane & 1) : 0u;
  __syncwarp();
  out[7 * 64 + t] = __activemask();
}

__global__ void atomics(int* gi, unsigned* gu, unsigned long long* gull, float* gf, int* out) {
  __shared__ int s_sum, s_max, s_min, s_cas;
  __shared__ float s_f;
  const int t = threadIdx.x + blockDim.x * blockIdx.x;
  if (threadIdx.x == 0) {
    s_sum = 0;
    s_max = -1000;
    s_min = 1000;
    s_cas = 0;
    s_f = 0.f;
  }
  __syncthreads();
  atomicAdd(&s_sum, 1);
  atomicMax(&s_max, (int)threadIdx.x);
  atomicMin(&s_min, (int)threadIdx.x - 5);
  atomicAdd(&s_f, 0.5f);
  int old;
  do {
    old = s_cas;
  } while (atomicCAS(&s_cas, old, old + 2) != old);
  atomicAdd(gi, t);
  atomicAdd(gu, 2u);
  atomicAdd(gull, 1ull << 33);
  atomicAdd(gf, 0.25f);
  atomicMax(gi + 1, t);
  atomicExch(gi + 2, 7);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[blockIdx.x * 5 + 0] = s_sum;
    out[blockIdx.x * 5 + 1] = s_max;
    out[blockIdx.x * 5 + 2] = s_min;
    out[blockIdx.x * 5 + 3] = s_cas;
    out[blockIdx.x * 5 + 4] = (int)s_f;
  }
}

__global__ void barriers_3d(int* out) {
  // block (4, 3, 2) = 24 threads; grid (2, 2, 1)
  const int lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int* s = fastinfer::dynamic_smem<int>();
  s[lin] = lin * 3 + blk;
  const int cnt = __syncthreads_count(lin % 4 == 0);
  const int all = __syncthreads_and(lin >= 0);
  const int any = __syncthreads_or(lin == 23);
  const int none = __syncthreads_or(0);
  int sum = 0;
  for (int i = 0; i < 24; ++i) sum += s[i];
  out[blk * 24 + lin] = sum * 1000 + cnt * 100 + all * 10 + any + none;
}

int main() {
  // shuffles
  int* oi = dalloc<int>(10 * 64);
  float *of = dalloc<float>(64), *oh = dalloc<float>(64), *ob = dalloc<float>(64), *oh2 = dalloc<float>(64);
  double* od = dalloc<double>(64);
  long long* ol = dalloc<long long>(64);
  CHECK_CUDA(fastinfer::launch_kernel(shuffles, dim3(1), dim3(64), 0, nullptr, oi, of, od, ol, oh, ob, oh2));
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32, base = t - lane;
    EXPECT(oi[t] == (base + (lane + 5) % 32) * 10, "shfl idx t=%d got %d", t, oi[t]);
    EXPECT(oi[64 + t] == (lane >= 3 ? t - 3 : t), "shfl up t=%d got %d", t, oi[64 + t]);
    EXPECT(oi[128 + t] == (lane + 3 < 32 ? t + 3 : t), "shfl down t=%d got %d", t, oi[128 + t]);
    EXPECT(oi[192 + t] == base + (lane ^ 5), "shfl xor t=%d", t);
    const int seg = lane & ~7;
    EXPECT(oi[256 + t] == base + seg + 2, "shfl idx w8 t=%d got %d", t, oi[256 + t]);
    EXPECT(oi[320 + t] == (lane - 2 >= seg ? t - 2 : t), "shfl up w8 t=%d", t);
    EXPECT(oi[384 + t] == (lane + 2 < seg + 8 ? t + 2 : t), "shfl down w8 t=%d", t);
    const int x = lane ^ 9;
    EXPECT(oi[448 + t] == (x < seg + 8 ? base + x : t), "shfl xor w8 t=%d got %d", t, oi[448 + t]);
    EXPECT(oi[512 + t] == base + 31, "shfl idx -1 t=%d got %d", t, oi[512 + t]);
    EXPECT(of[t] == 0.5f * (base + (lane ^ 1)), "float xor t=%d", t);
    EXPECT(od[t] == 0.25 * (lane < 31 ? t + 1 : t), "double down t=%d", t);
    EXPECT(ol[t] == (long long)(base + 31) << 40, "ll t=%d", t);
    EXPECT(oh[t] == (float)(base + (lane ^ 2)), "half t=%d", t);
    EXPECT(ob[t] == (float)(lane >= 1 ? t - 1 : t), "bf16 t=%d", t);
    EXPECT(oh2[t] == 2.f * (base + 7) + 100.f, "half2 t=%d got %f", t, oh2[t]);
    EXPECT(oi[576 + t] == (lane % 2 == 0 ? base + (lane ^ 2) : -1), "partial mask t=%d", t);
  }
  // votes
  unsigned* ov = dalloc<unsigned>(8 * 64);
  CHECK_CUDA(fastinfer::launch_kernel(votes, dim3(1), dim3(64), 0, nullptr, ov));
  for (int t = 0; t < 64; ++t) {
    const int lane = t % 32;
    unsigned b = 0;
    for (int l = 0; l < 32; l += 3) b |= 1u << l;
    EXPECT(ov[t] == b, "ballot t=%d", t);
    EXPECT(ov[64 + t] == (t >= 32 ? 1u : 0u), "any t=%d", t);
    EXPECT(ov[128 + t] == (t < 32 ? 1u : 0u), "all t=%d", t);
    EXPECT(ov[192 + t] == (0xFu << (lane / 4 * 4)), "match_any t=%d got %x", t, ov[192 + t]);
    EXPECT(ov[256 + t] == 496u, "reduce_add t=%d", t);
    EXPECT(ov[320 + t] == 21u, "reduce_max t=%d got %d", t, (int)ov[320 + t]);
    EXPECT(ov[384 + t] == (lane < 16 ? 0xAAAAu : 0u), "partial ballot t=%d", t);
    EXPECT(ov[448 + t] & (1u << lane), "activemask includes own lane t=%d", t);
  }
  // atomics
  int* gi = dalloc<int>(3);
  unsigned* gu = dalloc<unsigned>(1);
  unsigned long long* gull = dalloc<unsigned long long>(1);
  float* gf = dalloc<float>(1);
  int* oa = dalloc<int>(3 * 5);
  gi[0] = 0; gi[1] = -1; gi[2] = 0; *gu = 0; *gull = 0; *gf = 0.f;
  CHECK_CUDA(fastinfer::launch_kernel(atomics, dim3(3), dim3(96), 0, nullptr, gi, gu, gull, gf, oa));
  EXPECT(gi[0] == 288 * 287 / 2, "atomicAdd int %d", gi[0]);
  EXPECT(gi[1] == 287 && gi[2] == 7, "atomicMax/Exch %d %d", gi[1], gi[2]);
  EXPECT(*gu == 576u && *gull == 288ull << 33 && *gf == 72.f, "atomics u/ull/f");
  for (int b = 0; b < 3; ++b)
    EXPECT(oa[b * 5] == 96 && oa[b * 5 + 1] == 95 && oa[b * 5 + 2] == -5 && oa[b * 5 + 3] == 192 && oa[b * 5 + 4] == 48,
           "shared atomics block %d: %d %d %d %d %d", b, oa[b * 5], oa[b * 5 + 1], oa[b * 5 + 2], oa[b * 5 + 3], oa[b * 5 + 4]);
  // barriers + 3D indexing + dynamic smem
  int* ob3 = dalloc<int>(4 * 24);
  CHECK_CUDA(fastinfer::launch_kernel(barriers_3d, dim3(2, 2, 1), dim3(4, 3, 2), 24 * sizeof(int), nullptr, ob3));
  for (int blk = 0; blk < 4; ++blk)
    for (int lin = 0; lin < 24; ++lin) {
      const int sum = 3 * 276 + 24 * blk;
      EXPECT(ob3[blk * 24 + lin] == sum * 1000 + 6 * 100 + 10 + 1, "barrier blk %d lin %d got %d", blk, lin, ob3[blk * 24 + lin]);
    }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::printf("collectives: %s\n", g_failures ? "FAIL" : "OK");
  return g_failures ? 1 : 0;
}
