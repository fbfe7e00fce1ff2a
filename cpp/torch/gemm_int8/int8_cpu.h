#pragma once
// The symmetric int8 arithmetic of the CPU implementations (int8_quantize, rms_norm_quant): the rule
// of gemm/int8.h (fp32 amax, scale = max(amax, 1e-12) / 127, IEEE fp32 division, clamp, round half
// to even; a NaN quotient has code 0: int8 has no NaN, the scale carries it).
#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fastinfer::binding {

inline constexpr float kInt8MinRange = 1e-12f;

// A NaN amax stays NaN (std::max returns its first operand when the comparison fails).
inline float int8_scale_from_amax(float amax) { return std::max(amax, kInt8MinRange) / 127.0f; }

// The code of v = x / scale.
inline int8_t int8_symmetric_code(float v) {
  return v != v ? 0 : static_cast<int8_t>(std::nearbyint(std::min(std::max(v, -127.0f), 127.0f)));
}

}  // namespace fastinfer::binding
