"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat templates from
``tokenizer_config.json`` rendered with jinja2 (as ``transformers`` does), and incremental
detokenisation for streaming.

A GGUF checkpoint carries its tokenizer as metadata instead; :func:`tokenizer_from_gguf` builds the
same kind of ``tokenizers`` object from it (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``):
the vocabulary and merges, control tokens as special tokens and user-defined ones as added tokens,
the pre-tokenizer split llama.cpp uses for ``tokenizer.ggml.pre``, BOS/EOS added as
``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say, and ``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..models import find_gguf, open_gguf

__all__ = ["Tokenizer", "IncrementalDetokenizer", "tokenizer_from_gguf", "has_tokenizer", "GGUF_PRE_TOKENIZERS"]

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied one after the other; "gpt2" is the
# GPT-2 regex that tokenizers' ByteLevel(use_regex=True) applies itself.
_GPT2 = "gpt2"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS: Dict[str, Tuple[str, ...]] = {
    **{k: (_GPT2,) for k in ("gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{k: (r"\p{N}", _GPT2) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")},
    **{k: (_LLAMA3,) for k in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")},
    **{k: (_QWEN2,) for k in ("qwen2", "stablelm2", "deepseek-r1-qwen")},
}
# llama.cpp's tokenizer_ignore_merges: a pre-token that is a whole vocabulary entry is not split
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types (tokenizer.ggml.token_type)


def tokenizer_from_gguf(path: str):
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from the metadata of GGUF file ``path``
    (see the module docstring); a tokenizer model or pre-tokenizer other than those supported is a
    ``ValueError`` naming it."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as _HFTokenizer

    meta = open_gguf(path).tokenizer_metadata()
    kind = meta.get("ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path!r}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level "
                         "BPE); pass tokenizer=DIR with a tokenizer.json")
    pre = meta.get("ggml.pre") or "gpt2"
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path!r}: GGUF pre-tokenizer {pre!r} is not supported (supported: "
                         f"{', '.join(sorted(GGUF_PRE_TOKENIZERS))}); pass tokenizer=DIR with a tokenizer.json")
    tokens: List[str] = meta.get("ggml.tokens") or []
    merges_raw: List[str] = meta.get("ggml.merges") or []
    if not tokens:
        raise ValueError(f"{path!r}: no tokenizer.ggml.tokens in the GGUF metadata")
    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = []
    for m in merges_raw:
        pair = m.split(" ")
        if len(pair) != 2:
            raise ValueError(f"{path!r}: malformed BPE merge {m!r} in tokenizer.ggml.merges")
        merges.append((pair[0], pair[1]))
    tok = _HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                  ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_TOKENIZERS[pre] if r != _GPT2]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=_GPT2 in GGUF_PRE_TOKENIZERS[pre])])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("ggml.token_type") or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED])

    def token(key: str) -> Optional[str]:
        i = meta.get(f"ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg: Dict[str, Any] = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
                           "unk_token": token("unknown"), "chat_template": meta.get("chat_template"),
                           "add_bos_token": bool(meta.get("ggml.add_bos_token", False)),
                           "add_eos_token": bool(meta.get("ggml.add_eos_token", False))}
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        if cfg[flag] and cfg[name] is None:
            raise ValueError(f"{path!r}: tokenizer.ggml.{flag} is set but the GGUF has no {name} id")
    single = ([f"{cfg['bos_token']}:0"] if cfg["add_bos_token"] else []) + ["$A:0"] + \
        ([f"{cfg['eos_token']}:0"] if cfg["add_eos_token"] else [])
    specials = [(cfg[n], vocab[cfg[n]]) for f, n in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token"))
                if cfg[f]]
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    return tok, cfg


def has_tokenizer(path: Optional[str]) -> bool:
    """Whether checkpoint ``path`` has a tokenizer: a ``tokenizer.json``, or a GGUF's metadata."""
    return path is not None and (os.path.isfile(os.path.join(path, "tokenizer.json")) or find_gguf(path) is not None)


def _token_str(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content")
    return str(v)


class Tokenizer:
    """The tokenizer of a checkpoint directory (``tokenizer.json`` [+ ``tokenizer_config.json``]),
    of a ``tokenizer.json`` file, or of a GGUF file / a directory holding one."""

    def __init__(self, path: str):
        gguf_file = None if path.endswith(".json") else find_gguf(path)
        if gguf_file is not None and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            self._tok, cfg = tokenizer_from_gguf(gguf_file)
            self._setup(cfg, None)
            return
        tok_file = path if path.endswith(".json") and os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"no tokenizer.json found at {path!r}")
        from tokenizers import Tokenizer as _HFTokenizer  # imported lazily: optional dependency

        self._tok = _HFTokenizer.from_file(tok_file)
        cfg: Dict[str, Any] = {}
        cfg_file = os.path.join(os.path.dirname(tok_file), "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file, "r", encoding="utf-8") as f:
                cfg = json.load(f)
        self._setup(cfg, os.path.join(os.path.dirname(tok_file), "chat_template.jinja"))

    def _setup(self, cfg: Dict[str, Any], jinja_file: Optional[str]) -> None:
        self.config = cfg
        self.chat_template: Optional[str] = cfg.get("chat_template")
        if self.chat_template is None and jinja_file and os.path.isfile(jinja_file):
            with open(jinja_file, "r", encoding="utf-8") as f:
                self.chat_template = f.read()
        if isinstance(self.chat_template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> Dict[str, int]:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as JSON (its model, pre-tokenizer and decoder)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> List[Optional[str]]:
        return [self._tok.id_to_token(i) for i in ids]

    # ------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: List[Dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Optional[List[Dict[str, Any]]] = None,
                            **kwargs: Any) -> Union[str, List[int]]:
        """Render ``messages`` ([{"role": ..., "content": ...}], assistant ``tool_calls`` and
        ``role: "tool"`` results included) with the model's chat template. ``tools``: the function
        tools' JSON schemas (OpenAI's ``[{"type": "function", "function": {...}}]``), the template's
        ``tools`` variable, None without tools, as in ``transformers``. Returns the text, or its
        token ids (encoded without adding special tokens: the template writes them) when
        ``tokenize``."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        if self._template is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                       sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        ctx = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                   pad_token=self.pad_token or "")
        ctx.update(kwargs)
        text = self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **ctx)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only stable text.

    Decoding a token alone is wrong for BPE/byte-fallback vocabularies (a character may span
    tokens; SentencePiece drops a leading space at the start of a decode). So we decode a small
    window: ``prefix`` = tokens[prefix_offset:read_offset] (already emitted, used for context) and
    ``full`` = tokens[prefix_offset:]; the new text is ``full[len(prefix):]``, emitted only when it
    does not end with an incomplete character (U+FFFD). The prompt's last tokens seed the context,
    so the first generated token is decoded as it reads after the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 context: int = 5):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: List[int] = list(prompt_ids[-context:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly stable text (possibly "")."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: emit whatever is left (even an incomplete character)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        delta = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
