#!/usr/bin/env python
"""Run one fastinfer op in a loop, for Nsight Systems / Nsight Compute sessions.

The inputs are the Llama-3-8B-like shapes of ``bench/ops.py`` (hidden 4096, F 14336, Hq 32,
Hkv 8, D 128, BS 16); ``--tokens`` picks T. On CUDA every iteration is wrapped in an NVTX range
``fastinfer.<op>[i]`` (plus ``warmup`` / ``timed`` ranges around the phases) and the script ends
with ``torch.cuda.synchronize()``; the mean time per iteration is printed.

Usage::

    # timeline: kernels + NVTX ranges
    nsys profile -t cuda,nvtx -o rms_norm python bench/profile_op.py rms_norm --tokens 4096
    # all metrics of 3 launches of the kernel(s) whose name matches
    ncu --set full -k regex:rms_norm -o rms_norm python bench/profile_op.py rms_norm --iters 3 --warmup 0
    # only the timed phase of an nsys capture
    nsys profile -t cuda,nvtx --capture-range=nvtx --nvtx-capture=timed \\
        python bench/profile_op.py silu_and_mul --tokens 512 --iters 200
    # the torch eager implementation instead (to profile the peer)
    python bench/profile_op.py rotary_embedding --impl torch

OP is one of: rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding, reshape_and_cache.
Runs on CPU too (``--device cpu``), which is only useful to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import ops as bench_ops


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("op", choices=bench_ops.ALL_OPS)
    p.add_argument("--tokens", "--shape", dest="tokens", type=int, default=512, help="T (number of tokens)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--impl", default="fastinfer", choices=["fastinfer", "torch"])
    p.add_argument("--copies", type=int, default=1, help="rotating input sets (1: same buffers, L2-warm)")
    args = p.parse_args(argv)

    import fastinfer  # noqa: F401

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    case = bench_ops.make_case(args.op, args.tokens, dtype, device)
    sets = [case.make_set() for _ in range(max(1, args.copies))]
    fn = case.impls[args.impl]
    cuda = device.type == "cuda"

    def rng(name):
        if cuda:
            return torch.cuda.nvtx.range(name)
        return contextlib.nullcontext()

    with rng("warmup"):
        for i in range(args.warmup):
            fn(sets[i % len(sets)])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with rng("timed"):
        for i in range(args.iters):
            with rng(f"fastinfer.{args.op}[{i}]" if args.impl == "fastinfer" else f"torch.{args.op}[{i}]"):
                fn(sets[i % len(sets)])
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / max(1, args.iters)
    label = bench_ops.device_label(device)
    print(f"{args.impl} {args.op} {case.shape} {args.dtype} on {label}: {dt * 1e6:.2f} us/iter "
          f"(wall clock incl. NVTX overhead; {case.nbytes / dt / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
