#!/usr/bin/env python
"""Benchmark int4_gemm (W4A16) against bf16 torch.matmul and the memory roofline.

Shapes: the linear layers of Llama-3-8B and Llama-3-70B (fused qkv, o, fused gate_up, down;
out = a[M, K] @ W[N, K].T) at M in {1, 4, 16, 64, 256, 4096}, group size 128, symmetric,
bf16 activations. Reported per case: µs of int4_gemm and of torch.matmul on the bf16 weight,
their ratio (``speedup`` = bf16 time / int4 time; docs/design.md's goal is >= 3.7x at M = 1..16),
the effective GB/s of int4_gemm (packed weight + scales + a + out bytes, each read or written
once) and that as a fraction of the measured copy bandwidth, and which int4 path ran (the fused
kernel, or dequantise + dense for M >= 512; FASTINFER_TEST_INT4_DENSE_MIN_M changes the threshold).
Weights rotate over enough copies to exceed the L2 cache, so small layers are not timed from L2.
Marlin (``marlin`` package, fp16 only) is timed too when importable.

On CPU the same script times the CPU implementation on the first shapes only (--quick: one
shape scaled down); every row is labelled CPU there and says nothing about GPU performance.

    python bench/gemm_int4.py [--quick] [--json PATH] [--deadline SECONDS] [--models 8b,70b] [--m 1,16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

import fastinfer  # noqa: F401
from fastinfer import ops

from timing import copy_bandwidth, device_label, git_commit, time_fn

# (model, layer, N, K)
SHAPES = {
    "8b": [("llama3-8b", "qkv", 6144, 4096), ("llama3-8b", "o", 4096, 4096),
           ("llama3-8b", "gate_up", 28672, 4096), ("llama3-8b", "down", 4096, 14336)],
    "70b": [("llama3-70b", "qkv", 10240, 8192), ("llama3-70b", "o", 8192, 8192),
            ("llama3-70b", "gate_up", 57344, 8192), ("llama3-70b", "down", 8192, 28672)],
}
M_VALUES = (1, 4, 16, 64, 256, 4096)
GROUP = 128



def dense_min_m() -> int:
    try:
        v = int(os.environ.get("FASTINFER_TEST_INT4_DENSE_MIN_M", "512"))
        return v if v > 0 else 512
    except ValueError:
        return 512


def make_weight(n, k, device, dtype):
    """A random symmetric int4 weight in the kernel layout and its bf16 (dequantised) twin."""
    w_q = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device)
    scales = (torch.rand(k // GROUP, n, device=device) * 0.01 + 0.001).to(dtype)
    packed = ops.int4_pack(w_q)
    w = ((w_q.to(torch.float32) - 8) * scales.to(torch.float32).repeat_interleave(GROUP, 0).t()).to(dtype)
    return w_q, packed, scales, w


def try_marlin(m, n, k, device, sets_n):
    """Marlin's fp16 kernel on the same shape, when the `marlin` package imports; else None."""
    try:
        import marlin  # type: ignore
    except Exception:
        return None
    try:
        layers = []
        for _ in range(min(sets_n, 2)):  # Layer.pack runs on the host (numpy): keep it to two copies
            layer = marlin.Layer(k, n, groupsize=GROUP)
            lin = torch.nn.Linear(k, n, bias=False).half()
            s = torch.rand(n, k // GROUP, dtype=torch.half) * 0.01 + 0.001  # [outfeatures, groups]
            layer.pack(lin, s)
            layers.append(layer.to(device))
        a = torch.randn(1, m, k, dtype=torch.half, device=device)
        return lambda i: layers[i](a), list(range(len(layers)))
    except Exception as e:  # pragma: no cover - depends on the install
        print(f"marlin unavailable for {m}x{n}x{k}: {type(e).__name__}: {e}")
        return None


def bench(args, device, copy_gbps, rows, deadline):
    dtype = torch.bfloat16
    shapes = [s for key in args.models for s in SHAPES[key]]
    m_values = args.m or M_VALUES
    if device.type == "cpu":
        shapes = shapes[:1]
        if args.quick:
            shapes = [(model, layer + "/8", n // 8, k // 8) for model, layer, n, k in shapes]
        m_values = [m for m in m_values if m <= 16] or [1]
    elif args.quick:
        shapes = shapes[:2]
        m_values = [m for m in m_values if m in (1, 16, 256)]
    threshold = dense_min_m()
    # Decode sizes first across every shape, so that a --deadline cut keeps the cases that matter most.
    priority = [m for m in (1, 16, 4, 64, 256, 4096) if m in m_values] + [m for m in m_values
                                                                       if m not in (1, 16, 4, 64, 256, 4096)]
    cache = {}
    for m in priority:
        for model, layer, n, k in shapes:
            if time.perf_counter() > deadline:
                print("deadline reached; skipping the remaining cases")
                return
            weight_bytes = n * k // 2 + (k // GROUP) * n * 2
            # enough copies that one rotation exceeds ~2x a 64 MB L2 (GPU); 1 on CPU
            sets_n = 1 if device.type == "cpu" else max(1, min(8, math.ceil(128e6 / weight_bytes)))
            if (n, k) not in cache:
                cache[(n, k)] = [make_weight(n, k, device, dtype) for _ in range(sets_n)]
            weights = cache[(n, k)]
            a = torch.randn(m, k, dtype=dtype, device=device)
            shape = f"{model} {layer} M={m} N={n} K={k}"
            row = dict(device=device_label(device), shape=shape, model=model, layer=layer, m=m, n=n, k=k,
                       group_size=GROUP, path="dense" if m >= threshold else "kernel")
            try:
                t_int4 = time_fn(lambda i: ops.int4_gemm(a, weights[i][1], weights[i][2], None, GROUP),
                                 list(range(sets_n)), device, budget_s=args.budget, reps=args.reps, warmup=2)
                t_bf16 = time_fn(lambda i: torch.matmul(a, weights[i][3].t()), list(range(sets_n)), device,
                                 budget_s=args.budget, reps=args.reps, warmup=2)
                moved = weight_bytes + m * k * 2 + m * n * 2
                row.update(us_int4=t_int4, us_bf16=t_bf16, speedup_vs_bf16=t_bf16 / t_int4,
                           int4_gbps=moved / (t_int4 * 1e-6) / 1e9)
                row["fraction_of_copy_bw"] = row["int4_gbps"] / copy_gbps
                mar = try_marlin(m, n, k, device, sets_n) if device.type == "cuda" else None
                if mar is not None:
                    fn, sets = mar
                    row["us_marlin_fp16"] = time_fn(fn, sets, device, budget_s=args.budget, reps=args.reps, warmup=2)
            except Exception as e:  # keep going: one failing shape must not hide the others
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print_row(row)


def print_row(r):
    dev = "CPU" if r["device"].startswith("CPU") else "GPU"
    if "error" in r:
        print(f"{dev:<4} {r['shape']:<44} error: {r['error']}", flush=True)
        return
    mar = f"  marlin {r['us_marlin_fp16']:.1f} us" if "us_marlin_fp16" in r else ""
    print(f"{dev:<4} {r['shape']:<44} {r['path']:<6} int4 {r['us_int4']:>10.1f} us  bf16 {r['us_bf16']:>10.1f} us  "
          f"{r['speedup_vs_bf16']:5.2f}x  {r['int4_gbps']:8.1f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy){mar}",
          flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few shapes only (on CPU: one shape scaled down by 8)")
    p.add_argument("--json", default=None)
    p.add_argument("--deadline", type=float, default=None, help="stop starting new cases after S seconds")
    p.add_argument("--models", default="8b,70b", help="comma list of 8b, 70b")
    p.add_argument("--m", default=None, help="comma list of M values (default 1,4,16,64,256,4096)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per implementation and shape")
    args = p.parse_args(argv)
    args.models = [s.strip() for s in args.models.split(",") if s.strip()]
    args.m = [int(x) for x in args.m.split(",")] if args.m else None
    device = torch.device("cuda" if fastinfer.cuda_available() else "cpu")
    args.reps = args.reps or (10 if device.type == "cuda" else 3)
    args.budget = args.budget or (0.2 if device.type == "cuda" else 0.05)
    deadline = time.perf_counter() + (args.deadline if args.deadline else 1e9)
    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth(device)
    print(f"{device_label(device)}: measured copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    bench(args, device, copy_gbps, rows, deadline)
    label = "CPU figures only -- not a GPU measurement" if device.type == "cpu" else "GPU"
    print(f"{label}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(device), torch=torch.__version__, commit=git_commit(),
                           copy_gbps=copy_gbps, cpu_only=device.type == "cpu", dense_min_m=dense_min_m(),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
