// fastinfer simt: mma.sync and ldmatrix semantics with the PTX ISA fragment layouts.
#include <fastinfer/simt/ptx.h>

#include "profile.h"

namespace fastinfer::simt::detail {
namespace {

float f16_to_float(uint16_t bits) {
  __half h;
  std::memcpy(static_cast<void*>(&h), &bits, 2);
  return __half2float(h);
}
float bf16_to_float(uint16_t bits) {
  uint32_t u = (uint32_t)bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float e4m3_to_float(uint8_t bits) {
  __nv_fp8_e4m3 v;
  v.__x = bits;
  return float(v);
}

// 16-bit element j (0/1) of a register, 8-bit element j (0..3)
inline uint16_t h16(uint32_t r, int j) { return (uint16_t)(r >> (16 * j)); }
inline uint8_t b8(uint32_t r, int j) { return (uint8_t)(r >> (8 * j)); }

template <int K, typename Cvt>
void mma_impl(LaneIO* const* lanes, Cvt cvt) {
  float A[16][K], B[K][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const LaneIO* io = lanes[lane];
    int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) {
      int row = g + ((r & 1) ? 8 : 0);
      if (K == 16) {
        int col = 2 * t + ((r & 2) ? 8 : 0);
        for (int j = 0; j < 2; ++j) A[row][col + j] = cvt(h16(io->in[r], j));
      } else {
        int col = 4 * t + ((r & 2) ? 16 : 0);
        for (int j = 0; j < 4; ++j) A[row][col + j] = cvt(b8(io->in[r], j));
      }
    }
    for (int r = 0; r < 2; ++r) {
      if (K == 16) {
        int k = 2 * t + 8 * r;
        for (int j = 0; j < 2; ++j) B[k + j][g] = cvt(h16(io->in[4 + r], j));
      } else {
        int k = 4 * t + 16 * r;
        for (int j = 0; j < 4; ++j) B[k + j][g] = cvt(b8(io->in[4 + r], j));
      }
    }
    for (int i = 0; i < 4; ++i) {
      float c;
      std::memcpy(&c, &io->in[6 + i], 4);
      C[g + ((i & 2) ? 8 : 0)][2 * t + (i & 1)] = c;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
      int m = g + ((i & 2) ? 8 : 0), n = 2 * t + (i & 1);
      // products of f16/bf16/e4m3 values are exact in fp32; accumulate in k order.
      float acc = C[m][n];
      for (int k = 0; k < K; ++k) acc += A[m][k] * B[k][n];
      std::memcpy(&lanes[lane]->out[i], &acc, 4);
    }
  }
}

// s8 x s8 -> s32 m16n8k32: the A / B / C fragment layouts of the e4m3 variant, integer products
// summed in uint32 (two's-complement wrap-around, as the hardware without .satfinite).
void mma_s8_impl(LaneIO* const* lanes) {
  int32_t A[16][32], B[32][8];
  uint32_t C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const LaneIO* io = lanes[lane];
    int g = lane >> 2, t = lane & 3;
    for (int r = 0; r < 4; ++r) {
      int row = g + ((r & 1) ? 8 : 0), col = 4 * t + ((r & 2) ? 16 : 0);
      for (int j = 0; j < 4; ++j) A[row][col + j] = static_cast<int8_t>(b8(io->in[r], j));
    }
    for (int r = 0; r < 2; ++r) {
      int k = 4 * t + 16 * r;
      for (int j = 0; j < 4; ++j) B[k + j][g] = static_cast<int8_t>(b8(io->in[4 + r], j));
    }
    for (int i = 0; i < 4; ++i) C[g + ((i & 2) ? 8 : 0)][2 * t + (i & 1)] = io->in[6 + i];
  }
  for (int lane = 0; lane < 32; ++lane) {
    int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
      int m = g + ((i & 2) ? 8 : 0), n = 2 * t + (i & 1);
      uint32_t acc = C[m][n];
      for (int k = 0; k < 32; ++k) acc += static_cast<uint32_t>(A[m][k] * B[k][n]);
      lanes[lane]->out[i] = acc;
    }
  }
}

}  // namespace

void coll_mma_f16(LaneIO* const* lanes, unsigned) {
  prof::count_mma(0);
  mma_impl<16>(lanes, f16_to_float);
}
void coll_mma_bf16(LaneIO* const* lanes, unsigned) {
  prof::count_mma(1);
  mma_impl<16>(lanes, bf16_to_float);
}
void coll_mma_e4m3(LaneIO* const* lanes, unsigned) {
  prof::count_mma(2);
  mma_impl<32>(lanes, e4m3_to_float);
}

void coll_mma_s8(LaneIO* const* lanes, unsigned) {
  prof::count_mma(3);
  mma_s8_impl(lanes);
}

void coll_ldmatrix(LaneIO* const* lanes, unsigned) {
  int num = lanes[0]->a;
  bool trans = lanes[0]->b != 0;
  for (int l = 1; l < 32; ++l)
    if (lanes[l]->a != num || (lanes[l]->b != 0) != trans)
      fault(kFaultGeneric, "ldmatrix: lanes disagree on the shape (.x%d%s vs .x%d%s in lane %d)", num,
            trans ? ".trans" : "", lanes[l]->a, lanes[l]->b ? ".trans" : "", l);
  uint16_t M[4][8][8];
  for (int i = 0; i < num; ++i) {
    for (int r = 0; r < 8; ++r) {
      const void* p = lanes[8 * i + r]->ptr;
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
        fault(kFaultAddress, "ldmatrix: row address %p of lane %d is not 16-byte aligned", p, 8 * i + r);
      std::memcpy(M[i][r], p, 16);
    }
  }
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < num; ++i) {
      uint16_t lo, hi;
      if (!trans) {
        lo = M[i][l / 4][2 * (l % 4)];
        hi = M[i][l / 4][2 * (l % 4) + 1];
      } else {
        lo = M[i][2 * (l % 4)][l / 4];
        hi = M[i][2 * (l % 4) + 1][l / 4];
      }
      lanes[l]->out[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
  }
}

}  // namespace fastinfer::simt::detail
