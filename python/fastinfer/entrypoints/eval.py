"""Held-out perplexity of a model on the shipped models' evaluation text.

The shipped tiny models (``python/fastinfer/assets``) were trained on the CPython standard library;
every 50th file was held out, and ``assets/metadata.json`` lists those files. This module rebuilds
that token stream from the local Python installation (``<bos> file <eos>`` per file, the
training script's packing) and computes token-level perplexity over non-overlapping windows of
``context`` predictions, the way ``tools/train_tiny_models.py`` reported it. It is how quantised
variants are compared with the bf16 model::

    fastinfer eval --dtype bfloat16          # or python -m fastinfer.entrypoints.eval

Needs the same Python minor version's standard library as the one the metadata names (the held-out
files must exist); :func:`heldout_files` says which file is missing otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
from typing import List, Optional, Sequence, Tuple

import torch

from ..engine.config import EngineConfig
from ..engine.llm import LLM
from ..layers import BatchBuilder
from ..quant import describe_quantization
from .args import EVAL_OPTIONS, add_cli_args, add_quant_args, llm_kwargs

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
CONTEXT = 256


def heldout_files(stdlib: Optional[str] = None, metadata: Optional[str] = None) -> List[Tuple[str, str]]:
    """``(relative path, text)`` of the held-out files named in the shipped metadata."""
    with open(metadata or os.path.join(ASSETS, "metadata.json")) as f:
        meta = json.load(f)
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    out = []
    for rel in meta["corpus"]["heldout_files"]:
        path = os.path.join(stdlib, rel)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"held-out file {rel} not found under {stdlib} (the shipped models were evaluated on "
                f"Python {meta['corpus'].get('python_version')}'s standard library)")
        with open(path, encoding="utf-8") as f:
            out.append((rel, f.read()))
    return out


def calibration_files(stdlib: Optional[str] = None, metadata: Optional[str] = None, every: int = 50
                      ) -> List[Tuple[str, str]]:
    """``(relative path, text)`` of calibration files from the shipped models' TRAINING split: the
    corpus listing of ``tools/train_tiny_models.py`` (sorted ``.py`` files of the standard library,
    the metadata's excluded directories skipped), every ``every``-th file (index % every == 0; the
    held-out ones are index % 50 == 25)."""
    with open(metadata or os.path.join(ASSETS, "metadata.json")) as f:
        corpus = json.load(f)["corpus"]
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    excluded, held = set(corpus["excluded_dirs"]), set(corpus["heldout_files"])
    rels = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in excluded)
        rels += [os.path.relpath(os.path.join(root, n), stdlib).replace(os.sep, "/") for n in names if n.endswith(".py")]
    out = []
    for i, rel in enumerate(sorted(rels)):
        if i % every or rel in held:
            continue
        try:
            with open(os.path.join(stdlib, rel), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            out.append((rel, text))
    return out


def calibration_ids(model_dir: str, text_file: Optional[str] = None, max_tokens: int = 16384) -> torch.Tensor:
    """Calibration token ids for SmoothQuant: ``text_file`` (UTF-8), else :func:`calibration_files`,
    tokenised by ``model_dir``'s tokenizer (``<bos> file <eos>`` packing), at most ``max_tokens``."""
    from ..engine.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    if text_file is not None:
        with open(text_file, encoding="utf-8") as f:
            files = [(text_file, f.read())]
    else:
        files = calibration_files()
    ids = token_stream(tok, files)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"calibration text {text_file or 'corpus'} holds fewer than 2 tokens")
    return ids


def token_stream(tokenizer, files: Sequence[Tuple[str, str]]) -> torch.Tensor:
    """``<bos> tokens <eos>`` per file, concatenated (int64); a tokenizer without those special
    tokens packs the files back to back."""
    bos, eos = tokenizer.token_to_id("<|bos|>"), tokenizer.token_to_id("<|eos|>")
    ids: List[int] = []
    for enc in tokenizer.encode_batch([t for _, t in files], add_special_tokens=False):
        if bos is not None:
            ids.append(bos)
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def perplexity(model, stream: torch.Tensor, context: int = CONTEXT, max_tokens: Optional[int] = None,
               windows_per_batch: int = 8, block_size: int = EngineConfig.block_size,
               kv_cache_dtype: Optional[torch.dtype] = None) -> Tuple[float, int]:
    """Token-level perplexity of ``model`` (a :class:`~fastinfer.models.LlamaForCausalLM`) over
    non-overlapping windows of ``context`` predictions; returns ``(ppl, predicted tokens)``.
    ``kv_cache_dtype``: the KV cache's torch dtype (default the model's; ``LLM.kv_cache_dtype`` is
    an engine's)."""
    n = (len(stream) - 1) // context
    if max_tokens:
        n = min(n, max(1, max_tokens // context))
    blocks_per_window = -(-context // block_size)
    caches = model.allocate_kv_cache(windows_per_batch * blocks_per_window, block_size, kv_cache_dtype)
    total, count = 0.0, 0
    for w0 in range(0, n, windows_per_batch):
        rows = [stream[i * context:i * context + context + 1] for i in range(w0, min(n, w0 + windows_per_batch))]
        b = BatchBuilder(block_size, model.device)
        for j, r in enumerate(rows):
            b.prefill(r[:-1].tolist(), 0, list(range(j * blocks_per_window, (j + 1) * blocks_per_window)), logits="all")
        logits = model(b.build(), caches)
        target = torch.cat([r[1:] for r in rows]).to(logits.device)
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += target.numel()
    return math.exp(total / count), count


def add_args(ap: argparse.ArgumentParser) -> None:
    add_cli_args(ap, EVAL_OPTIONS)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="evaluate at most this many predicted tokens (default: all 72,704)")
    add_quant_args(ap)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")


def run(args) -> int:
    llm = LLM(**llm_kwargs(args, EVAL_OPTIONS), num_kv_blocks=1)
    stream = token_stream(llm.tokenizer, heldout_files())
    ppl, n = perplexity(llm.model, stream, max_tokens=args.max_tokens, kv_cache_dtype=llm.kv_cache_dtype)
    res = {"model": llm.model_path, "dtype": str(llm.model.dtype).replace("torch.", ""),
           "quantization": describe_quantization(llm.model),
           "kv_cache_dtype": str(llm.kv_cache_dtype).replace("torch.", ""), "heldout_ppl": round(ppl, 4), "tokens": n}
    print(json.dumps(res) if args.json else "  ".join(f"{k}={v}" for k, v in res.items()))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastinfer.entrypoints.eval", description=__doc__.split("\n\n")[0])
    add_args(ap)
    args = ap.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:  # bad model / quantisation arguments: one line, no traceback
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
