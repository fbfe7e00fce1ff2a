// GPU benchmark of launch_decode_attention (nvcc only; no reference check, see
// decode_attention_sim.cu for correctness):
//   nvcc -std=c++20 -O3 -arch=sm_90a -Icuda/include --expt-relaxed-constexpr -x cu \
//        tests/kernels/decode_attention_bench.cu -o /tmp/decode_bench && /tmp/decode_bench
// Reports KV bytes read / time against a device-to-device copy of the same number of bytes.
#include "../../cuda/src/attention_decode.cu"
#include "kernel_test_util.h"

#include <algorithm>
#include <numeric>

using fastinfer::DType;

template <typename T, typename CacheT>
void bench(const char* name, DType dtype, DType cache_dtype, int B, int ctx, int Hq, int Hkv, int D, int BS,
           int num_sms, double copy_gbps) {
  const int stride = (ctx + BS - 1) / BS;
  const int NB = B * stride;
  const size_t row = static_cast<size_t>(Hkv) * D;
  DeviceBuffer<CacheT> k(static_cast<size_t>(NB) * BS * row), v(static_cast<size_t>(NB) * BS * row);
  CHECK_CUDA(cudaMemset(k.ptr, 0x11, k.n * sizeof(CacheT)));
  CHECK_CUDA(cudaMemset(v.ptr, 0x22, v.n * sizeof(CacheT)));
  std::vector<int32_t> table(NB);
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(table.begin(), table.end(), rng);
  DeviceBuffer<int32_t> d_table(table), d_lens(std::vector<int32_t>(B, ctx));
  DeviceBuffer<T> q(static_cast<size_t>(B) * Hq * D), out(static_cast<size_t>(B) * Hq * D);
  CHECK_CUDA(cudaMemset(q.ptr, 0x3c, q.n * sizeof(T)));
  DeviceBuffer<float> lse(static_cast<size_t>(B) * Hq), scales(std::vector<float>{1.f, 1.f});
  fastinfer::DecodeAttentionParams p;
  p.q = q.ptr;
  p.k_cache = k.ptr;
  p.v_cache = v.ptr;
  p.out = out.ptr;
  p.lse = lse.ptr;
  p.block_table = d_table.ptr;
  p.block_table_stride = stride;
  p.seq_lens = d_lens.ptr;
  p.k_scale = scales.ptr;
  p.v_scale = scales.ptr + 1;
  p.batch_size = B;
  p.num_q_heads = Hq;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.block_size = BS;
  p.q_token_stride = p.out_token_stride = static_cast<int64_t>(Hq) * D;
  p.scale = 0.088f;
  p.dtype = dtype;
  p.cache_dtype = cache_dtype;
  const int auto_splits = fastinfer::decode_attention_num_splits(p, num_sms);
  const double kv_bytes = 2.0 * B * ctx * row * sizeof(CacheT);
  for (int splits : {1, 2, 3, 4, 8, auto_splits}) {
    p.num_splits = splits;
    const size_t ws = fastinfer::decode_attention_workspace_size(p);
    DeviceBuffer<unsigned char> d_ws(ws > 0 ? ws : 16);
    p.workspace = d_ws.ptr;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int i = 0; i < 3; ++i) CHECK_CUDA(fastinfer::launch_decode_attention(p, nullptr));
    const int iters = 20;
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) fastinfer::launch_decode_attention(p, nullptr);
    cudaEventRecord(e1);
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double us = 1e3 * ms / iters;
    const double gbps = kv_bytes / (us * 1e-6) / 1e9;
    std::printf("%-28s B=%-3d ctx=%-6d splits=%-2d%s %8.1f us %7.0f GB/s (%.2f of copy)\n", name, B, ctx, splits,
                splits == auto_splits ? "*" : " ", us, gbps, gbps / copy_gbps);
  }
}

int main() {
  int dev = 0, num_sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
  // Copy bandwidth (read + write counted) over 1 GiB.
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer<unsigned char> a(bytes), b(bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  CHECK_CUDA(cudaMemcpy(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice));
  cudaEventRecord(e0);
  for (int i = 0; i < 5; ++i) cudaMemcpy(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double copy_gbps = 2.0 * bytes * 5 / (ms * 1e-3) / 1e9;
  std::printf("SMs %d, copy bandwidth %.0f GB/s (read + write)\n", num_sms, copy_gbps);
  bench<__nv_bfloat16, __nv_bfloat16>("bf16 D128 GQA32/8", DType::kBFloat16, DType::kBFloat16, 64, 4096, 32, 8, 128,
                                      16, num_sms, copy_gbps);
  bench<__nv_bfloat16, __nv_bfloat16>("bf16 D128 GQA32/8", DType::kBFloat16, DType::kBFloat16, 1, 32768, 32, 8, 128,
                                      16, num_sms, copy_gbps);
  bench<__nv_bfloat16, __nv_bfloat16>("bf16 D128 GQA64/8", DType::kBFloat16, DType::kBFloat16, 32, 4096, 64, 8, 128,
                                      16, num_sms, copy_gbps);
  bench<__nv_bfloat16, __nv_bfloat16>("bf16 D128 MHA32", DType::kBFloat16, DType::kBFloat16, 16, 4096, 32, 32, 128,
                                      16, num_sms, copy_gbps);
  bench<__nv_bfloat16, __nv_fp8_e4m3>("bf16 D128 GQA32/8 fp8", DType::kBFloat16, DType::kFloat8E4M3, 64, 4096, 32, 8,
                                      128, 16, num_sms, copy_gbps);
  return 0;
}
