"""Per-request sampling parameters and the output objects returned by :class:`fastinfer.LLM`.

Names and meanings follow vLLM (``SamplingParams``, ``RequestOutput``, ``CompletionOutput``).

Error policy: an invalid ``SamplingParams`` value raises ``ValueError`` when the object is built
(``SamplingParams(temperature=-1)``), before anything is scheduled. Problems that depend on the
model or the prompt (empty prompt, prompt longer than ``max_model_len``, token ids outside the
vocabulary, a params object mutated into an invalid state) do not raise: that request finishes
immediately with ``finish_reason == "error"`` and ``RequestOutput.error`` holds the message, while
the other requests of the same ``generate`` call run normally.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


@dataclass
class StructuredOutputs:
    """A constraint on the text of a completion (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid against
      it (xgrammar's strict mode: no properties beyond those the schema names unless it allows them);
    - ``json_object=True``: any JSON object;
    - ``regex``: the whole output matches this regular expression;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar in xgrammar's (GBNF) notation, whose ``root`` rule the output matches.

    The grammar is compiled once per distinct constraint (the engine caches compiled grammars) by
    xgrammar (``pip install 'fastinfer[structured]'``); each sequence keeps a matcher, and the
    tokens the grammar does not allow next are masked to -inf before sampling
    (``fastinfer.ops.apply_token_bitmask``). JSON is written in one layout (``", "`` and ``": "``
    separators, no newlines: a small model cannot pad it with whitespace). A
    constraint that does not compile makes the request finish with an error naming it. The
    sequence can end (EOS) only where the grammar is complete; ``max_tokens`` may still cut it.
    """

    json: Optional[Union[str, Dict[str, Any]]] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None

    def verify(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: structured: {msg}")

        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            bad(f"exactly one of json, json_object, regex, choice, grammar must be given, got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            bad(f"json must be a JSON schema (a dict or its JSON text), got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            bad(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(f"{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            bad(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the engine's cache key)."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return ("json", schema)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", tuple(self.choice))
        return ("grammar", self.grammar)


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt.

    - ``n``: completions per prompt (they share the prompt's KV blocks).
    - ``temperature``: 0 = greedy (argmax); otherwise logits / temperature.
    - ``top_k``: keep the k most likely tokens (0 or -1: off).
    - ``top_p``: keep the smallest set of most likely tokens whose probability reaches top_p (1: off).
    - ``min_p``: drop tokens whose probability is below ``min_p * max probability`` (0: off).
    - ``repetition_penalty``: Hugging Face semantics over prompt + generated tokens: a logit l of a
      token already seen becomes l / p when l > 0, else l * p (1: off).
    - ``presence_penalty`` / ``frequency_penalty``: OpenAI semantics over the generated tokens: a
      token generated c > 0 times so far has its logit lowered by ``presence_penalty`` +
      ``c * frequency_penalty`` (after the repetition penalty; 0: off; each in [-2, 2]).
    - ``seed``: per-request seed; the same seed gives the same completion whatever else runs in the
      batch (completion i of n uses a generator seeded from (seed, i)).
    - ``max_tokens``: generated tokens at most (finish_reason "length"); None = up to max_model_len.
    - ``stop``: strings; generation stops when the detokenised text contains one, and the text is
      truncated before it (kept when ``include_stop_str_in_output``).
    - ``stop_token_ids``: token ids that stop generation (as EOS does; not in the text).
    - ``ignore_eos``: do not stop at the model's EOS token(s).
    - ``logprobs``: when not None, each generated token gets a dict {token_id: logprob} with the
      sampled token and the ``logprobs`` most likely tokens (log-softmax of the raw model logits).
    - ``prompt_logprobs``: when not None, every prompt token after the first gets a dict
      {token_id: logprob} with that token and the ``prompt_logprobs`` most likely tokens at its
      position (``RequestOutput.prompt_logprobs``; None for the first token). Like ``logprobs``:
      the log-softmax of the raw float32 logits, before penalties, temperature and ``logit_bias``.
      Computed during prefill from the logits of every prompt position, so such a request skips
      prefix-cache hits until its prompt has been computed once (it still fills the cache).
    - ``logit_bias``: {token_id: bias} (OpenAI semantics): each bias, in [-100, 100], is added to
      that token's logit after the penalties and before temperature and the filters, so it steers
      greedy decoding too (100 all but forces a token, -100 all but bans it). Token ids at or past
      the model's vocabulary make the request finish with an error (they depend on the model).
    - ``structured``: a :class:`StructuredOutputs` constraint on the output (JSON schema, any JSON
      object, regex, choice, EBNF grammar); not with ``ignore_eos`` (a grammar ends at EOS).
    - ``skip_special_tokens``: drop special tokens from the text.
    - ``speculative``: speculative decoding for this request when the engine has a draft model
      (``LLM(draft_model=...)``): None/True = use it, False = decode normally (in the same steps as
      the speculating requests). Requests using top_k / top_p / min_p / repetition_penalty always
      decode without speculation (the verifier reproduces the plain temperature distribution).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: Optional[bool] = None
    structured: Optional[StructuredOutputs] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.verify()

    def verify(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad(f"n must be an int >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0 or self.temperature == float("inf"):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad(f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty < float("inf"):
            bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be a number in [-2, 2], got {v!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            bad(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            bad(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            bad(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            bad(f"speculative must be None, True or False, got {self.speculative!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            bad(f"logprobs must be an int >= 0 or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            bad(f"prompt_logprobs must be an int >= 0 or None, got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad(f"logit_bias must be a dict {{token_id: bias}} or None, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad(f"logit_bias keys must be token ids (ints >= 0), got {t!r}")
                if not isinstance(b, (int, float)) or isinstance(b, bool) or not -100.0 <= b <= 100.0:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                bad(f"structured must be a StructuredOutputs or None, got {type(self.structured).__name__}")
            self.structured.verify()
            if self.ignore_eos:
                bad("structured output ends the completion at EOS where the grammar is complete: "
                    "ignore_eos is not supported with it")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass
class CompletionOutput:
    """One completion of a prompt. ``finish_reason``: None while running, then "stop" (EOS, a stop
    token or a stop string), "length" (max_tokens or max_model_len), "abort" or "error".
    ``stop_reason``: the stop string or stop token id that ended it, when one did."""

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    logprobs: Optional[List[Dict[int, float]]] = None
    stop_reason: Optional[Union[int, str]] = None
    cumulative_logprob: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: ``outputs`` has ``n`` completions. ``error`` is set (and every
    completion has finish_reason "error") when the request was rejected. ``prompt_logprobs`` (when
    the params asked for them): one entry per prompt token, None for the first, then
    {token_id: logprob} (see :class:`SamplingParams`); filled in as the prompt is prefilled."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    error: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # arrival / scheduled (first step computing it) / first_token / finished times (s, perf_counter)
    metrics: Dict[str, float] = field(default_factory=dict)
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
