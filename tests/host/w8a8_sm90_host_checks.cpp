// Host-side checks of the sm_90a W8A8 GEMM launchers (fastinfer/gemm/w8a8_sm90.h: fp8 and int8)
// that need no GPU: the library holds the kernels, the tile configuration by m, the argument
// validation (each bad argument gives its documented error before anything touches a device), a
// valid call that passes CUTLASS's can_implement and stops only at the device query, and the pure
// host decision of when the sm_90a kernels run (w8a8_gemm_sm90_applies, select_int8_gemm_backend).
// Built and run by tests/test_fp8_sm90.py against the installed lib/libfastinfer_kernels.a.
// Prints OK on success.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <initializer_list>

#include "fastinfer/gemm/int8.h"
#include "fastinfer/gemm/w8a8_sm90.h"

using namespace fastinfer;

static int failures = 0;
#define CHECK(cond)                                                 \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::printf("FAILED line %d: %s\n", __LINE__, #cond);         \
      ++failures;                                                   \
    }                                                               \
  } while (0)

alignas(256) static unsigned char buffer[1024];
static const int32_t* const kAzp = reinterpret_cast<const int32_t*>(buffer + 800);
static const int32_t* const kAzpAdj = reinterpret_cast<const int32_t*>(buffer + 816);

// Operands in `buffer` (aligned, never dereferenced by the host checks), M x 272 x 528.
template <typename Params>
static Params buffer_params(int64_t m) {
  Params p;
  p.a = buffer;
  p.b = buffer + 256;
  p.out = buffer + 512;
  p.scale_a = reinterpret_cast<const float*>(buffer + 768);
  p.scale_b = reinterpret_cast<const float*>(buffer + 784);
  p.m = m;
  p.n = 272;
  p.k = 528;
  return p;
}

static W8a8GemmSm90Args valid_args(int64_t m, DType out_dtype) {
  auto p = buffer_params<W8a8GemmSm90Args>(m);
  p.out_dtype = out_dtype;
  return p;
}

struct Launcher {
  const char* name;
  size_t (*workspace_bytes)(const W8a8GemmSm90Args&);
  cudaError_t (*launch)(const W8a8GemmSm90Args&, cudaStream_t);
  bool zero_points;  // int8: azp / azp_adj accepted
};

static void check_launcher(const Launcher& l, bool have_gpu) {
  auto launch = [&](const W8a8GemmSm90Args& p) { return l.launch(p, nullptr); };
  // Valid arguments pass every host check (CUTLASS's can_implement included) and fail only when
  // the device is queried.
  auto passes_host_checks = [&](const W8a8GemmSm90Args& p) {
    if (have_gpu) return true;
    const cudaError_t err = launch(p);
    (void)cudaGetLastError();
    return err != cudaSuccess && err != cudaErrorInvalidValue && err != cudaErrorMisalignedAddress &&
           err != cudaErrorNotSupported;
  };
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t m : {1, 17, 64, 65, 128, 129, 1000}) {
      W8a8GemmSm90Args p = valid_args(m, dt);
      CHECK(l.workspace_bytes(p) == 0);  // persistent scheduler, no split-k / stream-k
      CHECK(passes_host_checks(p));
      p.scale_a_per_row = true;  // scale modes are free
      CHECK(passes_host_checks(p));
      p.scale_b_per_col = true;
      CHECK(passes_host_checks(p));
      p.ldd = 512;  // padded rows are fine
      p.lda = p.ldb = 544;
      CHECK(passes_host_checks(p));
      if (l.zero_points) {
        p.azp = kAzp;
        p.azp_adj = kAzpAdj;
        CHECK(l.workspace_bytes(p) == 0);
        CHECK(passes_host_checks(p));
        p.azp_per_row = true;
        CHECK(passes_host_checks(p));
      }
    }
  }

  // Nothing to do.
  {
    W8a8GemmSm90Args p = valid_args(0, DType::kBFloat16);
    CHECK(launch(p) == cudaSuccess);
    p = valid_args(5, DType::kBFloat16);
    p.n = 0;
    CHECK(launch(p) == cudaSuccess);
  }

  // Each bad argument: cudaErrorInvalidValue.
  struct Bad {
    const char* what;
    void (*mutate)(W8a8GemmSm90Args&);
  };
  const Bad bad[] = {
      {"k == 0", [](W8a8GemmSm90Args& p) { p.k = 0; }},
      {"k % 16", [](W8a8GemmSm90Args& p) { p.k = 520; }},
      {"n % 16", [](W8a8GemmSm90Args& p) { p.n = 264; }},
      {"m < 0", [](W8a8GemmSm90Args& p) { p.m = -1; }},
      {"m >= 2^31", [](W8a8GemmSm90Args& p) { p.m = int64_t(1) << 31; }},
      {"k >= 2^31", [](W8a8GemmSm90Args& p) { p.k = int64_t(1) << 31; }},
      {"lda % 16", [](W8a8GemmSm90Args& p) { p.lda = 536; }},
      {"lda < k", [](W8a8GemmSm90Args& p) { p.lda = 512; }},
      {"ldb < k", [](W8a8GemmSm90Args& p) { p.ldb = 16; }},
      {"ldd < n", [](W8a8GemmSm90Args& p) { p.ldd = 256; }},
      {"ldd % 16", [](W8a8GemmSm90Args& p) { p.ldd = 280; }},
      {"out float32", [](W8a8GemmSm90Args& p) { p.out_dtype = DType::kFloat32; }},
      {"out fp8", [](W8a8GemmSm90Args& p) { p.out_dtype = DType::kFloat8E4M3; }},
      {"a null", [](W8a8GemmSm90Args& p) { p.a = nullptr; }},
      {"b null", [](W8a8GemmSm90Args& p) { p.b = nullptr; }},
      {"out null", [](W8a8GemmSm90Args& p) { p.out = nullptr; }},
      {"scale_a null", [](W8a8GemmSm90Args& p) { p.scale_a = nullptr; }},
      {"scale_b null", [](W8a8GemmSm90Args& p) { p.scale_b = nullptr; }},
      {"azp without azp_adj", [](W8a8GemmSm90Args& p) { p.azp = kAzp; }},
      {"azp_adj without azp", [](W8a8GemmSm90Args& p) { p.azp_adj = kAzpAdj; }},
  };
  for (const Bad& b : bad) {
    for (int64_t m : {3, 100, 300}) {
      W8a8GemmSm90Args p = valid_args(m, DType::kBFloat16);
      b.mutate(p);
      const cudaError_t err = launch(p);
      if (err != cudaErrorInvalidValue) {
        std::printf("FAILED %s %s (m=%lld): %d\n", l.name, b.what, static_cast<long long>(m), static_cast<int>(err));
        ++failures;
      }
    }
  }
  if (!l.zero_points) {  // fp8 has no zero points
    W8a8GemmSm90Args p = valid_args(100, DType::kBFloat16);
    p.azp = kAzp;
    p.azp_adj = kAzpAdj;
    CHECK(launch(p) == cudaErrorInvalidValue);
  }

  // Misaligned operands: cudaErrorMisalignedAddress.
  for (int which = 0; which < 3; ++which) {
    W8a8GemmSm90Args p = valid_args(100, DType::kFloat16);
    if (which == 0) p.a = buffer + 1;
    if (which == 1) p.b = buffer + 264;
    if (which == 2) p.out = buffer + 520;
    CHECK(launch(p) == cudaErrorMisalignedAddress);
  }
}

static Int8ScaledMmParams int8_params(int64_t m) { return buffer_params<Int8ScaledMmParams>(m); }

// When launch_int8_scaled_mm runs the sm_90a kernel: pure host code, so every branch is checked here.
static void check_int8_backend_selection() {
  const Sm90Target h100{9, 0, /*kernels_built=*/true, /*mma_sync_forced=*/false};
  auto sm90 = [](const Int8ScaledMmParams& p, const Sm90Target& t) {
    return select_int8_gemm_backend(p, t) == Int8GemmBackend::kCutlassSm90;
  };
  for (int64_t m : {1, 64, 65, 300}) {
    Int8ScaledMmParams p = int8_params(m);
    CHECK(sm90(p, h100));
    p.scale_a_per_row = true;  // every scale mode, bias and azp
    CHECK(sm90(p, h100));
    p.scale_b_per_col = true;
    p.bias = buffer + 832;
    p.azp = kAzp;
    p.azp_adj = kAzpAdj;
    p.azp_per_row = true;
    CHECK(sm90(p, h100));
    const W8a8GemmSm90Args a = int8_gemm_sm90_args(p);
    CHECK(a.a == p.a && a.b == p.b && a.out == p.out && a.bias == p.bias && a.scale_a == p.scale_a &&
          a.scale_b == p.scale_b && a.azp == p.azp && a.azp_adj == p.azp_adj && a.m == m && a.n == 272 &&
          a.k == 528 && a.scale_a_per_row && a.scale_b_per_col && a.azp_per_row && a.out_dtype == p.out_dtype &&
          a.lda == 0 && a.ldb == 0 && a.ldd == 0 && a.workspace == nullptr);
  }
  const Int8ScaledMmParams p = int8_params(100);
  CHECK(!sm90(p, Sm90Target{8, 0, true, false}));   // A100
  CHECK(!sm90(p, Sm90Target{8, 9, true, false}));   // L4 / L40 (Ada)
  CHECK(!sm90(p, Sm90Target{10, 0, true, false}));  // sm_90a SASS does not run on Blackwell
  CHECK(!sm90(p, Sm90Target{9, 1, true, false}));
  CHECK(!sm90(p, Sm90Target{9, 0, false, false}));  // built without the kernels
  CHECK(!sm90(p, Sm90Target{9, 0, true, true}));    // FASTINFER_TEST_INT8_GEMM=mma
  auto with = [](void (*mutate)(Int8ScaledMmParams&)) {
    Int8ScaledMmParams q = int8_params(100);
    mutate(q);
    return q;
  };
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.tiles = Int8GemmTiles::kLarge; }), h100));  // forced mma.sync tiles
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.tiles = Int8GemmTiles::kSmall; }), h100));
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.k = 0; }), h100));
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.m = 0; }), h100));
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.out = buffer + 516; }), h100));  // 4-byte aligned: mma.sync only
  CHECK(!sm90(with([](Int8ScaledMmParams& q) { q.a = buffer + 8; }), h100));

  // The shared rule itself, on fp8-shaped arguments.
  W8a8GemmSm90Args a = valid_args(100, DType::kBFloat16);
  CHECK(w8a8_gemm_sm90_applies(h100, a));
  a.n = 264;
  CHECK(!w8a8_gemm_sm90_applies(h100, a));
  a = valid_args(100, DType::kBFloat16);
  a.b = buffer + 264;
  CHECK(!w8a8_gemm_sm90_applies(h100, a));
}

int main() {
  CHECK(fp8_gemm_sm90_available());
  CHECK(int8_gemm_sm90_available());

  CHECK(gemm_sm90_config(1) == GemmSm90Config::kM64);
  CHECK(gemm_sm90_config(64) == GemmSm90Config::kM64);
  CHECK(gemm_sm90_config(65) == GemmSm90Config::kM128);
  CHECK(gemm_sm90_config(128) == GemmSm90Config::kM128);
  CHECK(gemm_sm90_config(129) == GemmSm90Config::kLarge);

  int devices = 0;
  const bool have_gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();

  check_launcher({"fp8", &fp8_gemm_sm90_workspace_bytes, &launch_fp8_gemm_sm90, false}, have_gpu);
  check_launcher({"int8", &int8_gemm_sm90_workspace_bytes, &launch_int8_gemm_sm90, true}, have_gpu);
  check_int8_backend_selection();

  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
