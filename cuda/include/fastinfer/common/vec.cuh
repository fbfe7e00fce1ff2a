#pragma once
// Register vectors for 16-byte global loads/stores, and fp32 conversions of the storage types.
#include <cstdint>
#include <type_traits>

#include "fastinfer/common/platform.cuh"

namespace fastinfer {

template <int Bytes> struct RawBits;
template <> struct RawBits<1> { using type = uint8_t; };
template <> struct RawBits<2> { using type = uint16_t; };
template <> struct RawBits<4> { using type = uint32_t; };
template <> struct RawBits<8> { using type = uint2; };
template <> struct RawBits<16> { using type = uint4; };

// N elements of T moved with the widest aligned accesses (at most 16 bytes each). The caller
// guarantees the address is aligned to min(16, N * sizeof(T)).
template <typename T, int N>
struct alignas(N * sizeof(T) < 16 ? N * sizeof(T) : 16) Vec {
  static constexpr int kBytes = N * sizeof(T);
  static constexpr int kChunkBytes = kBytes < 16 ? kBytes : 16;
  static constexpr int kChunks = kBytes / kChunkBytes;
  using Chunk = typename RawBits<kChunkBytes>::type;
  static_assert(kBytes % kChunkBytes == 0, "vector size must be a multiple of its access width");

  T data[N];

  __device__ __forceinline__ T& operator[](int i) { return data[i]; }
  __device__ __forceinline__ const T& operator[](int i) const { return data[i]; }

  __device__ __forceinline__ void load(const T* ptr) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      reinterpret_cast<Chunk*>(data)[c] = reinterpret_cast<const Chunk*>(ptr)[c];
  }
  __device__ __forceinline__ void store(T* ptr) const {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      reinterpret_cast<Chunk*>(ptr)[c] = reinterpret_cast<const Chunk*>(data)[c];
  }
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

// Round-to-nearest-even conversions from fp32; e4m3 saturates to +-448 (NaN stays NaN).
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) {
  return __nv_fp8_e4m3(x);  // __NV_SATFINITE, round to nearest even
}

// e4m3 -> fp16 by moving the 7 exponent / mantissa bits under fp16's: exact for normals and
// denormals, the result being 2^-8 times the e4m3 value (callers fold kE4m3HalfRescale into their
// scales; every e4m3 value times 2^-8 is an fp16 value, and a bf16 one). The e4m3 NaN pattern
// (0x7f / 0xff) would land on +-480 * 2^-8, a finite value: a compare and a select per half make
// it an fp16 NaN (exponent bits all set over the nonzero mantissa). Bytes 2 pair and 2 pair + 1 of
// `word` -> the two halves of a half2 (lower byte in the low half).
constexpr float kE4m3HalfRescale = 256.f;
__device__ __forceinline__ uint32_t e4m3x2_to_half2_scaled(uint32_t word, int pair) {
  // bytes (b_2p, b_2p+1) -> 16-bit lanes (b_2p << 8, b_2p+1 << 8)
  const uint32_t t = __byte_perm(word, 0u, pair == 0 ? 0x1404u : 0x3424u);
  const uint32_t h = ((t >> 1) & 0x3f803f80u) | (t & 0x80008000u);
  const uint32_t nan_lo = (h & 0x7fffu) == 0x3f80u ? 0x7c00u : 0u;
  const uint32_t nan_hi = (h & 0x7fff0000u) == 0x3f800000u ? 0x7c000000u : 0u;
  return h | nan_lo | nan_hi;
}

// True when p is aligned to `bytes` (a power of two).
__host__ __device__ __forceinline__ bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) & static_cast<uintptr_t>(bytes - 1)) == 0;
}

}  // namespace fastinfer
