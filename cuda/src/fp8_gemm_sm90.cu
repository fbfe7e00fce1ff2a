// FP8 e4m3 GEMM for Hopper with the scales and the bias fused into the epilogue: CUTLASS 3.x
// kernels built from CollectiveBuilder (TMA + wgmma, warp-specialised, persistent), see
// fastinfer/gemm/fp8_sm90.h for the API.
//
// Build: this file matches cuda/src/*_sm90.cu, which CMakeLists.txt keeps out of the simt build
// and compiles for sm_90a alone (with FASTINFER_SM90A_KERNELS=1) when 90a is among
// FASTINFER_CUDA_ARCHS and CUTLASS was found; otherwise it compiles to the stubs at the bottom.
//
// Design
//  * D = cast( scale_a (col broadcast, per row m) * (scale_b (row broadcast, per column n) * acc)
//              + bias (row broadcast) ), one epilogue visitor tree (Sm90EVT), all in fp32.
//    Per-tensor and per-token x per-channel share ONE instantiation: both broadcasts use CUTLASS's
//    dynamic broadcast strides (a `bool` stride: 1 = a vector, 0 = element 0 for every row/col),
//    so the scale mode is a runtime argument and costs nothing in code size. The bias is a row
//    broadcast with a null-pointer default of 0, so "no bias" is a runtime argument too.
//    Instantiations: 3 tile configurations x 2 output dtypes = 6 kernels.
//  * Tile configuration by M (the token count), in the spirit of vLLM's sm90 fp8 dispatch:
//      M <= 64        64 x  64 x 128, ping-pong,   cluster 1x4 (the a tile is multicast to 4 CTAs along n)
//      64 < M <= 128  64 x 128 x 128, ping-pong,   cluster 2x1 (each b tile is multicast to both m tiles)
//      M > 128       128 x 256 x 128, cooperative, cluster 2x1
//    Small M is bound by reading b (the weights): small CTA tiles give enough CTAs to keep every SM
//    streaming; ping-pong overlaps one consumer warp group's epilogue with the other's mainloop.
//    Large M is compute bound: 128x256 tiles (two consumer warp groups, 64x256 each) maximise
//    wgmma work per byte of shared memory traffic.
//  * FP8 fast accumulation (Kernel*FP8FastAccum): the wgmma accumulator (fp32 with reduced internal
//    precision for fp8 inputs) is used directly, without the periodic promotion into a separate
//    fp32 register sum that the non-fast schedules do every few k-blocks. It is what vLLM and
//    TensorRT-LLM use for per-tensor / per-token fp8 inference and is faster (fewer registers and
//    FADDs in the mainloop); the cost is a larger rounding error for very long K. The blockwise-
//    scaled path (elsewhere) promotes per 128-wide k-block by construction.
//  * The kernels need a, b and out rows 16-byte aligned (TMA): n, k and the row strides must be
//    multiples of 16 elements; any m works (TMA clips partial tiles, the broadcasts are predicated).
#include "fastinfer/gemm/fp8_sm90.h"

#if defined(FASTINFER_SM90A_KERNELS)

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <atomic>

namespace fastinfer {
namespace {

using namespace cute;

using ElementAB = cutlass::float_e4m3_t;
using ElementAcc = float;
using ElementCompute = float;
using ElementScale = float;
constexpr int kAlignmentAB = 128 / cutlass::sizeof_bits<ElementAB>::value;  // 16 elements = 16 bytes

// cudaDeviceGetAttribute is cheap but not free; the SM count of each device is cached.
int sm_count_of(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    n = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// One kernel: a tile configuration and an output dtype.
template <class ElementOut, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct Fp8GemmSm90 {
  static constexpr int kAlignmentOut = 128 / cutlass::sizeof_bits<ElementOut>::value;  // 8 elements
  static constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

  // Epilogue visitor tree. Broadcast strides (M, N, L): a `bool` in the M (col) or N (row) mode
  // selects vector (1) or scalar (0) at run time; L is the batch stride (always 0 here).
  using ColStride = Stride<bool, _0, int64_t>;
  using RowStride = Stride<_0, bool, int64_t>;
  using BiasStride = Stride<_0, _1, int64_t>;
  // scale_a: one value per row m (per token), or scale_a[0].
  using ScaleA = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, ElementScale, ElementCompute, ColStride,
                                                            /*Alignment=*/1>;
  // scale_b: one value per column n (per output channel), or scale_b[0].
  using ScaleB = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, ElementScale, ElementCompute, RowStride,
                                                            /*Alignment=*/1>;
  // bias[n] in the output dtype; a null pointer reads as 0.
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, ElementOut, ElementCompute, BiasStride,
                                                          /*Alignment=*/1>;
  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  using ScaleBTimesAcc = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementCompute, ElementCompute, kRound>, ScaleB, Acc>;
  // multiply_add(x, y, z) = x * y + z, then one rounding to ElementOut.
  using Epilogue = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementOut, ElementCompute, kRound>, ScaleA,
      ScaleBTimesAcc, Bias>;

  using LayoutA = cutlass::layout::RowMajor;     // a [m, k], k contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // b [n, k], k contiguous ("TN" GEMM: the only fp8 wgmma layout)
  using LayoutD = cutlass::layout::RowMajor;     // out [m, n]

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute,
      /*ElementC=*/void, LayoutD, kAlignmentOut,  // no C operand: the bias comes through the tree
      ElementOut, LayoutD, kAlignmentOut, EpilogueSchedule, Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignmentAB, ElementAB, LayoutB,
      kAlignmentAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;

  // hw_info (device, SM count) only matters to the launch; the checks below do not read it.
  static Arguments make_arguments(const Fp8GemmSm90Args& p, const cutlass::KernelHardwareInfo& hw_info) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    const int64_t lda = p.lda ? p.lda : p.k, ldb = p.ldb ? p.ldb : p.k, ldd = p.ldd ? p.ldd : p.n;
    StrideA stride_a = make_stride(lda, _1{}, int64_t(0));
    StrideB stride_b = make_stride(ldb, _1{}, int64_t(0));
    StrideD stride_d = make_stride(ldd, _1{}, int64_t(0));

    const bool vec = p.per_token_channel;
    typename Epilogue::Arguments fusion{
        {p.scale_a, ElementScale(0), ColStride{vec, _0{}, int64_t(0)}},  // ScaleA
        {
            {p.scale_b, ElementScale(0), RowStride{_0{}, vec, int64_t(0)}},  // ScaleB
            {},                                                            // Acc
            {},                                                            // multiplies
        },
        {static_cast<const ElementOut*>(p.bias), ElementOut(0), BiasStride{}},  // Bias (null: 0)
        {},                                                                    // multiply_add
    };

    return Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                     {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
                     {static_cast<const ElementAB*>(p.a), stride_a, static_cast<const ElementAB*>(p.b), stride_b},
                     {fusion, nullptr, stride_d, static_cast<ElementOut*>(p.out), stride_d},
                     hw_info};
  }

  static size_t workspace_bytes(const Fp8GemmSm90Args& p) { return Gemm::get_workspace_size(make_arguments(p, {})); }

  // Host checks first (CUTLASS's can_implement, workspace size: no device needed), then the device.
  static cudaError_t run(const Fp8GemmSm90Args& p, cudaStream_t stream) {
    Arguments args = make_arguments(p, {});
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (Gemm::get_workspace_size(args) > p.workspace_bytes) return cudaErrorInvalidValue;
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count_of(device);
    if (args.hw_info.sm_count <= 0) return cudaErrorInvalidDevice;
    Gemm gemm;
    cutlass::Status status = gemm.initialize(args, p.workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status == cutlass::Status::kSuccess) return cudaGetLastError();
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
};

using namespace cutlass::gemm;
using cutlass::epilogue::TmaWarpSpecialized;
using cutlass::epilogue::TmaWarpSpecializedCooperative;

template <class Out>
using GemmM64 = Fp8GemmSm90<Out, Shape<_64, _64, _128>, Shape<_1, _4, _1>, KernelTmaWarpSpecializedPingpongFP8FastAccum,
                            TmaWarpSpecialized>;
template <class Out>
using GemmM128 = Fp8GemmSm90<Out, Shape<_64, _128, _128>, Shape<_2, _1, _1>,
                             KernelTmaWarpSpecializedPingpongFP8FastAccum, TmaWarpSpecialized>;
template <class Out>
using GemmLarge = Fp8GemmSm90<Out, Shape<_128, _256, _128>, Shape<_2, _1, _1>,
                              KernelTmaWarpSpecializedCooperativeFP8FastAccum, TmaWarpSpecializedCooperative>;

// Calls f.template operator()<Gemm>() with the kernel type for the problem's configuration and dtype.
template <class F>
cudaError_t dispatch(const Fp8GemmSm90Args& p, F&& f) {
  auto by_config = [&]<class Out>() -> cudaError_t {
    switch (fp8_gemm_sm90_config(p.m)) {
      case Fp8GemmSm90Config::kM64: return f.template operator()<GemmM64<Out>>();
      case Fp8GemmSm90Config::kM128: return f.template operator()<GemmM128<Out>>();
      case Fp8GemmSm90Config::kLarge: return f.template operator()<GemmLarge<Out>>();
    }
    return cudaErrorInvalidValue;
  };
  switch (p.out_dtype) {
    case DType::kBFloat16: return by_config.template operator()<cutlass::bfloat16_t>();
    case DType::kFloat16: return by_config.template operator()<cutlass::half_t>();
    default: return cudaErrorInvalidValue;
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Host-side argument checks shared by workspace_bytes and launch (pointers excluded).
cudaError_t check_shape(const Fp8GemmSm90Args& p) {
  constexpr int64_t kMaxDim = 0x7fffffff;
  if (p.m < 0 || p.n < 0 || p.k <= 0 || p.m > kMaxDim || p.n > kMaxDim || p.k > kMaxDim) return cudaErrorInvalidValue;
  if (p.n % 16 != 0 || p.k % 16 != 0) return cudaErrorInvalidValue;
  if (p.lda < 0 || p.ldb < 0 || p.ldd < 0 || p.lda % 16 != 0 || p.ldb % 16 != 0 || p.ldd % 16 != 0)
    return cudaErrorInvalidValue;
  if ((p.lda && p.lda < p.k) || (p.ldb && p.ldb < p.k) || (p.ldd && p.ldd < p.n)) return cudaErrorInvalidValue;
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16) return cudaErrorInvalidValue;
  return cudaSuccess;
}

}  // namespace

bool fp8_gemm_sm90_available() { return true; }

size_t fp8_gemm_sm90_workspace_bytes(const Fp8GemmSm90Args& p) {
  if (check_shape(p) != cudaSuccess || p.m == 0 || p.n == 0) return 0;
  size_t bytes = 0;
  dispatch(p, [&]<class G>() {
    bytes = G::workspace_bytes(p);
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_fp8_gemm_sm90(const Fp8GemmSm90Args& p, cudaStream_t stream) {
  if (cudaError_t err = check_shape(p); err != cudaSuccess) return err;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (!p.a || !p.b || !p.out || !p.scale_a || !p.scale_b) return cudaErrorInvalidValue;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out)) return cudaErrorMisalignedAddress;
  return dispatch(p, [&]<class G>() { return G::run(p, stream); });
}

}  // namespace fastinfer

#else  // !FASTINFER_SM90A_KERNELS: built without sm_90a (or without CUTLASS): the API reports it.

namespace fastinfer {

bool fp8_gemm_sm90_available() { return false; }
size_t fp8_gemm_sm90_workspace_bytes(const Fp8GemmSm90Args&) { return 0; }
cudaError_t launch_fp8_gemm_sm90(const Fp8GemmSm90Args&, cudaStream_t) { return cudaErrorNotSupported; }

}  // namespace fastinfer

#endif
