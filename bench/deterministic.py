#!/usr/bin/env python3
"""The cost of the runner's deterministic mode: tokens/s of the same workload with
``LLM(deterministic=False)`` and ``deterministic=True``, batch 1 and 16, without speculation and
with draft-model chain and tree speculation, on the shipped tiny model; median of alternated repeats.

    python bench/deterministic.py [--repeats 5] [--dtype float32] [--json bench/results/deterministic-cpu.json]

CPU figures are labelled CPU (this machine); on a GPU run it with --device cuda (gpu_check.sh does
not yet). The modelled H200 cost of the fixed-split attention and dense_mm kernels is
``bench/model.py --fixed-split 256`` and the dense_mm rows of ``bench/model.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.engine.config import default_model_path  # noqa: E402


def assets(name: str) -> str:
    return os.path.join(os.path.dirname(default_model_path()), name)


def workload(batch: int, output_len: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 4096) for _ in range(rng.randint(16, 64))] for _ in range(batch)]
    return prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [("batch 1", 1, {}), ("batch 16", 16, {}),
             ("batch 1, draft chain 4", 1, dict(spec_method="draft", spec_model=assets("tiny-llama-draft"),
                                                 spec_mode="chain", num_spec_tokens=4)),
             ("batch 16, draft chain 4", 16, dict(spec_method="draft", spec_model=assets("tiny-llama-draft"),
                                                   spec_mode="chain", num_spec_tokens=4)),
             ("batch 1, draft tree 3 x top-2", 1, dict(spec_method="draft", spec_model=assets("tiny-llama-draft"),
                                                        spec_mode="tree", num_spec_tokens=3, spec_tree_topk=2)),
             ("batch 16, draft tree 3 x top-2", 16, dict(spec_method="draft", spec_model=assets("tiny-llama-draft"),
                                                          spec_mode="tree", num_spec_tokens=3, spec_tree_topk=2))]
    rows = []
    for name, batch, kw in cases:
        prompts, sp = workload(batch, args.output_len)
        llms = {det: LLM(None, dtype=args.dtype, device=args.device, deterministic=det, enable_prefix_caching=False,
                         **kw) for det in (False, True)}
        rates = {False: [], True: []}
        outs = {}
        for det in (False, True):  # warm-up
            llms[det].generate(prompts, sp)
        for _ in range(args.repeats):
            for det in (False, True):
                t0 = time.perf_counter()
                res = llms[det].generate(prompts, sp)
                rates[det].append(batch * args.output_len / (time.perf_counter() - t0))
                outs[det] = [o.outputs[0].token_ids for o in res]
        base, det = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append(dict(case=name, tokens_per_s_default=round(base, 1), tokens_per_s_deterministic=round(det, 1),
                         cost=round(1.0 - det / base, 3), same_greedy_tokens=outs[False] == outs[True]))
        print(f"{name:31s} default {base:8.1f} tok/s  deterministic {det:8.1f} tok/s  "
              f"cost {100 * (1 - det / base):5.1f}%  same tokens: {outs[False] == outs[True]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(label="CPU" if args.device == "cpu" else args.device, machine=platform.processor() or
                           platform.machine(), threads=args.threads, dtype=args.dtype, repeats=args.repeats,
                           output_len=args.output_len, cases=rows), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
