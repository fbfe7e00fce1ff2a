// THE op catalogue: the schemas of every family (each family's contract.h: define_<family>_ops),
// registered in one place. Compiled into fastinfer._C as namespace `fastinfer` and into
// fastinfer._sim / fastinfer._simprof as `fastinfer_sim` / `fastinfer_simprof` (same schemas; the
// sim namespaces run the CUDA kernels on CPU tensors through cpp/simt). The fake impls (output
// shapes for torch.compile and opcheck) are Python, next to each op's wrapper
// (python/fastinfer/ops/<family>.py).
#include "elementwise/contract.h"
#include "attention/contract.h"
#include "gemm_dense/contract.h"
#include "gemm_fp8/contract.h"
#include "gemm_int8/contract.h"
#include "gemm_int4/contract.h"
#include "gemm_fp4/contract.h"
#include "linear_attention/contract.h"
#include "speculative/contract.h"
#include "sampling/contract.h"
#include "moe/contract.h"

FASTINFER_LIBRARY(m) {
  using namespace fastinfer::binding;
  define_elementwise_ops(m);
  define_attention_ops(m);
  define_gemm_dense_ops(m);
  define_gemm_fp8_ops(m);
  define_gemm_int8_ops(m);
  define_gemm_int4_ops(m);
  define_gemm_fp4_ops(m);
  define_linear_attention_ops(m);
  define_speculative_ops(m);
  define_sampling_ops(m);
  define_moe_ops(m);
}
