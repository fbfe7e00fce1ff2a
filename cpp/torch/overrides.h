#pragma once
// The test overrides of the launchers' choices, the one place that reads them from the
// environment, passed to the torch-free launchers, which never read it. The GEMM overrides are read
// once per process (they are set before it starts); the attention and CPU dense ones on each call
// that can use them, since tests switch them between calls:
//   FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES=N  deterministic attention, split-parallel: the partials
//       of one launch take at most N bytes (small shapes then take several launches);
//   FASTINFER_TEST_FIXED_TREE_PREFIX=shared|per-token  deterministic attention under a custom mask:
//       the two-launch or the one-launch fold, whatever the SM count;
//   FASTINFER_TEST_DEFAULT_KEY_SPLITS=S  prefill attention in the default mode: each CTA's keys in
//       S parts, a CTA each, and the merge (1: unsplit), whatever the occupancy;
//   FASTINFER_TEST_MLA_ROWS=32|64  mla_decode_attention: the CTA shape, whatever the device (the
//       FIXED_SPLIT_PARTIAL_BYTES bound applies to its deterministic mode too);
//   FASTINFER_TEST_FP8_GEMM=mma, FASTINFER_TEST_INT8_GEMM=mma  the mma.sync kernel on Hopper too;
//   FASTINFER_TEST_INT4_DENSE_MIN_M=M  int4_gemm dequantises + dense matmul from M rows on;
//   FASTINFER_TEST_CPU_DENSE_PORTABLE=1  the CPU dense_mm takes its portable micro-kernel on AVX2.
// Every pair of choices gives the same bits (the default-mode key splits: the same result up to
// rounding); the overrides exist to test that.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "fastinfer/attention/attention.h"
#include "fastinfer/attention/mla.h"
#include "fastinfer/gemm/w8a8_sm90.h"

namespace fastinfer::binding {

inline const char* test_override(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

inline PrefillOverrides prefill_overrides() {
  PrefillOverrides o;
  if (const char* v = test_override("FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES")) {
    const long long bytes = std::atoll(v);
    if (bytes > 0) o.fixed_split_partial_bytes = bytes;
  }
  if (const char* v = test_override("FASTINFER_TEST_FIXED_TREE_PREFIX")) {
    if (std::strcmp(v, "shared") == 0) o.tree_prefix_plan = TreePrefixPlan::kShared;
    if (std::strcmp(v, "per-token") == 0) o.tree_prefix_plan = TreePrefixPlan::kPerToken;
  }
  if (const char* v = test_override("FASTINFER_TEST_DEFAULT_KEY_SPLITS")) {
    const long long splits = std::atoll(v);
    if (splits > 0) o.default_key_splits = static_cast<int32_t>(splits < 65535 ? splits : 65535);
  }
  return o;
}

inline MlaDecodeOverrides mla_decode_overrides() {
  MlaDecodeOverrides o;
  if (const char* v = test_override("FASTINFER_TEST_MLA_ROWS")) {
    const long long rows = std::atoll(v);
    if (rows == 32 || rows == 64) o.rows_per_cta = static_cast<int32_t>(rows);
  }
  if (const char* v = test_override("FASTINFER_TEST_FIXED_SPLIT_PARTIAL_BYTES")) {
    const long long bytes = std::atoll(v);
    if (bytes > 0) o.fixed_split_partial_bytes = bytes;
  }
  return o;
}

inline W8a8GemmOverrides w8a8_gemm_overrides(const char* name) {
  const char* v = test_override(name);
  return W8a8GemmOverrides{v != nullptr && std::strcmp(v, "mma") == 0};
}
inline W8a8GemmOverrides fp8_gemm_overrides() {
  static const W8a8GemmOverrides o = w8a8_gemm_overrides("FASTINFER_TEST_FP8_GEMM");
  return o;
}
inline W8a8GemmOverrides int8_gemm_overrides() {
  static const W8a8GemmOverrides o = w8a8_gemm_overrides("FASTINFER_TEST_INT8_GEMM");
  return o;
}

// int4_gemm's dequantise + dense matmul threshold: 512 (a guess, not measured on a GPU) unless
// overridden (e.g. to benchmark both paths).
inline int64_t int4_dense_min_m() {
  static const int64_t min_m = [] {
    if (const char* v = test_override("FASTINFER_TEST_INT4_DENSE_MIN_M")) {
      const long long m = std::atoll(v);
      if (m > 0) return static_cast<int64_t>(m);
    }
    return int64_t{512};
  }();
  return min_m;
}

inline bool cpu_dense_portable() {
  const char* v = test_override("FASTINFER_TEST_CPU_DENSE_PORTABLE");
  return v != nullptr && v[0] == '1';
}

// FASTINFER_TEST_CPU_INT4_PORTABLE=1: int4_gemm's decode path without AVX-512 on a machine that
// has it (tests: both give the same bits).
inline bool cpu_int4_portable() {
  const char* v = test_override("FASTINFER_TEST_CPU_INT4_PORTABLE");
  return v != nullptr && v[0] == '1';
}

}  // namespace fastinfer::binding
