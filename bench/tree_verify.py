#!/usr/bin/env python
"""Benchmark tree_verify against reading the visited nodes' logits once.

For each shape (B in {1, 16, 64}, N in {8, 64}, V = 128256, bf16 logits) and mode (greedy,
sampling with deterministic candidates, sampling with draft probabilities), the op runs on a
random tree whose draft tokens are the target's likely tokens (so walks go deep). The baseline is
``rows.amax(-1)`` over a contiguous [R, V] tensor with R = the number of nodes the walks visited
(sum over sequences of num_accepted + 1): the time to read those logits once with a tuned torch
reduction. Reported: µs of the op, µs of the baseline, their ratio (goal <= 1.2 on the GPU), and
the op's effective GB/s over the visited logits' bytes. With draft probabilities the op must
also read q (fp32) at every node that rejects, so its ratio there is not comparable to 1.2.

On CPU (``--quick`` or no GPU) the CPU implementation is timed on smaller shapes; every row is
labelled CPU and says nothing about GPU performance.

    python bench/tree_verify.py [--quick] [--json PATH] [--deadline SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import fastinfer  # noqa: F401
from fastinfer.reference.attention import random_tree_parents

from timing import device_label, git_commit, time_fn


def make_case(B, N, V, mode, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, N, V, generator=g).mul_(3).to(torch.bfloat16)
    parents = torch.empty(B, N, dtype=torch.int64)
    tokens = torch.empty(B, N, dtype=torch.int64)
    top = logits.float().argmax(-1)  # [B, N]
    for b in range(B):
        par = random_tree_parents(N, g)
        parents[b] = torch.tensor(par)
        seen = set()
        for c in range(1, N):  # first child of a node: the target's top token; later ones random
            tokens[b, c] = top[b, par[c]] if par[c] not in seen else int(torch.randint(0, V, (1,), generator=g))
            seen.add(par[c])
        tokens[b, 0] = 0
    q = None
    if mode == "draft":
        q = torch.softmax(logits.float() / 0.8 + torch.randn(B, N, V, generator=g), -1)
    temp = torch.full((B,), 0.8)
    uniforms = torch.rand(B, N + 1, generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (to(tokens), to(parents), to(logits), to(q), to(temp), to(uniforms), mode == "greedy")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--deadline", type=float, default=120.0)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device.type == "cpu"
    if cpu:
        batches, nodes, V = ([1, 4], [8], 32000) if args.quick else ([1, 16], [8, 64], 32000)
    else:
        batches, nodes, V = ([1, 64], [8], 128256) if args.quick else ([1, 16, 64], [8, 64], 128256)
    label = device_label(device)
    print(f"{label}{' (CPU implementation; not a GPU figure)' if cpu else ''}")
    t_end = time.time() + args.deadline
    rows = []
    for B in batches:
        for N in nodes:
            for mode in ("greedy", "sample", "draft"):
                if time.time() > t_end:
                    print("deadline reached")
                    break
                case = make_case(B, N, V, mode, device)
                acc, num, _ = torch.ops.fastinfer.tree_verify(*case)
                visited = int(num.sum().item()) + B
                op_us = time_fn(lambda _: torch.ops.fastinfer.tree_verify(*case), [None], device, budget_s=0.3,
                                reps=5, warmup=2)
                rows_t = torch.randn(visited, V, device=device).to(torch.bfloat16)
                base_us = time_fn(lambda _: rows_t.amax(-1), [None], device, budget_s=0.3, reps=5, warmup=2)
                nbytes = visited * V * 2
                row = dict(B=B, N=N, V=V, mode=mode, visited_nodes=visited, op_us=op_us, read_once_us=base_us,
                           ratio=op_us / base_us, op_gbps=nbytes / (op_us * 1e-6) / 1e9, cpu_only=cpu)
                rows.append(row)
                print(f"{'CPU ' if cpu else ''}B={B:3d} N={N:3d} V={V} {mode:6s} visited={visited:5d} "
                      f"op {op_us:9.1f} us  read-once {base_us:9.1f} us  ratio {row['ratio']:.2f}  "
                      f"{row['op_gbps']:.1f} GB/s")
                del case, rows_t
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=label, torch=torch.__version__, commit=git_commit(), cpu_only=cpu, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
