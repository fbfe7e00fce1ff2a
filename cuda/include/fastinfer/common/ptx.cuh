// The ONLY file with inline PTX. Every wrapper has an FASTINFER_SIMT twin implementing the PTX ISA
// semantics on the host emulator (warp collectives with the documented fragment layouts).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 / m16n8k32"), with
// g = lane >> 2 (groupID) and t = lane & 3 (threadID_in_group):
//   m16n8k16 f16/bf16  A (row-major 16x16, 4 regs x 2 halves):
//       a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..2t+1]  a[2] = A[g][2t+8..+9]  a[3] = A[g+8][2t+8..+9]
//     B (16x8, "col": element (k, n)), 2 regs x 2 halves:
//       b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]
//     C/D (16x8 f32): c[0..1] = C[g][2t..2t+1]  c[2..3] = C[g+8][2t..2t+1]
//   m16n8k32 e4m3      A (16x32, 4 regs x 4 bytes):
//       a[0] = A[g][4t..4t+3]  a[1] = A[g+8][4t..4t+3]  a[2] = A[g][4t+16..+19]  a[3] = A[g+8][4t+16..+19]
//     B (32x8): b[0] = B[4t..4t+3][g]  b[1] = B[4t+16..4t+19][g];  C/D as above.
//   ldmatrix m8n8 .b16: matrix i takes its 8 row addresses from lanes 8i..8i+7 (16 bytes per row);
//     r[i] of lane l = M_i[l/4][2(l%4)..2(l%4)+1]; with .trans r[i] = (M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]).
//     (.x1 uses the addresses of lanes 0-7, .x2 of lanes 0-15; all 32 lanes must execute it.)
//   Lower-indexed element in the low 16 (or 8) bits of each register.
#pragma once

#include "fastinfer/common/platform.cuh"

#include <cstdint>
#include <type_traits>

#if defined(FASTINFER_SIMT)
#include <fastinfer/simt/ptx.h>
#endif

// Wrappers that move memory (ldmatrix, cp.async) report each lane's access to the simt profiler
// in profile builds (FASTINFER_SIMT_PROFILE): there they are out-of-line, uninstrumented
// functions, so the call site they report is their caller's (cpp/simt/README.md, "Profiling").
#if defined(FASTINFER_SIMT) && defined(FASTINFER_SIMT_PROFILE)
#define FASTINFER_PTX_MEM_FN __device__ inline __attribute__((noinline, no_sanitize("thread")))
#define FASTINFER_PTX_REPORT(op, addr, size, addr2, size2)                                                       \
  ::fastinfer::simt::detail::prof_record(reinterpret_cast<uintptr_t>(__builtin_return_address(0)), (op), (addr), \
                                         (size), (addr2), (size2))
#else
#define FASTINFER_PTX_MEM_FN __device__ __forceinline__
#define FASTINFER_PTX_REPORT(op, addr, size, addr2, size2) ((void)0)
#endif

// ---- the frame of every wrapper ---------------------------------------------------------------
// A wrapper states three things: its simt twin, the oldest architecture that has the instruction
// (80 or 89: FASTINFER_PTX_FROM_SM<floor>) and its inline PTX, each statement list in parentheses:
//   FASTINFER_PTX(89, (simt twin;), (asm volatile(...);))
// The emulator compiles the twin; a device pass for that architecture or a newer one the PTX; an
// older device pass (and nvcc's host pass, which runs no device code) a trap, so a kernel compiled
// for an architecture without the instruction fails loudly instead of computing wrong output.
#define FASTINFER_PTX_STATEMENTS(...) __VA_ARGS__
#if defined(FASTINFER_SIMT)
#define FASTINFER_PTX(FLOOR, SIMT, PTX) FASTINFER_PTX_STATEMENTS SIMT
#else
#define FASTINFER_PTX(FLOOR, SIMT, PTX) FASTINFER_PTX_FROM_SM##FLOOR(FASTINFER_PTX_STATEMENTS PTX)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define FASTINFER_PTX_FROM_SM80(...) __VA_ARGS__
#else
#define FASTINFER_PTX_FROM_SM80(...) __trap();
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FASTINFER_PTX_FROM_SM89(...) __VA_ARGS__
#else
#define FASTINFER_PTX_FROM_SM89(...) __trap();
#endif

namespace fastinfer::ptx {

// ---- mma.sync (row.col, f32 accumulate) -------------------------------------------------------
// The four shapes have one operand list: d (4 regs), a (4), b (2), c (4); "f" or "r" registers.
#define FASTINFER_PTX_MMA_OPERANDS(R)                                                                          \
  : "=" R(d[0]), "=" R(d[1]), "=" R(d[2]), "=" R(d[3])                                                         \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), R(c[0]), R(c[1]), R(c[2]), R(c[3])
#define FASTINFER_PTX_MMA_REGS " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"

__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                 const float (&c)[4]) {
  FASTINFER_PTX(80, (::fastinfer::simt::detail::mma(::fastinfer::simt::detail::kMmaF16, d, a, b, c);),
                (asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" FASTINFER_PTX_MMA_REGS
                              FASTINFER_PTX_MMA_OPERANDS("f"));))
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
  FASTINFER_PTX(80, (::fastinfer::simt::detail::mma(::fastinfer::simt::detail::kMmaBF16, d, a, b, c);),
                (asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" FASTINFER_PTX_MMA_REGS
                              FASTINFER_PTX_MMA_OPERANDS("f"));))
}

// d += a b for 16-bit inputs of type T (__half or __nv_bfloat16): the kernels' one spelling.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 / bf16 only");
  if constexpr (std::is_same_v<T, __half>)
    mma_m16n8k16_f16(d, a, b, d);
  else
    mma_m16n8k16_bf16(d, a, b, d);
}

// e4m3 x e4m3 -> f32, sm_89+ (traps when compiled for an older architecture).
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
  FASTINFER_PTX(89, (::fastinfer::simt::detail::mma(::fastinfer::simt::detail::kMmaE4M3, d, a, b, c);),
                (asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32" FASTINFER_PTX_MMA_REGS
                              FASTINFER_PTX_MMA_OPERANDS("f"));))
}

// s8 x s8 -> s32, m16n8k32 (sm_80+): the fragment layouts of the e4m3 variant above (4 bytes per
// register, lower k in the low byte), int32 accumulators. No .satfinite: the sum wraps modulo 2^32,
// which int8 GEMMs with K < 2^17 never reach. The simt twin is exact integer arithmetic.
__device__ __forceinline__ void mma_m16n8k32_s8(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                const int32_t (&c)[4]) {
  FASTINFER_PTX(80, (::fastinfer::simt::detail::mma_s8(d, a, b, c);),
                (asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32" FASTINFER_PTX_MMA_REGS
                              FASTINFER_PTX_MMA_OPERANDS("r"));))
}
#undef FASTINFER_PTX_MMA_OPERANDS
#undef FASTINFER_PTX_MMA_REGS

// ---- ldmatrix (shared -> registers, m8n8 b16) --------------------------------------------------
// r[0..N-1] from the shared address addr, for N = 1, 2, 4 matrices.
#define FASTINFER_PTX_LDMATRIX_ASM_1(PTX) asm volatile(PTX " {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr))
#define FASTINFER_PTX_LDMATRIX_ASM_2(PTX) asm volatile(PTX " {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr))
#define FASTINFER_PTX_LDMATRIX_ASM_4(PTX) \
  asm volatile(PTX " {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr))
#define FASTINFER_PTX_LDMATRIX(NAME, N, TRANS, PTX)                                                               \
  FASTINFER_PTX_MEM_FN void NAME(uint32_t* r, const void* smem) {                                                \
    FASTINFER_PTX(80,                                                                                            \
                  (FASTINFER_PTX_REPORT(::fastinfer::simt::detail::kProfLdmatrix | ((N) << 4) | ((TRANS) ? 128 : 0), \
                                        smem, 16, nullptr, 0);                                                   \
                   ::fastinfer::simt::detail::ldmatrix(r, smem, N, TRANS);),                                     \
                  (const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));                  \
                   FASTINFER_PTX_LDMATRIX_ASM_##N(PTX);))                                                        \
  }
FASTINFER_PTX_LDMATRIX(ldmatrix_x1, 1, false, "ldmatrix.sync.aligned.m8n8.x1.shared.b16")
FASTINFER_PTX_LDMATRIX(ldmatrix_x2, 2, false, "ldmatrix.sync.aligned.m8n8.x2.shared.b16")
FASTINFER_PTX_LDMATRIX(ldmatrix_x4, 4, false, "ldmatrix.sync.aligned.m8n8.x4.shared.b16")
FASTINFER_PTX_LDMATRIX(ldmatrix_x1_trans, 1, true, "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16")
FASTINFER_PTX_LDMATRIX(ldmatrix_x2_trans, 2, true, "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16")
FASTINFER_PTX_LDMATRIX(ldmatrix_x4_trans, 4, true, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16")
#undef FASTINFER_PTX_LDMATRIX
#undef FASTINFER_PTX_LDMATRIX_ASM_1
#undef FASTINFER_PTX_LDMATRIX_ASM_2
#undef FASTINFER_PTX_LDMATRIX_ASM_4

// ---- cp.async (global -> shared, 16 bytes, L2 only) --------------------------------------------
// When !pred nothing is read from gmem and the 16 bytes are zero-filled (src-size operand = 0).
FASTINFER_PTX_MEM_FN void cp_async_cg_16(void* smem, const void* gmem, bool pred = true) {
  FASTINFER_PTX(80,
                (FASTINFER_PTX_REPORT(::fastinfer::simt::detail::kProfCpAsync, smem, 16u, gmem, pred ? 16u : 0u);
                 ::fastinfer::simt::detail::cp_async(smem, gmem, 16, pred ? 16u : 0u);),
                (const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
                 const int src_size = pred ? 16 : 0;
                 asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(src_size));))
}

__device__ __forceinline__ void cp_async_commit() {
  FASTINFER_PTX(80, (::fastinfer::simt::detail::cp_async_commit();), (asm volatile("cp.async.commit_group;\n" ::);))
}

// Wait until at most N of this thread's committed groups are still pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0 && N <= 7, "cp.async.wait_group takes 0..7");
  FASTINFER_PTX(80, (::fastinfer::simt::detail::cp_async_wait(N);), (asm volatile("cp.async.wait_group %0;\n" ::"n"(N));))
}

// ---- lop3 / prmt (integer bit manipulation, used by the int4 dequantisation) -------------------
// lop3.b32 d, a, b, c, LUT: bit i of d = LUT[(a_i << 2) | (b_i << 1) | c_i], i.e. any 3-input
// boolean function given by its truth table on the canonical operands a = 0xF0, b = 0xCC, c = 0xAA
// (for example (a & b) | c is LUT 0xEA, a ^ b ^ c is 0x96).
template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  static_assert(LUT >= 0 && LUT <= 255, "lop3 takes an 8-bit truth table");
  uint32_t d = 0;
  FASTINFER_PTX(80,
                (for (int i = 0; i < 32; ++i) {
                  const uint32_t idx = (((a >> i) & 1u) << 2) | (((b >> i) & 1u) << 1) | ((c >> i) & 1u);
                  d |= ((static_cast<uint32_t>(LUT) >> idx) & 1u) << i;
                }),
                (asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));))
  return d;
}

// prmt.b32 d, a, b, sel (default mode): the 8 bytes {b, a} are numbered 0..7 (a's bytes 0-3, b's
// bytes 4-7); byte i of d is chosen by nibble i of sel: its low 3 bits select a byte and when its
// bit 3 is set the byte is replaced by the sign (bit 7) of the selected byte replicated to 8 bits.
// Only the low 16 bits of sel are used.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d = 0;
  FASTINFER_PTX(80,
                (const uint64_t v = (static_cast<uint64_t>(b) << 32) | a;
                 for (int i = 0; i < 4; ++i) {
                   const uint32_t s = (sel >> (4 * i)) & 0xFu;
                   uint32_t byte = static_cast<uint32_t>(v >> (8 * (s & 7u))) & 0xFFu;
                   if (s & 8u) byte = (byte & 0x80u) ? 0xFFu : 0x00u;
                   d |= byte << (8 * i);
                 }),
                (asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));))
  return d;
}

}  // namespace fastinfer::ptx

// The frame is this file's alone: inline PTX lives nowhere else.
#undef FASTINFER_PTX
#undef FASTINFER_PTX_STATEMENTS
#undef FASTINFER_PTX_FROM_SM80
#undef FASTINFER_PTX_FROM_SM89
