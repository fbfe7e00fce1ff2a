// gated_delta_rule launcher: {fp32, fp16, bf16} x Dk {64, 128}; Dv, the index dtype, l2norm and
// beta's dtype are runtime values (Dv sets the grid's third dimension).
#include "fastinfer/common/launch.cuh"
#include "fastinfer/linear_attention/gated_delta_rule.cuh"

namespace fastinfer {
namespace {

template <typename T, int DK>
cudaError_t launch_dk(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  namespace la = linear_attention;
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_v_heads),
                  static_cast<unsigned>(p.head_dim_v / la::kGdnCols));
  return launch_kernel(la::gated_delta_rule_kernel<T, DK>, grid, dim3(la::kGdnThreads), 0, stream, p);
}

template <typename T>
cudaError_t launch_typed(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  return p.head_dim_k == 64 ? launch_dk<T, 64>(p, stream) : launch_dk<T, 128>(p, stream);
}

}  // namespace

cudaError_t launch_gated_delta_rule(const GatedDeltaRuleParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.num_v_heads == 0) return cudaSuccess;
  if (p.num_seqs < 0 || p.num_tokens < 0 || p.num_k_heads <= 0 || p.num_v_heads < 0 ||
      p.num_v_heads % p.num_k_heads != 0 || p.num_v_heads > 65535 || p.num_seqs > 0x7fffffff ||
      !gated_delta_rule_head_dim_supported(p.head_dim_k) || !gated_delta_rule_head_dim_supported(p.head_dim_v))
    return cudaErrorInvalidValue;
  if (p.states == nullptr || p.cu_seqlens == nullptr || p.state_indices == nullptr ||
      (p.num_tokens > 0 && (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.g == nullptr ||
                            p.beta == nullptr || p.out == nullptr)))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fastinfer
