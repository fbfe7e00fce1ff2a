#!/usr/bin/env python
"""Benchmark fp8_scaled_mm against torch._scaled_mm (cuBLASLt) on Llama-3 linear shapes.

Shapes (N, K) of the linear layers of Llama-3-8B and -70B (qkv, o, gate_up, down; nn.Linear layout
b = [N, K]) at M in {1, 4, 16, 64, 256, 4096}. For every shape, in the same run:

* ``fastinfer``        fp8_scaled_mm, per-token x per-channel scales, bf16 out;
* ``torch_scaled_mm``  torch._scaled_mm with the same operands and row-wise scales (cuBLASLt);
* ``fastinfer_block``  fp8_scaled_mm with blockwise scales (1x128 for a, 128x128 for b);
* ``torch_bf16``       torch.matmul in bf16 (what the fp8 path replaces).

Reported: µs (median) and TFLOP/s (2 M N K / time); ``speedup_of_fastinfer`` = peer time /
fastinfer time. Without a GPU the script times the CPU implementations on shapes scaled down by
16 in N and K (``--quick``: two shapes, M in {1, 16}); every such row is labelled CPU and says
nothing about GPU performance.

    python bench/gemm_fp8.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--threads N]

The run loop, the CPU scaling and the JSON are bench/timing.py's gemm_bench_main (shared with gemm_int8.py).
"""

from __future__ import annotations

import torch

import fastinfer  # noqa: F401
from fastinfer import ops

from timing import gemm_bench_main

M_VALUES = [1, 4, 16, 64, 256, 4096]


def make_case(m, n, k, device):
    g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
    qa, sa = ops.fp8_quantize(x, "token")
    qb, sb = ops.fp8_quantize(w, "token")  # per output channel of the weight
    ga, gsa = ops.fp8_quantize(x, "group", 128)
    qbb = qb  # blockwise weight scales: the per-channel ones reduced to 128 x 128 blocks (values irrelevant here)
    gsb = sb.view(-1)[: ((n + 127) // 128) * 128 : 128].reshape(-1, 1).expand(-1, (k + 127) // 128).contiguous()
    return dict(x=x, w=w, qa=qa, sa=sa, qb=qb, sb=sb, ga=ga, gsa=gsa, qbb=qbb, gsb=gsb)


def impls_for(c):
    sa_col, sb_row = c["sa"].view(-1, 1), c["sb"].view(1, -1)
    bt = c["qb"].t()  # [K, N] column-major, what _scaled_mm wants

    def scaled_mm(_):
        return torch._scaled_mm(c["qa"], bt, scale_a=sa_col, scale_b=sb_row, out_dtype=torch.bfloat16)

    return {
        "fastinfer": lambda _: ops.fp8_scaled_mm(c["qa"], c["qb"], c["sa"], c["sb"], torch.bfloat16),
        "torch_scaled_mm": scaled_mm,
        "fastinfer_block": lambda _: ops.fp8_scaled_mm(c["ga"], c["qbb"], c["gsa"], c["gsb"], torch.bfloat16),
        "torch_bf16": lambda _: c["x"] @ c["w"].t(),
    }


def main(argv=None):
    return gemm_bench_main(argv, __doc__, kernel="fp8_scaled_mm", metric="tflops", unit="TFLOP/s", m_values=M_VALUES,
                           cpu_m_values=[1, 16, 64], quick_gpu_m_values=[1, 64, 4096], make_case=make_case,
                           impls_for=impls_for)


if __name__ == "__main__":
    main()
