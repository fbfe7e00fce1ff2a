#pragma once
// The mma.sync tile vocabulary of the tensor-core kernels: prefill attention (attention/prefill*.cuh)
// and the fp8, int8, dense and int4 GEMMs (gemm/*_gemm.cuh). From global memory to the stores:
//
//   shared-memory tiles are rows of 16-byte chunks, XOR-swizzled (swizzle);
//   chunk_passes / tile_chunk deal a tile's chunks out to the threads of a CTA (the cp.async loads);
//   LdmatrixLane says which row and chunk each lane addresses in an ldmatrix.x4, so that the four
//     8 x 8 matrices arrive as an A fragment or as the B fragments of two n8 tiles, which load_a
//     and load_b_pair read;
//   pack2 rounds two fp32 results into one register of two 16-bit halves.
//
// Then the k-tile pipeline that the fp8, int8 and dense GEMMs share (GemmConfig, load_ab_stage,
// load_ab_fragments). The fragment layouts themselves are in common/ptx.cuh.
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/ptx.cuh"

#include <cstdint>

namespace fastinfer::mma {

// ---- shared-memory tiles -------------------------------------------------------------------------
constexpr int kChunkBytes = 16;  // one cp.async, one ldmatrix row address

// Byte offset of chunk `chunk` of row `row` in a [rows][kChunksPerRow] tile of 16-byte chunks, the
// chunk stored at position chunk ^ (row & 7) of its row (kChunksPerRow a multiple of 8, so that the
// XOR stays in the row). An ldmatrix phase reads 8 consecutive rows at one logical chunk: the XOR
// puts them at 8 distinct positions, all 32 banks, no conflict; the cp.async writes and any other
// access go through the same function.
template <int kChunksPerRow>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return (row * kChunksPerRow + (chunk ^ (row & 7))) * kChunkBytes;
}

// A tile of kRows x kChunksPerRow chunks is spread over the kThreads threads of a CTA in passes:
// chunk idx of the row-major order goes to thread idx % kThreads in pass idx / kThreads, so
// consecutive threads take consecutive chunks of a row and a warp's 16-byte accesses are
// contiguous runs of rows. The caller writes the loop over the passes:
//   for (int i = 0; i < chunk_passes<kRows, kChunksPerRow, kThreads>(); ++i) {
//     const TileChunk rc = tile_chunk<kChunksPerRow, kThreads>(tid, i);  ... }
template <int kRows, int kChunksPerRow, int kThreads>
__device__ __forceinline__ constexpr int chunk_passes() {
  static_assert((kRows * kChunksPerRow) % kThreads == 0, "whole passes");
  return kRows * kChunksPerRow / kThreads;
}
struct TileChunk {
  int row, chunk;
};
template <int kChunksPerRow, int kThreads>
__device__ __forceinline__ TileChunk tile_chunk(int tid, int pass) {
  const int idx = tid + pass * kThreads;
  return {idx / kChunksPerRow, idx % kChunksPerRow};
}

// ---- fragments ---------------------------------------------------------------------------------
// A lane's part in an ldmatrix.x4 over a block of 16 rows x 2 chunks: matrix mat = lane / 8 takes
// its 8 row addresses from lanes 8 mat .. 8 mat + 7, this lane giving row r = lane % 8 of it, and
// r[mat] of every lane comes from matrix mat. The block starts at row block * block_rows.
struct LdmatrixLane {
  int mat, r;

  __device__ __forceinline__ explicit LdmatrixLane(int lane) : mat(lane / 8), r(lane % 8) {}

  // A order, matrices rows 0-7 | rows 8-15 at chunk 0, then at chunk 1. On [m][k] rows: the A
  // fragment (a[0] rows g, k 0-7; a[1] rows g + 8; a[2], a[3] the same at k 8-15). With .trans on
  // [k][n] rows: b[0], b[1] of the n8 tile at chunk 0, then of the one at chunk 1.
  __device__ __forceinline__ int a_row(int block, int block_rows = 16) const {
    return block * block_rows + r + 8 * (mat & 1);
  }
  __device__ __forceinline__ int a_chunk() const { return mat >> 1; }

  // B order, matrices chunk 0 | chunk 1 of rows 0-7, then of rows 8-15. On [n][k] rows (the "col"
  // B operand): b[0], b[1] of the n8 tile of rows 0-7, then of the one of rows 8-15.
  __device__ __forceinline__ int b_row(int block, int block_rows = 16) const {
    return block * block_rows + r + 8 * (mat >> 1);
  }
  __device__ __forceinline__ int b_chunk() const { return mat & 1; }
};

// The fragment loads take this lane's row and chunk (LdmatrixLane) in a swizzled tile. A k-step is
// 32 bytes of k (16 fp16 / bf16 or 32 e4m3 / int8 elements), chunks 2 ks and 2 ks + 1, so the
// chunk is 2 ks + a_chunk() (or b_chunk()).

// The A fragment of [m][k] rows (A order).
template <int kChunksPerRow>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const unsigned char* tile, int row, int chunk) {
  ptx::ldmatrix_x4(a, tile + swizzle<kChunksPerRow>(row, chunk));
}

// The B fragments of the two n8 tiles of 16 rows: of [n][k] rows (B order), or with kTrans of
// [k][n] rows by ldmatrix .trans, the n8 tiles at chunks 2 np and 2 np + 1 (A order; 16-bit
// elements only).
template <int kChunksPerRow, bool kTrans = false>
__device__ __forceinline__ void load_b_pair(uint32_t (&b0)[2], uint32_t (&b1)[2], const unsigned char* tile, int row,
                                            int chunk) {
  uint32_t r[4];
  if constexpr (kTrans)
    ptx::ldmatrix_x4_trans(r, tile + swizzle<kChunksPerRow>(row, chunk));
  else
    ptx::ldmatrix_x4(r, tile + swizzle<kChunksPerRow>(row, chunk));
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}

// ---- results -----------------------------------------------------------------------------------
// Two fp32 -> one register of two 16-bit values (lower index in the low half), round to nearest:
// the layout of a 32-bit store of two adjacent outputs and of an A fragment register.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ---- the k-tile pipeline of the fp8, int8 and dense GEMMs ----------------------------------------
// A stage holds one k-tile of the CTA's A rows then of its B rows, each row kGemmKTileBytes bytes
// (8 chunks: one swizzle period) of a row-major [rows][K] operand (b is [N, K]: the "col" B).
constexpr int kGemmKTileBytes = 128;
constexpr int kGemmKTileChunks = kGemmKTileBytes / kChunkBytes;

// One CTA computes a kBlockM x kBlockN tile of out with kWarpsM x kWarpsN warps; each warp owns a
// kWarpM x kWarpN sub-tile = kMi x kNi mma tiles of 16 x 8, through a kStages-deep cp.async ring.
template <int kBlockM_, int kBlockN_, int kWarpsM_, int kWarpsN_, int kStages_>
struct GemmConfig {
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWarpM = kBlockM / kWarpsM;  // rows per warp
  static constexpr int kWarpN = kBlockN / kWarpsN;  // cols per warp
  static constexpr int kMi = kWarpM / 16;
  static constexpr int kNi = kWarpN / 8;
  static constexpr int kABytes = kBlockM * kGemmKTileBytes;
  static constexpr int kBBytes = kBlockN * kGemmKTileBytes;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes;
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile: multiples of 16 (ldmatrix.x4 covers 2 n8 tiles)");
  static_assert((kBlockM * kGemmKTileChunks) % kThreads == 0 && (kBlockN * kGemmKTileChunks) % kThreads == 0,
                "tile / thread mismatch in the cp.async loads");
  static_assert(kStages >= 2, "pipeline depth");
};

// k-tile kt of the rows [r0, r0 + kRows) of src ([rows][row_bytes]) into a swizzled tile by
// 16-byte cp.async chunks; rows past `rows` and chunks past row_bytes are zero-filled (row_bytes,
// K times the element size, is a multiple of 16: a chunk is all in or all out, and zeros add
// nothing to the products). Rows of src start row_pitch bytes apart (row_bytes, or a multiple of
// 16 above it: a column slice of a wider buffer). No commit.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_k_tile_rows(uint8_t* tile, const uint8_t* __restrict__ src, int64_t r0,
                                                 int64_t rows, int64_t row_bytes, int64_t row_pitch, int kt,
                                                 int tid) {
  const int64_t k0 = static_cast<int64_t>(kt) * kGemmKTileBytes;
#pragma unroll
  for (int i = 0; i < chunk_passes<kRows, kGemmKTileChunks, kThreads>(); ++i) {
    const TileChunk rc = tile_chunk<kGemmKTileChunks, kThreads>(tid, i);
    const int64_t k = k0 + rc.chunk * kChunkBytes;
    const bool pred = r0 + rc.row < rows && k < row_bytes;
    ptx::cp_async_cg_16(tile + swizzle<kGemmKTileChunks>(rc.row, rc.chunk),
                        pred ? src + (r0 + rc.row) * row_pitch + k : src, pred);
  }
}

// The same for gathered rows: tile row r is row row_of[r] of src (row_of in shared memory; a
// negative entry zero-fills the tile row), as the grouped GEMMs read the tokens of one expert.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_k_tile_gathered(uint8_t* tile, const uint8_t* __restrict__ src,
                                                     const int32_t* row_of, int64_t row_bytes, int kt, int tid) {
  const int64_t k0 = static_cast<int64_t>(kt) * kGemmKTileBytes;
#pragma unroll
  for (int i = 0; i < chunk_passes<kRows, kGemmKTileChunks, kThreads>(); ++i) {
    const TileChunk rc = tile_chunk<kGemmKTileChunks, kThreads>(tid, i);
    const int64_t k = k0 + rc.chunk * kChunkBytes;
    const int32_t row = row_of[rc.row];
    const bool pred = row >= 0 && k < row_bytes;
    ptx::cp_async_cg_16(tile + swizzle<kGemmKTileChunks>(rc.row, rc.chunk), pred ? src + row * row_bytes + k : src,
                        pred);
  }
}

// k-tile kt of the A rows [m0, m0 + kBlockM) and the B rows [n0, n0 + kBlockN) into a stage. A's
// rows start a_pitch bytes apart (row_bytes, or more: see load_k_tile_rows), B's row_bytes apart.
template <typename Cfg>
__device__ __forceinline__ void load_ab_stage(uint8_t* stage, const uint8_t* __restrict__ a,
                                              const uint8_t* __restrict__ b, int64_t m0, int64_t n0, int64_t M,
                                              int64_t N, int64_t row_bytes, int64_t a_pitch, int kt, int tid) {
  load_k_tile_rows<Cfg::kBlockM, Cfg::kThreads>(stage, a, m0, M, row_bytes, a_pitch, kt, tid);
  load_k_tile_rows<Cfg::kBlockN, Cfg::kThreads>(stage + Cfg::kABytes, b, n0, N, row_bytes, row_bytes, kt, tid);
}

// A lane's ldmatrix rows and chunks in a stage: A order in the warp's A rows, B order in its B
// rows (the warp's first row of each folded in).
struct GemmFragmentLanes {
  int a_row, a_chunk;
  int b_row, b_chunk;
};
template <typename Cfg>
__device__ __forceinline__ GemmFragmentLanes gemm_fragment_lanes(int warp_m, int warp_n, int lane) {
  const LdmatrixLane l(lane);
  return {l.a_row(warp_m, Cfg::kWarpM), l.a_chunk(), l.b_row(warp_n, Cfg::kWarpN), l.b_chunk()};
}

// The warp's A and B fragments of k-step ks from a stage.
template <typename Cfg>
__device__ __forceinline__ void load_ab_fragments(uint32_t (&af)[Cfg::kMi][4], uint32_t (&bf)[Cfg::kNi][2],
                                                  const uint8_t* stage, const GemmFragmentLanes& l, int ks) {
#pragma unroll
  for (int i = 0; i < Cfg::kMi; ++i) load_a<kGemmKTileChunks>(af[i], stage, l.a_row + 16 * i, 2 * ks + l.a_chunk);
#pragma unroll
  for (int j = 0; j < Cfg::kNi / 2; ++j)
    load_b_pair<kGemmKTileChunks>(bf[2 * j], bf[2 * j + 1], stage + Cfg::kABytes, l.b_row + 16 * j,
                                  2 * ks + l.b_chunk);
}

}  // namespace fastinfer::mma
