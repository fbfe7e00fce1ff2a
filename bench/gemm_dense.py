#!/usr/bin/env python
"""Benchmark dense_mm (the batch-invariant GEMM) against torch.matmul on Llama-3 linear shapes.

Shapes (N, K) of the Llama-3-8B and -70B linear layers (nn.Linear layout b = [N, K]) at M in
{1, 16, 256, 4096}, bf16 on a GPU. For every shape, in the same run:

* ``fastinfer``     dense_mm (mma.sync.m16n8k16, no split-K: a row's bits never depend on M);
* ``torch_matmul``  torch.matmul (cuBLAS: tiles and split-K chosen by M, not batch invariant).

Reported: µs (median) and TFLOP/s (2 M N K / time); ``speedup_of_fastinfer`` on the torch row =
torch time / fastinfer time (below 1: the price of the deterministic mode's float linears). Without a
GPU the script times the CPU implementations in float32 (the CPU runner's dtype; torch.matmul is MKL
there) on shapes scaled down by 16 in N and K, M in {1, 16, 256}; every such row is labelled CPU.
The run loop and the JSON are bench/timing.py's gemm_bench_main (shared with gemm_fp8.py, gemm_int8.py).

    python bench/gemm_dense.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--threads N]
"""

from __future__ import annotations

import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer import ops

from timing import gemm_bench_main

M_VALUES = [1, 16, 256, 4096]


def make_case(m, n, k, device):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dtype)
    return x, w


def impls_for(case):
    x, w = case
    return {"fastinfer": lambda _: ops.dense_mm(x, w), "torch_matmul": lambda _: x @ w.t()}


def main(argv=None):
    return gemm_bench_main(argv, __doc__, kernel="dense_mm", metric="tflops", unit="TFLOP/s", m_values=M_VALUES,
                           cpu_m_values=[1, 16, 256], quick_gpu_m_values=[1, 256], make_case=make_case,
                           impls_for=impls_for)


if __name__ == "__main__":
    main()
