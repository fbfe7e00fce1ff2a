// fastinfer simt: host (CPU) emulation of the CUDA execution model.
//
// This header is what `fastinfer/common/platform.cuh` includes when FASTINFER_SIMT is defined
// (and what the runner force-includes with `-include`). It
//   1. defines the CUDA keywords (__global__, __device__, __shared__, ...) BEFORE CUDA's own
//      host headers are included (those headers only define them when they are not defined yet),
//   2. includes CUDA's host headers for the types (__half, __nv_bfloat16, __nv_fp8_e4m3, float4,
//      dim3, cudaError_t, cudaStream_t, ...) and the runtime API declarations,
//   3. declares the builtins (threadIdx, blockIdx, blockDim, gridDim, warpSize) and the device
//      intrinsics (barriers, warp collectives, atomics, math) implemented by libfastinfer_simt.
#pragma once

#if defined(__CUDACC__)
#error "fastinfer/simt/device.h is for the host compiler (FASTINFER_SIMT builds), not for nvcc"
#endif

#ifndef FASTINFER_SIMT
#define FASTINFER_SIMT 1
#endif
#define FASTINFER_SIMT_ARCH 900

// ---- 1. keywords (must precede the CUDA headers) ------------------------------------------------
// (#undef first: a CUDA header included earlier, e.g. <cuda_runtime_api.h> from a torch-free API
// header, has already defined them as CUDA attributes.)
#undef __host__
#define __host__
#undef __device__
#define __device__
#undef __global__
#define __global__ __attribute__((noinline, used, visibility("default")))
#undef __shared__
#define __shared__ static thread_local
#undef __constant__
#define __constant__
#undef __managed__
#define __managed__
#undef __grid_constant__
#define __grid_constant__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __nv_pure__
#define __nv_pure__
#undef __tile__
#define __tile__
#undef __tile_global__
#define __tile_global__
#undef __tile_builtin__
#define __tile_builtin__

// ---- 2. CUDA host headers -----------------------------------------------------------------------
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#undef __forceinline__
#define __forceinline__ inline

#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstddef>
#include <source_location>
#include <type_traits>

// ---- 3. emulator interface ----------------------------------------------------------------------
#pragma GCC visibility push(hidden)

namespace fastinfer::simt {

struct Stats {
  unsigned long long switches;  // fiber context switches (both directions counted)
  unsigned long long blocks;    // thread blocks executed
  unsigned long long launches;  // kernel launches (including failed ones)
  unsigned long long threads;   // CUDA threads started
};
Stats stats();
void reset_stats();
// Detailed message of the most recent fault on this OS thread ("" when none).
const char* last_fault_message();

// Memory-access profiler (cpp/simt/README.md, "Profiling"). Counts only accesses of code built
// with the profile flags (`python -m fastinfer.simt profile`, the fastinfer._simprof module).
// mode 0: run the kernels and count; mode 1: record the launch configurations only (kernels do
// not run). sample_one_in = k > 1 (mode 0): of each launch only one CTA in k runs: every k-th
// blockIdx.x, at an offset per blockIdx.y spread evenly over the k residues (every blockIdx.z of
// such a pair; at least the pair (0, 0)); each launch record says how many ran. profile_end
// writes the data (JSON, call sites as module + offset) to `path` (when not null or empty), then
// stops and discards it.
void profile_begin(int mode = 0, int sample_one_in = 1);
bool profile_active();
bool profile_end(const char* path);

namespace detail {

// Per-CUDA-thread builtins; the scheduler keeps `tls_cur` pointing at the running fiber.
struct FiberBuiltins {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  unsigned linear;  // linear thread id within the block
  unsigned lane;    // linear % 32
  unsigned warp;    // linear / 32
  unsigned char* dyn_smem;
  uintptr_t stack_lo, stack_hi;  // the fiber's stack (the profiler ignores accesses to it)
};
extern __thread FiberBuiltins* tls_cur;

inline FiberBuiltins* cur() {
  FiberBuiltins* c = tls_cur;
  if (__builtin_expect(c == nullptr, 0)) __builtin_trap();  // device builtin used outside a kernel
  return c;
}

using Thunk = void (*)(void*);
cudaError_t launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream,
                   Thunk thunk, void* ctx);

enum FaultKind { kFaultGeneric = 0, kFaultAssert = 1, kFaultAddress = 2 };
[[noreturn]] void fault(int kind, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Block barrier. kind: 0 plain, 1 count, 2 and, 3 or. Returns the reduced predicate.
int barrier(int kind, int pred, const char* file, unsigned line, unsigned column);
// The same, reading the call site from `loc` inside the library (so that profile builds do not
// count the source-location reads as the kernel's memory accesses).
int barrier_at(int kind, int pred, const std::source_location& loc);

// Warp collective: every lane named in `mask` must arrive with the same `fn` and mask; when the
// last one arrives, fn computes all lanes' outputs from all lanes' inputs.
struct LaneIO {
  uint32_t in[12];
  uint32_t out[4];
  const void* ptr;
  int a, b;
};
using CollFn = void (*)(LaneIO* const* lanes, unsigned mask);
void warp_collective(const char* name, CollFn fn, unsigned mask, LaneIO* io);
unsigned active_mask();

// Profiler: an access of `size` bytes at `addr` by the running lane, from call site `site` (a
// return address into the kernel's code). cp.async passes its global source as addr2 / size2.
enum ProfOp { kProfLoad = 0, kProfStore = 1, kProfAtomic = 2, kProfLdmatrix = 3, kProfCpAsync = 4 };
void prof_record(uintptr_t site, int op, const void* addr, unsigned size, const void* addr2 = nullptr,
                 unsigned size2 = 0);

// cp.async emulation (per-thread queue of pending copies, grouped by commit).
void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes);
void cp_async_commit();
void cp_async_wait(int n);

// collective implementations (defined in the library)
void coll_shfl_idx(LaneIO* const*, unsigned);
void coll_shfl_up(LaneIO* const*, unsigned);
void coll_shfl_down(LaneIO* const*, unsigned);
void coll_shfl_xor(LaneIO* const*, unsigned);
void coll_vote(LaneIO* const*, unsigned);
void coll_syncwarp(LaneIO* const*, unsigned);
void coll_match_any(LaneIO* const*, unsigned);
void coll_reduce(LaneIO* const*, unsigned);

// Values exchanged by warp collectives: any type of at most 8 bytes whose copy is a bit copy
// (__half2 / __nv_bfloat162 define copy assignment on the host, so trivially-copyable is too strict).
template <typename T>
inline uint64_t to_bits(const T& v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_destructible_v<T> && !std::is_reference_v<T>,
                "warp shuffles take values of at most 8 bytes that are plain bit copies");
  uint64_t b = 0;
  std::memcpy(&b, static_cast<const void*>(&v), sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(static_cast<void*>(&v), &b, sizeof(T));
  return v;
}
template <typename T>
inline T shfl_impl(const char* name, CollFn fn, unsigned mask, const T& var, int arg, int width) {
  LaneIO io;
  uint64_t b = to_bits(var);
  io.in[0] = (uint32_t)b;
  io.in[1] = (uint32_t)(b >> 32);
  io.a = arg;
  io.b = width;
  warp_collective(name, fn, mask, &io);
  return from_bits<T>((uint64_t)io.out[0] | ((uint64_t)io.out[1] << 32));
}

}  // namespace detail
}  // namespace fastinfer::simt

#pragma GCC visibility pop

// ---- builtins -----------------------------------------------------------------------------------
#define threadIdx (static_cast<const uint3&>(::fastinfer::simt::detail::cur()->thread_idx))
#define blockIdx (static_cast<const uint3&>(::fastinfer::simt::detail::cur()->block_idx))
#define blockDim (static_cast<const dim3&>(::fastinfer::simt::detail::cur()->block_dim))
#define gridDim (static_cast<const dim3&>(::fastinfer::simt::detail::cur()->grid_dim))
inline constexpr int warpSize = 32;

#pragma GCC visibility push(hidden)

// Profile builds (FASTINFER_SIMT_PROFILE, -fsanitize=thread code generation): the emulator's own
// bookkeeping in these inline functions (source locations of barriers, collective descriptors)
// must not be counted as the kernel's memory accesses, so they are left uninstrumented.
#if defined(FASTINFER_SIMT_PROFILE)
#define FI_SIMT_NOPROF __attribute__((no_sanitize("thread")))
#else
#define FI_SIMT_NOPROF
#endif

// ---- barriers -----------------------------------------------------------------------------------
FI_SIMT_NOPROF inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  ::fastinfer::simt::detail::barrier_at(0, 1, loc);
}
FI_SIMT_NOPROF inline int __syncthreads_count(int pred, std::source_location loc = std::source_location::current()) {
  return ::fastinfer::simt::detail::barrier_at(1, pred, loc);
}
FI_SIMT_NOPROF inline int __syncthreads_and(int pred, std::source_location loc = std::source_location::current()) {
  return ::fastinfer::simt::detail::barrier_at(2, pred, loc);
}
FI_SIMT_NOPROF inline int __syncthreads_or(int pred, std::source_location loc = std::source_location::current()) {
  return ::fastinfer::simt::detail::barrier_at(3, pred, loc);
}
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) {}
[[noreturn]] inline void __trap() { ::fastinfer::simt::detail::fault(0, "__trap() called"); }
[[noreturn]] inline void __brkpt() { ::fastinfer::simt::detail::fault(0, "__brkpt() called"); }

// ---- warp collectives ---------------------------------------------------------------------------
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::fastinfer::simt::detail::LaneIO io;
  ::fastinfer::simt::detail::warp_collective("__syncwarp", ::fastinfer::simt::detail::coll_syncwarp, mask, &io);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
  return ::fastinfer::simt::detail::shfl_impl<T>("__shfl_sync", ::fastinfer::simt::detail::coll_shfl_idx, mask, var,
                                                 srcLane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return ::fastinfer::simt::detail::shfl_impl<T>("__shfl_up_sync", ::fastinfer::simt::detail::coll_shfl_up, mask, var,
                                                 (int)delta, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return ::fastinfer::simt::detail::shfl_impl<T>("__shfl_down_sync", ::fastinfer::simt::detail::coll_shfl_down, mask,
                                                 var, (int)delta, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
  return ::fastinfer::simt::detail::shfl_impl<T>("__shfl_xor_sync", ::fastinfer::simt::detail::coll_shfl_xor, mask,
                                                 var, laneMask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  ::fastinfer::simt::detail::LaneIO io;
  io.in[0] = pred != 0;
  ::fastinfer::simt::detail::warp_collective("__ballot_sync", ::fastinfer::simt::detail::coll_vote, mask, &io);
  return io.out[0];
}
inline int __any_sync(unsigned mask, int pred) {
  ::fastinfer::simt::detail::LaneIO io;
  io.in[0] = pred != 0;
  ::fastinfer::simt::detail::warp_collective("__any_sync", ::fastinfer::simt::detail::coll_vote, mask, &io);
  return io.out[0] != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  ::fastinfer::simt::detail::LaneIO io;
  io.in[0] = pred != 0;
  ::fastinfer::simt::detail::warp_collective("__all_sync", ::fastinfer::simt::detail::coll_vote, mask, &io);
  return io.out[0] == mask;
}
inline unsigned __activemask() { return ::fastinfer::simt::detail::active_mask(); }
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T value) {
  ::fastinfer::simt::detail::LaneIO io;
  uint64_t b = ::fastinfer::simt::detail::to_bits(value);
  io.in[0] = (uint32_t)b;
  io.in[1] = (uint32_t)(b >> 32);
  ::fastinfer::simt::detail::warp_collective("__match_any_sync", ::fastinfer::simt::detail::coll_match_any, mask, &io);
  return io.out[0];
}
namespace fastinfer::simt::detail {
// op: 0 add, 1 min, 2 max, 3 and, 4 or, 5 xor; b: signed
inline uint32_t reduce_sync(const char* name, unsigned mask, uint32_t v, int op, int is_signed) {
  LaneIO io;
  io.in[0] = v;
  io.a = op;
  io.b = is_signed;
  warp_collective(name, coll_reduce, mask, &io);
  return io.out[0];
}
}  // namespace fastinfer::simt::detail
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_add_sync", mask, v, 0, 0); }
inline int __reduce_add_sync(unsigned mask, int v) { return (int)::fastinfer::simt::detail::reduce_sync("__reduce_add_sync", mask, (uint32_t)v, 0, 1); }
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_min_sync", mask, v, 1, 0); }
inline int __reduce_min_sync(unsigned mask, int v) { return (int)::fastinfer::simt::detail::reduce_sync("__reduce_min_sync", mask, (uint32_t)v, 1, 1); }
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_max_sync", mask, v, 2, 0); }
inline int __reduce_max_sync(unsigned mask, int v) { return (int)::fastinfer::simt::detail::reduce_sync("__reduce_max_sync", mask, (uint32_t)v, 2, 1); }
inline unsigned __reduce_and_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_and_sync", mask, v, 3, 0); }
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_or_sync", mask, v, 4, 0); }
inline unsigned __reduce_xor_sync(unsigned mask, unsigned v) { return ::fastinfer::simt::detail::reduce_sync("__reduce_xor_sync", mask, v, 5, 0); }

// ---- atomics (fibers of a launch run one at a time: plain read-modify-write is atomic) ---------
// Profile builds: the atomics are out-of-line, uninstrumented functions that report one atomic
// access from their caller's call site (their read-modify-write is not counted as a load + store).
#if defined(FASTINFER_SIMT_PROFILE)
#define FI_SIMT_PROFILED_FN inline __attribute__((noinline, no_sanitize("thread")))
#define FI_SIMT_REPORT_ATOMIC(addr)                                                                            \
  ::fastinfer::simt::detail::prof_record(reinterpret_cast<uintptr_t>(__builtin_return_address(0)),           \
                                         ::fastinfer::simt::detail::kProfAtomic, (addr), sizeof(*(addr)))
#else
#define FI_SIMT_PROFILED_FN inline
#define FI_SIMT_REPORT_ATOMIC(addr) ((void)0)
#endif
#define FI_SIMT_ATOMIC_RMW(NAME, T, EXPR) \
  FI_SIMT_PROFILED_FN T NAME(T* address, T val) { \
    FI_SIMT_REPORT_ATOMIC(address);       \
    T old = *address;                     \
    *address = (EXPR);                    \
    return old;                           \
  }                                       \
  inline T NAME##_block(T* a, T v) { return NAME(a, v); } \
  inline T NAME##_system(T* a, T v) { return NAME(a, v); }
FI_SIMT_ATOMIC_RMW(atomicAdd, int, old + val)
FI_SIMT_ATOMIC_RMW(atomicAdd, unsigned, old + val)
FI_SIMT_ATOMIC_RMW(atomicAdd, unsigned long long, old + val)
FI_SIMT_ATOMIC_RMW(atomicAdd, float, old + val)
FI_SIMT_ATOMIC_RMW(atomicAdd, double, old + val)
FI_SIMT_ATOMIC_RMW(atomicSub, int, old - val)
FI_SIMT_ATOMIC_RMW(atomicSub, unsigned, old - val)
FI_SIMT_ATOMIC_RMW(atomicMax, int, old > val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMax, unsigned, old > val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMax, long long, old > val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMax, unsigned long long, old > val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMin, int, old < val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMin, unsigned, old < val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMin, long long, old < val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicMin, unsigned long long, old < val ? old : val)
FI_SIMT_ATOMIC_RMW(atomicExch, int, val)
FI_SIMT_ATOMIC_RMW(atomicExch, unsigned, val)
FI_SIMT_ATOMIC_RMW(atomicExch, unsigned long long, val)
FI_SIMT_ATOMIC_RMW(atomicExch, float, val)
FI_SIMT_ATOMIC_RMW(atomicAnd, int, old & val)
FI_SIMT_ATOMIC_RMW(atomicAnd, unsigned, old & val)
FI_SIMT_ATOMIC_RMW(atomicAnd, unsigned long long, old & val)
FI_SIMT_ATOMIC_RMW(atomicOr, int, old | val)
FI_SIMT_ATOMIC_RMW(atomicOr, unsigned, old | val)
FI_SIMT_ATOMIC_RMW(atomicOr, unsigned long long, old | val)
FI_SIMT_ATOMIC_RMW(atomicXor, int, old ^ val)
FI_SIMT_ATOMIC_RMW(atomicXor, unsigned, old ^ val)
FI_SIMT_ATOMIC_RMW(atomicXor, unsigned long long, old ^ val)
FI_SIMT_ATOMIC_RMW(atomicInc, unsigned, (old >= val) ? 0u : old + 1u)
FI_SIMT_ATOMIC_RMW(atomicDec, unsigned, (old == 0u || old > val) ? val : old - 1u)
#undef FI_SIMT_ATOMIC_RMW
#define FI_SIMT_ATOMIC_CAS(T)                                   \
  FI_SIMT_PROFILED_FN T atomicCAS(T* address, T compare, T val) { \
    FI_SIMT_REPORT_ATOMIC(address);                             \
    T old = *address;                                           \
    if (old == compare) *address = val;                         \
    return old;                                                 \
  }                                                             \
  inline T atomicCAS_block(T* a, T c, T v) { return atomicCAS(a, c, v); } \
  inline T atomicCAS_system(T* a, T c, T v) { return atomicCAS(a, c, v); }
FI_SIMT_ATOMIC_CAS(int)
FI_SIMT_ATOMIC_CAS(unsigned)
FI_SIMT_ATOMIC_CAS(unsigned long long)
FI_SIMT_ATOMIC_CAS(unsigned short)
#undef FI_SIMT_ATOMIC_CAS

// ---- math and bit intrinsics --------------------------------------------------------------------
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdividef(float x, float y) { return x / y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline double __dmul_rn(double x, double y) { return x * y; }
inline double __dadd_rn(double x, double y) { return x + y; }
inline double __fma_rn(double x, double y, double z) { return fma(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline int __float_as_int(float x) { int u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; std::memcpy(&x, &u, 8); return x; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned long long __brevll(unsigned long long x) {
  return ((unsigned long long)__brev((unsigned)x) << 32) | __brev((unsigned)(x >> 32));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)((v << (shift & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  unsigned long long v = ((unsigned long long)hi << 32) | lo;
  return (unsigned)(v >> (shift & 31));
}
inline unsigned __umulhi(unsigned x, unsigned y) { return (unsigned)(((unsigned long long)x * y) >> 32); }
inline int __mulhi(int x, int y) { return (int)(((long long)x * y) >> 32); }
inline unsigned long long __umul64hi(unsigned long long x, unsigned long long y) {
  return (unsigned long long)(((unsigned __int128)x * y) >> 64);
}
inline int __mul24(int x, int y) { return x * y; }
inline unsigned __umul24(unsigned x, unsigned y) { return x * y; }
inline int __sad(int x, int y, int z) { return z + (x > y ? x - y : y - x); }
inline long long clock64() {
  static thread_local long long ticks = 0;
  return ticks += 1000;
}

// min/max overloads as CUDA provides them (int, unsigned, mixed -> unsigned, 64-bit, float).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline int umin(int a, int b) { return min(a, b); }

// cache-hinted loads/stores: plain memory accesses on the host
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

// Device-side assertion that becomes a kernel fault (cudaErrorAssert) instead of aborting.
namespace fastinfer::simt::detail {
[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line) {
  fault(kFaultAssert, "assertion `%s` failed at %s:%d", expr, file, line);
}
}  // namespace fastinfer::simt::detail
#define FASTINFER_SIMT_ASSERT(cond) \
  ((cond) ? (void)0 : ::fastinfer::simt::detail::assert_fail(#cond, __FILE__, __LINE__))

#pragma GCC visibility pop
