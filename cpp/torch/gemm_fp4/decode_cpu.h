#pragma once
// fp4 weights decoded on the CPU with the kernels' rounding (the scale converted to the activation
// dtype T, then e2m1 * scale rounded to it): fp4_gemm's and fused_moe_fp4's CPU implementations.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemm_int4/dequantize_cpu.h"

namespace fastinfer::binding {

inline constexpr float kE2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};

inline float bits_as_float(uint32_t u) {
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// The value of a scale byte: e4m3 (NVFP4; 0x7F / 0xFF NaN) or e8m0 2^(e - 127) (MXFP4).
inline float fp4_scale_value(uint8_t bits, bool nvfp4) {
  if (!nvfp4) return bits == 0 ? bits_as_float(0x00400000u) : (bits == 255 ? NAN : bits_as_float(uint32_t{bits} << 23));
  const uint32_t em = bits & 0x7Fu;
  float v;
  if (em == 0x7Fu)
    v = NAN;
  else if (em < 8u)
    v = static_cast<float>(em) * 0.001953125f;  // subnormal: m * 2^-9
  else
    v = std::ldexp(1.f + static_cast<float>(em & 7u) / 8.f, static_cast<int>(em >> 3) - 7);
  return (bits & 0x80u) ? -v : v;
}

// w[r][k] (fp32, rows n0 .. n0 + rows) of the packed weight: int4_pack's layout (gemm/int4.h) with
// e2m1 codes as nibbles; nibble i = 4 e + 2 h + kh of word (kt, nt, lane = 4 g + t, j) is the code
// of W[16 nt + 8 h + g][64 kt + 16 j + 8 kh + 2 t + e].
template <typename T>
inline void decode_fp4_rows(const uint32_t* words, const uint8_t* scales, bool nvfp4, int64_t n, int64_t k,
                            int64_t n0, int64_t rows, float* w) {
  const int64_t group = nvfp4 ? 16 : 32;
  torch::stable::parallel_for(0, rows / 16, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t nt = n0 / 16 + tile;
      for (int64_t kt = 0; kt < k / 64; ++kt) {
        const uint32_t* unit = words + (kt * (n / 16) + nt) * 128;
        for (int lane = 0; lane < 32; ++lane) {
          const int g = lane >> 2, t = lane & 3;
          for (int j = 0; j < 4; ++j) {
            const uint32_t word = unit[4 * lane + j];
            for (int i = 0; i < 8; ++i) {
              const int e = i >> 2, h = (i >> 1) & 1, kh = i & 1;
              const int64_t col = 16 * nt + 8 * h + g, kk = 64 * kt + 16 * j + 8 * kh + 2 * t + e;
              const uint32_t code = (word >> (4 * i)) & 15u;
              const float s = round_to<T>(fp4_scale_value(scales[(kk / group) * n + col], nvfp4));
              const float mag = round_to<T>(kE2m1[code & 7u] * s);
              w[(col - n0) * k + kk] = (code & 8u) ? -mag : mag;
            }
          }
        }
      }
    }
  });
}

}  // namespace fastinfer::binding
