#pragma once
// The e4m3 arithmetic of the CPU implementations (fp8_quantize, fp8_scaled_mm, fused_moe_fp8): the
// quantisation rule of gemm/fp8.h (fp32 amax, scale = max(amax, 1e-12) / 448, IEEE fp32 division,
// clamp, round-to-nearest-even) and a 256-entry table of the e4m3 values.
#include <algorithm>
#include <array>
#include <cstdint>

#include "common.h"

namespace fastinfer::binding {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kMinAmax = 1e-12f;

inline float scale_from_amax(float amax) { return std::max(amax, kMinAmax) / kE4m3Max; }

inline Float8_e4m3fn to_e4m3(float v, float s) {
  const float q = v / s;  // IEEE fp32 division, then clamp and a round-to-nearest-even cast
  return Float8_e4m3fn(std::min(std::max(q, -kE4m3Max), kE4m3Max));
}

// fp32 value of each e4m3 bit pattern (ATen's elementwise cast is ~10x slower).
inline const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(Float8_e4m3fn(static_cast<uint8_t>(i), Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

}  // namespace fastinfer::binding
