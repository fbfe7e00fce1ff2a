// fastinfer simt: fibers, block scheduler, barriers, warp collectives, cp.async, faults.
#include <fastinfer/simt/device.h>

#include <cxxabi.h>
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "internal.h"
#include "profile.h"

#if defined(__x86_64__) || defined(__aarch64__)
#define FI_SIMT_ASM_SWITCH 1
extern "C" void fi_simt_switch(void** save_sp, void* new_sp);
extern "C" void fi_simt_fiber_start();
#else
#include <ucontext.h>
#endif

namespace fastinfer::simt {
namespace detail {

__thread FiberBuiltins* tls_cur = nullptr;

namespace {

constexpr size_t kStackSize = 128 * 1024;
constexpr size_t kSmemGuard = 256;
constexpr unsigned char kGuardByte = 0xA5;
constexpr size_t kMaxDynamicSmem = 232448;  // 227 KiB, sm90 opt-in maximum

enum class St : uint8_t { Runnable, Running, BarWait, WarpWait, Exited };

struct CpOp {
  void* dst;
  const void* src;
  unsigned bytes, src_bytes;
};

struct Fiber : FiberBuiltins {
  void* sp = nullptr;
  char* stack = nullptr;  // lowest address of the mapping (guard page first)
#if !FI_SIMT_ASM_SWITCH
  ucontext_t uc;
#endif
  St st = St::Runnable;
  // barrier
  const char* bfile = nullptr;
  unsigned bline = 0, bcol = 0;
  int bresult = 0;
  // warp collective
  CollFn cfn = nullptr;
  const char* cname = nullptr;
  unsigned cmask = 0;
  LaneIO* cio = nullptr;
  // cp.async: pending copies and the end index of each committed group
  std::vector<CpOp> cp;
  std::vector<size_t> groups;
};

struct Launch {
  const void* kernel = nullptr;
  Thunk thunk = nullptr;
  void* ctx = nullptr;
  dim3 grid, block;
  unsigned nthreads = 0;
  size_t smem_bytes = 0;
  unsigned char* smem = nullptr;
  std::vector<Fiber*> runnable;
  Fiber** fibers = nullptr;
  unsigned nexited = 0;
  // barrier state
  unsigned bar_count = 0;
  const char* bar_file = nullptr;
  unsigned bar_line = 0, bar_col = 0;
  int bar_kind = 0;
  int bar_sum = 0, bar_and = 1, bar_or = 0;
  // fault
  bool faulted = false;
  int fault_kind = 0;
  std::string msg;
  uint64_t rng = 0;
  void* sched_sp = nullptr;
#if !FI_SIMT_ASM_SWITCH
  ucontext_t sched_uc;
#endif
  unsigned long long switches = 0;
};

__thread Launch* tls_launch = nullptr;

std::mutex g_launch_mutex;
std::vector<Fiber*> g_fibers;  // pool, guarded by g_launch_mutex
std::atomic<unsigned long long> g_switches{0}, g_blocks{0}, g_launches{0}, g_threads{0};
std::atomic<unsigned long long> g_launch_counter{0};

thread_local std::string tls_fault_msg;
thread_local cudaError_t tls_fault_code = cudaSuccess;

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline uint32_t rand_below(uint64_t& s, uint32_t n) { return (uint32_t)(((splitmix(s) >> 32) * n) >> 32); }


std::string vformat(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

std::string where(const Launch& L, const FiberBuiltins* f) {
  std::string s = "kernel `" + internal::kernel_name(L.kernel) + "`";
  if (f) {
    s += format(" block (%u,%u,%u) thread (%u,%u,%u) [warp %u lane %u]", f->block_idx.x, f->block_idx.y,
                f->block_idx.z, f->thread_idx.x, f->thread_idx.y, f->thread_idx.z, f->warp, f->lane);
  }
  return s;
}

void set_fault(Launch& L, int kind, const std::string& what, const FiberBuiltins* f) {
  if (L.faulted) return;
  L.faulted = true;
  L.fault_kind = kind;
  L.msg = "fastinfer simt fault: " + where(L, f) + ": " + what;
}

// ---- stacks and context switch ------------------------------------------------------------------
char* alloc_stack() {
  void* p = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    fprintf(stderr, "fastinfer simt: cannot allocate a fiber stack\n");
    abort();
  }
  mprotect(p, 4096, PROT_NONE);  // guard page: a fiber stack overflow is a SIGSEGV, not corruption
  return static_cast<char*>(p);
}

extern "C" void fi_simt_fiber_entry(void* arg);

#if FI_SIMT_ASM_SWITCH
void* init_stack(Fiber* f) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + kStackSize) & ~uintptr_t(15);
#if defined(__x86_64__)
  // layout (low -> high): [mxcsr|fcw] r15 r14 r13 r12 rbx rbp ret ; rsp after `ret` is 16-aligned
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 16 - 64);
  uint32_t csr[2] = {0x1F80u, 0x037Fu};
  std::memcpy(&sp[0], csr, 8);
  sp[1] = 0;                                                  // r15
  sp[2] = 0;                                                  // r14
  sp[3] = reinterpret_cast<uint64_t>(&fi_simt_fiber_entry);   // r13: entry
  sp[4] = reinterpret_cast<uint64_t>(f);                      // r12: argument
  sp[5] = 0;                                                  // rbx
  sp[6] = 0;                                                  // rbp
  sp[7] = reinterpret_cast<uint64_t>(&fi_simt_fiber_start);   // return address
  return sp;
#else
  // aarch64 frame of 176 bytes: x19..x30 (12 x 8), d8..d15 (8 x 8), fpcr, pad
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 176);
  std::memset(sp, 0, 176);
  sp[0] = reinterpret_cast<uint64_t>(f);                      // x19: argument
  sp[1] = reinterpret_cast<uint64_t>(&fi_simt_fiber_entry);   // x20: entry
  sp[11] = reinterpret_cast<uint64_t>(&fi_simt_fiber_start);  // x30: return address
  return sp;
#endif
}
inline void switch_to_fiber(Launch& L, Fiber* f) { fi_simt_switch(&L.sched_sp, f->sp); }
inline void switch_to_scheduler(Launch& L, Fiber* f) { fi_simt_switch(&f->sp, L.sched_sp); }
#else
void ucontext_entry(unsigned lo, unsigned hi) {
  fi_simt_fiber_entry(reinterpret_cast<void*>(((uintptr_t)hi << 32) | lo));
}
void* init_stack(Fiber* f) {
  getcontext(&f->uc);
  f->uc.uc_stack.ss_sp = f->stack + 4096;
  f->uc.uc_stack.ss_size = kStackSize - 4096;
  f->uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(f);
  makecontext(&f->uc, (void (*)())ucontext_entry, 2, (unsigned)(p & 0xffffffffu), (unsigned)(p >> 32));
  return nullptr;
}
inline void switch_to_fiber(Launch& L, Fiber* f) { swapcontext(&L.sched_uc, &f->uc); }
inline void switch_to_scheduler(Launch& L, Fiber* f) { swapcontext(&f->uc, &L.sched_uc); }
#endif

inline Fiber* cur_fiber() { return static_cast<Fiber*>(cur()); }

// Suspend the running fiber (its state has been set by the caller) and return to the scheduler.
inline void block_me(Launch& L, Fiber* f) { switch_to_scheduler(L, f); }

inline void make_runnable(Launch& L, Fiber* f) {
  f->st = St::Runnable;
  L.runnable.push_back(f);
}

[[noreturn]] void fiber_fault(Launch& L, Fiber* f, int kind, const std::string& what) {
  set_fault(L, kind, what, f);
  if (f) {
    switch_to_scheduler(L, f);  // never resumed
  }
  __builtin_trap();
}

bool check_smem_guard(Launch& L, Fiber* f) {
  if (!L.smem) return true;
  const unsigned char* g = L.smem + L.smem_bytes;
  for (size_t i = 0; i < kSmemGuard; ++i) {
    if (g[i] != kGuardByte) {
      size_t last = i;
      for (size_t j = i; j < kSmemGuard; ++j)
        if (g[j] != kGuardByte) last = j;
      set_fault(L, kFaultAddress,
                format("dynamic shared memory overflow: bytes [%zu, %zu] past the end of the %zu-byte dynamic "
                       "shared memory buffer were written (detected at %s)",
                       i, last, L.smem_bytes, f ? "__syncthreads" : "block end"),
                f);
      return false;
    }
  }
  return true;
}

void perform_copies(Fiber* f, size_t upto) {
  for (size_t i = 0; i < upto; ++i) {
    CpOp& op = f->cp[i];
    if (op.src_bytes) std::memcpy(op.dst, op.src, op.src_bytes);
    if (op.bytes > op.src_bytes) std::memset(static_cast<char*>(op.dst) + op.src_bytes, 0, op.bytes - op.src_bytes);
  }
  f->cp.erase(f->cp.begin(), f->cp.begin() + upto);
  for (size_t& g : f->groups) g -= upto;
}

std::string lane_list(unsigned m) {
  std::string s;
  int i = 0;
  while (i < 32) {
    if (!(m >> i & 1)) {
      ++i;
      continue;
    }
    int j = i;
    while (j + 1 < 32 && (m >> (j + 1) & 1)) ++j;
    if (!s.empty()) s += ",";
    s += j == i ? format("%d", i) : format("%d-%d", i, j);
    i = j + 1;
  }
  return s.empty() ? "none" : s;
}

std::string describe_stall(Launch& L, Fiber** first) {
  std::string s;
  unsigned nbar = 0, nrun = 0;
  *first = nullptr;
  for (unsigned i = 0; i < L.nthreads; ++i) {
    Fiber* f = L.fibers[i];
    if (f->st == St::BarWait) {
      ++nbar;
      if (!*first) *first = f;
    }
    if (f->st == St::Runnable || f->st == St::Running) ++nrun;
  }
  if (nbar)
    s += format("%u thread(s) wait at __syncthreads (%s:%u:%u); ", nbar, L.bar_file ? L.bar_file : "?", L.bar_line,
                L.bar_col);
  if (L.nexited) s += format("%u thread(s) have exited; ", L.nexited);
  unsigned nwarps = (L.nthreads + 31) / 32;
  for (unsigned w = 0; w < nwarps; ++w) {
    unsigned coll = 0, ex = 0, bar = 0;
    const char* name = nullptr;
    unsigned mask = 0;
    for (unsigned l = 0; l < 32 && w * 32 + l < L.nthreads; ++l) {
      Fiber* f = L.fibers[w * 32 + l];
      if (f->st == St::WarpWait) {
        coll |= 1u << l;
        if (!name) {
          name = f->cname;
          mask = f->cmask;
          if (!*first) *first = f;
        }
      } else if (f->st == St::Exited) {
        ex |= 1u << l;
      } else if (f->st == St::BarWait) {
        bar |= 1u << l;
      }
    }
    if (coll)
      s += format("warp %u: lanes {%s} wait at %s (mask 0x%08x), lanes {%s} at __syncthreads, lanes {%s} exited; ", w,
                  lane_list(coll).c_str(), name, mask, lane_list(bar).c_str(), lane_list(ex).c_str());
  }
  (void)nrun;
  return s;
}

void fiber_exit(Launch& L, Fiber* f) {
  // Copies never waited for are dropped: they could only land in this block's shared memory after
  // the thread is gone, so any read of them was a race (and saw the 0xFF poison).
  f->cp.clear();
  f->groups.clear();
  f->st = St::Exited;
  ++L.nexited;
  if (L.bar_count > 0) {
    fiber_fault(L, f, kFaultGeneric,
                format("barrier divergence: thread exited while %u thread(s) wait at __syncthreads (%s:%u:%u)",
                       L.bar_count, L.bar_file, L.bar_line, L.bar_col));
  }
  unsigned base = f->warp * 32;
  for (unsigned l = 0; l < 32 && base + l < L.nthreads; ++l) {
    Fiber* o = L.fibers[base + l];
    if (o->st == St::WarpWait && (o->cmask >> f->lane & 1)) {
      fiber_fault(L, f, kFaultGeneric,
                  format("warp collective divergence: lane %u exited while lane %u waits at %s with mask 0x%08x "
                         "(which includes lane %u)",
                         f->lane, l, o->cname, o->cmask, f->lane));
    }
  }
  switch_to_scheduler(L, f);
  __builtin_trap();
}

}  // namespace

extern "C" void fi_simt_fiber_entry(void* arg) {
  Fiber* f = static_cast<Fiber*>(arg);
  Launch& L = *tls_launch;
  L.thunk(L.ctx);
  fiber_exit(L, f);
}

// ---- public (library-internal) entry points -----------------------------------------------------
void fault(int kind, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string what = vformat(fmt, ap);
  va_end(ap);
  Launch* L = tls_launch;
  if (!L || !tls_cur) {
    fprintf(stderr, "fastinfer simt: fault outside a kernel: %s\n", what.c_str());
    abort();
  }
  fiber_fault(*L, cur_fiber(), kind, what);
}

int barrier(int kind, int pred, const char* file, unsigned line, unsigned column) {
  Launch& L = *tls_launch;
  Fiber* f = cur_fiber();
  if (L.nexited > 0) {
    fiber_fault(L, f, kFaultGeneric,
                format("barrier divergence: __syncthreads at %s:%u:%u reached after %u thread(s) of the block exited",
                       file, line, column, L.nexited));
  }
  if (L.bar_count == 0) {
    L.bar_file = file;
    L.bar_line = line;
    L.bar_col = column;
    L.bar_kind = kind;
    L.bar_sum = 0;
    L.bar_and = 1;
    L.bar_or = 0;
  } else if (L.bar_line != line || L.bar_col != column || L.bar_kind != kind ||
             (L.bar_file != file && std::strcmp(L.bar_file, file) != 0)) {
    fiber_fault(L, f, kFaultGeneric,
                format("barrier divergence: thread arrives at __syncthreads %s:%u:%u while %u thread(s) wait at "
                       "__syncthreads %s:%u:%u",
                       file, line, column, L.bar_count, L.bar_file, L.bar_line, L.bar_col));
  }
  L.bar_sum += pred != 0;
  L.bar_and &= pred != 0;
  L.bar_or |= pred != 0;
  f->st = St::BarWait;
  if (++L.bar_count == L.nthreads) {
    if (!check_smem_guard(L, f)) fiber_fault(L, f, L.fault_kind, "");
    if (prof::g_launch_on) prof::epoch_end();  // the warps reconverge: close their pending requests
    int result = kind == 1 ? L.bar_sum : kind == 2 ? L.bar_and : L.bar_or;
    for (unsigned i = 0; i < L.nthreads; ++i) {
      L.fibers[i]->bresult = result;
      make_runnable(L, L.fibers[i]);
    }
    L.bar_count = 0;
  }
  block_me(L, f);
  return f->bresult;
}

int barrier_at(int kind, int pred, const std::source_location& loc) {
  return barrier(kind, pred, loc.file_name(), loc.line(), loc.column());
}

void warp_collective(const char* name, CollFn fn, unsigned mask, LaneIO* io) {
  Launch& L = *tls_launch;
  Fiber* f = cur_fiber();
  if (!(mask >> f->lane & 1)) {
    fiber_fault(L, f, kFaultGeneric,
                format("%s: mask 0x%08x does not include the calling lane %u", name, mask, f->lane));
  }
  f->cfn = fn;
  f->cname = name;
  f->cmask = mask;
  f->cio = io;
  f->st = St::WarpWait;
  unsigned base = f->warp * 32;
  bool ready = true;
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1)) continue;
    if (base + l >= L.nthreads) {
      fiber_fault(L, f, kFaultGeneric,
                  format("%s: lane %u named in mask 0x%08x does not exist (the block has %u threads)", name, l, mask,
                         L.nthreads));
    }
    Fiber* o = L.fibers[base + l];
    if (o->st == St::Exited) {
      fiber_fault(L, f, kFaultGeneric,
                  format("%s: lane %u named in mask 0x%08x has exited (missing lane)", name, l, mask));
    }
    if (o->st != St::WarpWait) {
      ready = false;
      continue;
    }
    if ((o->cfn != fn || o->cmask != mask) && (o->cmask >> f->lane & 1)) {
      fiber_fault(L, f, kFaultGeneric,
                  format("warp collective divergence: lane %u at %s (mask 0x%08x) while lane %u waits at %s (mask "
                         "0x%08x)",
                         f->lane, name, mask, l, o->cname, o->cmask));
    }
    if (o->cfn != fn || o->cmask != mask) ready = false;
  }
  if (ready) {
    LaneIO* lanes[32] = {};
    for (unsigned l = 0; l < 32; ++l)
      if (mask >> l & 1) lanes[l] = L.fibers[base + l]->cio;
    fn(lanes, mask);
    for (unsigned l = 0; l < 32; ++l)
      if (mask >> l & 1) make_runnable(L, L.fibers[base + l]);
  }
  block_me(L, f);
  if (L.faulted) fiber_fault(L, f, L.fault_kind, "");  // a collective computation reported a fault
}

unsigned active_mask() {
  Launch& L = *tls_launch;
  Fiber* f = cur_fiber();
  unsigned base = f->warp * 32, m = 0;
  for (unsigned l = 0; l < 32 && base + l < L.nthreads; ++l)
    if (L.fibers[base + l]->st != St::Exited) m |= 1u << l;
  return m;
}

void cp_async(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
  Launch& L = *tls_launch;
  Fiber* f = cur_fiber();
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % bytes != 0) {
    fiber_fault(L, f, kFaultAddress, format("cp.async of %u bytes with misaligned address (dst %p, src %p)", bytes,
                                            dst, src));
  }
  if (src_bytes > 0 && src == nullptr) fiber_fault(L, f, kFaultAddress, "cp.async from a null global address");
  if (src_bytes > bytes) fiber_fault(L, f, kFaultGeneric, format("cp.async src-size %u > cp-size %u", src_bytes, bytes));
  if (L.smem) {
    auto d = static_cast<unsigned char*>(dst);
    if (d >= L.smem && d < L.smem + L.smem_bytes + kSmemGuard && d + bytes > L.smem + L.smem_bytes) {
      fiber_fault(L, f, kFaultAddress,
                  format("cp.async destination [%zu, %zu) beyond the %zu-byte dynamic shared memory buffer",
                         (size_t)(d - L.smem), (size_t)(d - L.smem) + bytes, L.smem_bytes));
    }
  }
  f->cp.push_back(CpOp{dst, src, bytes, src_bytes});
}

void cp_async_commit() {
  Fiber* f = cur_fiber();
  f->groups.push_back(f->cp.size());
}

void cp_async_wait(int n) {
  Fiber* f = cur_fiber();
  if (n < 0) n = 0;
  size_t g = f->groups.size();
  if (g <= (size_t)n) return;
  size_t upto = f->groups[g - n - 1];
  f->groups.erase(f->groups.begin(), f->groups.begin() + (g - n));
  perform_copies(f, upto);
}

// ---- launch -------------------------------------------------------------------------------------
namespace {

void run_block(Launch& L, uint3 bidx) {
  L.nexited = 0;
  L.bar_count = 0;
  L.runnable.clear();
  if (L.smem) {
    std::memset(L.smem, 0xFF, L.smem_bytes);
    std::memset(L.smem + L.smem_bytes, kGuardByte, kSmemGuard);
  }
  unsigned bx = L.block.x, by = L.block.y;
  for (unsigned i = 0; i < L.nthreads; ++i) {
    Fiber* f = L.fibers[i];
    f->thread_idx = uint3{i % bx, (i / bx) % by, i / (bx * by)};
    f->block_idx = bidx;
    f->block_dim = L.block;
    f->grid_dim = L.grid;
    f->linear = i;
    f->lane = i % 32;
    f->warp = i / 32;
    f->dyn_smem = L.smem;
    f->st = St::Runnable;
    f->cp.clear();
    f->groups.clear();
    f->sp = init_stack(f);
    L.runnable.push_back(f);
  }
  g_threads.fetch_add(L.nthreads, std::memory_order_relaxed);
  unsigned long long sw = 0;
  while (!L.faulted) {
    size_t n = L.runnable.size();
    if (n == 0) {
      if (L.nexited == L.nthreads) break;
      Fiber* first = nullptr;
      std::string d = describe_stall(L, &first);
      set_fault(L, kFaultGeneric, "deadlock (no thread can make progress): " + d, first);
      break;
    }
    uint32_t k = n == 1 ? 0 : rand_below(L.rng, (uint32_t)n);
    Fiber* f = L.runnable[k];
    L.runnable[k] = L.runnable[n - 1];
    L.runnable.pop_back();
    f->st = St::Running;
    tls_cur = f;
    switch_to_fiber(L, f);
    sw += 2;
  }
  tls_cur = nullptr;
  L.switches += sw;
  if (!L.faulted) check_smem_guard(L, nullptr);
  if (prof::g_launch_on) prof::block_end();  // closes the pending requests too
}

}  // namespace

cudaError_t launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t, Thunk thunk,
                   void* ctx) {
  if (tls_launch) {
    tls_fault_msg = "fastinfer simt: kernel launch from inside a kernel is not supported";
    tls_fault_code = cudaErrorNotSupported;
    return cudaErrorNotSupported;
  }
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  g_launches.fetch_add(1, std::memory_order_relaxed);
  unsigned long long launch_no = g_launch_counter.fetch_add(1, std::memory_order_relaxed);
  unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0 || nthreads > 1024 ||
      block.x > 1024 || block.y > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 ||
      grid.x > 2147483647u) {
    tls_fault_msg = format("fastinfer simt: invalid launch configuration for kernel `%s`: grid (%u,%u,%u) block "
                           "(%u,%u,%u)",
                           internal::kernel_name(kernel).c_str(), grid.x, grid.y, grid.z, block.x, block.y, block.z);
    tls_fault_code = cudaErrorInvalidConfiguration;
    return cudaErrorInvalidConfiguration;
  }
  if (dynamic_smem > kMaxDynamicSmem) {
    tls_fault_msg = format("fastinfer simt: kernel `%s` requests %zu bytes of dynamic shared memory (max %zu)",
                           internal::kernel_name(kernel).c_str(), dynamic_smem, kMaxDynamicSmem);
    tls_fault_code = cudaErrorInvalidValue;
    return cudaErrorInvalidValue;
  }
  while (g_fibers.size() < nthreads) {
    Fiber* f = new Fiber();
    f->stack = alloc_stack();
    f->stack_lo = reinterpret_cast<uintptr_t>(f->stack);
    f->stack_hi = f->stack_lo + kStackSize;
    g_fibers.push_back(f);
  }
  Launch L;
  L.kernel = kernel;
  L.thunk = thunk;
  L.ctx = ctx;
  L.grid = grid;
  L.block = block;
  L.nthreads = (unsigned)nthreads;
  L.fibers = g_fibers.data();
  L.runnable.reserve(nthreads);
  L.smem_bytes = dynamic_smem;
  void* smem_raw = nullptr;
  if (dynamic_smem > 0) {
    smem_raw = aligned_alloc(64, (dynamic_smem + kSmemGuard + 63) / 64 * 64);
    L.smem = static_cast<unsigned char*>(smem_raw);
  }
  const char* seed_env = getenv("FASTINFER_SIMT_SEED");
  uint64_t seed = seed_env ? strtoull(seed_env, nullptr, 0) : 0;
  L.rng = seed * 0xD1B54A32D192ED03ull + launch_no * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  splitmix(L.rng);

  unsigned long long nblocks = (unsigned long long)grid.x * grid.y * grid.z;
  std::vector<uint32_t> order;
  bool shuffled = nblocks <= (1ull << 24);
  if (shuffled) {
    order.resize(nblocks);
    for (uint32_t i = 0; i < nblocks; ++i) order[i] = i;
    for (uint32_t i = (uint32_t)nblocks; i > 1; --i) std::swap(order[i - 1], order[rand_below(L.rng, i)]);
  }
  if (prof::launch_begin(kernel, grid, block, dynamic_smem, L.smem)) {  // profiler: launch configuration only
    free(smem_raw);
    return cudaSuccess;
  }
  // Profiler CTA sampling: only the CTAs whose (x, y) the lattice keeps (at least those of (0, 0)).
  const bool sampled = prof::g_launch_on && prof::g_sample > 1 && !prof::g_launch_whole;
  bool any_kept = false;
  if (sampled) {
    for (unsigned y = 0; y < grid.y && !any_kept; ++y)
      for (unsigned x = 0; x < grid.x && !any_kept; ++x) any_kept = prof::sample_keeps(x, y, grid.y);
  }
  tls_launch = &L;
  unsigned long long done = 0;
  for (unsigned long long b = 0; b < nblocks && !L.faulted; ++b) {
    unsigned long long id = shuffled ? order[b] : b;
    uint3 bidx{(unsigned)(id % grid.x), (unsigned)((id / grid.x) % grid.y), (unsigned)(id / ((unsigned long long)grid.x * grid.y))};
    if (sampled && !(any_kept ? prof::sample_keeps(bidx.x, bidx.y, grid.y) : (bidx.x == 0 && bidx.y == 0))) continue;
    run_block(L, bidx);
    ++done;
  }
  tls_launch = nullptr;
  tls_cur = nullptr;
  prof::launch_end(L.faulted, done);
  free(smem_raw);
  g_blocks.fetch_add(done, std::memory_order_relaxed);
  g_switches.fetch_add(L.switches, std::memory_order_relaxed);
  if (L.faulted) {
    cudaError_t code = L.fault_kind == kFaultAssert    ? cudaErrorAssert
                       : L.fault_kind == kFaultAddress ? cudaErrorIllegalAddress
                                                       : cudaErrorLaunchFailure;
    tls_fault_msg = L.msg;
    tls_fault_code = code;
    internal::record_async_error(code);
    if (getenv("FASTINFER_SIMT_QUIET") == nullptr) fprintf(stderr, "%s\n", L.msg.c_str());
    return code;
  }
  return cudaSuccess;
}

}  // namespace detail

Stats stats() {
  return Stats{detail::g_switches.load(), detail::g_blocks.load(), detail::g_launches.load(), detail::g_threads.load()};
}
void reset_stats() {
  detail::g_switches = 0;
  detail::g_blocks = 0;
  detail::g_launches = 0;
  detail::g_threads = 0;
}
const char* last_fault_message() { return detail::tls_fault_msg.c_str(); }

namespace internal {
std::string kernel_name(const void* k) {
  Dl_info info;
  if (k && dladdr(k, &info) && info.dli_sname) {
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string r = (status == 0 && d) ? d : info.dli_sname;
    free(d);
    return r;
  }
  char buf[64];
  snprintf(buf, sizeof buf, "kernel@%p", k);
  return buf;
}

const char* fault_message_for(cudaError_t e) {
  if (e != cudaSuccess && e == detail::tls_fault_code && !detail::tls_fault_msg.empty())
    return detail::tls_fault_msg.c_str();
  return nullptr;
}
}  // namespace internal

}  // namespace fastinfer::simt
