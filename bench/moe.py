#!/usr/bin/env python
"""Benchmark fused_moe's CPU implementation against a torch loop over the experts.

Two scaled-down MoE layers, routed by moe_topk on random logits, at T in {1, 16, 256} tokens:

* ``mixtral-like``  H 1024, I 896 (Mixtral-8x7B's 4096 / 14336 scaled by 4 / 16), E 8, k 2;
* ``qwen3-moe-like`` H 512, I 192 (Qwen3-30B-A3B's 2048 / 768 scaled by 4), E 128, k 8.

For every case, in the same run:

* ``fastinfer``   fused_moe (slots grouped by expert, the batch-invariant GEMM per expert);
* ``torch_loop``  per used expert: F.linear over its tokens (MKL), silu * up, F.linear, then
  index_add of the weighted rows (transformers' MixtralExperts.forward).

Reported: µs per call (median), tokens/s, and ``speedup_of_fastinfer`` on the torch row (torch
time / fastinfer time). CPU: every row is labelled CPU (the CUDA kernels' figures are bench/model.py's).

    python bench/moe.py [--dtype float32|bfloat16] [--threads N] [--budget SECONDS] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer import ops

from timing import device_label, git_commit, time_fn

# (name, hidden, intermediate, experts, top_k, renormalize)
SHAPES = [
    ("mixtral-like", 1024, 896, 8, 2, True),
    ("qwen3-moe-like", 512, 192, 128, 8, True),
]
TOKENS = [1, 16, 256]


def make_layer(H, I, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    return w13, w2


def make_tokens(T, H, E, k, renormalize, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    weights, ids = ops.moe_topk(torch.randn(T, E, generator=g), k, renormalize)
    return x, weights, ids


def torch_loop(x, w13, w2, weights, ids):
    I = w13.shape[1] // 2
    out = torch.zeros_like(x)
    ids = ids.long()
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tokens], w13[e])
        y = F.linear(F.silu(h[:, :I]) * h[:, I:], w2[e])
        out.index_add_(0, tokens, y * weights[tokens, slots, None].to(x.dtype))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--budget", type=float, default=1.5, help="timing seconds per impl and case")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")
    label = device_label(device)
    rows = []
    print(f"fused_moe vs a torch loop over the experts, {args.dtype}, {label}")
    print(f"{'shape':<16} {'T':>4} {'impl':<11} {'us':>11} {'tokens/s':>11} {'speedup':>8}")
    for si, (name, H, I, E, k, renormalize) in enumerate(SHAPES):
        w13, w2 = make_layer(H, I, E, dtype, seed=si)
        for T in TOKENS:
            x, weights, ids = make_tokens(T, H, E, k, renormalize, dtype, seed=T)
            impls = {"fastinfer": lambda _: ops.fused_moe(x, w13, w2, weights, ids),
                     "torch_loop": lambda _: torch_loop(x, w13, w2, weights, ids)}
            scale = x.float().abs().max().item() + 1e-30
            diff = (impls["fastinfer"](None).float() - impls["torch_loop"](None).float()).abs().max().item()
            times = {}
            for impl, fn in impls.items():
                times[impl] = time_fn(fn, [None], device, budget_s=args.budget, reps=5, warmup=2)
                row = {"kernel": "fused_moe", "impl": impl, "shape": name, "tokens": T, "hidden": H,
                       "intermediate": I, "experts": E, "top_k": k, "dtype": args.dtype, "device": label,
                       "cpu_only": True, "us": times[impl], "tokens_per_s": T / (times[impl] * 1e-6),
                       "max_abs_diff_vs_torch_loop": diff if impl == "fastinfer" else None}
                if impl == "torch_loop":
                    row["speedup_of_fastinfer"] = times["torch_loop"] / times["fastinfer"]
                rows.append(row)
                speed = f"{row['speedup_of_fastinfer']:.2f}x" if impl == "torch_loop" else ""
                print(f"{name:<16} {T:>4} {impl:<11} {row['us']:>11.1f} {row['tokens_per_s']:>11.1f} {speed:>8}")
            print(f"{'':<16} {'':>4} max |fastinfer - torch_loop| = {diff:.2e} (max |x| {scale:.2f})")
            sys.stdout.flush()
    if args.json:
        result = {"device": label, "torch": torch.__version__, "commit": git_commit(), "cpu_only": True,
                  "threads": torch.get_num_threads(), "dtype": args.dtype, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
