"""Structured output on the tensor side: grammars compiled by xgrammar, one grammar matcher per
sequence, and the token bitmasks the sampler and the verifier apply (``apply_token_bitmask``).

:class:`GrammarBackend` is built by the driver with the tokenizer (the vocabulary xgrammar matches
text against) and imports xgrammar on first use (``pip install 'fastinfer[structured]'``):

* :meth:`~GrammarBackend.error` compiles a request's constraint when it arrives (the engine core
  refuses the request with the message when it does not compile); compiled grammars are cached by
  :attr:`~fastinfer.engine.params.StructuredOutputs.key`, so a repeated schema compiles once;
* :meth:`~GrammarBackend.row_bitmask` fills, for the rows a step samples, the bitmask of each
  constrained row from its sequence's matcher. Matchers catch up lazily with the tokens the core
  appended since (sampled or accepted from a draft), so a matcher always stands at its sequence's
  committed output: preemption and re-prefill keep it (the sequence keeps its tokens), forks of
  n > 1 start their own from the grammar's start. The executor fills the masks after the forward
  is enqueued and before sampling reads the logits, so on a GPU (an asynchronous forward) the
  host work of a step can overlap the device's forward of that step;
* :meth:`~GrammarBackend.tree_bitmask` gives every node of a speculative draft the mask of the
  matcher advanced along the node's path (draft tokens the grammar refuses leave their subtree
  unmasked: the parent's mask already rejects them), then rolls the matcher back to the committed
  tokens; the accepted ones are taken in at the next catch-up.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence as Seq, Tuple

import torch

from .._optional import require
from .params import StructuredOutputs
from .sequence import Sequence

__all__ = ["GrammarBackend", "vocab_metadata"]

#: compiled grammars kept (least recently used dropped first)
CACHE_SIZE = 128


def vocab_metadata(tokenizer_json: str) -> Tuple[str, bool]:
    """``(vocab type, add_prefix_space)`` of a ``tokenizers`` tokenizer from its JSON: "byte_level"
    (a ByteLevel decoder: GPT-2 style BPE, Llama 3, Qwen, SmolLM), "byte_fallback" (SentencePiece
    BPE with byte fallback, Llama 2) or "raw" (tokens are their text)."""
    decoder = json.loads(tokenizer_json).get("decoder") or {}
    parts = [decoder] + list(decoder.get("decoders") or [])
    kinds = {d.get("type") for d in parts}
    prefix = any(d.get("type") == "Metaspace" and (d.get("add_prefix_space") or d.get("prepend_scheme") in
                                                   ("first", "always")) for d in parts)
    if "ByteLevel" in kinds:
        return "byte_level", False
    if "ByteFallback" in kinds:
        return "byte_fallback", prefix
    return "raw", prefix


class _Matcher:
    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0  # output tokens taken in


class GrammarBackend:
    """See the module docstring. ``tokenizer``: the engine's :class:`~.tokenizer.Tokenizer`;
    ``vocab_size``: the model's (the logits' width; ids past the tokenizer's are never allowed);
    ``stop_token_ids``: the tokens that end a completion (the grammar allows them where complete)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._xgr = None
        self._compiler = None
        self._compiled: "OrderedDict[tuple, object]" = OrderedDict()
        self._matchers: Dict[int, _Matcher] = {}

    def _setup(self) -> None:
        xgr = self._xgr = require("xgrammar", "structured", "structured output")
        vocab = self.tokenizer.get_vocab()
        encoded = [""] * self.vocab_size
        for tok, i in vocab.items():
            if i < self.vocab_size:
                encoded[i] = tok
        kind, prefix = vocab_metadata(self.tokenizer.backend_json())
        vocab_type = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                      "raw": xgr.VocabType.RAW}[kind]
        info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids or None, add_prefix_space=prefix)
        # the engine keeps its own cache by key (xgrammar's is off: one cache, one eviction rule)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    # ---- grammars ---------------------------------------------------------------------------------
    def compiled(self, spec: StructuredOutputs):
        key = spec.key
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        if self._compiler is None:
            self._setup()
        kind, value = key
        c = self._compiler
        if kind == "json":
            grammar = c.compile_json_schema(value, any_whitespace=False, strict_mode=True)
        elif kind == "json_object":
            grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        elif kind == "regex":
            grammar = c.compile_regex(value)
        elif kind == "choice":
            grammar = c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in value))
        else:
            grammar = c.compile_grammar(value)
        self._compiled[key] = grammar
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return grammar

    def error(self, spec: StructuredOutputs) -> Optional[str]:
        """Why ``spec`` cannot constrain a completion (it does not compile, or xgrammar is not
        installed), or None (it is now cached)."""
        try:
            self.compiled(spec)
        except ImportError as e:  # xgrammar is not installed: the message names the extra
            return str(e)
        except Exception as e:  # xgrammar reports a bad schema / regex / grammar as RuntimeError or ValueError
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice list", "grammar": "grammar"}[spec.key[0]]
            msg = str(e).strip().splitlines()
            return f"structured output: the {what} does not compile: {msg[0] if msg else type(e).__name__}"
        return None

    # ---- matchers ---------------------------------------------------------------------------------
    def forget(self, seq_ids: Iterable[int]) -> None:
        for sid in seq_ids:
            self._matchers.pop(sid, None)

    def _matcher(self, seq: Sequence):
        """The sequence's matcher, caught up with its committed output tokens."""
        st = self._matchers.get(seq.seq_id)
        if st is None:
            grammar = self.compiled(seq.params.structured)  # imports xgrammar on first use
            st = self._matchers[seq.seq_id] = _Matcher(self._xgr.GrammarMatcher(grammar))
        new = seq.token_ids[seq.num_prompt_tokens + st.consumed:]
        for tok in new:
            if not st.matcher.accept_token(tok):
                raise RuntimeError(f"structured output: sequence {seq.seq_id} committed token {tok}, which its "
                                   "grammar does not allow (the mask was not applied)")
        st.consumed += len(new)
        return st.matcher

    def allocate(self, rows: int) -> torch.Tensor:
        """An all-allowed bitmask of ``rows`` rows."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def row_bitmask(self, seqs: Seq[Sequence]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(bitmask [len(seqs), W] int32, constrained rows int64)`` for sampling one token per
        sequence, or None when no sequence is constrained."""
        rows = [i for i, s in enumerate(seqs) if s.params.structured is not None]
        if not rows:
            return None
        mask = self.allocate(len(seqs))
        for i in rows:
            self._matcher(seqs[i]).fill_next_token_bitmask(mask, i)
        return mask, torch.tensor(rows, dtype=torch.int64)

    def tree_bitmask(self, seq: Sequence, tokens: Seq[int], parents: Seq[int]) -> Tuple[torch.Tensor, List[int]]:
        """``(bitmask [N, W] int32, masked nodes)`` for a draft tree (node 0 the root, the last
        committed token; parents before children): node i's row allows what the grammar allows
        after the path to i. Nodes whose path the grammar refuses, or ends, are not listed."""
        m = self._matcher(seq)
        N = len(tokens)
        mask = self.allocate(N)
        paths: List[Optional[List[int]]] = [[]] + [None] * (N - 1)
        current: List[int] = []  # the draft nodes the matcher has taken in
        masked = []
        for i in range(N):
            if i > 0:
                parent_path = paths[parents[i]]
                if parent_path is None:
                    continue
                target = parent_path + [i]
                k = 0
                while k < len(current) and k < len(target) and current[k] == target[k]:
                    k += 1
                if len(current) > k:
                    m.rollback(len(current) - k)
                    del current[k:]
                for node in target[k:]:
                    if not m.accept_token(tokens[node]):
                        break
                    current.append(node)
                if current != target:
                    continue
                paths[i] = target
            if m.is_terminated():
                continue
            m.fill_next_token_bitmask(mask, i)
            masked.append(i)
        if current:
            m.rollback(len(current))
        return mask, masked
