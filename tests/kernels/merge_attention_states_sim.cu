// merge_attention_states (launch_merge_attention_states) against the fp64 host formula, for
// fp16/bf16/fp32, vectorised and scalar paths, -inf lse on either or both sides, and in-place
// outputs (v_out aliasing v_a or v_b, lse_out aliasing lse_a). Exits 0 on success.
#include "../../cuda/src/attention_merge.cu"
#include "kernel_test_util.h"

#include <cmath>
#include <string>

using fastinfer::DType;
using fastinfer::MergeAttentionStatesParams;

enum class Alias { kNone, kA, kB };

template <typename T>
bool run_case(DType dtype, int T_, int H, int D, Alias alias, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  const size_t rows = static_cast<size_t>(T_) * H, n = rows * D;
  std::vector<T> va(n), vb(n);
  std::vector<float> la(rows), lb(rows);
  for (size_t i = 0; i < n; ++i) {
    va[i] = kt_from_float<T>(uni(rng));
    vb[i] = kt_from_float<T>(uni(rng));
  }
  for (size_t r = 0; r < rows; ++r) {
    la[r] = 8.f * uni(rng);
    lb[r] = 8.f * uni(rng);
    switch (r % 7) {  // -inf patterns
      case 1: la[r] = -INFINITY; break;
      case 2: lb[r] = -INFINITY; break;
      case 3: la[r] = lb[r] = -INFINITY; break;
      case 4: lb[r] = la[r] + 60.f; break;  // very unequal
      default: break;
    }
  }
  std::vector<double> ref_v(n), ref_l(rows);
  for (size_t r = 0; r < rows; ++r) {
    const double a = la[r], b = lb[r];
    const double m = std::max(a, b);
    if (std::isinf(m) && m < 0) {
      ref_l[r] = -INFINITY;
      for (int d = 0; d < D; ++d) ref_v[r * D + d] = 0.0;
      continue;
    }
    const double s = std::exp(a - m) + std::exp(b - m);
    ref_l[r] = m + std::log(s);
    for (int d = 0; d < D; ++d)
      ref_v[r * D + d] = kt_to_float(va[r * D + d]) * std::exp(a - ref_l[r]) +
                         kt_to_float(vb[r * D + d]) * std::exp(b - ref_l[r]);
  }
  DeviceBuffer<T> d_va(va), d_vb(vb), d_out(n);
  DeviceBuffer<float> d_la(la), d_lb(lb), d_lout(rows);
  MergeAttentionStatesParams p;
  p.v_a = d_va.ptr;
  p.v_b = d_vb.ptr;
  p.lse_a = d_la.ptr;
  p.lse_b = d_lb.ptr;
  p.v_out = alias == Alias::kA ? d_va.ptr : alias == Alias::kB ? d_vb.ptr : d_out.ptr;
  p.lse_out = alias == Alias::kA ? d_la.ptr : d_lout.ptr;
  p.num_tokens = T_;
  p.num_heads = H;
  p.head_dim = D;
  p.dtype = dtype;
  CHECK_CUDA(fastinfer::launch_merge_attention_states(p, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<T> out = alias == Alias::kA ? d_va.download() : alias == Alias::kB ? d_vb.download() : d_out.download();
  const std::vector<float> lout = alias == Alias::kA ? d_la.download() : d_lout.download();
  const double tol = std::is_same_v<T, float> ? 1e-5 : std::is_same_v<T, __half> ? 1.5e-3 : 1e-2;
  double max_err = 0, max_lerr = 0;
  Checksum cs;
  bool ok = true;
  for (size_t i = 0; i < n; ++i) {
    const double x = kt_to_float(out[i]);
    cs.add(&out[i], sizeof(T));
    const double e = std::fabs(x - ref_v[i]);
    max_err = std::max(max_err, std::isfinite(x) ? e : INFINITY);
    if (!(e <= tol)) {
      EXPECT(false, "v[%zu] = %g, ref %g", i, x, ref_v[i]);
      ok = false;
    }
  }
  for (size_t r = 0; r < rows; ++r) {
    cs.add(&lout[r], sizeof(float));
    const bool good = std::isinf(ref_l[r]) ? (std::isinf(lout[r]) && lout[r] < 0)
                                           : std::fabs(lout[r] - ref_l[r]) <= 1e-5 * (1 + std::fabs(ref_l[r]));
    if (!std::isinf(ref_l[r])) max_lerr = std::max(max_lerr, std::fabs(lout[r] - ref_l[r]));
    if (!good) {
      EXPECT(false, "lse[%zu] = %g, ref %g", r, lout[r], ref_l[r]);
      ok = false;
    }
  }
  std::printf("merge %-5s T=%-3d H=%d D=%-3d alias=%d max_err=%.3e lse_err=%.3e checksum=%016llx\n",
              fastinfer::dtype_name(dtype), T_, H, D, static_cast<int>(alias), max_err, max_lerr,
              static_cast<unsigned long long>(cs.h));
  return ok;
}

int main() {
  bool ok = true;
  uint64_t seed = 7;
  ok &= run_case<__nv_bfloat16>(DType::kBFloat16, 17, 4, 128, Alias::kNone, seed++);
  ok &= run_case<__half>(DType::kFloat16, 5, 3, 64, Alias::kA, seed++);
  ok &= run_case<float>(DType::kFloat32, 9, 2, 256, Alias::kB, seed++);
  ok &= run_case<__half>(DType::kFloat16, 3, 5, 36, Alias::kNone, seed++);        // scalar path (36 % 8)
  ok &= run_case<float>(DType::kFloat32, 1, 1, 1000, Alias::kA, seed++);          // wide rows
  ok &= run_case<__nv_bfloat16>(DType::kBFloat16, 100, 1, 8, Alias::kNone, seed++);  // many rows per CTA
  MergeAttentionStatesParams bad;
  bad.num_tokens = 1;
  bad.num_heads = 1;
  bad.head_dim = 8;
  EXPECT(fastinfer::launch_merge_attention_states(bad, nullptr) == cudaErrorInvalidValue, "null pointers");
  bad.num_tokens = 0;
  EXPECT(fastinfer::launch_merge_attention_states(bad, nullptr) == cudaSuccess, "empty");
  std::printf("merge_attention_states: %s\n", ok && g_failures == 0 ? "OK" : "FAILED");
  return ok && g_failures == 0 ? 0 : 1;
}
