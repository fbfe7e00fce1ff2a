// fastinfer simt: emulation of the PTX instructions wrapped by fastinfer/common/ptx.cuh.
#pragma once
#include <fastinfer/simt/device.h>

#pragma GCC visibility push(hidden)
namespace fastinfer::simt::detail {

enum MmaKind { kMmaF16 = 0, kMmaBF16 = 1, kMmaE4M3 = 2, kMmaS8 = 3 };

void coll_mma_f16(LaneIO* const*, unsigned);
void coll_mma_bf16(LaneIO* const*, unsigned);
void coll_mma_e4m3(LaneIO* const*, unsigned);
void coll_mma_s8(LaneIO* const*, unsigned);
void coll_ldmatrix(LaneIO* const*, unsigned);

FI_SIMT_NOPROF inline void mma(int kind, float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  LaneIO io;
  for (int i = 0; i < 4; ++i) io.in[i] = a[i];
  io.in[4] = b[0];
  io.in[5] = b[1];
  for (int i = 0; i < 4; ++i) std::memcpy(&io.in[6 + i], &c[i], 4);
  static const char* const names[3] = {"mma.sync.m16n8k16.row.col.f32.f16.f16.f32",
                                       "mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32",
                                       "mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32"};
  static const CollFn fns[3] = {coll_mma_f16, coll_mma_bf16, coll_mma_e4m3};
  warp_collective(names[kind], fns[kind], 0xffffffffu, &io);
  for (int i = 0; i < 4; ++i) std::memcpy(&d[i], &io.out[i], 4);
}

// mma.sync.m16n8k32.row.col.s32.s8.s8.s32 (no .satfinite: int32 accumulation wraps, exact).
FI_SIMT_NOPROF inline void mma_s8(int32_t (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                  const int32_t (&c)[4]) {
  LaneIO io;
  for (int i = 0; i < 4; ++i) io.in[i] = a[i];
  io.in[4] = b[0];
  io.in[5] = b[1];
  for (int i = 0; i < 4; ++i) io.in[6 + i] = static_cast<uint32_t>(c[i]);
  warp_collective("mma.sync.m16n8k32.row.col.s32.s8.s8.s32", coll_mma_s8, 0xffffffffu, &io);
  for (int i = 0; i < 4; ++i) d[i] = static_cast<int32_t>(io.out[i]);
}

FI_SIMT_NOPROF inline void ldmatrix(uint32_t* r, const void* smem, int num, bool trans) {
  LaneIO io;
  io.ptr = smem;
  io.a = num;
  io.b = trans;
  warp_collective(trans ? "ldmatrix.sync.m8n8.trans.b16" : "ldmatrix.sync.m8n8.b16", coll_ldmatrix, 0xffffffffu,
                  &io);
  for (int i = 0; i < num; ++i) r[i] = io.out[i];
}

}  // namespace fastinfer::simt::detail
#pragma GCC visibility pop
