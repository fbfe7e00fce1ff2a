// Standalone test of launch_prefill_attention (cuda/src/attention_prefill.cu): random ragged
// batches through the real kernel (on the simt emulator or a GPU), compared with an fp64 host
// reference on the same (rounded) inputs. Prints per-case errors and an FNV checksum of every
// output byte (must be identical across FASTINFER_SIMT_SEED values); exits 0 when all pass.
//
//   python python/fastinfer/simt/__init__.py run tests/kernels/prefill_attention_sim.cu [-- filter]
//   nvcc -std=c++20 -O2 -arch=sm_90a -Icuda/include --expt-relaxed-constexpr \
//        tests/kernels/prefill_attention_sim.cu -o prefill_test && ./prefill_test
#include "../../cuda/src/attention_launch_plan.cu"
#include "../../cuda/src/attention_prefill.cu"
#include "kernel_test_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace fastinfer;


struct Case {
  std::string name;
  DType dtype = DType::kBFloat16;
  int head_dim = 128;
  int hq = 4, hkv = 4;
  std::vector<int> q_lens, k_lens;
  bool causal = true;
  int window_left = -1;
  float softcap = 0.f;
  bool paged = false;
  int block_size = 16;
  bool custom_mask = false;
  bool lse = true;
  bool fused_qkv = false;  // contiguous path: q/k/v are slices of one [T, Hq + 2 Hkv, D] buffer
  bool packed_mask = false;  // custom mask in the bit-packed form (8 entries per byte)
  bool tight_grid = true;    // pass num_q_tokens (the launcher's tighter work-item bound)
};

static uint64_t g_checksum = 1469598103934665603ull;
static void hash_bytes(const void* data, size_t n) {
  const unsigned char* c = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) g_checksum = (g_checksum ^ c[i]) * 1099511628211ull;
}

static uint16_t encode(float x, DType dt) {
  uint16_t u;
  if (dt == DType::kBFloat16) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&u, &h, 2);
  } else {
    __half h = __float2half_rn(x);
    std::memcpy(&u, &h, 2);
  }
  return u;
}
static float decode(uint16_t u, DType dt) {
  if (dt == DType::kBFloat16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &u, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &u, 2);
  return __half2float(h);
}

template <typename T>
static T* to_device(const std::vector<T>& h) {
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, h.size()) * sizeof(T)));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return static_cast<T*>(d);
}

// The launch as a caller makes it: the plan for this device, its workspace, the launch (the
// workspace is freed after the launch completes). A plan that refuses the shape is the error.
static cudaError_t plan_and_launch(PrefillAttentionParams p) {
  static DeviceDescription device;
  static const cudaError_t queried = query_device_description(0, &device);
  if (queried != cudaSuccess) return queried;
  const PrefillLaunchPlan plan = plan_prefill_launch(p, device);
  if (plan.status != cudaSuccess) return plan.status;
  void* ws = nullptr;
  if (plan.workspace_bytes > 0) CHECK_CUDA(cudaMalloc(&ws, plan.workspace_bytes));
  p.workspace = ws;
  cudaError_t err = launch_prefill_attention(p, plan, nullptr);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  cudaFree(ws);
  return err;
}

static bool run_case(const Case& c, std::mt19937& rng) {
  const int B = static_cast<int>(c.q_lens.size());
  const int D = c.head_dim, Hq = c.hq, Hkv = c.hkv;
  std::vector<int> cu_q(B + 1, 0), cu_k(B + 1, 0);
  for (int b = 0; b < B; ++b) {
    cu_q[b + 1] = cu_q[b] + c.q_lens[b];
    cu_k[b + 1] = cu_k[b] + c.k_lens[b];
  }
  const int T = cu_q[B], Tk = cu_k[B];
  const int max_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  std::normal_distribution<float> nd(0.f, 1.f);

  // Logical (rounded) inputs as float, per token / head.
  std::vector<float> qf(static_cast<size_t>(T) * Hq * D), kf(static_cast<size_t>(Tk) * Hkv * D),
      vf(static_cast<size_t>(Tk) * Hkv * D);
  for (auto& x : qf) x = decode(encode(nd(rng), c.dtype), c.dtype);
  for (auto& x : kf) x = decode(encode(nd(rng), c.dtype), c.dtype);
  for (auto& x : vf) x = decode(encode(nd(rng), c.dtype), c.dtype);

  // Custom tree masks: random lower-triangular-ish (diagonal always set) plus some random bits.
  std::vector<int64_t> mask_off(B + 1, 0);
  std::vector<unsigned char> mask;
  if (c.custom_mask) {
    for (int b = 0; b < B; ++b) {
      const int ql = c.q_lens[b];
      mask_off[b + 1] = mask_off[b] + static_cast<int64_t>(ql) * ql;
      for (int i = 0; i < ql; ++i)
        for (int j = 0; j < ql; ++j) {
          bool v = (j == i) || (j < i && (rng() % 3 != 0)) || (j > i && rng() % 7 == 0);
          if (b == 0 && i == ql - 1 && ql > 2) v = false;  // one row that sees only the prefix
          mask.push_back(v);
        }
    }
  }

  // ---- reference (fp64) ----
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> ref_out(static_cast<size_t>(T) * Hq * D, 0.0);
  std::vector<double> ref_lse(static_cast<size_t>(T) * Hq, -INFINITY);
  int empty_rows = 0;
  for (int b = 0; b < B; ++b) {
    const int ql = c.q_lens[b], kl = c.k_lens[b];
    for (int h = 0; h < Hq; ++h) {
      const int kh = h / (Hq / Hkv);
      for (int i = 0; i < ql; ++i) {
        const int pos = kl - ql + i;
        std::vector<double> s(kl);
        std::vector<char> vis(kl, 0);
        double mx = -INFINITY;
        const float* qrow = &qf[(static_cast<size_t>(cu_q[b] + i) * Hq + h) * D];
        for (int j = 0; j < kl; ++j) {
          bool ok = true;
          if (c.custom_mask) {
            if (j >= kl - ql) ok = mask[mask_off[b] + static_cast<int64_t>(i) * ql + (j - (kl - ql))];
          } else if (c.causal) {
            ok = j <= pos;
          }
          if (c.window_left >= 0 && j < pos - c.window_left) ok = false;
          if (!ok) continue;
          const float* krow = &kf[(static_cast<size_t>(cu_k[b] + j) * Hkv + kh) * D];
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += static_cast<double>(qrow[d]) * krow[d];
          acc *= scale;
          if (c.softcap > 0) acc = c.softcap * std::tanh(acc / c.softcap);
          s[j] = acc;
          vis[j] = 1;
          mx = std::max(mx, acc);
        }
        double sum = 0;
        for (int j = 0; j < kl; ++j)
          if (vis[j]) sum += std::exp(s[j] - mx);
        const size_t orow = (static_cast<size_t>(cu_q[b] + i) * Hq + h);
        if (sum == 0) {
          ++empty_rows;
          continue;
        }
        ref_lse[orow] = mx + std::log(sum);
        for (int j = 0; j < kl; ++j) {
          if (!vis[j]) continue;
          const double w = std::exp(s[j] - mx) / sum;
          const float* vrow = &vf[(static_cast<size_t>(cu_k[b] + j) * Hkv + kh) * D];
          for (int d = 0; d < D; ++d) ref_out[orow * D + d] += w * vrow[d];
        }
      }
    }
  }

  // ---- device buffers ----
  PrefillAttentionParams p;
  p.batch_size = B;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.max_seqlen_q = max_q;
  p.scale = static_cast<float>(scale);
  p.causal = c.causal;
  p.window_left = c.window_left;
  p.softcap = c.softcap;
  p.dtype = c.dtype;
  p.num_q_tokens = c.tight_grid ? T : 0;

  std::vector<void*> allocs;
  // Output buffer with a padded token stride (Hq * D + 8), poisoned to catch missed rows.
  const int64_t out_stride = static_cast<int64_t>(Hq) * D + 8;
  std::vector<uint16_t> out_h(static_cast<size_t>(T) * out_stride, 0x7fff);
  uint16_t* out_d = to_device(out_h);
  allocs.push_back(out_d);
  p.out = out_d;
  p.out_token_stride = out_stride;
  std::vector<float> lse_h(static_cast<size_t>(T) * Hq, 12345.f);
  float* lse_d = nullptr;
  if (c.lse) {
    lse_d = to_device(lse_h);
    allocs.push_back(lse_d);
    p.lse = lse_d;
  }
  int32_t* cuq_d = to_device(std::vector<int32_t>(cu_q.begin(), cu_q.end()));
  allocs.push_back(cuq_d);
  p.cu_seqlens_q = cuq_d;

  if (!c.paged) {
    if (c.fused_qkv) {
      // One [T, Hq + 2 Hkv, D] buffer (requires T == Tk); q/k/v are head slices of it.
      const int64_t stride = static_cast<int64_t>(Hq + 2 * Hkv) * D;
      std::vector<uint16_t> qkv(static_cast<size_t>(T) * stride);
      for (int tkn = 0; tkn < T; ++tkn) {
        for (int i = 0; i < Hq * D; ++i) qkv[tkn * stride + i] = encode(qf[static_cast<size_t>(tkn) * Hq * D + i], c.dtype);
        for (int i = 0; i < Hkv * D; ++i) {
          qkv[tkn * stride + Hq * D + i] = encode(kf[static_cast<size_t>(tkn) * Hkv * D + i], c.dtype);
          qkv[tkn * stride + (Hq + Hkv) * D + i] = encode(vf[static_cast<size_t>(tkn) * Hkv * D + i], c.dtype);
        }
      }
      uint16_t* d = to_device(qkv);
      allocs.push_back(d);
      p.q = d;
      p.k = d + Hq * D;
      p.v = d + (Hq + Hkv) * D;
      p.q_token_stride = p.k_token_stride = p.v_token_stride = stride;
    } else {
      std::vector<uint16_t> qh(qf.size()), kh(kf.size()), vh(vf.size());
      for (size_t i = 0; i < qf.size(); ++i) qh[i] = encode(qf[i], c.dtype);
      for (size_t i = 0; i < kf.size(); ++i) kh[i] = encode(kf[i], c.dtype);
      for (size_t i = 0; i < vf.size(); ++i) vh[i] = encode(vf[i], c.dtype);
      uint16_t *qd = to_device(qh), *kd = to_device(kh), *vd = to_device(vh);
      allocs.insert(allocs.end(), {qd, kd, vd});
      p.q = qd;
      p.k = kd;
      p.v = vd;
      p.q_token_stride = static_cast<int64_t>(Hq) * D;
      p.k_token_stride = p.v_token_stride = static_cast<int64_t>(Hkv) * D;
    }
    int32_t* cuk_d = to_device(std::vector<int32_t>(cu_k.begin(), cu_k.end()));
    allocs.push_back(cuk_d);
    p.cu_seqlens_k = cuk_d;
  } else {
    std::vector<uint16_t> qh(qf.size());
    for (size_t i = 0; i < qf.size(); ++i) qh[i] = encode(qf[i], c.dtype);
    uint16_t* qd = to_device(qh);
    allocs.push_back(qd);
    p.q = qd;
    p.q_token_stride = static_cast<int64_t>(Hq) * D;
    // Paged cache: blocks of all sequences shuffled, plus a few unused blocks filled with NaN-ish
    // garbage (0x7fff is NaN in both formats) to catch reads outside the sequences' keys.
    const int BS = c.block_size;
    int max_blocks = 0, total_blocks = 0;
    for (int b = 0; b < B; ++b) {
      const int nb = (c.k_lens[b] + BS - 1) / BS;
      max_blocks = std::max(max_blocks, nb);
      total_blocks += nb;
    }
    const int NB = total_blocks + 3;
    std::vector<int> perm(NB);
    for (int i = 0; i < NB; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    const int64_t row = static_cast<int64_t>(Hkv) * D;
    std::vector<uint16_t> kc(static_cast<size_t>(NB) * BS * row, 0x7fff), vc(kc.size(), 0x7fff);
    const int stride = max_blocks + 1;
    std::vector<int32_t> table(static_cast<size_t>(B) * stride, -1);
    int next = 0;
    for (int b = 0; b < B; ++b) {
      const int nb = (c.k_lens[b] + BS - 1) / BS;
      for (int lb = 0; lb < nb; ++lb) table[b * stride + lb] = perm[next++];
      for (int j = 0; j < c.k_lens[b]; ++j) {
        const int64_t slot = static_cast<int64_t>(table[b * stride + j / BS]) * BS + j % BS;
        for (int i = 0; i < row; ++i) {
          kc[slot * row + i] = encode(kf[static_cast<size_t>(cu_k[b] + j) * row + i], c.dtype);
          vc[slot * row + i] = encode(vf[static_cast<size_t>(cu_k[b] + j) * row + i], c.dtype);
        }
      }
    }
    uint16_t *kd = to_device(kc), *vd = to_device(vc);
    int32_t* td = to_device(table);
    int32_t* sl = to_device(std::vector<int32_t>(c.k_lens.begin(), c.k_lens.end()));
    allocs.insert(allocs.end(), {kd, vd, td, sl});
    p.k = kd;
    p.v = vd;
    p.block_table = td;
    p.block_table_stride = stride;
    p.block_size = BS;
    p.seq_lens_k = sl;
    if (c.custom_mask) {
      int64_t* mo = to_device(mask_off);
      allocs.push_back(mo);
      p.mask_offsets = mo;
      if (c.packed_mask) {  // entry e -> bit e % 8 of byte e / 8, over the whole batch
        std::vector<uint8_t> bits((mask.size() + 7) / 8, 0);
        for (size_t e = 0; e < mask.size(); ++e)
          if (mask[e]) bits[e / 8] |= static_cast<uint8_t>(1u << (e % 8));
        uint8_t* bd = to_device(bits);
        allocs.push_back(bd);
        p.packed_custom_mask = bd;
      } else {
        bool* md = nullptr;
        CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&md), std::max<size_t>(1, mask.size())));
        std::vector<char> mb(mask.begin(), mask.end());
        CHECK_CUDA(cudaMemcpy(md, mb.data(), mb.size(), cudaMemcpyHostToDevice));
        allocs.push_back(md);
        p.custom_mask = md;
      }
    }
  }

  const auto t0 = std::chrono::steady_clock::now();
  CHECK_CUDA(plan_and_launch(p));
  CHECK_CUDA(cudaDeviceSynchronize());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK_CUDA(cudaMemcpy(out_h.data(), out_d, out_h.size() * 2, cudaMemcpyDeviceToHost));
  if (c.lse) CHECK_CUDA(cudaMemcpy(lse_h.data(), lse_d, lse_h.size() * 4, cudaMemcpyDeviceToHost));
  for (void* a : allocs) cudaFree(a);

  // ---- compare ----
  double err2 = 0, ref2 = 0, max_abs = 0, lse_err = 0;
  int bad = 0, nan = 0;
  for (int tkn = 0; tkn < T; ++tkn)
    for (int h = 0; h < Hq; ++h) {
      const size_t orow = static_cast<size_t>(tkn) * Hq + h;
      const bool empty = std::isinf(ref_lse[orow]);
      for (int d = 0; d < D; ++d) {
        const float got = decode(out_h[tkn * out_stride + h * D + d], c.dtype);
        const double r = ref_out[orow * D + d];
        if (std::isnan(got)) {
          ++nan;
          continue;
        }
        if (empty && got != 0.f) ++bad;
        err2 += (got - r) * (got - r);
        ref2 += r * r;
        max_abs = std::max(max_abs, std::fabs(got - r));
      }
      if (c.lse) {
        const float l = lse_h[orow];
        if (std::isnan(l)) ++nan;
        else if (empty) bad += !(std::isinf(l) && l < 0);
        else lse_err = std::max(lse_err, std::fabs(l - ref_lse[orow]));
      }
    }
  // Only the output elements (not the padding) go into the checksum.
  for (int tkn = 0; tkn < T; ++tkn) hash_bytes(&out_h[tkn * out_stride], static_cast<size_t>(Hq) * D * 2);
  if (c.lse) hash_bytes(lse_h.data(), lse_h.size() * 4);

  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const double tol = c.dtype == DType::kBFloat16 ? 1e-2 : 3e-3;
  const bool pass = nan == 0 && bad == 0 && rel < tol && max_abs < (c.dtype == DType::kBFloat16 ? 4e-2 : 8e-3) &&
                    lse_err < 1e-3;
  std::printf("%-48s %s D=%3d Hq/Hkv=%d/%d T=%4d rel=%.2e max_abs=%.2e lse_err=%.2e empty_rows=%d nan=%d bad=%d %.2fs %s\n",
              c.name.c_str(), c.dtype == DType::kBFloat16 ? "bf16" : "fp16", D, Hq, Hkv, T, rel, max_abs, lse_err,
              empty_rows, nan, bad, secs, pass ? "OK" : "FAIL");
  return pass;
}

static int check_validation() {
  int fails = 0;
  PrefillAttentionParams p;
  p.batch_size = 0;
  fails += plan_and_launch(p) != cudaSuccess;  // empty batch: nothing to do
  std::vector<uint16_t> buf(64 * 128);
  uint16_t* d = to_device(buf);
  int32_t* cu = to_device(std::vector<int32_t>{0, 1});
  p.batch_size = 1;
  p.max_seqlen_q = 1;
  p.num_q_heads = 2;
  p.num_kv_heads = 1;
  p.head_dim = 128;
  p.q = p.k = p.v = p.out = d;
  p.q_token_stride = p.k_token_stride = p.v_token_stride = p.out_token_stride = 256;
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  fails += plan_and_launch(p) != cudaSuccess;
  CHECK_CUDA(cudaDeviceSynchronize());
  auto expect_invalid = [&](PrefillAttentionParams q, const char* what) {
    // without the workspace the plan asks for (a refused shape fails in the plan already)
    if (launch_prefill_attention(q, plan_prefill_launch(q, DeviceDescription{}), nullptr) != cudaErrorInvalidValue) {
      std::printf("validation: %s not rejected\n", what);
      ++fails;
    }
  };
  { auto q = p; q.head_dim = 96; expect_invalid(q, "head_dim 96"); }
  { auto q = p; q.num_kv_heads = 3; expect_invalid(q, "Hq % Hkv"); }
  { auto q = p; q.num_q_heads = 0; expect_invalid(q, "Hq 0"); }
  { auto q = p; q.dtype = DType::kFloat32; expect_invalid(q, "float32"); }
  { auto q = p; q.q_token_stride = 250; expect_invalid(q, "unaligned stride"); }
  { auto q = p; q.block_table = cu; q.seq_lens_k = cu; q.block_table_stride = 1; q.block_size = 24;
    expect_invalid(q, "block size 24"); }
  { auto q = p; q.custom_mask = reinterpret_cast<const bool*>(d); expect_invalid(q, "custom mask, contiguous"); }
  { auto q = p; q.block_table = cu; q.seq_lens_k = cu; q.block_table_stride = 1; q.block_size = 16;
    q.custom_mask = reinterpret_cast<const bool*>(d); q.mask_offsets = reinterpret_cast<const int64_t*>(d);
    q.window_left = 3; expect_invalid(q, "custom mask + window without the tree scratch"); }
  { auto q = p; q.block_table = cu; q.seq_lens_k = cu; q.block_table_stride = 1; q.block_size = 16;
    q.custom_mask = reinterpret_cast<const bool*>(d); q.mask_offsets = reinterpret_cast<const int64_t*>(d);
    q.fixed_split_size = 64; q.num_q_tokens = 4;
    expect_invalid(q, "fixed mode + custom mask without the tree scratch (keys by rank)"); }
  { auto q = p; q.block_table = cu; q.seq_lens_k = cu; q.block_table_stride = 1; q.block_size = 16;
    q.custom_mask = reinterpret_cast<const bool*>(d); q.packed_custom_mask = reinterpret_cast<const uint8_t*>(d);
    q.mask_offsets = reinterpret_cast<const int64_t*>(d); expect_invalid(q, "both custom mask forms"); }
  { auto q = p; q.num_q_tokens = -1; expect_invalid(q, "num_q_tokens < 0"); }
  { auto q = p; q.max_seqlen_q = 0; if (plan_and_launch(q) != cudaSuccess) ++fails; }
  // The work-item grid bound (attention.h): B * ceil(max_q * group / rows), tightened by the token count.
  {
    auto q = p;
    q.batch_size = 16; q.num_q_heads = 32; q.num_kv_heads = 8; q.max_seqlen_q = 1024; q.num_q_tokens = 0;
    const int64_t rows = plan_prefill_launch(q, DeviceDescription{}).rows_per_cta;
    const int64_t loose = plan_prefill_launch(q, DeviceDescription{}).work_items;
    q.num_q_tokens = 1024 + 15 * 8;
    const int64_t tight = plan_prefill_launch(q, DeviceDescription{}).work_items;
    const int64_t exact = (1024 * 4 + rows - 1) / rows + 15 * ((8 * 4 + rows - 1) / rows);
    if (rows != 128 || loose != 16 * 32 || tight < exact || tight > exact + 16) {
      std::printf("validation: work items rows %lld loose %lld tight %lld exact %lld\n", (long long)rows,
                  (long long)loose, (long long)tight, (long long)exact);
      ++fails;
    }
  }
  cudaFree(d);
  cudaFree(cu);
  std::printf("validation: %s\n", fails ? "FAIL" : "OK");
  return fails;
}

int main(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(std::move(c)); };
  const DType bf = DType::kBFloat16, fp = DType::kFloat16;

  // Contiguous (varlen) path.
  add({.name = "causal odd lens", .dtype = bf, .head_dim = 128, .hq = 2, .hkv = 2,
       .q_lens = {1, 2, 15, 17, 100}, .k_lens = {1, 2, 15, 17, 100}});
  add({.name = "causal odd lens fp16 D64", .dtype = fp, .head_dim = 64, .hq = 2, .hkv = 2,
       .q_lens = {1, 17, 100}, .k_lens = {1, 17, 100}});
  add({.name = "noncausal gqa4", .dtype = bf, .head_dim = 64, .hq = 8, .hkv = 2,
       .q_lens = {17, 0, 70}, .k_lens = {17, 5, 70}, .causal = false});
  add({.name = "causal prefix q<k gqa8", .dtype = fp, .head_dim = 128, .hq = 8, .hkv = 1,
       .q_lens = {5, 33}, .k_lens = {130, 40}});
  add({.name = "causal q>k (rows see nothing)", .dtype = bf, .head_dim = 64, .hq = 1, .hkv = 1,
       .q_lens = {20, 70}, .k_lens = {9, 0}});
  add({.name = "window causal", .dtype = bf, .head_dim = 128, .hq = 2, .hkv = 1,
       .q_lens = {150}, .k_lens = {150}, .window_left = 37});
  add({.name = "window noncausal + prefix", .dtype = fp, .head_dim = 64, .hq = 2, .hkv = 1,
       .q_lens = {40, 3}, .k_lens = {200, 3}, .causal = false, .window_left = 5});
  add({.name = "window 0 causal", .dtype = bf, .head_dim = 64, .hq = 1, .hkv = 1,
       .q_lens = {65}, .k_lens = {65}, .window_left = 0});
  add({.name = "softcap causal", .dtype = bf, .head_dim = 128, .hq = 4, .hkv = 2,
       .q_lens = {33, 64}, .k_lens = {33, 64}, .softcap = 5.f});
  add({.name = "fused qkv strides noncausal no-lse", .dtype = fp, .head_dim = 128, .hq = 4, .hkv = 1,
       .q_lens = {66, 9}, .k_lens = {66, 9}, .causal = false, .lse = false, .fused_qkv = true});
  add({.name = "long causal multi-tile", .dtype = bf, .head_dim = 64, .hq = 1, .hkv = 1,
       .q_lens = {257}, .k_lens = {300}});
  // Paged path.
  add({.name = "paged BS16 causal prefix", .dtype = bf, .head_dim = 128, .hq = 4, .hkv = 1,
       .q_lens = {1, 17, 64}, .k_lens = {30, 17, 100}, .paged = true, .block_size = 16});
  add({.name = "paged BS8 fp16 D64 gqa8", .dtype = fp, .head_dim = 64, .hq = 8, .hkv = 1,
       .q_lens = {15, 2}, .k_lens = {77, 9}, .paged = true, .block_size = 8});
  add({.name = "paged BS64 noncausal softcap", .dtype = bf, .head_dim = 64, .hq = 2, .hkv = 2,
       .q_lens = {100}, .k_lens = {150}, .causal = false, .softcap = 30.f, .paged = true, .block_size = 64});
  add({.name = "paged BS256 window", .dtype = bf, .head_dim = 128, .hq = 2, .hkv = 1,
       .q_lens = {70}, .k_lens = {300}, .window_left = 50, .paged = true, .block_size = 256});
  add({.name = "paged BS32 fp16 D128 gqa4 window+softcap", .dtype = fp, .head_dim = 128, .hq = 8, .hkv = 2,
       .q_lens = {3, 130, 1}, .k_lens = {50, 200, 1}, .window_left = 70, .softcap = 20.f, .paged = true,
       .block_size = 32});
  add({.name = "paged custom tree mask", .dtype = bf, .head_dim = 128, .hq = 4, .hkv = 1,
       .q_lens = {7, 16, 1}, .k_lens = {40, 16, 5}, .paged = true, .block_size = 16, .custom_mask = true});
  add({.name = "paged custom mask q==k (empty row)", .dtype = bf, .head_dim = 64, .hq = 2, .hkv = 1,
       .q_lens = {9, 3}, .k_lens = {9, 20}, .paged = true, .block_size = 8, .custom_mask = true});
  add({.name = "paged custom mask long tree fp16", .dtype = fp, .head_dim = 64, .hq = 2, .hkv = 2,
       .q_lens = {70}, .k_lens = {100}, .causal = false, .paged = true, .block_size = 8, .custom_mask = true});

  // GQA packing and work items: groups that do not divide the 128-row tile (a token's heads split
  // between two tiles), many sequences (the work-item search walks 32 at a time), empty ones.
  add({.name = "gqa3 causal odd lens", .dtype = bf, .head_dim = 128, .hq = 6, .hkv = 2,
       .q_lens = {1, 43, 100, 2}, .k_lens = {1, 50, 100, 9}});
  add({.name = "gqa5 noncausal window fp16 D64 loose grid", .dtype = fp, .head_dim = 64, .hq = 5, .hkv = 1,
       .q_lens = {26, 77}, .k_lens = {40, 77}, .causal = false, .window_left = 20, .tight_grid = false});
  {
    Case c{.name = "ragged 37 seqs gqa4 (work-item search)", .dtype = bf, .head_dim = 64, .hq = 8, .hkv = 2};
    for (int b = 0; b < 37; ++b) {
      const int ql = b % 9 == 4 ? 0 : 1 + (b * 7) % 13;
      c.q_lens.push_back(ql);
      c.k_lens.push_back(ql + (b * 5) % 11);
    }
    c.q_lens[30] = 70;
    c.k_lens[30] = 90;
    add(c);
  }
  add({.name = "paged gqa6 tree mask packed", .dtype = bf, .head_dim = 128, .hq = 12, .hkv = 2,
       .q_lens = {7, 16, 1, 9}, .k_lens = {40, 16, 5, 30}, .paged = true, .block_size = 16, .custom_mask = true,
       .packed_mask = true});
  add({.name = "paged tree mask packed long fp16 gqa4", .dtype = fp, .head_dim = 64, .hq = 4, .hkv = 1,
       .q_lens = {3, 70}, .k_lens = {8, 100}, .causal = false, .paged = true, .block_size = 8, .custom_mask = true,
       .packed_mask = true});

  std::mt19937 rng(1234);
  int fails = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const Case& c : cases) {
    std::mt19937 case_rng(rng());
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    fails += !run_case(c, case_rng);
  }
  fails += check_validation();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("checksum %016llx  total %.1fs  %s\n", static_cast<unsigned long long>(g_checksum), secs,
              fails ? "FAILED" : "ALL OK");
  return fails ? 1 : 0;
}
