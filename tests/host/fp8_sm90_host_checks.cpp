// Host-side checks of the sm_90a FP8 GEMM launcher (fastinfer/gemm/fp8_sm90.h) that need no GPU:
// the library holds the kernels, the tile configuration by m, the argument validation (each bad
// argument gives its documented error before anything touches a device), and a valid call that
// passes CUTLASS's can_implement and stops only at the device query. Built and run by
// tests/test_fp8_sm90.py against the installed lib/libfastinfer_kernels.a. Prints OK on success.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <initializer_list>

#include "fastinfer/gemm/fp8_sm90.h"

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

static Fp8GemmSm90Args valid_args(int64_t m, DType out_dtype) {
  Fp8GemmSm90Args p;
  p.a = buffer;  // never dereferenced by the host checks
  p.b = buffer + 256;
  p.out = buffer + 512;
  p.scale_a = reinterpret_cast<const float*>(buffer + 768);
  p.scale_b = reinterpret_cast<const float*>(buffer + 784);
  p.m = m;
  p.n = 272;
  p.k = 528;
  p.out_dtype = out_dtype;
  return p;
}

int main() {
  CHECK(fp8_gemm_sm90_available());

  CHECK(fp8_gemm_sm90_config(1) == Fp8GemmSm90Config::kM64);
  CHECK(fp8_gemm_sm90_config(64) == Fp8GemmSm90Config::kM64);
  CHECK(fp8_gemm_sm90_config(65) == Fp8GemmSm90Config::kM128);
  CHECK(fp8_gemm_sm90_config(128) == Fp8GemmSm90Config::kM128);
  CHECK(fp8_gemm_sm90_config(129) == Fp8GemmSm90Config::kLarge);

  int devices = 0;
  const bool have_gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  (void)cudaGetLastError();

  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int64_t m : {1, 17, 64, 65, 128, 129, 1000}) {
      Fp8GemmSm90Args p = valid_args(m, dt);
      CHECK(fp8_gemm_sm90_workspace_bytes(p) == 0);  // persistent scheduler, no split-k / stream-k
      if (!have_gpu) {
        // Valid arguments pass every host check (CUTLASS's can_implement included) and fail
        // only when the device is queried.
        const cudaError_t err = launch_fp8_gemm_sm90(p, nullptr);
        CHECK(err != cudaSuccess && err != cudaErrorInvalidValue && err != cudaErrorMisalignedAddress &&
              err != cudaErrorNotSupported);
        (void)cudaGetLastError();
      }
      p.ldd = 512;  // padded rows are fine
      p.lda = p.ldb = 544;
      if (!have_gpu) {
        const cudaError_t err = launch_fp8_gemm_sm90(p, nullptr);
        CHECK(err != cudaSuccess && err != cudaErrorInvalidValue && err != cudaErrorMisalignedAddress);
        (void)cudaGetLastError();
      }
    }
  }

  // Nothing to do.
  {
    Fp8GemmSm90Args p = valid_args(0, DType::kBFloat16);
    CHECK(launch_fp8_gemm_sm90(p, nullptr) == cudaSuccess);
    p = valid_args(5, DType::kBFloat16);
    p.n = 0;
    CHECK(launch_fp8_gemm_sm90(p, nullptr) == cudaSuccess);
  }

  // Each bad argument: cudaErrorInvalidValue.
  struct Bad {
    const char* what;
    void (*mutate)(Fp8GemmSm90Args&);
  };
  const Bad bad[] = {
      {"k == 0", [](Fp8GemmSm90Args& p) { p.k = 0; }},
      {"k % 16", [](Fp8GemmSm90Args& p) { p.k = 520; }},
      {"n % 16", [](Fp8GemmSm90Args& p) { p.n = 264; }},
      {"m < 0", [](Fp8GemmSm90Args& p) { p.m = -1; }},
      {"m >= 2^31", [](Fp8GemmSm90Args& p) { p.m = int64_t(1) << 31; }},
      {"k >= 2^31", [](Fp8GemmSm90Args& p) { p.k = int64_t(1) << 31; }},
      {"lda % 16", [](Fp8GemmSm90Args& p) { p.lda = 536; }},
      {"lda < k", [](Fp8GemmSm90Args& p) { p.lda = 512; }},
      {"ldb < k", [](Fp8GemmSm90Args& p) { p.ldb = 16; }},
      {"ldd < n", [](Fp8GemmSm90Args& p) { p.ldd = 256; }},
      {"ldd % 16", [](Fp8GemmSm90Args& p) { p.ldd = 280; }},
      {"out float32", [](Fp8GemmSm90Args& p) { p.out_dtype = DType::kFloat32; }},
      {"out fp8", [](Fp8GemmSm90Args& p) { p.out_dtype = DType::kFloat8E4M3; }},
      {"a null", [](Fp8GemmSm90Args& p) { p.a = nullptr; }},
      {"b null", [](Fp8GemmSm90Args& p) { p.b = nullptr; }},
      {"out null", [](Fp8GemmSm90Args& p) { p.out = nullptr; }},
      {"scale_a null", [](Fp8GemmSm90Args& p) { p.scale_a = nullptr; }},
      {"scale_b null", [](Fp8GemmSm90Args& p) { p.scale_b = nullptr; }},
  };
  for (const Bad& b : bad) {
    for (int64_t m : {3, 100, 300}) {
      Fp8GemmSm90Args p = valid_args(m, DType::kBFloat16);
      b.mutate(p);
      const cudaError_t err = launch_fp8_gemm_sm90(p, nullptr);
      if (err != cudaErrorInvalidValue) {
        std::printf("FAILED %s (m=%lld): %d\n", b.what, static_cast<long long>(m), static_cast<int>(err));
        ++failures;
      }
    }
  }

  // Misaligned operands: cudaErrorMisalignedAddress.
  for (int which = 0; which < 3; ++which) {
    Fp8GemmSm90Args p = valid_args(100, DType::kFloat16);
    if (which == 0) p.a = buffer + 1;
    if (which == 1) p.b = buffer + 264;
    if (which == 2) p.out = buffer + 520;
    CHECK(launch_fp8_gemm_sm90(p, nullptr) == cudaErrorMisalignedAddress);
  }

  if (failures == 0) std::printf("OK\n");
  return failures == 0 ? 0 : 1;
}
