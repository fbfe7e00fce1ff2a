// FP8 e4m3 GEMM for Hopper with the scales and the bias fused into the epilogue: the shared CUTLASS
// 3.x sm_90a kernel (fastinfer/gemm/w8a8_sm90_gemm.cuh: tile configurations by M, TMA + wgmma,
// warp-specialised, persistent) with e4m3 operands; API in fastinfer/gemm/w8a8_sm90.h.
//
// Build: this file matches cuda/src/*_sm90.cu, which CMakeLists.txt keeps out of the simt build
// and compiles for sm_90a alone (with FASTINFER_SM90A_KERNELS=1) when 90a is among
// FASTINFER_CUDA_ARCHS and CUTLASS was found; otherwise it compiles to the stubs at the bottom.
//
// Design
//  * D = cast( scale_a (col broadcast, per row m) * (scale_b (row broadcast, per column n) * acc)
//              + bias (row broadcast) ), one epilogue visitor tree (Sm90EVT), all in fp32.
//    Both scales use dynamic broadcast strides (vector or element 0, chosen at run time, each on
//    its own), so every scale mode shares ONE instantiation. The bias is a row broadcast with a
//    null-pointer default of 0, so "no bias" is a runtime argument too.
//    Instantiations: 3 tile configurations x 2 output dtypes = 6 kernels.
//  * FP8 fast accumulation (Kernel*FP8FastAccum): the wgmma accumulator (fp32 with reduced internal
//    precision for fp8 inputs) is used directly, without the periodic promotion into a separate
//    fp32 register sum that the non-fast schedules do every few k-blocks. It is what vLLM and
//    TensorRT-LLM use for per-tensor / per-token fp8 inference and is faster (fewer registers and
//    FADDs in the mainloop); the cost is a larger rounding error for very long K. The blockwise-
//    scaled path (elsewhere) promotes per 128-wide k-block by construction.
#include "fastinfer/gemm/w8a8_sm90.h"

#if defined(FASTINFER_SM90A_KERNELS)

#include "fastinfer/gemm/w8a8_sm90_gemm.cuh"

namespace fastinfer {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

struct Fp8Op {
  using ElementAB = cutlass::float_e4m3_t;
  using ElementAcc = float;

  template <bool kCooperative>
  using MainloopSchedule = std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                              cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>;

  template <class TileShape, class ElementOut>
  struct Tree {
    // scale_a: one value per row m (per token), or scale_a[0]; scale_b per column n or scale_b[0].
    using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, sm90::ColStride, /*Alignment=*/1>;
    using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, sm90::RowStride, /*Alignment=*/1>;
    // bias[n] in the output dtype; a null pointer reads as 0.
    using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementOut, float, sm90::VectorRowStride, /*Alignment=*/1>;
    using ScaleBTimesAcc =
        fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, sm90::kRound>, ScaleB, fusion::Sm90AccFetch>;
    // multiply_add(x, y, z) = x * y + z, then one rounding to ElementOut.
    using Root = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiply_add, ElementOut, float, sm90::kRound>, ScaleA,
                                 ScaleBTimesAcc, Bias>;
  };
  template <class TileShape, class ElementOut>
  using Epilogue = typename Tree<TileShape, ElementOut>::Root;

  template <class Epilogue, class ElementOut>
  static typename Epilogue::Arguments fusion_args(const W8a8GemmSm90Args& p) {
    return {
        {p.scale_a, 0.0f, sm90::ColStride{p.scale_a_per_row, _0{}, int64_t(0)}},  // ScaleA
        {
            {p.scale_b, 0.0f, sm90::RowStride{_0{}, p.scale_b_per_col, int64_t(0)}},  // ScaleB
            {},                                                                      // Acc
            {},                                                                      // multiplies
        },
        {static_cast<const ElementOut*>(p.bias), ElementOut(0), sm90::VectorRowStride{}},  // Bias (null: 0)
        {},                                                                               // multiply_add
    };
  }

  // No zero points for fp8.
  static bool accepts(const W8a8GemmSm90Args& p) { return p.azp == nullptr && p.azp_adj == nullptr; }
};

}  // namespace

bool fp8_gemm_sm90_available() { return true; }
size_t fp8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args& p) { return sm90::workspace_bytes<Fp8Op>(p); }
cudaError_t launch_fp8_gemm_sm90(const W8a8GemmSm90Args& p, cudaStream_t stream) { return sm90::launch<Fp8Op>(p, stream); }

}  // namespace fastinfer

#else  // !FASTINFER_SM90A_KERNELS: built without sm_90a (or without CUTLASS): the API reports it.

namespace fastinfer {

bool fp8_gemm_sm90_available() { return false; }
size_t fp8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args&) { return 0; }
cudaError_t launch_fp8_gemm_sm90(const W8a8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }

}  // namespace fastinfer

#endif
