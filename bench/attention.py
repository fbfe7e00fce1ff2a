#!/usr/bin/env python
"""Benchmark the attention ops against their peers and the memory roofline.

Decode (``paged_decode_attention``): B in {1, 16, 64, 256}, context {512, 4096, 32768}, Hq/Hkv
{32/8, 32/32}, D 128, BS 16, bf16. Reported: µs, effective GB/s of KV read (K and V bytes of all
sequences, read once), and that figure as a fraction of the device's measured copy bandwidth
(a large device-to-device copy, counting bytes read + written). Peers when importable:
flashinfer (``BatchDecodeWithPagedKVCacheWrapper``), flash-attn (``flash_attn_with_kvcache``),
and torch SDPA on the same K/V gathered dense (what an engine without paged kernels runs; the
gather itself is not timed).

Prefill (``prefill_attention``): one sequence of 1k..16k tokens, Hq = Hkv = 32 (and 32/8), causal
and not, D 64/128: TFLOP/s (causal counts the visible half) vs torch SDPA (flash backend) and
flash-attn's ``flash_attn_varlen_func`` when importable.

On CPU the same script times the CPU implementations on small shapes; every row is labelled CPU
there and says nothing about GPU performance.

    python bench/attention.py [--quick] [--json PATH] [--deadline SECONDS] [--only decode|prefill]
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


def _peer(name):
    try:
        return __import__(name)
    except Exception:
        return None



def make_decode_case(b, ctx, hq, hkv, d, bs, device, dtype=torch.bfloat16):
    blocks_per_seq = math.ceil(ctx / bs)
    nb = b * blocks_per_seq
    k_cache = torch.randn(nb, bs, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(nb, bs, hkv, d, dtype=dtype, device=device)
    table = torch.randperm(nb, device=device).to(torch.int32).view(b, blocks_per_seq)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    return q, k_cache, v_cache, table, lens


def bench_decode(args, device, copy_gbps, rows, deadline):
    batches = [1, 16, 64, 256] if device.type == "cuda" else [1, 4]
    contexts = [512, 4096, 32768] if device.type == "cuda" else [512, 2048]
    heads = [(32, 8), (32, 32)] if device.type == "cuda" else [(32, 8)]
    if args.quick:
        batches, contexts = batches[:2] if device.type != "cuda" else [1, 64], contexts[:2]
    d, bs = 128, 16
    for hq, hkv in heads:
        for b in batches:
            for ctx in contexts:
                if time.perf_counter() > deadline:
                    return
                kv_bytes = 2 * b * ctx * hkv * d * 2
                if device.type == "cuda" and kv_bytes > 40e9:
                    continue
                q, kc, vc, table, lens = make_decode_case(b, ctx, hq, hkv, d, bs, device)
                shape = f"B={b} ctx={ctx} Hq/Hkv={hq}/{hkv} D={d} BS={bs}"
                impls = {"fastinfer": lambda _: ops.paged_decode_attention(q, kc, vc, table, lens)}
                # dense SDPA on pre-gathered K/V: [B, H, ctx, D]
                if device.type == "cuda" or b * ctx <= 8192:
                    kd = kc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2)
                    vd = vc[table.long()].reshape(b, -1, hkv, d)[:, :ctx].transpose(1, 2)
                    qd = q.unsqueeze(2)
                    impls["torch_sdpa"] = lambda _: torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, enable_gqa=hq != hkv)
                fa = _peer("flash_attn")
                if fa is not None and device.type == "cuda":
                    impls["flash_attn"] = lambda _: fa.flash_attn_with_kvcache(
                        q.unsqueeze(1), kc, vc, cache_seqlens=lens, block_table=table)
                base = None
                for name, fn in impls.items():
                    try:
                        us = time_fn(fn, [None], device, budget_s=args.budget, reps=args.reps, warmup=2)
                        err = None
                    except Exception as e:  # a peer that rejects the shape
                        us, err = None, f"{type(e).__name__}: {str(e)[:80]}"
                    row = dict(kernel="decode", impl=name, shape=shape, device=device_label(device), us=us, error=err)
                    if us:
                        row["kv_gbps"] = kv_bytes / (us * 1e-6) / 1e9
                        row["fraction_of_copy_bw"] = row["kv_gbps"] / copy_gbps
                        if name == "fastinfer":
                            base = us
                        elif base:
                            row["speedup_of_fastinfer"] = us / base
                    rows.append(row)
                    print_row(row)
                del q, kc, vc, table, lens, impls
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def bench_prefill(args, device, rows, deadline):
    lengths = [1024, 4096, 8192, 16384] if device.type == "cuda" else [256, 512]
    if args.quick:
        lengths = lengths[:2]
    configs = [(32, 32, 128), (32, 8, 128), (32, 32, 64)] if device.type == "cuda" else [(8, 8, 128)]
    for hq, hkv, d in configs:
        for t in lengths:
            for causal in (True, False):
                if time.perf_counter() > deadline:
                    return
                q = torch.randn(t, hq, d, dtype=torch.bfloat16, device=device)
                k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=device)
                v = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=device)
                cu = torch.tensor([0, t], dtype=torch.int32, device=device)
                flops = 4 * hq * d * (t * (t + 1) / 2 if causal else t * t)
                shape = f"T={t} Hq/Hkv={hq}/{hkv} D={d} {'causal' if causal else 'full'}"
                impls = {"fastinfer": lambda _: ops.prefill_attention(q, k, v, cu, cu, t, t, causal=causal)}
                qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                impls["torch_sdpa"] = lambda _: torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=causal, enable_gqa=hq != hkv)
                fa = _peer("flash_attn")
                if fa is not None and device.type == "cuda":
                    impls["flash_attn"] = lambda _: fa.flash_attn_varlen_func(q, k, v, cu, cu, t, t, causal=causal)
                base = None
                for name, fn in impls.items():
                    try:
                        us = time_fn(fn, [None], device, budget_s=args.budget, reps=args.reps, warmup=2)
                        err = None
                    except Exception as e:
                        us, err = None, f"{type(e).__name__}: {str(e)[:80]}"
                    row = dict(kernel="prefill", impl=name, shape=shape, device=device_label(device), us=us, error=err)
                    if us:
                        row["tflops"] = flops / (us * 1e-6) / 1e12
                        if name == "fastinfer":
                            base = us
                        elif base:
                            row["speedup_of_fastinfer"] = us / base
                    rows.append(row)
                    print_row(row)


def print_row(r):
    dev = "CPU" if r["device"].startswith("CPU") else "GPU"
    us = f"{r['us']:.1f}" if r.get("us") else "error"
    metric = (f"{r['kv_gbps']:.1f} GB/s ({r['fraction_of_copy_bw']:.2f} of copy)" if "kv_gbps" in r
              else f"{r['tflops']:.2f} TFLOP/s" if "tflops" in r else r.get("error") or "")
    sp = f"{r['speedup_of_fastinfer']:.2f}x" if r.get("speedup_of_fastinfer") else ""
    print(f"{dev:<4} {r['kernel']:<8} {r['shape']:<42} {r['impl']:<11} {us:>10} us  {metric:<32} {sp}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--deadline", type=float, default=None, help="stop starting new cases after S seconds")
    p.add_argument("--only", choices=["decode", "prefill"], default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per implementation and shape")
    args = p.parse_args(argv)
    device = torch.device("cuda" if fastinfer.cuda_available() else "cpu")
    args.reps = args.reps or (10 if device.type == "cuda" else 3)
    args.budget = args.budget or (0.2 if device.type == "cuda" else 0.05)
    deadline = time.perf_counter() + (args.deadline if args.deadline else 1e9)
    t0 = time.perf_counter()
    copy_gbps = copy_bandwidth(device)
    print(f"{device_label(device)}: measured copy bandwidth {copy_gbps:.0f} GB/s (read + write)")
    rows = []
    if args.only in (None, "decode"):
        bench_decode(args, device, copy_gbps, rows, deadline)
    if args.only in (None, "prefill"):
        bench_prefill(args, device, rows, deadline)
    label = "CPU figures only -- not a GPU measurement" if device.type == "cpu" else "GPU"
    print(f"{label}; {time.perf_counter() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=device_label(device), torch=torch.__version__, commit=git_commit(),
                           copy_gbps=copy_gbps, cpu_only=device.type == "cpu", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
