// causal_conv1d launcher: {fp32, fp16, bf16}; the index dtype and the activation are runtime
// branches (one load and one select per output, next to W loads).
#include "fastinfer/common/launch.cuh"
#include "fastinfer/linear_attention/causal_conv1d.cuh"

namespace fastinfer {
namespace {

// Up to this many tokens per sequence on average, a thread per (sequence, channel) walks its
// sequence (one pass over the state: decode, verification); beyond it, a thread per (token,
// channel) (prefill: a long sequence would serialise). Same bits either way.
constexpr int64_t kSeqKernelMaxTokensPerSeq = 4;

template <typename T>
cudaError_t launch_typed(const CausalConv1dParams& p, cudaStream_t stream) {
  namespace la = linear_attention;
  const unsigned channel_blocks = static_cast<unsigned>((p.dim + la::kConvThreads - 1) / la::kConvThreads);
  if (p.num_tokens <= kSeqKernelMaxTokensPerSeq * p.num_seqs)
    return launch_kernel(la::causal_conv1d_seq_kernel<T>, dim3(static_cast<unsigned>(p.num_seqs), channel_blocks),
                         dim3(la::kConvThreads), 0, stream, p);
  if (p.num_tokens > 0) {
    const unsigned chunks = static_cast<unsigned>((p.num_tokens + la::kConvChunk - 1) / la::kConvChunk);
    const cudaError_t err = launch_kernel(la::causal_conv1d_kernel<T>, dim3(chunks, channel_blocks),
                                          dim3(la::kConvThreads), 0, stream, p);
    if (err != cudaSuccess) return err;
  }
  return launch_kernel(la::causal_conv1d_states_kernel<T>, dim3(static_cast<unsigned>(p.num_seqs), channel_blocks),
                       dim3(la::kConvThreads), 0, stream, p);
}

}  // namespace

cudaError_t launch_causal_conv1d(const CausalConv1dParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.dim == 0) return cudaSuccess;
  if (p.num_seqs < 0 || p.num_tokens < 0 || p.dim < 0 || p.width < kCausalConvMinWidth ||
      p.width > kCausalConvMaxWidth || p.x_row_stride < p.dim || p.num_tokens > 0x7fffffff ||
      p.num_seqs > 0x7fffffff || p.dim > (int64_t{65535} * 128))
    return cudaErrorInvalidValue;
  if (p.weight == nullptr || p.conv_states == nullptr || p.cu_seqlens == nullptr || p.state_indices == nullptr ||
      (p.num_tokens > 0 && (p.x == nullptr || p.out == nullptr)))
    return cudaErrorInvalidValue;
  switch (p.dtype) {
    case DType::kFloat32: return launch_typed<float>(p, stream);
    case DType::kFloat16: return launch_typed<__half>(p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fastinfer
