#pragma once
// The dynamic quantisation kernels that e4m3 (gemm/fp8_quantize.cuh) and int8
// (gemm/int8_quantize.cuh) share, written once over a format policy F:
//
//  - per token (quantize_token_kernel): one CTA per row. Each thread keeps up to kTokenRegVecs
//    8-element (16-byte) vectors of the row in registers (rows of K <= kQuantThreads *
//    kTokenRegVecs * 8 = 8192 elements are read once); longer rows re-read x after the block-wide
//    reduction (the second read is served by L2). Then the row's scale (and zero point), and 8
//    bytes per vector.
//  - per tensor (quantize_tensor_kernel): one flat elementwise pass, with the given scale or with
//    one from the amax partials of a reduction pass before it (amax_partials_kernel: one amax per
//    CTA into the workspace, no atomics, so the result is deterministic), which each CTA
//    reduces again (a few hundred floats, from L2); CTA 0 writes the scale. x is read by both
//    passes (the second read is an L2 hit when x fits there): a single pass would need a grid-wide
//    barrier.
//
// A format F provides:
//   Params                               the op's parameters (x, out, scale, given_scale, rows, cols,
//                                        x_row_stride, workspace)
//   Range                                a thread's running statistic of a row: add(Vec<T, 8>)
//   row_scale(Range, scratch)            the block-wide reduction of the CTA's Ranges -> QuantScale
//   store_row_scale(Params, row, scale)  the row's scale (and zero point) into the outputs
//   scale_from_amax(amax)                the per-tensor scale
//   given_zero_point(Params)             the per-tensor zero point with a given scale (0 without one)
//   quantize8(Vec<T, 8>, QuantScale)     8 codes -> 8 bytes (a uint2), lower index in the lowest byte
#include "fastinfer/common/platform.cuh"
#include "fastinfer/common/launch.cuh"
#include "fastinfer/common/reduce.cuh"
#include "fastinfer/common/vec.cuh"

#include <cstdint>

namespace fastinfer::quant {

constexpr int kQuantThreads = 256;
constexpr int kTokenRegVecs = 4;
constexpr int kMaxAmaxPartials = 512;  // CTAs of the per-tensor reduction pass

// max |x| of 8 values, NaN if one is (max_nan: a NaN in x makes a NaN scale, as torch.amax does).
template <typename T>
__device__ __forceinline__ float amax8(const Vec<T, 8>& v) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = max_nan(m, fabsf(to_float(v[i])));
  return m;
}

// A row's (or the tensor's) quantisation: x ~= (q - zero_point) * scale; zero_point is 0 but for
// asymmetric int8.
struct QuantScale {
  float scale;
  int32_t zero_point;
};

// Where x's rows start: x_row_stride elements apart (a column slice of a wider buffer; a multiple
// of 8), or cols apart when it is 0. The outputs are dense [rows, cols].
template <typename Params>
__device__ __forceinline__ int64_t x_row_stride(const Params& p) {
  return p.x_row_stride != 0 ? p.x_row_stride : p.cols;
}

// The element offset in x of the v-th 8-element vector of the dense [rows, cols] output.
template <typename Params>
__device__ __forceinline__ int64_t x_vector_offset(const Params& p, int64_t v) {
  const int64_t stride = x_row_stride(p);
  if (stride == p.cols) return v * 8;
  const int64_t vecs_per_row = p.cols / 8;
  return v / vecs_per_row * stride + v % vecs_per_row * 8;
}

// ---- per token: grid M, block kQuantThreads --------------------------------------------------
template <typename F, typename T>
__global__ void __launch_bounds__(kQuantThreads) quantize_token_kernel(const typename F::Params p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int vecs = static_cast<int>(p.cols / 8);
  const T* x_row = static_cast<const T*>(p.x) + row * x_row_stride(p);
  uint2* out_row = reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + row * p.cols);
  const bool in_regs = vecs <= kQuantThreads * kTokenRegVecs;

  Vec<T, 8> regs[kTokenRegVecs];
  typename F::Range range;
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) {
        regs[i].load(x_row + static_cast<int64_t>(v) * 8);
        range.add(regs[i]);
      }
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      range.add(x);
    }
  }
  const QuantScale s = F::row_scale(range, scratch);
  if (threadIdx.x == 0) F::store_row_scale(p, row, s);
  if (in_regs) {
#pragma unroll
    for (int i = 0; i < kTokenRegVecs; ++i) {
      const int v = threadIdx.x + i * kQuantThreads;
      if (v < vecs) out_row[v] = F::quantize8(regs[i], s);
    }
  } else {
    for (int v = threadIdx.x; v < vecs; v += kQuantThreads) {
      Vec<T, 8> x;
      x.load(x_row + static_cast<int64_t>(v) * 8);
      out_row[v] = F::quantize8(x, s);
    }
  }
}

// ---- per tensor, reduction pass: grid num_partials (<= kMaxAmaxPartials), block kQuantThreads ----
// Grid-stride over the vectors; partials[blockIdx.x] = amax of this CTA's vectors. Reads only x,
// rows, cols and workspace of the Params.
template <typename Params, typename T>
__global__ void __launch_bounds__(kQuantThreads) amax_partials_kernel(const Params p) {
  __shared__ float scratch[32];
  const int64_t num_vecs = p.rows * p.cols / 8;
  float amax = 0.f;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x; v < num_vecs;
       v += static_cast<int64_t>(gridDim.x) * kQuantThreads) {
    Vec<T, 8> x;
    x.load(static_cast<const T*>(p.x) + x_vector_offset(p, v));
    amax = max_nan(amax, amax8(x));
  }
  amax = block_reduce_max(amax, scratch);
  if (threadIdx.x == 0) static_cast<float*>(p.workspace)[blockIdx.x] = amax;
}

// ---- per tensor, flat pass: grid ceil(M * K / 8 / kQuantThreads), block kQuantThreads ----------
// The scale is the given one, or comes from the num_partials amax partials in the workspace.
template <typename F, typename T>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_tensor_kernel(const typename F::Params p, const int num_partials) {
  __shared__ float scratch[32];
  float scale;
  if (p.given_scale != nullptr) {
    scale = *p.given_scale;
  } else {
    const float* partials = static_cast<const float*>(p.workspace);
    float amax = 0.f;
    for (int i = threadIdx.x; i < num_partials; i += kQuantThreads) amax = max_nan(amax, partials[i]);
    scale = F::scale_from_amax(block_reduce_max(amax, scratch));
  }
  const QuantScale s{scale, F::given_zero_point(p)};
  if (blockIdx.x == 0 && threadIdx.x == 0) F::store_row_scale(p, 0, s);
  const int64_t num_vecs = p.rows * p.cols / 8;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  if (v >= num_vecs) return;
  Vec<T, 8> x;
  x.load(static_cast<const T*>(p.x) + x_vector_offset(p, v));
  reinterpret_cast<uint2*>(p.out)[v] = F::quantize8(x, s);
}

// ---- launch (host) -----------------------------------------------------------------------------
// CTAs of the flat passes over the 8-element vectors of x, and of the reduction pass.
inline int64_t flat_blocks(int64_t rows, int64_t cols) { return (rows * cols / 8 + kQuantThreads - 1) / kQuantThreads; }
inline int num_amax_partials(int64_t rows, int64_t cols) {
  const int64_t blocks = flat_blocks(rows, cols);
  return static_cast<int>(blocks < kMaxAmaxPartials ? (blocks > 0 ? blocks : 1) : kMaxAmaxPartials);
}

// Per tensor: the reduction pass into p.workspace (num_amax_partials floats) unless p.given_scale
// is set, then the flat pass, at least one CTA (an empty x still gets its scale written).
template <typename F, typename T>
cudaError_t launch_quantize_tensor(const typename F::Params& p, cudaStream_t stream) {
  const int64_t blocks = flat_blocks(p.rows, p.cols);
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 block(kQuantThreads);
  int partials = 0;
  if (p.given_scale == nullptr) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    partials = num_amax_partials(p.rows, p.cols);
    cudaError_t err =
        launch_kernel(amax_partials_kernel<typename F::Params, T>, dim3(partials), block, 0, stream, p);
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(quantize_tensor_kernel<F, T>, dim3(blocks > 0 ? static_cast<unsigned>(blocks) : 1u), block, 0,
                       stream, p, partials);
}

}  // namespace fastinfer::quant
