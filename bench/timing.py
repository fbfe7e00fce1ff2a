"""Timing helpers shared by the benchmarks in this folder (import as ``timing`` when a bench is run
as a script: its folder is then ``sys.path[0]``)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Optional

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn, sets, device, budget_s: float, reps: int, warmup: int) -> float:
    """Median per-call time in microseconds; call i uses input set i % len(sets)."""
    n = len(sets)
    for i in range(max(warmup, 1)):
        fn(sets[i % n])
    _sync(device)
    t0 = time.perf_counter()
    fn(sets[0])
    _sync(device)
    est = max(time.perf_counter() - t0, 1e-7)
    per_batch = int(max(1, min(1000, budget_s / reps / est)))
    samples = []
    k = 0
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_batch):
                fn(sets[k % n])
                k += 1
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / per_batch)
        else:
            t0 = time.perf_counter()
            for _ in range(per_batch):
                fn(sets[k % n])
                k += 1
            samples.append((time.perf_counter() - t0) * 1e6 / per_batch)
    return statistics.median(samples)


def device_label(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=here, stderr=subprocess.DEVNULL,
                                       text=True).strip()
    except Exception:
        return None


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a large device-to-device copy (GB/s)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_fn(lambda _: dst.copy_(src), [None], device, budget_s=0.5, reps=5, warmup=2)
    return 2 * n / (us * 1e-6) / 1e9


# ---- the W8A8 GEMM benchmarks (gemm_fp8.py, gemm_int8.py) ----------------------------------------
# (model, layer, N, K) of the Llama-3 linear layers: hidden 4096 / 8192, intermediate 14336 / 28672,
# 32 / 64 query heads, 8 KV heads, head dim 128.
LLAMA3_SHAPES = [
    ("8b", "qkv", 6144, 4096),
    ("8b", "o", 4096, 4096),
    ("8b", "gate_up", 28672, 4096),
    ("8b", "down", 4096, 14336),
    ("70b", "qkv", 10240, 8192),
    ("70b", "o", 8192, 8192),
    ("70b", "gate_up", 57344, 8192),
    ("70b", "down", 8192, 28672),
]


def gemm_bench_main(argv, doc, *, kernel, metric, unit, m_values, cpu_m_values, quick_gpu_m_values, make_case,
                    impls_for):
    """The run loop of a GEMM benchmark over LLAMA3_SHAPES x M: for each shape ``make_case(m, n, k,
    device)`` builds the operands and ``impls_for(case)`` gives {name: fn}, timed in that order; the
    first is fastinfer, the others get ``speedup_of_fastinfer`` (their time / fastinfer's). Each row
    carries ``metric`` (2 M N K / time / 1e12, printed as ``unit``). Without a GPU: shapes scaled
    down by 16 in N and K, M in ``cpu_m_values``, every row labelled CPU. Returns the rows."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two shapes, few M (CPU: the first two M)")
    p.add_argument("--json", default=None)
    p.add_argument("--deadline", type=float, default=None, help="stop starting new shapes after S seconds")
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per implementation and shape")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import fastinfer

    device = torch.device("cuda" if fastinfer.cuda_available() else "cpu")
    cpu = device.type == "cpu"
    reps = args.reps or (10 if not cpu else 3)
    budget = args.budget or (0.2 if not cpu else 0.05)
    deadline = time.perf_counter() + (args.deadline if args.deadline else 1e9)
    models = set(args.models.split(","))
    shapes = [s for s in LLAMA3_SHAPES if s[0] in models]
    if cpu:  # the CPU implementation on scaled-down shapes: plumbing and CPU-runner figures only
        shapes = [(mod, f"{layer}/16", n // 16, k // 16) for mod, layer, n, k in shapes]
        m_values = cpu_m_values
    if args.quick:
        shapes, m_values = shapes[:2], m_values[:2] if cpu else quick_gpu_m_values
    t0 = time.perf_counter()
    rows = []
    for model, layer, n, k in shapes:
        for m in m_values:
            if time.perf_counter() > deadline:
                break
            c = make_case(m, n, k, device)
            shape = f"llama3-{model} {layer} M={m} N={n} K={k}"
            base = None  # fastinfer's time (the first implementation), when it ran
            for i, (name, fn) in enumerate(impls_for(c).items()):
                try:
                    us = time_fn(fn, [None], device, budget_s=budget, reps=reps, warmup=2)
                    err = None
                except Exception as e:  # e.g. a torch peer without a kernel (or shape rule) for this device
                    us, err = None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                row = dict(kernel=kernel, impl=name, model=model, layer=layer, m=m, n=n, k=k, shape=shape,
                           device=device_label(device), cpu_only=cpu, us=us, error=err)
                if us:
                    row[metric] = 2.0 * m * n * k / (us * 1e-6) / 1e12
                    if i == 0:
                        base = us
                    elif base:
                        row["speedup_of_fastinfer"] = us / base
                rows.append(row)
                _print_gemm_row(row, metric, unit)
            del c
    label = "CPU figures only -- not a GPU measurement" if cpu else "GPU"
    print(f"{label}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(device), torch=torch.__version__, commit=git_commit(), cpu_only=cpu,
                           threads=torch.get_num_threads(), rows=rows), f, indent=1)
    return rows


def _print_gemm_row(r, metric, unit):
    dev = "CPU" if r["cpu_only"] else "GPU"
    us = f"{r['us']:.1f}" if r.get("us") else "error"
    value = f"{r[metric]:.3f} {unit}" if metric in r else (r.get("error") or "")
    sp = f"{r['speedup_of_fastinfer']:.2f}x" if r.get("speedup_of_fastinfer") else ""
    print(f"{dev:<4} {r['shape']:<36} {r['impl']:<16} {us:>11} us  {value:<40} {sp}", flush=True)
