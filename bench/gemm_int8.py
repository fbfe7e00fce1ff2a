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
time. GPU goals (issue 16): >= 1.0x torch_int_mm + epilogue, >= 1.6x bf16 at M >= 256. torch._int_mm
needs M > 16 on CUDA (a row marks the error otherwise). Without a GPU the script times the CPU
implementations on shapes scaled down by 16 in N and K (``--quick``: two shapes, M in {1, 16});
every such row is labelled CPU and says nothing about GPU performance.

    python bench/gemm_int8.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--threads N]

``--threads N`` sets torch's intra-op threads (CPU runs on a shared machine: with more threads than
free cores, OpenMP's barriers turn every call into scheduler quanta).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fastinfer  # noqa: F401
from fastinfer import ops

from gemm_fp8 import LLAMA3_SHAPES
from timing import device_label, git_commit, time_fn

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


def print_row(r):
    dev = "CPU" if r["device"].startswith("CPU") else "GPU"
    us = f"{r['us']:.1f}" if r.get("us") else "error"
    metric = f"{r['tops']:.3f} TOP/s" if "tops" in r else (r.get("error") or "")
    sp = f"{r['speedup_of_fastinfer']:.2f}x" if r.get("speedup_of_fastinfer") else ""
    print(f"{dev:<4} {r['shape']:<36} {r['impl']:<14} {us:>11} us  {metric:<40} {sp}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--deadline", type=float, default=None, help="stop starting new shapes after S seconds")
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per implementation and shape")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if fastinfer.cuda_available() else "cpu")
    cpu = device.type == "cpu"
    args.reps = args.reps or (10 if not cpu else 3)
    args.budget = args.budget or (0.2 if not cpu else 0.05)
    deadline = time.perf_counter() + (args.deadline if args.deadline else 1e9)
    models = set(args.models.split(","))
    shapes = [s for s in LLAMA3_SHAPES if s[0] in models]
    m_values = M_VALUES
    if cpu:  # the CPU implementation on scaled-down shapes: plumbing and CPU-runner figures only
        shapes = [(mod, f"{layer}/16", n // 16, k // 16) for mod, layer, n, k in shapes]
        m_values = [1, 16, 64, 256]
    if args.quick:
        shapes, m_values = shapes[:2], m_values[:2] if cpu else [1, 256, 4096]
    t0 = time.perf_counter()
    rows = []
    for model, layer, n, k in shapes:
        for m in m_values:
            if time.perf_counter() > deadline:
                break
            c = make_case(m, n, k, device)
            ops_count = 2.0 * m * n * k
            shape = f"llama3-{model} {layer} M={m} N={n} K={k}"
            base = None
            for name, fn in impls_for(c).items():
                try:
                    us = time_fn(fn, [None], device, budget_s=args.budget, reps=args.reps, warmup=2)
                    err = None
                except Exception as e:  # e.g. torch._int_mm's shape rules on CUDA
                    us, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                row = dict(kernel="int8_scaled_mm", impl=name, model=model, layer=layer, m=m, n=n, k=k, shape=shape,
                           device=device_label(device), cpu_only=cpu, us=us, error=err)
                if us:
                    row["tops"] = ops_count / (us * 1e-6) / 1e12
                    if name == "fastinfer":
                        base = us
                    elif base:
                        row["speedup_of_fastinfer"] = us / base
                rows.append(row)
                print_row(row)
            del c
    label = "CPU figures only -- not a GPU measurement" if cpu else "GPU"
    print(f"{label}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(device), torch=torch.__version__, commit=git_commit(), cpu_only=cpu,
                           threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
