// fastinfer simt: the callbacks of GCC's -fsanitize=thread code generation, implemented for the
// memory-access profiler instead of libtsan (programs built with the profile flags are compiled
// with -fsanitize=thread but linked without it). Every instrumented load and store reports its
// address, width and call site (the return address into the instrumented code); atomics
// generated from __atomic builtins (host code: std::atomic) are performed, not counted.
// A program built with the profile flags must not also link the real ThreadSanitizer runtime.
#include "profile.h"

#include <cstdint>
#include <mutex>

namespace {

inline void load(void* ret, void* addr, unsigned size) {
  ::fastinfer::simt::prof::on_access(reinterpret_cast<uintptr_t>(ret), ::fastinfer::simt::detail::kProfLoad, addr, size,
                                     nullptr, 0);
}
inline void store(void* ret, void* addr, unsigned size) {
  ::fastinfer::simt::prof::on_access(reinterpret_cast<uintptr_t>(ret), ::fastinfer::simt::detail::kProfStore, addr,
                                     size, nullptr, 0);
}

std::mutex g_atomic128_mutex;

}  // namespace

#define FI_RET __builtin_return_address(0)

extern "C" {

void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_ignore_thread_begin() {}
void __tsan_ignore_thread_end() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}

#define FI_TSAN_RW(N)                                                            \
  void __tsan_read##N(void* a) { load(FI_RET, a, N); }                           \
  void __tsan_write##N(void* a) { store(FI_RET, a, N); }                         \
  void __tsan_unaligned_read##N(void* a) { load(FI_RET, a, N); }                 \
  void __tsan_unaligned_write##N(void* a) { store(FI_RET, a, N); }               \
  void __tsan_volatile_read##N(void* a) { load(FI_RET, a, N); }                  \
  void __tsan_volatile_write##N(void* a) { store(FI_RET, a, N); }                \
  void __tsan_unaligned_volatile_read##N(void* a) { load(FI_RET, a, N); }        \
  void __tsan_unaligned_volatile_write##N(void* a) { store(FI_RET, a, N); }      \
  void __tsan_read##N##_pc(void* a, void* pc) { load(pc, a, N); }                \
  void __tsan_write##N##_pc(void* a, void* pc) { store(pc, a, N); }
FI_TSAN_RW(1)
FI_TSAN_RW(2)
FI_TSAN_RW(4)
FI_TSAN_RW(8)
FI_TSAN_RW(16)
#undef FI_TSAN_RW

void __tsan_read_range(void* a, unsigned long size) { load(FI_RET, a, static_cast<unsigned>(size)); }
void __tsan_write_range(void* a, unsigned long size) { store(FI_RET, a, static_cast<unsigned>(size)); }

// Atomics: performed sequentially consistent (the memory order argument is ignored).
#define FI_TSAN_ATOMIC(N, T)                                                                                 \
  T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); }       \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }      \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }   \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) { return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); } \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                        \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                  \
  }                                                                                                          \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {                          \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                   \
  }                                                                                                          \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                              \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);                        \
    return c;                                                                                                \
  }
FI_TSAN_ATOMIC(8, int8_t)
FI_TSAN_ATOMIC(16, int16_t)
FI_TSAN_ATOMIC(32, int32_t)
FI_TSAN_ATOMIC(64, int64_t)
#undef FI_TSAN_ATOMIC

// 128-bit atomics under a lock (no libatomic needed).
using fi_i128 = __int128;
#define FI_LOCKED(EXPR) \
  std::lock_guard<std::mutex> lock(g_atomic128_mutex); \
  EXPR
fi_i128 __tsan_atomic128_load(const volatile fi_i128* a, int) { FI_LOCKED(return *a;) }
void __tsan_atomic128_store(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(*a = v;) }
fi_i128 __tsan_atomic128_exchange(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = v; return o;) }
fi_i128 __tsan_atomic128_fetch_add(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = o + v; return o;) }
fi_i128 __tsan_atomic128_fetch_sub(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = o - v; return o;) }
fi_i128 __tsan_atomic128_fetch_and(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = o & v; return o;) }
fi_i128 __tsan_atomic128_fetch_or(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = o | v; return o;) }
fi_i128 __tsan_atomic128_fetch_xor(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = o ^ v; return o;) }
fi_i128 __tsan_atomic128_fetch_nand(volatile fi_i128* a, fi_i128 v, int) { FI_LOCKED(fi_i128 o = *a; *a = ~(o & v); return o;) }
int __tsan_atomic128_compare_exchange_strong(volatile fi_i128* a, fi_i128* c, fi_i128 v, int, int) {
  FI_LOCKED(if (*a == *c) { *a = v; return 1; } *c = *a; return 0;)
}
int __tsan_atomic128_compare_exchange_weak(volatile fi_i128* a, fi_i128* c, fi_i128 v, int m, int f) {
  return __tsan_atomic128_compare_exchange_strong(a, c, v, m, f);
}
fi_i128 __tsan_atomic128_compare_exchange_val(volatile fi_i128* a, fi_i128 c, fi_i128 v, int, int) {
  FI_LOCKED(fi_i128 o = *a; if (o == c) *a = v; return o;)
}
#undef FI_LOCKED

void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

}  // extern "C"
