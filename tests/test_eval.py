"""Held-out perplexity (fastinfer.entrypoints.eval): the shipped model's number, checked against transformers."""
import math
import os

import pytest
import torch

import fastinfer  # noqa: F401
from fastinfer.entrypoints.eval import ASSETS, CONTEXT, heldout_files, perplexity, token_stream

TARGET = os.path.join(ASSETS, "tiny-llama")


def _files_or_skip():
    try:
        return heldout_files()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_perplexity_matches_transformers_on_heldout_windows():
    transformers = pytest.importorskip("transformers")
    from fastinfer.engine.tokenizer import Tokenizer
    from fastinfer.models import load_model

    stream = token_stream(Tokenizer(TARGET), _files_or_skip())
    assert stream.numel() > 50_000
    ppl, n = perplexity(load_model(TARGET, dtype=torch.float32), stream, max_tokens=3 * CONTEXT)
    assert n == 3 * CONTEXT
    hf = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    x = torch.stack([stream[i * CONTEXT:i * CONTEXT + CONTEXT + 1] for i in range(3)])
    with torch.no_grad():
        logits = hf(input_ids=x[:, :-1]).logits
    ref = math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).item())
    assert abs(ppl - ref) / ref < 1e-4
    assert 3.0 < ppl < 30.0  # a trained model, not a uniform one (ppl 4096)
