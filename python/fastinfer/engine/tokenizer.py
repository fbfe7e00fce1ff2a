"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat templates from
``tokenizer_config.json`` rendered with jinja2 (as ``transformers`` does), and incremental
detokenisation for streaming.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Union



def _token_str(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content")
    return str(v)


class Tokenizer:
    def __init__(self, path: str):
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
        self.config = cfg
        self.chat_template: Optional[str] = cfg.get("chat_template")
        jinja_file = os.path.join(os.path.dirname(tok_file), "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(jinja_file):
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
                            tokenize: bool = False, **kwargs: Any) -> Union[str, List[int]]:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.
        Returns the text, or its token ids (encoded without adding special tokens: the template
        writes them) when ``tokenize``."""
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
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
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
