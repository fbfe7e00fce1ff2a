// CPU implementation of dense_mm and the batch-invariant fp32 GEMM behind it (batch_invariant_mm.h).
// ATen's GEMM (MKL / oneDNN / OpenBLAS) picks its blocking and k-splits from M, so a row's bits
// change with the batch (tests/test_deterministic_gemm.py shows it); this one does not: every
// output element is reduced by the same code, one micro-kernel, with a k-order fixed by K alone.
//
// Blocking: columns in chunks of kChunkCols (those rows of b read in place when b is fp32 and K a
// multiple of 8, else converted to zero-padded fp32 once; a likewise), rows in blocks of kRows x
// kCols outputs (8 fp32 lanes each: 12 AVX2 accumulators), the last M % kRows rows one at a time. The fma are explicit (never left to the compiler's contraction),
// so every block shape and both the AVX2 and the portable micro-kernel give the same bits.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "gemm_dense/batch_invariant_mm.h"
#include "cpu_simd.h"
#include "overrides.h"
#include "gemm_dense/contract.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTINFER_DENSE_AVX2 1
#else
#define FASTINFER_DENSE_AVX2 0
#endif

namespace fastinfer::binding {
namespace {

constexpr int kLanes = 8;
constexpr int64_t kChunkCols = 24;
// Block shapes: kRows x kCols for every full group of 4 rows; the rows past the last full group
// one at a time against kTailCols columns (M = 1 does no wasted work). Both shapes compute every
// element with the same sequence of fma and the same final sum, so they give the same bits.
constexpr int kRows = 4, kCols = 3, kTailCols = 8;
static_assert(kChunkCols % kTailCols == 0 && kChunkCols % kCols == 0, "chunks hold whole column blocks");

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// out[r][c] = sum over k of a_rows[r][k] * b_rows[c][k] (kp a multiple of kLanes) in the fixed
// order: lane l accumulates k = l, l + 8, ... by fma, then the lanes are summed pairwise. Two
// implementations of that one order (AVX2 + FMA, and std::fma per lane), bitwise the same.
template <int R, int C>
void block_dot_scalar(const float* const (&a_rows)[R], const float* const (&b_rows)[C], int64_t kp,
                      float (&out)[R][C]) {
  float acc[R][C][kLanes] = {};
  for (int64_t k = 0; k < kp; k += kLanes)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < kLanes; ++l) acc[r][c][l] = std::fma(a_rows[r][k + l], b_rows[c][k + l], acc[r][c][l]);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = cpu::tree_sum<kLanes>(acc[r][c]);
}

#if FASTINFER_DENSE_AVX2
// The compiler does not keep the accumulators of the scalar form in registers (2 GFLOP/s
// measured): written with intrinsics, compiled for AVX2 + FMA whatever the baseline ISA.
// Eight elements of a b row as fp32 (exact conversions: bf16 by a shift, fp16 by F16C), so bf16 /
// fp16 weights are read where they are instead of converted to an fp32 copy on every call.
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R, int C, typename BT>
__attribute__((target("avx2,fma,f16c"))) void block_dot_avx2(const float* const (&a_rows)[R],
                                                             const BT* const (&b_rows)[C], int64_t kp,
                                                             float (&out)[R][C]) {
  static_assert(kLanes == 8, "one __m256 per output");
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; k += kLanes) {
    __m256 bv[C];
    for (int c = 0; c < C; ++c) bv[c] = load8(b_rows[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_loadu_ps(a_rows[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
  // The lane sums of eight accumulators at a time, transposed into registers: the additions of
  // cpu::tree_sum<8> ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)) on the same operands, so the
  // same bits, without a store and seven scalar adds per output (a quarter of the work at K = 256).
  constexpr int kOutputs = R * C, kGroups = (kOutputs + 7) / 8;
  __m256 flat[kGroups * 8];
  for (int i = 0; i < kGroups * 8; ++i) flat[i] = i < kOutputs ? acc[i / C][i % C] : _mm256_setzero_ps();
  for (int g = 0; g < kGroups; ++g) {
    const __m256* x = flat + 8 * g;
    __m256 s[4], t[2];
    for (int i = 0; i < 4; ++i)  // [x_j + x_{j+4}] of accumulators 2i (low half) and 2i + 1 (high half)
      s[i] = _mm256_add_ps(_mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(x[2 * i], x[2 * i + 1], 0x31));
    for (int i = 0; i < 2; ++i)  // + the pair two lanes up: [s_0 + s_2, s_1 + s_3] of two accumulators per half
      t[i] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 sum = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float lanes[8];  // accumulators 0 2 4 6 | 1 3 5 7 of the group
    _mm256_store_ps(lanes, sum);
    for (int j = 0; j < 8; ++j) {
      const int i = 8 * g + (j < 4 ? 2 * j : 2 * (j - 4) + 1);
      if (i < kOutputs) out[i / C][i % C] = lanes[j];
    }
  }
}
#else
template <int R, int C, typename BT>
void block_dot_avx2(const float* const (&)[R], const BT* const (&)[C], int64_t, float (&)[R][C]) {}  // never called
#endif

// FASTINFER_TEST_CPU_DENSE_PORTABLE=1 (overrides.h) takes the portable micro-kernel on an AVX2
// machine too (tests: both give the same bits).
bool use_avx2() {
#if FASTINFER_DENSE_AVX2
  static const bool ok =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return ok && !binding::cpu_dense_portable();
#else
  return false;
#endif
}

// Rows [r0, r0 + R) of out against the columns [n0, n0 + cols) of this chunk, C at a time (a
// block past `cols` reads the chunk's last column again and drops those results).
// b rows of type BT (fp32, or bf16 / fp16 read in place: AVX2 only).
template <int R, int C, typename BT>
void rows_mm(const float* a, int64_t r0, const BT* bc, int64_t cols, int64_t kp, bool avx2, float* out, int64_t N,
             int64_t n0) {
  const float* a_rows[R];
  for (int r = 0; r < R; ++r) a_rows[r] = a + (r0 + r) * kp;
  for (int64_t c0 = 0; c0 < cols; c0 += C) {
    const BT* b_rows[C];
    for (int c = 0; c < C; ++c) b_rows[c] = bc + std::min<int64_t>(c0 + c, cols - 1) * kp;
    float res[R][C];
    if constexpr (std::is_same_v<BT, float>) {
      if (avx2)
        block_dot_avx2<R, C, BT>(a_rows, b_rows, kp, res);
      else
        block_dot_scalar<R, C>(a_rows, b_rows, kp, res);
    } else {
      block_dot_avx2<R, C, BT>(a_rows, b_rows, kp, res);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C && c0 + c < cols; ++c) out[(r0 + r) * N + n0 + c0 + c] = res[r][c];
  }
}

// Columns [n0, n0 + cols) of out from their rows of b (bc [cols][kp]).
template <typename BT>
void chunk_mm(const float* a, int64_t M, const BT* bc, int64_t cols, int64_t kp, bool avx2, float* out, int64_t N,
              int64_t n0) {
  const int64_t full = M / kRows * kRows;
  for (int64_t r0 = 0; r0 < full; r0 += kRows) rows_mm<kRows, kCols, BT>(a, r0, bc, cols, kp, avx2, out, N, n0);
  for (int64_t r = full; r < M; ++r) rows_mm<1, kTailCols, BT>(a, r, bc, cols, kp, avx2, out, N, n0);
}

// rows [r0, r0 + rows) of src [R, K] (contiguous, of dtype `type`) as fp32 into dst [rows][kp]
// (zero padding past K and past R).
void rows_to_f32(const void* src, ScalarType type, int64_t R, int64_t K, int64_t r0, int64_t rows, int64_t kp,
                 float* dst) {
  std::fill(dst, dst + rows * kp, 0.f);
  FASTINFER_DISPATCH_FLOAT_TYPES(type, "rows_to_f32", [&] {
    const scalar_t* s = static_cast<const scalar_t*>(src);
    for (int64_t r = 0; r < rows && r0 + r < R; ++r)
      for (int64_t k = 0; k < K; ++k) dst[r * kp + k] = static_cast<float>(s[(r0 + r) * K + k]);
  });
}

}  // namespace

int64_t batch_invariant_padded_k(int64_t K) { return round_up(K, kLanes); }

void batch_invariant_mm_f32_rows(const float* a, int64_t M, const void* b, ScalarType b_type, int64_t N, int64_t K,
                                 float* out) {
  if (M == 0 || N == 0) return;
  const int64_t kp = round_up(K, kLanes);
  const bool avx2 = use_avx2();
  // b read where it is: fp32 always, bf16 / fp16 with the AVX2 kernel (else an fp32 copy per chunk).
  const bool half_b = b_type == kBFloat16 || b_type == kHalf;
  const bool b_in_place = kp == K && (b_type == kFloat || (avx2 && half_b));
  const int64_t chunks = (N + kChunkCols - 1) / kChunkCols;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> bc(b_in_place ? 0 : static_cast<size_t>(kChunkCols * kp));
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t n0 = ch * kChunkCols, cols = std::min(kChunkCols, N - n0);
      if (!b_in_place) {
        rows_to_f32(b, b_type, N, K, n0, cols, kp, bc.data());
        chunk_mm<float>(a, M, bc.data(), cols, kp, avx2, out, N, n0);
      } else if (b_type == kBFloat16) {
        chunk_mm<BFloat16>(a, M, static_cast<const BFloat16*>(b) + n0 * K, cols, kp, avx2, out, N, n0);
      } else if (b_type == kHalf) {
        chunk_mm<Half>(a, M, static_cast<const Half*>(b) + n0 * K, cols, kp, avx2, out, N, n0);
      } else {
        chunk_mm<float>(a, M, static_cast<const float*>(b) + n0 * K, cols, kp, avx2, out, N, n0);
      }
    }
  });
}

Tensor batch_invariant_mm_f32(const Tensor& a_in, const Tensor& b_in) {
  const Tensor a = torch::stable::contiguous(a_in), b = torch::stable::contiguous(b_in);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  auto out = empty_on(a, {M, N}, kFloat);
  if (M == 0 || N == 0) return out;
  if (K == 0) return torch::stable::zero_(out);
  const int64_t kp = round_up(K, kLanes);
  // fp32 rows that need no padding are read where they are (the same values and fma sequence as a
  // converted copy: the bits do not depend on which).
  std::vector<float> af;
  const float* ap = nullptr;
  if (a.scalar_type() == kFloat && kp == K) {
    ap = a.const_data_ptr<float>();
  } else {
    af.resize(static_cast<size_t>(M * kp));
    torch::stable::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      rows_to_f32(a.const_data_ptr(), a.scalar_type(), M, K, begin, end - begin, kp, af.data() + begin * kp);
    });
    ap = af.data();
  }
  batch_invariant_mm_f32_rows(ap, M, b.const_data_ptr(), b.scalar_type(), N, K, out.mutable_data_ptr<float>());
  return out;
}

namespace {

Tensor dense_mm_cpu(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias) {
  const char* op = "dense_mm";
  validate_dense_mm(op, a, b, bias, /*allow_fp32=*/true);
  check_on_cpu(a, op, "a");
  check_dense_mm_layout(op, a, b, bias);
  auto acc = batch_invariant_mm_f32(a, b);
  if (bias.has_value()) add_bias_f32(acc, *bias);  // elementwise: fp32, then one rounding
  return contiguous_as(acc, a.scalar_type());
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("dense_mm", TORCH_BOX(&dense_mm_cpu));
}
