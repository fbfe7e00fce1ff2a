// Paged decode attention (launch_decode_attention) against a naive fp64 host reference.
// Runs in the simt emulator (python -m fastinfer.simt run tests/kernels/decode_attention_sim.cu)
// or with nvcc on a GPU (nvcc -std=c++20 -Icuda/include --expt-relaxed-constexpr -x cu ...).
// Prints max errors and a checksum of the raw output bits per case (must not depend on
// FASTINFER_SIMT_SEED); exits 0 when every check passes.
#include "../../cuda/src/attention_decode.cu"
#include "kernel_test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>

using fastinfer::DecodeAttentionParams;
using fastinfer::DType;

struct Case {
  std::string name;
  DType dtype;
  DType cache_dtype;
  int Hq, Hkv, D, BS;
  std::vector<int> seq_lens;
  int window_left = -1;
  float softcap = 0.f;
  float scale = 0.f;  // 0: 1/sqrt(D)
  std::vector<int> splits = {1};
  bool with_lse = true;
};

template <typename T, typename CacheT>
bool run_case(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  const int B = static_cast<int>(c.seq_lens.size());
  const int D = c.D, Hq = c.Hq, Hkv = c.Hkv, BS = c.BS;
  const int group = Hq / Hkv;
  const float scale = c.scale > 0.f ? c.scale : 1.f / std::sqrt(static_cast<float>(D));
  const int max_len = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  const int stride = (max_len + BS - 1) / BS + 1;  // one spare entry per row
  const int NB = B * stride + 3;
  constexpr bool kFp8 = std::is_same_v<CacheT, __nv_fp8_e4m3>;
  const float k_scale = kFp8 ? 0.37f : 1.f, v_scale = kFp8 ? 0.61f : 1.f;

  // Block table: a shuffled permutation of the physical blocks.
  std::vector<int32_t> perm(NB);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(static_cast<size_t>(B) * stride);
  for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i];

  // Cache: random rows; the rows past each sequence's length hold huge values (NaN bits for the
  // 16-bit types) so that reading them shows in the result.
  const size_t row = static_cast<size_t>(Hkv) * D;
  std::vector<CacheT> kc(static_cast<size_t>(NB) * BS * row), vc(kc.size());
  const float amp = kFp8 ? 3.f : 1.f;
  for (size_t i = 0; i < kc.size(); ++i) {
    kc[i] = kt_from_float<CacheT>(amp * uni(rng));
    vc[i] = kt_from_float<CacheT>(amp * uni(rng));
  }
  CacheT poison;
  if constexpr (kFp8) {
    poison = kt_from_float<CacheT>(448.f);
  } else {
    uint16_t bits = 0x7fc1;
    std::memcpy(&poison, &bits, 2);
  }
  for (int b = 0; b < B; ++b) {
    for (int j = c.seq_lens[b]; j < stride * BS; ++j) {
      const size_t slot = static_cast<size_t>(table[b * stride + j / BS]) * BS + j % BS;
      for (size_t e = 0; e < row; ++e) kc[slot * row + e] = vc[slot * row + e] = poison;
    }
  }
  const int64_t q_stride = static_cast<int64_t>(Hq) * D + 8;    // padded token strides
  const int64_t out_stride = static_cast<int64_t>(Hq) * D + 4;
  std::vector<T> q(static_cast<size_t>(B) * q_stride);
  for (auto& x : q) x = kt_from_float<T>(uni(rng));

  // Reference.
  std::vector<double> ref_out(static_cast<size_t>(B) * Hq * D, 0.0), ref_lse(static_cast<size_t>(B) * Hq);
  for (int b = 0; b < B; ++b) {
    const int L = c.seq_lens[b];
    const int lo = c.window_left >= 0 ? std::max(0, L - 1 - c.window_left) : 0;
    for (int h = 0; h < Hq; ++h) {
      const int kvh = h / group;
      std::vector<double> s;
      double mx = -std::numeric_limits<double>::infinity();
      for (int j = lo; j < L; ++j) {
        const size_t slot = static_cast<size_t>(table[b * stride + j / BS]) * BS + j % BS;
        double dot = 0;
        for (int d = 0; d < D; ++d)
          dot += static_cast<double>(kt_to_float(q[b * q_stride + h * D + d])) *
                 kt_to_float(kc[slot * row + kvh * D + d]) * k_scale;
        double x = dot * scale;
        if (c.softcap > 0.f) x = c.softcap * std::tanh(x / c.softcap);
        s.push_back(x);
        mx = std::max(mx, x);
      }
      double sum = 0;
      for (double x : s) sum += std::exp(x - mx);
      double* o = &ref_out[(static_cast<size_t>(b) * Hq + h) * D];
      for (int j = lo; j < L; ++j) {
        const size_t slot = static_cast<size_t>(table[b * stride + j / BS]) * BS + j % BS;
        const double w = std::exp(s[j - lo] - mx) / sum;
        for (int d = 0; d < D; ++d) o[d] += w * kt_to_float(vc[slot * row + kvh * D + d]) * v_scale;
      }
      ref_lse[static_cast<size_t>(b) * Hq + h] = L > lo ? mx + std::log(sum) : -INFINITY;
    }
  }

  DeviceBuffer<T> d_q(q), d_out(static_cast<size_t>(B) * out_stride);
  DeviceBuffer<CacheT> d_k(kc), d_v(vc);
  DeviceBuffer<int32_t> d_table(table), d_lens(std::vector<int32_t>(c.seq_lens.begin(), c.seq_lens.end()));
  DeviceBuffer<float> d_lse(static_cast<size_t>(B) * Hq);
  DeviceBuffer<float> d_scales(std::vector<float>{k_scale, v_scale});

  DecodeAttentionParams p;
  p.q = d_q.ptr;
  p.k_cache = d_k.ptr;
  p.v_cache = d_v.ptr;
  p.out = d_out.ptr;
  p.lse = c.with_lse ? d_lse.ptr : nullptr;
  p.block_table = d_table.ptr;
  p.block_table_stride = stride;
  p.seq_lens = d_lens.ptr;
  if (kFp8) {
    p.k_scale = d_scales.ptr;
    p.v_scale = d_scales.ptr + 1;
  }
  p.batch_size = B;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.block_size = BS;
  p.q_token_stride = q_stride;
  p.out_token_stride = out_stride;
  p.scale = scale;
  p.window_left = c.window_left;
  p.softcap = c.softcap;
  p.dtype = c.dtype;
  p.cache_dtype = c.cache_dtype;

  const double tol = std::is_same_v<T, __nv_bfloat16> ? 1.6e-2 : 3e-3;
  bool ok = true;
  std::vector<float> first_out;
  std::vector<float> first_lse;
  for (int splits : c.splits) {
    p.num_splits = splits;
    const size_t ws = fastinfer::decode_attention_workspace_size(p);
    DeviceBuffer<unsigned char> d_ws(ws > 0 ? ws : 16);
    CHECK_CUDA(cudaMemset(d_ws.ptr, 0xff, ws > 0 ? ws : 16));  // NaN poison
    p.workspace = ws > 0 ? d_ws.ptr : nullptr;
    CHECK_CUDA(cudaMemset(d_out.ptr, 0xff, d_out.n * sizeof(T)));
    CHECK_CUDA(cudaMemset(d_lse.ptr, 0xff, d_lse.n * sizeof(float)));
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_CUDA(fastinfer::launch_decode_attention(p, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::vector<T> out = d_out.download();
    const std::vector<float> lse = d_lse.download();

    double max_err = 0, max_lse_err = 0, max_split_diff = 0, max_lse_split_diff = 0;
    std::vector<float> out_f;
    Checksum cs;
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < Hq; ++h) {
        for (int d = 0; d < D; ++d) {
          const T raw = out[b * out_stride + h * D + d];
          cs.add(&raw, sizeof(T));
          const float x = kt_to_float(raw);
          out_f.push_back(x);
          const double r = ref_out[(static_cast<size_t>(b) * Hq + h) * D + d];
          const double err = std::isfinite(x) ? std::fabs(x - r) : INFINITY;
          max_err = std::max(max_err, err);
          if (!(err <= tol * (1.0 + std::fabs(r)))) {
            EXPECT(false, "%s splits=%d out[b=%d,h=%d,d=%d] = %g, ref %g", c.name.c_str(), splits, b, h, d, x, r);
            ok = false;
          }
        }
        if (c.with_lse) {
          const float x = lse[b * Hq + h];
          cs.add(&x, sizeof(float));
          const double r = ref_lse[b * Hq + h];
          const bool good = std::isinf(r) ? (std::isinf(x) && x < 0) : std::fabs(x - r) <= 1e-4 * (1 + std::fabs(r));
          if (!std::isinf(r)) max_lse_err = std::max(max_lse_err, std::fabs(x - r));
          if (!good) {
            EXPECT(false, "%s splits=%d lse[b=%d,h=%d] = %g, ref %g", c.name.c_str(), splits, b, h, x, r);
            ok = false;
          }
        }
      }
    }
    if (first_out.empty()) {
      first_out = out_f;
      first_lse = lse;
    } else {
      for (size_t i = 0; i < out_f.size(); ++i)
        max_split_diff = std::max(max_split_diff, static_cast<double>(std::fabs(out_f[i] - first_out[i])));
      if (c.with_lse)
        for (size_t i = 0; i < lse.size(); ++i)
          if (std::isfinite(first_lse[i]))
            max_lse_split_diff = std::max(max_lse_split_diff, static_cast<double>(std::fabs(lse[i] - first_lse[i])));
      // Splits change only the fp32 summation order: at most a couple of output ulps.
      const double split_tol = std::is_same_v<T, __nv_bfloat16> ? 1.6e-2 : 2e-3;
      if (max_split_diff > split_tol || max_lse_split_diff > 1e-5) {
        EXPECT(false, "%s splits=%d differs from splits=%d by %g (lse %g)", c.name.c_str(), splits, c.splits[0],
                  max_split_diff, max_lse_split_diff);
        ok = false;
      }
    }
    if (std::getenv("DECODE_SIM_DEBUG")) {
      for (int b = 0; b < B; ++b) std::printf(" %a", lse[b * Hq]);
      std::printf("\n");
    }
    std::printf("%-34s splits=%d max_err=%.3e lse_err=%.3e split_diff=%.3e checksum=%016llx (%.2fs)\n",
                c.name.c_str(), splits, max_err, max_lse_err, max_split_diff,
                static_cast<unsigned long long>(cs.h), secs);
  }
  return ok;
}

bool run(const Case& c, uint64_t seed) {
  if (c.dtype == DType::kBFloat16) {
    if (c.cache_dtype == DType::kFloat8E4M3) return run_case<__nv_bfloat16, __nv_fp8_e4m3>(c, seed);
    return run_case<__nv_bfloat16, __nv_bfloat16>(c, seed);
  }
  if (c.cache_dtype == DType::kFloat8E4M3) return run_case<__half, __nv_fp8_e4m3>(c, seed);
  return run_case<__half, __half>(c, seed);
}

void check_validation() {
  DecodeAttentionParams p;
  p.batch_size = 0;
  EXPECT(fastinfer::launch_decode_attention(p, nullptr) == cudaSuccess, "batch 0 must succeed");
  DeviceBuffer<__nv_bfloat16> dummy(4096);
  DeviceBuffer<int32_t> idx(4);
  p.q = p.k_cache = p.v_cache = dummy.ptr;
  p.out = dummy.ptr;
  p.block_table = idx.ptr;
  p.seq_lens = idx.ptr;
  p.block_table_stride = 1;
  p.batch_size = 1;
  p.num_q_heads = 4;
  p.num_kv_heads = 2;
  p.head_dim = 64;
  p.block_size = 16;
  p.q_token_stride = p.out_token_stride = 256;
  auto expect_invalid = [&](DecodeAttentionParams bad, const char* what) {
    EXPECT(fastinfer::launch_decode_attention(bad, nullptr) == cudaErrorInvalidValue, "%s: not rejected", what);
  };
  DecodeAttentionParams bad = p;
  bad.head_dim = 96;
  expect_invalid(bad, "head_dim 96");
  bad = p;
  bad.num_q_heads = 3;
  expect_invalid(bad, "Hq % Hkv");
  bad = p;
  bad.num_splits = 0;
  expect_invalid(bad, "num_splits 0");
  bad = p;
  bad.num_splits = 2;
  expect_invalid(bad, "no workspace");
  bad = p;
  bad.cache_dtype = DType::kFloat8E4M3;
  expect_invalid(bad, "fp8 without scales");
  bad = p;
  bad.block_size = 12;
  expect_invalid(bad, "block_size 12");
  bad = p;
  bad.dtype = DType::kFloat32;
  bad.cache_dtype = DType::kFloat32;
  expect_invalid(bad, "fp32");
  // A valid launch over a zero-length sequence works.
  EXPECT(fastinfer::launch_decode_attention(p, nullptr) == cudaSuccess, "valid launch");

  // Split heuristic.
  DecodeAttentionParams h = p;
  h.num_q_heads = 32;
  h.num_kv_heads = 8;
  h.head_dim = 128;
  h.block_table_stride = 4096 / 16;
  h.batch_size = 64;
  const int s64 = fastinfer::decode_attention_num_splits(h, 132);
  EXPECT(s64 == 3, "B=64: %d splits", s64);
  h.batch_size = 256;
  EXPECT(fastinfer::decode_attention_num_splits(h, 132) == 1, "B=256 x Hkv=8: many waves");
  h.batch_size = 1;
  const int s1 = fastinfer::decode_attention_num_splits(h, 132);
  EXPECT(s1 == 32, "B=1: %d splits", s1);
  h.block_table_stride = 2;  // at most 32 keys
  EXPECT(fastinfer::decode_attention_num_splits(h, 132) == 1, "short table");
  h.block_table_stride = 4096 / 16;
  h.batch_size = 4;
  const int s4 = fastinfer::decode_attention_num_splits(h, 132);
  EXPECT(s4 == 11, "B=4: %d splits", s4);  // 11 non-empty splits of 384 keys (12 would leave one empty)
  h.batch_size = 1;
  h.block_table_stride = 32768 / 16;
  const int s1_long = fastinfer::decode_attention_num_splits(h, 132);
  EXPECT(s1_long == 47, "B=1, 32k keys: %d splits", s1_long);  // 376 CTAs: 0.95 of a wave of 396
  std::printf("validation + split heuristic (GQA 32/8, 4k keys, 132 SMs): B=1 -> %d, B=4 -> %d, B=64 -> %d splits\n",
              s1, s4, s64);
}

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  check_validation();
  const std::vector<int> mixed = {1, 2, 15, 17, 100, 257, 0, 33};
  std::vector<Case> cases;
  cases.push_back({"bf16 D128 G4 BS16", DType::kBFloat16, DType::kBFloat16, 8, 2, 128, 16, mixed, -1, 0.f, 0.f,
                   {1, 2, 3, 5, 8}});
  cases.push_back({"fp16 D64 G1 BS8 window20", DType::kFloat16, DType::kFloat16, 3, 3, 64, 8, {17, 100, 0, 257, 21},
                   20, 0.f, 0.f, {1, 3, 8}});
  cases.push_back({"bf16 D128 G8 BS64 softcap", DType::kBFloat16, DType::kBFloat16, 16, 2, 128, 64,
                   {257, 1, 64, 65}, -1, 2.f, 0.5f, {1, 4}});
  cases.push_back({"fp16 D128 G4 BS16 fp8", DType::kFloat16, DType::kFloat8E4M3, 8, 2, 128, 16, mixed, -1, 0.f,
                   0.f, {1, 2, 7}});
  cases.push_back({"bf16 D64 G8 BS8 fp8 window", DType::kBFloat16, DType::kFloat8E4M3, 8, 1, 64, 8,
                   {257, 5, 0, 100}, 50, 0.f, 0.f, {1, 5}});
  cases.push_back({"fp16 D256 G2 BS32", DType::kFloat16, DType::kFloat16, 4, 2, 256, 32, {100, 2, 257}, -1, 0.f,
                   0.f, {1, 2}});
  cases.push_back({"bf16 D128 G6 (chunk 8) BS16 nolse", DType::kBFloat16, DType::kBFloat16, 12, 2, 128, 16,
                   {33, 0, 200}, -1, 0.f, 0.f, {1, 3}, false});
  cases.push_back({"fp16 D64 G12 (2 chunks) BS256", DType::kFloat16, DType::kFloat16, 12, 1, 64, 256,
                   {300, 1, 17}, 0, 0.f, 0.f, {1}});
  cases.push_back({"fp16 D64 G12 (2 chunks) BS256 w", DType::kFloat16, DType::kFloat16, 12, 1, 64, 256,
                   {300, 1, 17}, 40, 1.5f, 0.f, {1, 2, 6}});
  cases.push_back({"bf16 D128 G4 BS16 long", DType::kBFloat16, DType::kBFloat16, 4, 1, 128, 16, {1000, 3, 600},
                   -1, 0.f, 0.f, {1, 4, 16, 32}});
  bool ok = true;
  uint64_t seed = 1234;
  for (const Case& c : cases) ok &= run(c, seed++);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("decode_attention: %s (%d failures, %.1fs)\n", ok && g_failures == 0 ? "OK" : "FAILED", g_failures,
              secs);
  return ok && g_failures == 0 ? 0 : 1;
}
