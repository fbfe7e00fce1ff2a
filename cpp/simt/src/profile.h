// Library-internal interface of the memory-access profiler (profile.cpp) used by the scheduler
// and the collectives. Not installed. See cpp/simt/README.md, "Profiling".
#pragma once
#include <fastinfer/simt/device.h>

#include <atomic>

#pragma GCC visibility push(hidden)
namespace fastinfer::simt::prof {

// True while profile_begin() is in effect (set and read under the launch mutex).
extern bool g_on;
// True while the running launch is being profiled (only ever read on the launching OS thread).
extern bool g_launch_on;
// The running launch is exempt from CTA sampling (its kernel's name contains one of the strings
// given to profile_run_whole: kernels whose outputs later launches index by, such as an alignment
// that orders the rows of a grouped GEMM).
extern bool g_launch_whole;

// Called by launch() after the configuration checks, with the launch mutex held. Returns true
// when the kernel must not run (launch-configuration-only mode).
bool launch_begin(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, const unsigned char* smem);
// CTA sampling of the running launch: 1 runs every CTA.
extern int g_sample;
// Whether CTA (x, y, *) of a grid with grid_y rows runs under sampling: a lattice, every
// g_sample-th blockIdx.x, with an offset per blockIdx.y spread evenly over the k residues (row y
// keeps x = r(y) mod k, r(y) = the centre of the y-th of grid_y equal slices of [0, k) when
// grid_y <= k, else y mod k). So work that varies along x, such as causal attention's q-tiles, is
// sampled without bias whatever grid_y is; all blockIdx.z, so split partitions stay whole.
inline bool sample_keeps(unsigned x, unsigned y, unsigned grid_y) {
  const uint64_t k = static_cast<uint64_t>(g_sample);
  const uint64_t r = grid_y <= k ? ((2ull * y + 1) * k) / (2ull * grid_y) : y % k;
  return x % k == r;
}
// A __syncthreads completed, or a block ended: the pending accesses form their warp requests.
void epoch_end();
// A block ended (after its last epoch_end): counts it in blocks_storing when it wrote global memory.
void block_end();
void launch_end(bool faulted, unsigned long long blocks_run);
// One warp-level mma.sync: kind 0 f16 m16n8k16, 1 bf16 m16n8k16, 2 e4m3 m16n8k32, 3 s8 m16n8k32.
void count_mma(int kind);

// The access hooks (tsan callbacks, ptx wrappers, atomics) end here.
void on_access(uintptr_t site, int op, const void* addr, unsigned size, const void* addr2, unsigned size2);

}  // namespace fastinfer::simt::prof
#pragma GCC visibility pop
