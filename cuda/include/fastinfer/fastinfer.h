#pragma once
// fastinfer's C++ API: torch-free launchers, each taking a Params struct and a stream and
// returning cudaError_t. Link fastinfer::kernels (GPU) or fastinfer::kernels_simt (CPU emulator).
#include "fastinfer/activation/gated.h"
#include "fastinfer/attention/attention.h"
#include "fastinfer/cache/reshape_and_cache.h"
#include "fastinfer/common/types.h"
#include "fastinfer/gemm/dense.h"
#include "fastinfer/gemm/fp8.h"
#include "fastinfer/gemm/int4.h"
#include "fastinfer/gemm/int8.h"
#include "fastinfer/gemm/w8a8_sm90.h"
#include "fastinfer/moe/fused_moe.h"
#include "fastinfer/moe/routing.h"
#include "fastinfer/norm/rms_norm.h"
#include "fastinfer/rope/rotary_embedding.h"
#include "fastinfer/sampling/token_bitmask.h"
#include "fastinfer/speculative/tree_verify.h"
