// CPU implementations of the int4 (W4A16) ops: int4_pack / int4_repack (the layout conversions
// shared with the CUDA/sim bindings, contract.h) and int4_gemm. int4_gemm dequantises with the kernels'
// rounding (w = (q - z) * s rounded once to a's dtype) and accumulates in fp32:
//  - M <= kFusedMaxM (decode; 16 rows, 8 in bf16): a loop over 16-column tiles on torch's thread pool that decodes each
//    64 x 16 unit of the packed weight once, in registers (through per-group tables of the 16
//    possible values), and applies it to every row of a (no weight copy): see "the decode path's
//    order of summation" below;
//  - larger M: 256-column chunks of W dequantised to fp32 and multiplied with ATen's matmul (its GEMM:
//    a row's bits depend on M), except with deterministic=True, which keeps the fused loop for
//    every M (each row's sums run in the same order whatever the other rows: batch invariant).

#include <algorithm>
#include <cmath>

#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "gemm_int4/contract.h"
#include "overrides.h"
#include "gemm_int4/dequantize_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTINFER_INT4_AVX512 1
#else
#define FASTINFER_INT4_AVX512 0
#endif

namespace fastinfer::binding {
namespace {

// The fused decode loop's largest M: beyond it a dequantised chunk and ATen's matmul are faster (in
// bf16 sooner: its matmul has the bf16 dot-product / AMX kernels).
template <typename T>
constexpr int64_t kFusedMaxM = std::is_same_v<T, BFloat16> ? 8 : 16;
constexpr int64_t kChunkN = 256;
constexpr int64_t kChunkBytes = int64_t{1} << 20;  // a dequantised chunk stays in L2

// The decode path's order of summation. In the int4_pack layout (gemm/int4.h) columns c and c + 8
// of a 64 x 16 unit live in the same 16 words (lanes 4c .. 4c + 3, four words each); word w of
// them holds, in nibble i, the weight at k = 16 (w & 3) + 2 (w >> 2) + kNibble[i].dk of column
// c + kNibble[i].dn. Each column keeps 16 fp32 lanes, lane w summing by fma, over the units in k
// order and the nibbles in order, the products of its weights in word position w with the matching
// activations; the lanes are then added by cpu::tree_sum<16>. The activations are gathered once per
// row into that order (xperm), so a unit is decoded into registers and never scattered.
// Two implementations of that one order, bitwise the same: AVX-512 (a 16-entry table lookup per
// nibble: vpermt2ps over the column's two groups) and std::fma per lane.
constexpr int kWords = 16;

// xperm[((r * kt_count + kt) * 8 + i) * 16 + w] = a[r][64 kt + 16 (w & 3) + 2 (w >> 2) + dk_i].
void gather_activations(const float* a, int64_t m, int64_t k, std::vector<float>& xperm) {
  const int64_t kts = k / 64;
  xperm.resize(static_cast<size_t>(m * kts * 8 * kWords));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kt = 0; kt < kts; ++kt)
      for (int i = 0; i < 8; ++i)
        for (int w = 0; w < kWords; ++w)
          xperm[((r * kts + kt) * 8 + i) * kWords + w] =
              a[r * k + 64 * kt + 16 * (w & 3) + 2 * (w >> 2) + kNibble[i].dk];
}

// The bf16 order (bf16 activations; int4_gemm_fused_bf16). The products (q - 8) x are exact in fp32
// (a 4-bit integer times a bf16 value). Lane w of a column sums, per unit in k order: q = 0, then for
// the word's pairs p = 0, 1 (k = k_w + 8 p, k_w = 64 kt + 16 (w & 3) + 2 (w >> 2)) q += w[k + 1]
// x[k + 1] and q += w[k] x[k] (vdpbf16ps' order: the odd element first), then lane += q s, s the
// lane's group scale, and with zero points lane -= xsum (z - 8) s, xsum the lane's four activations
// of the unit summed ((x[k_w] + x[k_w + 1]) + x[k_w + 8]) + x[k_w + 9]. So the weight is (q - z) s
// in fp32, not rounded to bf16 first as with the other dtypes. Subnormal activations count as zero
// (vdpbf16ps reads them so), and the two forms differ only where a pair's partial sum is subnormal
// (vdpbf16ps flushes it).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint32_t bits) {
  const uint32_t u = bits << 16;
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// xpair[((r * kts + kt) * 2 + p) * 16 + w] = the bits of (x[k], x[k + 1]), k = k_w + 8 p, low half
// first; xsum[(r * kts + kt) * 16 + w] (only with zero points) as the bf16 order says.
void gather_activation_pairs(const BFloat16* a, int64_t m, int64_t k, bool sums, std::vector<uint32_t>& xpair,
                             std::vector<float>& xsum) {
  const int64_t kts = k / 64;
  xpair.resize(static_cast<size_t>(m * kts * 2 * kWords));
  if (sums) xsum.resize(static_cast<size_t>(m * kts * kWords));
  const auto flushed = [](BFloat16 v) -> uint32_t { return (v.x & 0x7F80u) == 0 ? (v.x & 0x8000u) : v.x; };
  for (int64_t r = 0; r < m; ++r)
    for (int64_t kt = 0; kt < kts; ++kt)
      for (int w = 0; w < kWords; ++w) {
        const BFloat16* x = a + r * k + 64 * kt + 16 * (w & 3) + 2 * (w >> 2);
        for (int p = 0; p < 2; ++p)
          xpair[((r * kts + kt) * 2 + p) * kWords + w] = flushed(x[8 * p]) | (flushed(x[8 * p + 1]) << 16);
        if (sums)
          xsum[(r * kts + kt) * kWords + w] = ((bf16_value(flushed(x[0])) + bf16_value(flushed(x[1]))) +
                                               bf16_value(flushed(x[8]))) + bf16_value(flushed(x[9]));
      }
}

// The bf16 order, one tile, per lane with std::fma (the twin of chunk_lanes_bf16dp).
FASTINFER_CPU_CLONES void tile_lanes_bf16_portable(const uint32_t* words, const BFloat16* scales, const uint8_t* zeros,
                                                   const uint32_t* xpair, const float* xsum, int64_t m, int64_t k,
                                                   int64_t n, int64_t group_size, int64_t nt, float* acc) {
  const int64_t kts = k / 64;
  for (int64_t kt = 0; kt < kts; ++kt) {
    const uint32_t* unit = words + (kt * (n / 16) + nt) * 128;
    int64_t rows[4];
    step_group_rows(kt, group_size, rows);
    for (int g = 0; g < 8; ++g)
      for (int half = 0; half < 2; ++half) {
        const int c = g + 8 * half;
        float s[4], zt[4] = {0.f, 0.f, 0.f, 0.f};  // per k16 step
        for (int j = 0; j < 4; ++j) {
          const int64_t at = rows[j] * n + 16 * nt + c;
          s[j] = static_cast<float>(scales[at]);
          if (zeros != nullptr) zt[j] = static_cast<float>(static_cast<int>(zeros[at]) - 8) * s[j];
        }
        float lo[2][kWords], hi[2][kWords];
        for (int p = 0; p < 2; ++p)
          for (int w = 0; w < kWords; ++w) {
            const int i = 2 * half + p;  // kNibble[i]: column g + 8 half, k offset 8 p; nibble i + 4: k + 1
            lo[p][w] = static_cast<float>(static_cast<int>((unit[16 * g + w] >> (4 * i)) & 15u) - 8);
            hi[p][w] = static_cast<float>(static_cast<int>((unit[16 * g + w] >> (4 * i + 16)) & 15u) - 8);
          }
        for (int64_t r = 0; r < m; ++r) {
          const uint32_t* xp = xpair + (r * kts + kt) * 2 * kWords;
          float* lane = acc + (r * 16 + c) * kWords;
          for (int w = 0; w < kWords; ++w) {
            float q = 0.f;
            for (int p = 0; p < 2; ++p) {
              q = std::fma(hi[p][w], bf16_value(xp[p * kWords + w] >> 16), q);
              q = std::fma(lo[p][w], bf16_value(xp[p * kWords + w] & 0xFFFFu), q);
            }
            lane[w] = std::fma(q, s[w & 3], lane[w]);
            if (zeros != nullptr) lane[w] = std::fma(-xsum[(r * kts + kt) * kWords + w], zt[w & 3], lane[w]);
          }
        }
      }
  }
}

// The lanes of tile nt: acc[(r * 16 + c) * 16 + w] (m rows, 16 columns), accumulated over every unit.
// lut: the tile's table (build_lut): lut[(group * 16 + c) * 16 + q]. Cloned per ISA (cpu_simd.h):
// the lane loops vectorise (with hardware fma where the clone has it).
FASTINFER_CPU_CLONES void tile_lanes_portable(const uint32_t* words, const float* lut, const float* xperm, int64_t m,
                                              int64_t k, int64_t n, int64_t group_size, int64_t nt, float* acc) {
  const int64_t kts = k / 64;
  for (int64_t kt = 0; kt < kts; ++kt) {
    const uint32_t* unit = words + (kt * (n / 16) + nt) * 128;
    int64_t rows[4];
    step_group_rows(kt, group_size, rows);
    for (int g = 0; g < 8; ++g)
      for (int i = 0; i < 8; ++i) {
        const int c = g + kNibble[i].dn;
        float v[kWords];
        for (int w = 0; w < kWords; ++w)
          v[w] = lut[(rows[w & 3] * 16 + c) * 16 + ((unit[16 * g + w] >> (4 * i)) & 15u)];
        for (int64_t r = 0; r < m; ++r) {
          const float* x = xperm + ((r * kts + kt) * 8 + i) * kWords;
          float* lane = acc + (r * 16 + c) * kWords;
          for (int w = 0; w < kWords; ++w) lane[w] = std::fma(v[w], x[w], lane[w]);
        }
      }
  }
}

#if FASTINFER_INT4_AVX512
// Distinct group rows in a 64-k unit: 1 when G % 64 == 0, 2 (one per 32 k) when G % 32 == 0, else
// 4 (one per k16 step).
inline int unit_group_rows(int64_t group_size) { return group_size % 32 != 0 ? 4 : (group_size % 64 != 0 ? 2 : 1); }

// Tiles nt0 .. nt0 + tiles - 1 at once, k-major: the packed layout stores a unit row (every tile's
// unit kt) contiguously, so walking the chunk's tiles within each kt reads tiles x 512 contiguous
// bytes per step instead of one 512-byte unit per (N / 16) x 512-byte stride (a page or more
// apart: no prefetch). The tables of the unit row's kRows group rows (unit_group_rows) are built
// when the group changes (L1-resident); acc: [tiles][m][16 columns][16 lanes]. Each lane's sequence
// of fma is the one-tile order.
constexpr int64_t kChunkTiles = 8;

template <typename T, int kRows>
__attribute__((target("avx512f"))) void chunk_lanes_avx512(const uint32_t* words, const T* scales, const uint8_t* zeros,
                                                            const float* xperm, int64_t m, int64_t k, int64_t n,
                                                            int64_t group_size, int64_t nt0, int64_t tiles, float* acc) {
  const int64_t kts = k / 64;
  // the chunk's tables for the group rows of the current unit row: [tile][row][16 columns][16]
  alignas(64) float luts[kChunkTiles][kRows][256];
  // the first and last group rows the tables hold (rows grow with k: equal ends, equal rows)
  int64_t built_first = -1, built_last = -1;
  for (int64_t kt = 0; kt < kts; ++kt) {
    int64_t rows[4];
    step_group_rows(kt, group_size, rows);
    if (rows[0] != built_first || rows[3] != built_last) {
      for (int64_t t = 0; t < tiles; ++t)
        for (int r = 0; r < kRows; ++r)
          build_lut_row_avx512<T>(scales, zeros, n, rows[r * 4 / kRows], nt0 + t, luts[t][r]);
      built_first = rows[0];
      built_last = rows[3];
    }
    const uint32_t* row = words + (kt * (n / 16) + nt0) * 128;
    for (int64_t t = 0; t < tiles; ++t) {
      const uint32_t* unit = row + t * 128;
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(unit + 16 * g);
        __m512 lo[4], hi[4];  // the tables of columns g and g + 8 for each k16 step
        for (int j = 0; j < 4; ++j) {
          lo[j] = _mm512_load_ps(luts[t][j * kRows / 4] + g * 16);
          hi[j] = _mm512_load_ps(luts[t][j * kRows / 4] + (g + 8) * 16);
        }
        __m512 w[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) w[i] = kNibble[i].dn ? lookup_steps<kRows>(v, i, hi) : lookup_steps<kRows>(v, i, lo);
        for (int64_t r = 0; r < m; ++r) {
          const float* xp = xperm + (r * kts + kt) * 8 * kWords;
          float* acc_lo = acc + ((t * m + r) * 16 + g) * kWords;
          float* acc_hi = acc_lo + 8 * kWords;
          __m512 alo = _mm512_loadu_ps(acc_lo), ahi = _mm512_loadu_ps(acc_hi);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) {
            const __m512 x = _mm512_loadu_ps(xp + i * kWords);
            if (kNibble[i].dn)
              ahi = _mm512_fmadd_ps(w[i], x, ahi);
            else
              alo = _mm512_fmadd_ps(w[i], x, alo);
          }
          _mm512_storeu_ps(acc_lo, alo);
          _mm512_storeu_ps(acc_hi, ahi);
        }
      }
    }
  }
}

// 16 bf16 scales as fp32.
__attribute__((target("avx512f"), always_inline)) inline __m512 scale_row_avx512(const BFloat16* s) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// (z - 8) s of 16 columns: the zero points' correction of the lanes' activation sums.
__attribute__((target("avx512f"), always_inline)) inline __m512 zero_terms_avx512(const uint8_t* z, __m512 s) {
  const __m128i zi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(z));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(zi), _mm512_set1_epi32(8))), s);
}

// bf16 activations: vdpbf16ps. The table holds the integers q - 8 (exact in bf16), not the scaled
// weights: it is one constant, where scaled tables are rebuilt per group row and column (with
// 32-element groups, GGUF's, that rebuilding cost more than the products). Nibbles i and i + 4 of a
// word are the same column at k and k + 1, the two halves of one 32-bit lane: v >> 4 i indexes
// the table for both (vpermw), and vdpbf16ps multiplies them with the pair
// (x[k], x[k + 1]). Each unit's integer sums are then scaled per lane (a lane takes the scale of its
// k16 step's group row): see "the bf16 order" above int4_gemm_fused_bf16.

template <int kRows, bool kZeros>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void chunk_lanes_bf16dp(
    const uint32_t* words, const BFloat16* scales, const uint8_t* zeros, const uint32_t* xpair, const float* xsum,
    int64_t m, int64_t k, int64_t n, int64_t group_size, int64_t nt0, int64_t tiles, float* acc) {
  const int64_t kts = k / 64;
  alignas(64) uint16_t ints[32];
  for (int j = 0; j < 32; ++j) ints[j] = bf16_bits(static_cast<float>((j & 15) - 8));
  const __m512i table = _mm512_load_si512(ints);
  for (int64_t kt = 0; kt < kts; ++kt) {
    int64_t rows[4];
    step_group_rows(kt, group_size, rows);
    const uint32_t* row = words + (kt * (n / 16) + nt0) * 128;
    for (int64_t t = 0; t < tiles; ++t) {
      const uint32_t* unit = row + t * 128;
      const int64_t col0 = 16 * (nt0 + t);
      __m512 s[4], z[4];  // the scales (zero terms) of each k16 step's group row; kRows distinct
      for (int j = 0; j < 4; ++j) {
        if (j * kRows % 4 != 0) {  // the same row as step j - 1
          s[j] = s[j - 1];
          z[j] = z[j - 1];
          continue;
        }
        s[j] = scale_row_avx512(scales + rows[j] * n + col0);
        z[j] = kZeros ? zero_terms_avx512(zeros + rows[j] * n + col0, s[j]) : s[j];
      }
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(unit + 16 * g);
        // vpermw reads the low 5 bits of each 16-bit index: the nibble and one bit of the next,
        // which the table's second half (a copy of the first) ignores
        const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v, table);
        const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 4), table);
        const __m512bh w2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 8), table);
        const __m512bh w3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi32(v, 12), table);
        // column g (g + 8) of each lane's step row
        const __m512i lo_col = _mm512_set1_epi32(g), hi_col = _mm512_set1_epi32(g + 8);
        const __m512 slo = select_per_step<kRows>(lo_col, s), shi = select_per_step<kRows>(hi_col, s);
        __m512 zlo = slo, zhi = shi;
        if constexpr (kZeros) {
          zlo = select_per_step<kRows>(lo_col, z);
          zhi = select_per_step<kRows>(hi_col, z);
        }
        for (int64_t r = 0; r < m; ++r) {
          const uint32_t* xp = xpair + (r * kts + kt) * 2 * kWords;
          const __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp), x1 = (__m512bh)_mm512_loadu_si512(xp + kWords);
          const __m512 qlo = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w0, x0), w1, x1);
          const __m512 qhi = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w2, x0), w3, x1);
          float* lo = acc + ((t * m + r) * 16 + g) * kWords;
          float* hi = lo + 8 * kWords;
          __m512 alo = _mm512_fmadd_ps(qlo, slo, _mm512_loadu_ps(lo));
          __m512 ahi = _mm512_fmadd_ps(qhi, shi, _mm512_loadu_ps(hi));
          if constexpr (kZeros) {
            const __m512 xs = _mm512_loadu_ps(xsum + (r * kts + kt) * kWords);
            alo = _mm512_fnmadd_ps(xs, zlo, alo);
            ahi = _mm512_fnmadd_ps(xs, zhi, ahi);
          }
          _mm512_storeu_ps(lo, alo);
          _mm512_storeu_ps(hi, ahi);
        }
      }
    }
  }
}

bool have_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  return yes && !cpu_int4_portable();
}

bool have_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes && !cpu_int4_portable();
}
#endif

// The decode paths' driver: chunks of `tiles_per_chunk` 16-column tiles on torch's thread pool,
// each accumulated by `lanes(nt0, tiles, acc)` into acc [tiles][m][16 columns][16 lanes] (zeroed
// first), then every column's lanes summed (cpu::tree_sum) into out [m, n] as T.
template <typename T, typename Lanes>
void run_tile_chunks(int64_t m, int64_t n, int64_t tiles_per_chunk, T* out, const Lanes& lanes) {
  const int64_t chunks = (n / 16 + tiles_per_chunk - 1) / tiles_per_chunk;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(tiles_per_chunk * m * 16 * kWords));
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t nt0 = chunk * tiles_per_chunk, tiles = std::min(tiles_per_chunk, n / 16 - nt0);
      std::fill(acc.begin(), acc.end(), 0.f);
      lanes(nt0, tiles, acc.data());
      for (int64_t t = 0; t < tiles; ++t)
        for (int64_t r = 0; r < m; ++r)
          for (int c = 0; c < 16; ++c)
            out[r * n + 16 * (nt0 + t) + c] =
                static_cast<T>(cpu::tree_sum<kWords>(acc.data() + ((t * m + r) * 16 + c) * kWords));
    }
  });
}

// Decode path: per 16-column tile (torch's thread pool) the tile's table, then every unit decoded in
// registers and applied to every row of a (no weight copy); see the order above.
template <typename T>
void int4_gemm_fused(const Tensor& a, const Tensor& packed, const Tensor& scales, const uint8_t* zp,
                     int64_t group_size, Tensor& out) {
  const int64_t m = a.size(0), k = a.size(1), n = out.size(1);
  const auto af = contiguous_as(a, kFloat);
  std::vector<float> xperm;
  gather_activations(af.const_data_ptr<float>(), m, k, xperm);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed.const_data_ptr<int32_t>());
  const T* sp = scales.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
#if FASTINFER_INT4_AVX512
  if (have_avx512()) {
    const int rows = unit_group_rows(group_size);
    const auto kernel = rows == 4 ? chunk_lanes_avx512<T, 4> : (rows == 2 ? chunk_lanes_avx512<T, 2> : chunk_lanes_avx512<T, 1>);
    run_tile_chunks(m, n, kChunkTiles, op, [&](int64_t nt0, int64_t tiles, float* acc) {
      kernel(words, sp, zp, xperm.data(), m, k, n, group_size, nt0, tiles, acc);
    });
    return;
  }
#endif
  run_tile_chunks(m, n, 1, op, [&](int64_t nt, int64_t, float* acc) {
    thread_local std::vector<float> lut;
    build_lut<T>(sp, zp, n, k / group_size, nt, lut);
    tile_lanes_portable(words, lut.data(), xperm.data(), m, k, n, group_size, nt, acc);
  });
}

// Decode path for bf16 activations: the bf16 order (above), on 16-column tiles as int4_gemm_fused.
void int4_gemm_fused_bf16(const Tensor& a, const Tensor& packed, const Tensor& scales, const uint8_t* zp,
                          int64_t group_size, Tensor& out) {
  const int64_t m = a.size(0), k = a.size(1), n = out.size(1);
  const auto ac = contiguous_as(a, kBFloat16);
  std::vector<uint32_t> xpair;
  std::vector<float> xsum;
  gather_activation_pairs(ac.const_data_ptr<BFloat16>(), m, k, zp != nullptr, xpair, xsum);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed.const_data_ptr<int32_t>());
  const BFloat16* sp = scales.const_data_ptr<BFloat16>();
  BFloat16* op = out.mutable_data_ptr<BFloat16>();
#if FASTINFER_INT4_AVX512
  if (have_avx512_bf16()) {
    const int rows = unit_group_rows(group_size);
    const auto kernel = zp != nullptr ? (rows == 4 ? chunk_lanes_bf16dp<4, true>
                                                   : (rows == 2 ? chunk_lanes_bf16dp<2, true> : chunk_lanes_bf16dp<1, true>))
                                      : (rows == 4 ? chunk_lanes_bf16dp<4, false>
                                                   : (rows == 2 ? chunk_lanes_bf16dp<2, false> : chunk_lanes_bf16dp<1, false>));
    run_tile_chunks(m, n, kChunkTiles, op, [&](int64_t nt0, int64_t tiles, float* acc) {
      kernel(words, sp, zp, xpair.data(), xsum.data(), m, k, n, group_size, nt0, tiles, acc);
    });
    return;
  }
#endif
  run_tile_chunks(m, n, 1, op, [&](int64_t nt, int64_t, float* acc) {
    tile_lanes_bf16_portable(words, sp, zp, xpair.data(), xsum.data(), m, k, n, group_size, nt, acc);
  });
}

// w[n0 : n0 + rows, :] (values rounded to T), rows a multiple of 16: bf16 for bf16 activations (the
// matmul then runs in bf16: its products are exact, its sums fp32), fp32 otherwise.
template <typename T>
Tensor dequantize_rows(const Tensor& packed, const Tensor& scales, const uint8_t* zeros, int64_t n,
                           int64_t k, int64_t group_size, int64_t n0, int64_t rows) {
  using Out = std::conditional_t<std::is_same_v<T, BFloat16>, BFloat16, float>;
  auto w = empty_on(scales, {rows, k}, std::is_same_v<T, BFloat16> ? kBFloat16 : kFloat);
  dequantize_int4_rows<T, Out>(packed.const_data_ptr<int32_t>(), scales.const_data_ptr<T>(), zeros, n, k, group_size,
                               n0, rows, w.template mutable_data_ptr<Out>());
  return w;
}

template <typename T>
void int4_gemm_chunked(const Tensor& a, const Tensor& packed, const Tensor& scales, const uint8_t* zeros,
                       int64_t group_size, Tensor& out) {
  const int64_t k = a.size(1), n = out.size(1);
  const auto af = std::is_same_v<T, BFloat16> ? a : to_dtype_of(a, kFloat);
  // chunks of about kChunkBytes, at least kChunkN rows (each matmul call costs a weight reorder)
  const int64_t bytes_per_row = k * (std::is_same_v<T, BFloat16> ? 2 : 4);
  const int64_t chunk = std::max(kChunkN, kChunkBytes / bytes_per_row / 16 * 16);
  for (int64_t n0 = 0; n0 < n; n0 += chunk) {
    const int64_t rows = std::min(chunk, n - n0);
    const auto w = dequantize_rows<T>(packed, scales, zeros, n, k, group_size, n0, rows);
    auto cols = slice(out, 1, n0, rows);
    torch::stable::copy_(cols, matmul_nt(af, w));
  }
}

Tensor int4_pack_cpu(const Tensor& w_q) {
  const char* op = "int4_pack";
  validate_int4_pack(op, w_q);
  check_on_cpu(w_q, op, "w_q");
  check_index_range(w_q, 0, 16, op, "w_q", "4-bit values 0..15");
  return int4_pack_impl(w_q);
}

std::tuple<Tensor, Tensor, Tensor> int4_repack_cpu(const Tensor& qweight, const Tensor& qzeros,
                                                               std::string_view fmt,
                                                               const std::optional<Tensor>& g_idx) {
  const char* op = "int4_repack";
  validate_int4_repack(op, qweight, qzeros, fmt, g_idx);
  check_on_cpu(qweight, op, "qweight");
  if (g_idx.has_value()) check_index_range(*g_idx, 0, qzeros.size(0), op, "g_idx", "group indices < K / group_size");
  return int4_repack_impl(op, qweight, qzeros, fmt, g_idx);
}

Tensor int4_gemm_cpu(const Tensor& a_in, const Tensor& packed, const Tensor& scales,
                         const std::optional<Tensor>& zeros, int64_t group_size,
                         const std::optional<Tensor>& perm, bool deterministic) {
  const char* op = "int4_gemm";
  validate_int4_gemm(op, a_in, packed, scales, zeros, group_size, perm, /*allow_fp32=*/true);
  check_on_cpu(a_in, op, "a");
  check_int4_gemm_layout(op, a_in, packed, scales, zeros, perm);
  check_int4_gemm_values(op, a_in, zeros, perm);
  const auto a = perm.has_value() ? torch::stable::index_select(a_in, 1, *perm) : a_in;
  const int64_t m = a.size(0), n = packed.size(1) / 8;
  auto out = empty_on(a, {m, n});
  if (m == 0) return out;
  const uint8_t* zp = zeros.has_value() ? zeros->mutable_data_ptr<uint8_t>() : nullptr;
  FASTINFER_DISPATCH_FLOAT_TYPES(a.scalar_type(), "int4_gemm_cpu", [&] {
    if ((m <= kFusedMaxM<scalar_t> || deterministic) && std::is_same_v<scalar_t, BFloat16>)
      int4_gemm_fused_bf16(a, packed, scales, zp, group_size, out);
    else if (m <= kFusedMaxM<scalar_t> || deterministic)
      int4_gemm_fused<scalar_t>(a, packed, scales, zp, group_size, out);
    else
      int4_gemm_chunked<scalar_t>(a, packed, scales, zp, group_size, out);
  });
  return out;
}

}  // namespace
}  // namespace fastinfer::binding

FASTINFER_LIBRARY_IMPL(CPU, m) {
  using namespace fastinfer::binding;
  m.impl("int4_pack", TORCH_BOX(&int4_pack_cpu));
  m.impl("int4_repack", TORCH_BOX(&int4_repack_cpu));
  m.impl("int4_gemm", TORCH_BOX(&int4_gemm_cpu));
}
