#!/usr/bin/env python
"""Benchmark dense_mm (the batch-invariant GEMM) against torch.matmul on Llama-3 linear shapes.

Shapes (N, K) of the Llama-3-8B and -70B linear layers (nn.Linear layout b = [N, K]) at M in
{1, 16, 256, 4096}, bf16 on a GPU. For every shape, in the same run:

* ``fastinfer``     dense_mm (mma.sync.m16n8k16, no split-K: a row's bits never depend on M);
* ``torch_matmul``  torch.matmul (cuBLAS: tiles and split-K chosen by M, not batch invariant).

Reported: µs (median) and TFLOP/s (2 M N K / time); ``cost_of_invariance`` = fastinfer time / torch
time (the price of the deterministic mode's float linears). Without a GPU the script times the CPU
implementations in float32 (the CPU runner's dtype; torch.matmul is MKL there) on shapes scaled
down by 8 in N and K, M in {1, 16, 256}; every such row is labelled CPU.

    python bench/gemm_dense.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--threads N]
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

M_VALUES = [1, 16, 256, 4096]


def make_case(m, n, k, device, dtype):
    g = torch.Generator().manual_seed(m * 31 + n * 7 + k)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=dtype)
    return x, w


def print_row(r):
    dev = "CPU" if r["cpu_only"] else "GPU"
    us = f"{r['us']:.1f}" if r.get("us") else "error"
    metric = f"{r['tflops'] * 1e3:.2f} GFLOP/s" if "tflops" in r else (r.get("error") or "")
    cost = f"{r['cost_of_invariance']:.2f}x" if r.get("cost_of_invariance") else ""
    print(f"{dev:<4} {r['shape']:<40} {r['impl']:<13} {us:>11} us  {metric:<22} {cost}", flush=True)


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
    dtype = torch.float32 if cpu else torch.bfloat16
    args.reps = args.reps or (10 if not cpu else 3)
    args.budget = args.budget or (0.2 if not cpu else 0.05)
    deadline = time.perf_counter() + (args.deadline if args.deadline else 1e9)
    shapes = [s for s in LLAMA3_SHAPES if s[0] in set(args.models.split(","))]
    m_values = M_VALUES
    if cpu:
        shapes = [(mod, f"{layer}/8", n // 8, k // 8) for mod, layer, n, k in shapes]
        m_values = [1, 16, 256]
    if args.quick:
        shapes, m_values = shapes[:2], m_values[:2] if cpu else [1, 256]
    t0 = time.perf_counter()
    rows = []
    for model, layer, n, k in shapes:
        for m in m_values:
            if time.perf_counter() > deadline:
                break
            x, w = make_case(m, n, k, device, dtype)
            shape = f"llama3-{model} {layer} M={m} N={n} K={k} {str(dtype).replace('torch.', '')}"
            times = {}
            for name, fn in (("fastinfer", lambda _: ops.dense_mm(x, w)), ("torch_matmul", lambda _: x @ w.t())):
                try:
                    us, err = time_fn(fn, [None], device, budget_s=args.budget, reps=args.reps, warmup=2), None
                except Exception as e:
                    us, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                row = dict(kernel="dense_mm", impl=name, model=model, layer=layer, m=m, n=n, k=k, shape=shape,
                           dtype=str(dtype), device=device_label(device), cpu_only=cpu, us=us, error=err)
                if us:
                    times[name] = us
                    row["tflops"] = 2.0 * m * n * k / (us * 1e-6) / 1e12
                    if name == "torch_matmul" and "fastinfer" in times:
                        row["cost_of_invariance"] = times["fastinfer"] / us
                rows.append(row)
                print_row(row)
    label = "CPU figures only -- not a GPU measurement" if cpu else "GPU"
    print(f"{label}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(device), torch=torch.__version__, commit=git_commit(), cpu_only=cpu,
                           threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
