"""Writing GGUF test files with ``gguf.GGUFWriter``: the shipped tiny model's byte-level BPE
tokenizer as GGUF metadata (``tokenizer.ggml.*``)."""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(os.path.dirname(HERE), "python", "fastinfer", "assets", "tiny-llama")


def tiny_tokenizer_meta() -> dict:
    """The tiny model's ``tokenizer.json`` as the fields llama.cpp's converter writes (4096 tokens)."""
    with open(os.path.join(TINY, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"pre": "gpt2", "tokens": tokens, "merges": merges, "types": [3 if i in special else 1 for i in
                                                                         range(len(tokens))],
            "bos": 0, "eos": 1, "add_bos": True}


def add_tokenizer(w, tokenizer: dict) -> None:
    """Write ``tokenizer`` (as :func:`tiny_tokenizer_meta` returns it) with GGUFWriter ``w``."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer["pre"])
    w.add_token_list(tokenizer["tokens"])
    w.add_token_merges(tokenizer["merges"])
    w.add_token_types(tokenizer["types"])
    w.add_bos_token_id(tokenizer["bos"])
    w.add_eos_token_id(tokenizer["eos"])
    w.add_add_bos_token(tokenizer["add_bos"])
