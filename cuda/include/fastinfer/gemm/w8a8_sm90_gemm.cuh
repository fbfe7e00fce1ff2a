#pragma once
// The CUTLASS 3.x sm_90a GEMM both W8A8 ops share (fp8_gemm_sm90.cu, int8_gemm_sm90.cu): the tile
// configurations by M, the kernel assembled from CollectiveBuilder (TMA + wgmma, warp-specialised,
// persistent), the host argument checks and the launch. An `Op` supplies what differs:
//
//   struct Op {
//     using ElementAB, ElementAcc;                           // e4m3 / fp32 or int8 / int32
//     template <bool kCooperative> using MainloopSchedule;   // a cutlass::gemm::Kernel* schedule
//     template <class TileShape, class ElementOut> using Epilogue;  // an Sm90EVT fusion tree
//     template <class Epilogue, class ElementOut>
//     static typename Epilogue::Arguments fusion_args(const W8a8GemmSm90Args&);
//     static bool accepts(const W8a8GemmSm90Args&);         // op-specific argument checks
//   };
//
// Tile configuration by M (the token count), in the spirit of vLLM's sm90 dispatch; both ops
// read 1-byte operands, so the same byte tiles fit both:
//   M <= 64        64 x  64 x 128, ping-pong,   cluster 1x4 (the a tile is multicast to 4 CTAs along n)
//   64 < M <= 128  64 x 128 x 128, ping-pong,   cluster 2x1 (each b tile is multicast to both m tiles)
//   M > 128       128 x 256 x 128, cooperative, cluster 2x1
// Small M is bound by reading b (the weights): small CTA tiles give enough CTAs to keep every SM
// streaming; ping-pong overlaps one consumer warp group's epilogue with the other's mainloop.
// Large M is compute bound: 128x256 tiles (two consumer warp groups, 64x256 each) maximise wgmma
// work per byte of shared memory traffic.
//
// The kernels need a, b and out rows 16-byte aligned (TMA): n, k and the row strides must be
// multiples of 16 elements; any m works (TMA clips partial tiles, the broadcasts are predicated).
// Only *_sm90.cu files include this header, and only when FASTINFER_SM90A_KERNELS is defined.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include <atomic>

#include "fastinfer/gemm/w8a8_sm90.h"

namespace fastinfer::sm90 {

using namespace cute;

// Epilogue broadcast strides (M, N, L): a `bool` in the M (col) or N (row) mode selects vector (1)
// or scalar element 0 (0) at run time, so per-tensor / per-token / per-channel share one kernel;
// L is the batch stride (always 0 here).
using ColStride = Stride<bool, _0, int64_t>;
using RowStride = Stride<_0, bool, int64_t>;
using VectorRowStride = Stride<_0, _1, int64_t>;  // always a vector over n (bias, azp_adj)
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// cudaDeviceGetAttribute is cheap but not free; the SM count of each device is cached.
inline int sm_count_of(int device) {
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

template <GemmSm90Config C>
struct TileConfig;
template <>
struct TileConfig<GemmSm90Config::kM64> {
  using TileShape = Shape<_64, _64, _128>;
  using ClusterShape = Shape<_1, _4, _1>;
  static constexpr bool kCooperative = false;
};
template <>
struct TileConfig<GemmSm90Config::kM128> {
  using TileShape = Shape<_64, _128, _128>;
  using ClusterShape = Shape<_2, _1, _1>;
  static constexpr bool kCooperative = false;
};
template <>
struct TileConfig<GemmSm90Config::kLarge> {
  using TileShape = Shape<_128, _256, _128>;
  using ClusterShape = Shape<_2, _1, _1>;
  static constexpr bool kCooperative = true;
};

// One kernel: an op, an output dtype and a tile configuration.
template <class Op, class ElementOut, GemmSm90Config C>
struct Gemm {
  using Cfg = TileConfig<C>;
  using ElementAB = typename Op::ElementAB;
  using ElementAcc = typename Op::ElementAcc;
  using ElementCompute = float;
  static constexpr int kAlignmentAB = 128 / cutlass::sizeof_bits<ElementAB>::value;    // 16 elements = 16 bytes
  static constexpr int kAlignmentOut = 128 / cutlass::sizeof_bits<ElementOut>::value;  // 8 elements
  using EpilogueSchedule = std::conditional_t<Cfg::kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using Epilogue = typename Op::template Epilogue<typename Cfg::TileShape, ElementOut>;

  using LayoutA = cutlass::layout::RowMajor;     // a [m, k], k contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // b [n, k], k contiguous ("TN": the only 8-bit wgmma layout)
  using LayoutD = cutlass::layout::RowMajor;     // out [m, n]

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute,
      /*ElementC=*/void, LayoutD, kAlignmentOut,  // no C operand: the bias comes through the tree
      ElementOut, LayoutD, kAlignmentOut, EpilogueSchedule, Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignmentAB, ElementAB, LayoutB,
      kAlignmentAB, ElementAcc, typename Cfg::TileShape, typename Cfg::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Op::template MainloopSchedule<Cfg::kCooperative>>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Adapter::Arguments;

  // hw_info (device, SM count) only matters to the launch; the checks below do not read it.
  static Arguments make_arguments(const W8a8GemmSm90Args& p, const cutlass::KernelHardwareInfo& hw_info) {
    const int64_t lda = p.lda ? p.lda : p.k, ldb = p.ldb ? p.ldb : p.k, ldd = p.ldd ? p.ldd : p.n;
    typename Kernel::StrideA stride_a = make_stride(lda, _1{}, int64_t(0));
    typename Kernel::StrideB stride_b = make_stride(ldb, _1{}, int64_t(0));
    typename Kernel::StrideD stride_d = make_stride(ldd, _1{}, int64_t(0));
    return Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                     {static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), 1},
                     {static_cast<const ElementAB*>(p.a), stride_a, static_cast<const ElementAB*>(p.b), stride_b},
                     {Op::template fusion_args<Epilogue, ElementOut>(p), nullptr, stride_d,
                      static_cast<ElementOut*>(p.out), stride_d},
                     hw_info};
  }

  static size_t workspace_bytes(const W8a8GemmSm90Args& p) { return Adapter::get_workspace_size(make_arguments(p, {})); }

  // Host checks first (CUTLASS's can_implement, workspace size: no device needed), then the device.
  static cudaError_t run(const W8a8GemmSm90Args& p, cudaStream_t stream) {
    Arguments args = make_arguments(p, {});
    if (Adapter::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorInvalidValue;
    if (Adapter::get_workspace_size(args) > p.workspace_bytes) return cudaErrorInvalidValue;
    int device = 0;
    if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count_of(device);
    if (args.hw_info.sm_count <= 0) return cudaErrorInvalidDevice;
    Adapter gemm;
    cutlass::Status status = gemm.initialize(args, p.workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status == cutlass::Status::kSuccess) return cudaGetLastError();
    const cudaError_t err = cudaGetLastError();
    return err != cudaSuccess ? err : cudaErrorLaunchFailure;
  }
};

// Calls f.template operator()<G>() with the kernel type for the problem's configuration and dtype.
template <class Op, class F>
cudaError_t dispatch(const W8a8GemmSm90Args& p, F&& f) {
  auto by_config = [&]<class Out>() -> cudaError_t {
    switch (gemm_sm90_config(p.m)) {
      case GemmSm90Config::kM64: return f.template operator()<Gemm<Op, Out, GemmSm90Config::kM64>>();
      case GemmSm90Config::kM128: return f.template operator()<Gemm<Op, Out, GemmSm90Config::kM128>>();
      case GemmSm90Config::kLarge: return f.template operator()<Gemm<Op, Out, GemmSm90Config::kLarge>>();
    }
    return cudaErrorInvalidValue;
  };
  switch (p.out_dtype) {
    case DType::kBFloat16: return by_config.template operator()<cutlass::bfloat16_t>();
    case DType::kFloat16: return by_config.template operator()<cutlass::half_t>();
    default: return cudaErrorInvalidValue;
  }
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Host-side argument checks shared by workspace_bytes and launch (pointers excluded).
template <class Op>
cudaError_t check_shape(const W8a8GemmSm90Args& p) {
  constexpr int64_t kMaxDim = 0x7fffffff;
  if (p.m < 0 || p.n < 0 || p.k <= 0 || p.m > kMaxDim || p.n > kMaxDim || p.k > kMaxDim) return cudaErrorInvalidValue;
  if (p.n % 16 != 0 || p.k % 16 != 0) return cudaErrorInvalidValue;
  if (p.lda < 0 || p.ldb < 0 || p.ldd < 0 || p.lda % 16 != 0 || p.ldb % 16 != 0 || p.ldd % 16 != 0)
    return cudaErrorInvalidValue;
  if ((p.lda && p.lda < p.k) || (p.ldb && p.ldb < p.k) || (p.ldd && p.ldd < p.n)) return cudaErrorInvalidValue;
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16) return cudaErrorInvalidValue;
  if (!Op::accepts(p)) return cudaErrorInvalidValue;
  return cudaSuccess;
}

template <class Op>
size_t workspace_bytes(const W8a8GemmSm90Args& p) {
  if (check_shape<Op>(p) != cudaSuccess || p.m == 0 || p.n == 0) return 0;
  size_t bytes = 0;
  dispatch<Op>(p, [&]<class G>() {
    bytes = G::workspace_bytes(p);
    return cudaSuccess;
  });
  return bytes;
}

template <class Op>
cudaError_t launch(const W8a8GemmSm90Args& p, cudaStream_t stream) {
  if (cudaError_t err = check_shape<Op>(p); err != cudaSuccess) return err;
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (!p.a || !p.b || !p.out || !p.scale_a || !p.scale_b) return cudaErrorInvalidValue;
  if (!aligned16(p.a) || !aligned16(p.b) || !aligned16(p.out)) return cudaErrorMisalignedAddress;
  return dispatch<Op>(p, [&]<class G>() { return G::run(p, stream); });
}

}  // namespace fastinfer::sm90
