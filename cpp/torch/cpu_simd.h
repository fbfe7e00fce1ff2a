#pragma once
// Helpers for the CPU impls' hot loops. The extension is built for the baseline ISA (it must load
// on any x86-64 or aarch64 machine); FASTINFER_CPU_CLONES compiles a function again for AVX-512
// (x86-64-v4) and AVX2+FMA (x86-64-v3), picked once at load time by the dynamic linker (ifunc).
// Everything a cloned function calls must be FASTINFER_CPU_INLINE so it is compiled into each
// clone with that clone's ISA; a lambda body is a separate function and is not cloned.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define FASTINFER_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTINFER_CPU_CLONES
#endif
#define FASTINFER_CPU_INLINE inline __attribute__((always_inline))

namespace fastinfer::binding::cpu {

// The largest f(x[i]) over n values, NaN propagating (as ATen's amax); -inf when n == 0. The
// quantise ops' amax / range: f = fabs, identity, negation.
template <typename F>
inline float max_over(const float* x, int64_t n, F f) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float v = f(x[i]);
    if (v > m || std::isnan(v)) m = v;
  }
  return m;
}
inline float abs_max(const float* x, int64_t n) { return max_over(x, n, [](float v) { return std::fabs(v); }); }

// exp(x) for float, within 2 ulp on [-87, 88] and 0 below; branch-free so loops over it vectorise
// (std::exp is a libm call per element). Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a
// degree-6 polynomial for e^r and 2^n put straight into the exponent bits.
FASTINFER_CPU_INLINE float fast_exp(float x) {
  const float lo = -87.0f, hi = 88.0f;
  const float xc = x < lo ? lo : (x > hi ? hi : x);
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (xc * 1.44269504088896341f + kRound) - kRound;
  float r = xc - n * 0.693359375f;  // ln2 split in a short high part (exact product) ...
  r = r - n * -2.12194440e-4f;      // ... and the rest
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < lo ? 0.0f : p * scale;
}

// exp(x) for float as torch's vectorised CPU kernels compute it (SLEEF's expf_u10, which ATen's
// Vectorized<float>::exp calls; within 1 ulp): x = q ln2 + s with q = rint(x / ln2) and ln2 split
// in two, a degree-7 polynomial in s with fused multiply-adds, then 2^q in two factors so that
// q = -150 still scales to a subnormal. torch's own F.silu is x / (1 + this(-x)), so the gated
// activations built on it equal torch's bit for bit on the elements torch computes vectorised. The
// explicit fmaf (not a contraction the compiler may or may not make) fixes every rounding.
FASTINFER_CPU_INLINE float sleef_exp(float x) {
  const float d = x >= -104.0f ? (x <= 100.0f ? x : 100.0f) : -104.0f;  // NaN -> -104, fixed below
  const float q = std::nearbyint(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
  float s = std::fma(q, -0.693145751953125f, d);
  s = std::fma(q, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  const int32_t qi = static_cast<int32_t>(q), half = qi >> 1;
  const int32_t bits_lo = (half + 127) << 23, bits_hi = (qi - half + 127) << 23;
  float lo, hi;
  std::memcpy(&lo, &bits_lo, sizeof(lo));
  std::memcpy(&hi, &bits_hi, sizeof(hi));
  u = u * lo * hi;
  u = x < -104.0f ? 0.0f : u;
  u = x > 100.0f ? INFINITY : u;
  return x != x ? x : u;
}

// Pairwise sum / max of N lanes (N a power of two): log2(N) vector steps with constant trip
// counts instead of a serial chain of N dependent scalar ops (the compiler may not reassociate
// float math itself). Folds lanes in place.
template <int N>
FASTINFER_CPU_INLINE float tree_sum(float* lanes) {
  if constexpr (N > 1) {
    for (int j = 0; j < N / 2; ++j) lanes[j] += lanes[j + N / 2];
    return tree_sum<N / 2>(lanes);
  }
  return lanes[0];
}

// tree_max: a NaN lane is the maximum (as torch.max), whichever lane it sits in.
template <int N>
FASTINFER_CPU_INLINE float tree_max(float* lanes) {
  if constexpr (N > 1) {
    for (int j = 0; j < N / 2; ++j)
      lanes[j] = lanes[j] > lanes[j + N / 2] || lanes[j] != lanes[j] ? lanes[j] : lanes[j + N / 2];
    return tree_max<N / 2>(lanes);
  }
  return lanes[0];
}

}  // namespace fastinfer::binding::cpu
