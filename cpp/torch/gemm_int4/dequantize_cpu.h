#pragma once
// Decoding the int4_pack layout on the CPU (gemm/int4.h), shared by int4_gemm and fused_moe_int4:
// the dequantised weight (q - z) * s rounded once to the activation dtype T, as the kernels
// round it, held in fp32.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

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

// Decodes unit (kt, nt) into w[16][64] (fp32 values already rounded to T) through the tile's table.
inline void decode_unit(const int32_t* packed, const std::vector<float>& lut, int64_t n, int64_t group_size, int64_t kt,
                 int64_t nt, float (&w)[16][64]) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(packed) + (kt * (n / 16) + nt) * 128;
  // k in [64 kt + 32 h, 64 kt + 32 h + 32) is one group (group_size is a multiple of 32).
  const float* tab[2] = {lut.data() + (64 * kt) / group_size * 256, lut.data() + (64 * kt + 32) / group_size * 256};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = words[4 * lane + j];
      const float* tb = tab[j >> 1];
      for (int i = 0; i < 8; ++i) {
        const int c = g + kNibble[i].dn;
        w[c][16 * j + 2 * t + kNibble[i].dk] = tb[c * 16 + ((word >> (4 * i)) & 15u)];
      }
    }
  }
}

// w[n0 : n0 + rows, :] of the packed [K / 64, 8 N] weight into out [rows, k] (fp32, values rounded
// to T), rows a multiple of 16; 16-row tiles on torch's thread pool.
template <typename T>
void dequantize_int4_rows(const int32_t* packed, const T* scales, const uint8_t* zeros, int64_t n, int64_t k,
                          int64_t group_size, int64_t n0, int64_t rows, float* out) {
  torch::stable::parallel_for(0, rows / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lut;
    float buf[16][64];
    for (int64_t tile = begin; tile < end; ++tile) {
      build_lut<T>(scales, zeros, n, k / group_size, n0 / 16 + tile, lut);
      for (int64_t kt = 0; kt < k / 64; ++kt) {
        decode_unit(packed, lut, n, group_size, kt, n0 / 16 + tile, buf);
        for (int c = 0; c < 16; ++c) std::memcpy(out + (16 * tile + c) * k + 64 * kt, buf[c], sizeof(buf[c]));
      }
    }
  });
}

}  // namespace fastinfer::binding
