#pragma once
// Decoding the int4_pack layout on the CPU (gemm/int4.h), shared by int4_gemm and fused_moe_int4:
// the dequantised weight (q - z) * s rounded once to the activation dtype T, as the kernels
// round it, held in fp32.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "overrides.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTINFER_INT4_DECODE_AVX512 1
#else
#define FASTINFER_INT4_DECODE_AVX512 0
#endif

namespace fastinfer::binding {

// The 8 (n, k) positions of nibble i in a unit, relative to (n0 = 0, k0 = 16 j): see gemm/int4.h.
struct NibblePos {
  int dn, dk;
};
constexpr NibblePos kNibble[8] = {{0, 0}, {0, 8}, {8, 0}, {8, 8}, {0, 1}, {0, 9}, {8, 1}, {8, 9}};

template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return static_cast<float>(static_cast<T>(x));
}

// Table of the 16 values a weight of each column of tile nt can take, per group row:
// lut[(row * 16 + c) * 16 + q] = round_T((q - z[row][16 nt + c]) * s[row][16 nt + c]) (one rounding
// per table entry instead of one per weight).
template <typename T>
inline void build_lut(const T* scales, const uint8_t* zeros, int64_t n, int64_t groups, int64_t nt, std::vector<float>& lut) {
  lut.resize(static_cast<size_t>(groups) * 256);
  for (int64_t row = 0; row < groups; ++row)
    for (int c = 0; c < 16; ++c) {
      const float sc = static_cast<float>(scales[row * n + 16 * nt + c]);
      const int z = zeros != nullptr ? zeros[row * n + 16 * nt + c] : 8;
      for (int q = 0; q < 16; ++q) lut[(row * 16 + c) * 16 + q] = round_to<T>(static_cast<float>(q - z) * sc);
    }
}

// The group row of each k16 step j of unit kt: word j of a lane holds k in [64 kt + 16 j, + 16),
// one group (group_size is a multiple of 16).
inline void step_group_rows(int64_t kt, int64_t group_size, int64_t (&rows)[4]) {
  for (int j = 0; j < 4; ++j) rows[j] = (64 * kt + 16 * j) / group_size;
}

// Decodes unit (kt, nt) into w[16][64] (fp32 values already rounded to T) through the tile's table.
inline void decode_unit(const int32_t* packed, const std::vector<float>& lut, int64_t n, int64_t group_size, int64_t kt,
                 int64_t nt, float (&w)[16][64]) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed) + (kt * (n / 16) + nt) * 128;
  int64_t rows[4];
  step_group_rows(kt, group_size, rows);
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = words[4 * lane + j];
      const float* tb = lut.data() + rows[j] * 256;
      for (int i = 0; i < 8; ++i) {
        const int c = g + kNibble[i].dn;
        w[c][16 * j + 2 * t + kNibble[i].dk] = tb[c * 16 + ((word >> (4 * i)) & 15u)];
      }
    }
  }
}

#if FASTINFER_INT4_DECODE_AVX512
// build_lut's table, 16 entries per store: (q - z) * s in fp32, rounded to T as a static_cast does
// (round to nearest even; bf16 by the carry trick, fp16 by vcvtps2ph), bitwise build_lut's. One
// group row of tile nt: its 16 columns' 16 entries into dst[c * 16 + q].
template <typename T>
__attribute__((target("avx512f"), always_inline)) inline void build_lut_row_avx512(const T* scales, const uint8_t* zeros,
                                                                                  int64_t n, int64_t row, int64_t nt,
                                                                                  float* dst) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int c = 0; c < 16; ++c) {
    const int64_t at = row * n + 16 * nt + c;
    const float z = static_cast<float>(zeros != nullptr ? zeros[at] : 8);
    __m512 v = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(static_cast<float>(scales[at])));
    if constexpr (std::is_same_v<T, BFloat16>) {
      const __m512i u = _mm512_castps_si512(v);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
      v = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else if constexpr (std::is_same_v<T, Half>) {
      v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    _mm512_storeu_ps(dst + c * 16, v);
  }
}

// build_lut with AVX-512, bitwise the same.
template <typename T>
__attribute__((target("avx512f"))) void build_lut_avx512(const T* scales, const uint8_t* zeros, int64_t n,
                                                          int64_t groups, int64_t nt, std::vector<float>& lut) {
  lut.resize(static_cast<size_t>(groups) * 256);
  for (int64_t row = 0; row < groups; ++row) build_lut_row_avx512<T>(scales, zeros, n, row, nt, lut.data() + row * 256);
}

// 16 fp32 values to dst as Out (BFloat16: values that are bf16 already, so the upper halves).
template <typename Out>
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void store16(Out* dst, __m512 v) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm512_storeu_ps(dst, v);
  } else {
    const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  }
}

// Words w of 16 (4 lanes x 4 k16 steps) whose step w & 3 is 2 or 3: the unit's second 32 k.
constexpr __mmask16 kSecondHalfWords = 0xCCCC;

// Per word w of 16 (4 lanes x 4 k16 steps), entry idx[w] (0..15) of its step's row: tab[j] for the
// words of step j (w & 3 == j). kRows 1: tab[0] for every step (one vpermps); 2: tab[0] for steps 0
// and 1, tab[2] for 2 and 3 (one vpermt2ps); 4: a vpermt2ps per pair of steps and a blend.
template <int kRows>
__attribute__((target("avx512f"), always_inline)) inline __m512 select_per_step(__m512i idx, const __m512 (&tab)[4]) {
  if constexpr (kRows == 1) {
    return _mm512_permutexvar_ps(idx, tab[0]);
  } else if constexpr (kRows == 2) {
    const __m512i second = _mm512_set_epi32(16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0);
    return _mm512_permutex2var_ps(tab[0], _mm512_or_si512(idx, second), tab[2]);
  } else {
    const __m512i odd = _mm512_or_si512(idx, _mm512_set_epi32(16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0));
    return _mm512_mask_blend_ps(kSecondHalfWords, _mm512_permutex2var_ps(tab[0], odd, tab[1]),
                                _mm512_permutex2var_ps(tab[2], odd, tab[3]));
  }
}

// Nibble i of the 16 words v looked up in the tables of their k16 steps (select_per_step).
template <int kRows>
__attribute__((target("avx512f"), always_inline)) inline __m512 lookup_steps(__m512i v, int i, const __m512 (&tab)[4]) {
  return select_per_step<kRows>(_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), _mm512_set1_epi32(15)), tab);
}

// decode_unit with AVX-512, bitwise the same: per word group g (columns g and g + 8) each nibble's
// 16 values by table lookups (lookup_steps over the column's tables of the unit's k16 steps), then
// put in k order: nibbles at k offsets 0 / 1 interleaved (P), 8 / 9 likewise (Q), and 128-bit
// blocks of P and Q give k [16 j, 16 j + 16). out[c * ld + k] for the 16 columns, 64 k; Out float or
// BFloat16 (the values are bf16 already when T is). tabs[j]: the tile's table of step j's group row.
template <typename Out, int kRows>
__attribute__((target("avx512f,avx512bw"))) inline void decode_unit_avx512(const uint32_t* unit,
                                                                         const float* const (&tabs)[4], Out* out,
                                                                         int64_t ld) {
  const __m512i lo_pairs = _mm512_set_epi32(29, 13, 25, 9, 21, 5, 17, 1, 28, 12, 24, 8, 20, 4, 16, 0);
  const __m512i hi_pairs = _mm512_set_epi32(31, 15, 27, 11, 23, 7, 19, 3, 30, 14, 26, 10, 22, 6, 18, 2);
  for (int g = 0; g < 8; ++g) {
    const __m512i v = _mm512_loadu_si512(unit + 16 * g);
    for (int half = 0; half < 2; ++half) {
      const int c = g + 8 * half;
      __m512 tab[4];
      for (int j = 0; j < 4; ++j) tab[j] = _mm512_loadu_ps(tabs[j] + c * 16);
      __m512 f[4];  // nibbles 2 half + {0, 4, 1, 5}: k offsets 0, 1, 8, 9
      const int nib[4] = {2 * half, 2 * half + 4, 2 * half + 1, 2 * half + 5};
      for (int j = 0; j < 4; ++j) f[j] = lookup_steps<kRows>(v, nib[j], tab);
      const __m512 pa = _mm512_permutex2var_ps(f[0], lo_pairs, f[1]), pb = _mm512_permutex2var_ps(f[0], hi_pairs, f[1]);
      const __m512 qa = _mm512_permutex2var_ps(f[2], lo_pairs, f[3]), qb = _mm512_permutex2var_ps(f[2], hi_pairs, f[3]);
      Out* row = out + c * ld;
      store16<Out>(row, _mm512_shuffle_f32x4(pa, qa, 0x44));
      store16<Out>(row + 16, _mm512_shuffle_f32x4(pa, qa, 0xEE));
      store16<Out>(row + 32, _mm512_shuffle_f32x4(pb, qb, 0x44));
      store16<Out>(row + 48, _mm512_shuffle_f32x4(pb, qb, 0xEE));
    }
  }
}

inline bool int4_decode_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes && !cpu_int4_portable();
}
#endif

// w[n0 : n0 + rows, :] of the packed [K / 64, 8 N] weight into out [rows, k] (values rounded to T;
// Out float, or BFloat16 when T is), rows a multiple of 16; 16-row tiles on torch's thread pool.
template <typename T, typename Out = float>
void dequantize_int4_rows(const int32_t* packed, const T* scales, const uint8_t* zeros, int64_t n, int64_t k,
                          int64_t group_size, int64_t n0, int64_t rows, Out* out) {
  static_assert(std::is_same_v<Out, float> || std::is_same_v<Out, T>, "rows as float, or in the weights' dtype");
  torch::stable::parallel_for(0, rows / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lut;
    float buf[16][64];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t nt = n0 / 16 + tile;
#if FASTINFER_INT4_DECODE_AVX512
      if (int4_decode_avx512()) {
        build_lut_avx512<T>(scales, zeros, n, k / group_size, nt, lut);
      } else
#endif
        build_lut<T>(scales, zeros, n, k / group_size, nt, lut);
      for (int64_t kt = 0; kt < k / 64; ++kt) {
#if FASTINFER_INT4_DECODE_AVX512
        if constexpr (std::is_same_v<Out, float> || std::is_same_v<Out, BFloat16>) {
          if (int4_decode_avx512()) {
            const uint32_t* unit = reinterpret_cast<const uint32_t*>(packed) + (kt * (n / 16) + nt) * 128;
            int64_t rows[4];
            step_group_rows(kt, group_size, rows);
            const float* const tabs[4] = {lut.data() + rows[0] * 256, lut.data() + rows[1] * 256,
                                          lut.data() + rows[2] * 256, lut.data() + rows[3] * 256};
            Out* dst = out + 16 * tile * k + 64 * kt;
            if (group_size % 32 == 0)
              decode_unit_avx512<Out, 2>(unit, tabs, dst, k);
            else
              decode_unit_avx512<Out, 4>(unit, tabs, dst, k);
            continue;
          }
        }
#endif
        decode_unit(packed, lut, n, group_size, kt, nt, buf);
        for (int c = 0; c < 16; ++c) {
          Out* dst = out + (16 * tile + c) * k + 64 * kt;
          if constexpr (std::is_same_v<Out, float>)
            std::memcpy(dst, buf[c], sizeof(buf[c]));
          else
            for (int i = 0; i < 64; ++i) dst[i] = static_cast<Out>(buf[c][i]);
        }
      }
    }
  });
}

}  // namespace fastinfer::binding
