"""Timing helpers shared by the benchmarks in this folder (import as ``timing`` when a bench is run
as a script: its folder is then ``sys.path[0]``)."""

from __future__ import annotations

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
