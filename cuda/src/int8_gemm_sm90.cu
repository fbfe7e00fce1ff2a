// INT8 GEMM for Hopper (s8 x s8 -> exact s32 accumulation) with the zero-point correction, the
// scales and the bias fused into the epilogue: the shared CUTLASS 3.x sm_90a kernel
// (fastinfer/gemm/w8a8_sm90_gemm.cuh: tile configurations by M, TMA + wgmma, warp-specialised,
// persistent) with int8 operands; API in fastinfer/gemm/w8a8_sm90.h.
//
// Build: as fp8_gemm_sm90.cu (cuda/src/*_sm90.cu: sm_90a only, stubs at the bottom otherwise).
//
// Design
//  * The epilogue is the one of the mma.sync kernel (fastinfer/gemm/int8.h), operation for
//    operation, so the two kernels and the reference agree bit for bit:
//      c   = acc - azp[m] * azp_adj[n]                          (int32, wrapping like the reference)
//      out = cast( fma(float(c), scale_a[m] * scale_b[n], bias[n]) )   (fp32, one rounding)
//    as one epilogue visitor tree (Sm90EVT). Without azp both zero-point broadcasts are null and
//    read as 0; without bias the fma adds 0 (the same value as the reference's plain product).
//    The scales and azp use dynamic broadcast strides (vector or element 0, chosen at run time),
//    so every mode -- symmetric / asymmetric, [1] or [M] x [1] or [N] scales, bias or not --
//    shares ONE instantiation: 3 tile configurations x 2 output dtypes = 6 kernels.
//  * Mainloop: the plain warp-specialised schedules (no fast-accumulation variant exists or is
//    needed: s32 accumulation in the tensor cores is exact).
#include "fastinfer/gemm/w8a8_sm90.h"

#if defined(FASTINFER_SM90A_KERNELS)

#include "fastinfer/gemm/w8a8_sm90_gemm.cuh"

namespace fastinfer {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

struct Int8Op {
  using ElementAB = int8_t;
  using ElementAcc = int32_t;

  template <bool kCooperative>
  using MainloopSchedule = std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                              cutlass::gemm::KernelTmaWarpSpecializedPingpong>;

  template <class TileShape, class ElementOut>
  struct Tree {
    // azp[m] (or azp[0]) times azp_adj[n], in int32; null pointers read as 0 (symmetric a).
    using Azp = fusion::Sm90ColBroadcast<0, TileShape, int32_t, int32_t, sm90::ColStride, /*Alignment=*/1>;
    using AzpAdj = fusion::Sm90RowBroadcast<0, TileShape, int32_t, int32_t, sm90::VectorRowStride, /*Alignment=*/1>;
    using AzpTerm = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, int32_t, int32_t, sm90::kRound>, Azp, AzpAdj>;
    using Corrected =
        fusion::Sm90EVT<fusion::Sm90Compute<cutlass::minus, int32_t, int32_t, sm90::kRound>, fusion::Sm90AccFetch, AzpTerm>;
    // scale_a[m] * scale_b[n] in fp32 (either may be element 0 for every row / column).
    using ScaleA = fusion::Sm90ColBroadcast<0, TileShape, float, float, sm90::ColStride, /*Alignment=*/1>;
    using ScaleB = fusion::Sm90RowBroadcast<0, TileShape, float, float, sm90::RowStride, /*Alignment=*/1>;
    using ScaleAB = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, sm90::kRound>, ScaleA, ScaleB>;
    // bias[n] in the output dtype; a null pointer reads as 0.
    using Bias = fusion::Sm90RowBroadcast<0, TileShape, ElementOut, float, sm90::VectorRowStride, /*Alignment=*/1>;
    // multiply_add(float(c), scale_ab, bias): one fma, then one rounding to ElementOut.
    using Root = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiply_add, ElementOut, float, sm90::kRound>, Corrected,
                                 ScaleAB, Bias>;
  };
  template <class TileShape, class ElementOut>
  using Epilogue = typename Tree<TileShape, ElementOut>::Root;

  template <class Epilogue, class ElementOut>
  static typename Epilogue::Arguments fusion_args(const W8a8GemmSm90Args& p) {
    return {
        {
            // Corrected
            {},  // Acc
            {
                {p.azp, int32_t(0), sm90::ColStride{p.azp_per_row, _0{}, int64_t(0)}},  // Azp (null: 0)
                {p.azp_adj, int32_t(0), sm90::VectorRowStride{}},                       // AzpAdj (null: 0)
                {},                                                                    // multiplies
            },
            {},  // minus
        },
        {
            // ScaleAB
            {p.scale_a, 0.0f, sm90::ColStride{p.scale_a_per_row, _0{}, int64_t(0)}},  // ScaleA
            {p.scale_b, 0.0f, sm90::RowStride{_0{}, p.scale_b_per_col, int64_t(0)}},  // ScaleB
            {},                                                                      // multiplies
        },
        {static_cast<const ElementOut*>(p.bias), ElementOut(0), sm90::VectorRowStride{}},  // Bias (null: 0)
        {},                                                                               // multiply_add
    };
  }

  // azp and azp_adj come together.
  static bool accepts(const W8a8GemmSm90Args& p) { return (p.azp == nullptr) == (p.azp_adj == nullptr); }
};

}  // namespace

bool int8_gemm_sm90_available() { return true; }
size_t int8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args& p) { return sm90::workspace_bytes<Int8Op>(p); }
cudaError_t launch_int8_gemm_sm90(const W8a8GemmSm90Args& p, cudaStream_t stream) { return sm90::launch<Int8Op>(p, stream); }

}  // namespace fastinfer

#else  // !FASTINFER_SM90A_KERNELS: built without sm_90a (or without CUTLASS): the API reports it.

namespace fastinfer {

bool int8_gemm_sm90_available() { return false; }
size_t int8_gemm_sm90_workspace_bytes(const W8a8GemmSm90Args&) { return 0; }
cudaError_t launch_int8_gemm_sm90(const W8a8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }

}  // namespace fastinfer

#endif
