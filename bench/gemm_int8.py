#!/usr/bin/env python
"""Benchmark int8_scaled_mm against torch._int_mm (+ the same epilogue in torch) and bf16 torch.matmul
on Llama-3 linear shapes.

Shapes (N, K) of the linear layers of Llama-3-8B and -70B (qkv, o, gate_up, down; nn.Linear layout
b = [N, K]) at M in {1, 16, 64, 256, 4096}. For every shape, in the same run:

* ``fastinfer``        int8_scaled_mm, per-token x per-channel scales, bf16 out (int32 accumulation,
                       scales in the epilogue);
* ``torch_int_mm``     torch._int_mm (int32 out) followed by the same epilogue in torch
                       (``acc.float() * sa * sb`` -> bf16);
* ``torch_bf16``       torch.matmul in bf16 (what the int8 path replaces).

Reported: µs (median) and TOP/s (2 M N K / time); ``speedup_of_fastinfer`` = peer time / fastinfer
time. GPU goals: >= 1.0x torch_int_mm + epilogue, >= 1.6x bf16 at M >= 256. torch._int_mm
needs M > 16 on CUDA (a row marks the error otherwise). Without a GPU the script times the CPU
implementations on shapes scaled down by 16 in N and K (``--quick``: two shapes, M in {1, 16});
every such row is labelled CPU and says nothing about GPU performance.

    python bench/gemm_int8.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--threads N]

``--threads N`` sets torch's intra-op threads (CPU runs on a shared machine: with more threads than
free cores, OpenMP's barriers turn every call into scheduler quanta). The run loop, the CPU scaling
and the JSON are bench/timing.py's gemm_bench_main (shared with gemm_fp8.py).
"""

from __future__ import annotations

import torch

import fastinfer  # noqa: F401
from fastinfer import ops

from timing import gemm_bench_main

M_VALUES = [1, 16, 64, 256, 4096]


def make_case(m, n, k, device):
    g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    qa, sa = ops.int8_quantize(x, "token")
    qb, sb = ops.int8_quantize(w, "token")  # per output channel of the weight
    return dict(x=x, w=w, qa=qa, sa=sa, qb=qb, sb=sb, bt=qb.t())


def impls_for(c):
    sa_col, sb_row = c["sa"].view(-1, 1), c["sb"].view(1, -1)

    def int_mm(_):
        return (torch._int_mm(c["qa"], c["bt"]).float() * sa_col * sb_row).to(torch.bfloat16)

    return {
        "fastinfer": lambda _: ops.int8_scaled_mm(c["qa"], c["qb"], c["sa"], c["sb"], torch.bfloat16),
        "torch_int_mm": int_mm,
        "torch_bf16": lambda _: c["x"] @ c["w"].t(),
    }


def main(argv=None):
    return gemm_bench_main(argv, __doc__, kernel="int8_scaled_mm", metric="tops", unit="TOP/s", m_values=M_VALUES,
                           cpu_m_values=[1, 16, 64, 256], quick_gpu_m_values=[1, 256, 4096], make_case=make_case,
                           impls_for=impls_for)


if __name__ == "__main__":
    main()
