"""Output processing: the request registry, incremental detokenisation, stop strings, logprobs,
:class:`~fastinfer.engine.params.RequestOutput` and per-request metrics.

The engine core reports token ids (:class:`~fastinfer.engine.messages.SeqOutput`); this module turns
them into what users read. A request lives in the registry from ``add_request`` until its final
output is built: then it leaves (a long-running server keeps a bounded registry and can reuse ids).
A stop string found in a completion's text ends that completion here; :meth:`OutputProcessor.process`
reports it so the caller stops the sequence in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .messages import SeqOutput
from .params import CompletionOutput, RequestOutput, SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["OutputProcessor", "ProcessedOutputs"]


class _Completion:
    def __init__(self, index: int, params: SamplingParams, detok: Optional[IncrementalDetokenizer]):
        self.index = index
        self.params = params
        self.token_ids: List[int] = []
        self.text = ""
        self.detok = detok
        self.logprobs: Optional[List[dict]] = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: Optional[str] = None
        self.stop_reason = None

    def _stop_string(self, delta: str) -> Optional[Tuple[int, str]]:
        """The earliest stop string that the text now contains (it may straddle the new ``delta``)."""
        stops = self.params.stop
        start = max(0, len(self.text) - len(delta) - max(len(s) for s in stops) + 1)
        best = None
        for s in stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def add(self, tok: int, lp: Optional[dict], finish_reason: Optional[str], stop_reason) -> bool:
        """One new token; returns True when a stop string ended the completion."""
        self.token_ids.append(tok)
        if lp is not None:
            self.logprobs.append(lp)
            self.cumulative_logprob += lp[tok]
        if finish_reason == "stop":  # EOS or a stop token: not part of the text
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
            return False
        if self.detok is not None:
            delta = self.detok.add(tok)
            if delta:
                self.text += delta
                hit = self._stop_string(delta) if self.params.stop else None
                if hit is not None:
                    i, s = hit
                    self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
                    self.finish_reason, self.stop_reason = "stop", s
                    return True
        if finish_reason is not None:
            self.finish(finish_reason, stop_reason)
        return False

    def finish(self, reason: str, stop_reason=None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if reason == "length" and self.detok is not None:
            self.text += self.detok.flush()  # a trailing incomplete character, if any

    def output(self, streaming: bool) -> CompletionOutput:
        text = self.text
        if streaming and self.finish_reason is None and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1  # a stop string may be forming
            text = text[: max(0, len(text) - hold)]
        return CompletionOutput(index=self.index, text=text, token_ids=list(self.token_ids),
                                finish_reason=self.finish_reason,
                                logprobs=list(self.logprobs) if self.logprobs is not None else None,
                                stop_reason=self.stop_reason,
                                cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None)


@dataclass
class _RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    arrival_time: float
    error: Optional[str] = None
    completions: Dict[int, _Completion] = field(default_factory=dict)
    scheduled_time: Optional[float] = None  # first step that computed any of its tokens (queue time ends)
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_cached_tokens: int = 0
    num_forwards: int = 0
    spec_verify: int = 0
    spec_draft: int = 0
    spec_accepted: int = 0
    prompt_logprobs: Optional[List[Optional[dict]]] = None  # [None] + one dict per computed prompt token

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        return len(self.completions) == self.params.n and all(c.finish_reason is not None
                                                              for c in self.completions.values())


@dataclass
class ProcessedOutputs:
    outputs: List[RequestOutput]  # finished requests (final outputs) and the wanted unfinished ones
    stop: List[Tuple[str, int]]  # (request id, completion index) ended by a stop string: stop them in the core


class OutputProcessor:
    """Registry of the requests in flight and the builder of their outputs.

    ``speculative``: add the speculative metrics to every output (the engine has a proposer).
    """

    def __init__(self, tokenizer: Optional[Tokenizer], speculative: bool = False):
        self.tokenizer = tokenizer
        self.speculative = speculative
        self._requests: Dict[str, _RequestState] = {}
        self._ready: List[str] = []  # finished without a core step (refused at add_request)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: List[int],
                    params: SamplingParams, error: Optional[str] = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        st = _RequestState(request_id, prompt, list(prompt_token_ids), params, time.perf_counter(), error)
        if params.prompt_logprobs is not None and error is None:
            st.prompt_logprobs = [None]
        self._requests[request_id] = st
        if error is not None:
            st.finished_time = st.arrival_time
            self._ready.append(request_id)

    def abort(self, request_id: str) -> None:
        """Forget the request (no further output)."""
        self._requests.pop(request_id, None)

    def _completion(self, st: _RequestState, index: int) -> _Completion:
        c = st.completions.get(index)
        if c is None:
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, st.prompt_token_ids, st.params.skip_special_tokens)
            c = st.completions[index] = _Completion(index, st.params, detok)
        return c

    def process(self, seq_outputs: List[SeqOutput],
                wanted: Optional[Callable[[str], bool]] = None) -> ProcessedOutputs:
        """Apply one core step. Outputs: every request that finished (its final output; it leaves
        the registry) and every other request that changed, when ``wanted(request_id)`` (default:
        all)."""
        now = time.perf_counter()
        touched: Dict[str, _RequestState] = {rid: self._requests[rid] for rid in self._ready if rid in self._requests}
        self._ready = []
        stop: List[Tuple[str, int]] = []
        for o in seq_outputs:
            st = self._requests.get(o.request_id)
            if st is None:  # aborted meanwhile
                continue
            st.num_forwards += o.num_forwards
            if st.scheduled_time is None and o.num_forwards:
                st.scheduled_time = now
            st.spec_verify += o.spec_verified
            st.spec_draft += o.spec_num_draft
            st.spec_accepted += o.spec_num_accepted
            if o.index == 0:
                st.num_cached_tokens = o.num_cached_tokens
            if o.new_prompt_logprobs:
                st.prompt_logprobs.extend(o.new_prompt_logprobs)
            if o.error is not None:
                st.error = o.error
                st.finished_time = now
                touched[o.request_id] = st
                continue
            if not o.new_token_ids and o.finish_reason is None:
                continue
            c = self._completion(st, o.index)
            if c.finish_reason is not None:
                continue
            if st.first_token_time is None and o.new_token_ids:
                st.first_token_time = now
            last = len(o.new_token_ids) - 1
            for i, tok in enumerate(o.new_token_ids):
                lp = o.new_logprobs[i] if o.new_logprobs is not None else None
                if c.add(tok, lp, o.finish_reason if i == last else None, o.stop_reason if i == last else None):
                    if o.finish_reason is None or i < last:
                        stop.append((o.request_id, o.index))  # still running in the core
                    break
            if not o.new_token_ids and o.finish_reason is not None:
                c.finish(o.finish_reason, o.stop_reason)
            touched[o.request_id] = st
        outputs = []
        for rid, st in touched.items():
            if st.finished:
                st.finished_time = st.finished_time or now
                outputs.append(self._output(st, streaming=False))
                del self._requests[rid]
            elif wanted is None or wanted(rid):
                outputs.append(self._output(st, streaming=True))
        return ProcessedOutputs(outputs, stop)

    def _output(self, st: _RequestState, streaming: bool) -> RequestOutput:
        n = st.params.n
        if st.error is not None:
            outs = [CompletionOutput(i, "", [], "error") for i in range(n)]
        else:
            outs = [st.completions[i].output(streaming) for i in sorted(st.completions)]
        metrics = {"arrival_time": st.arrival_time}
        if st.scheduled_time is not None:
            metrics["scheduled_time"] = st.scheduled_time
        if st.first_token_time is not None:
            metrics["first_token_time"] = st.first_token_time
        if st.finished_time is not None and not streaming:
            metrics["finished_time"] = st.finished_time
        if self.speculative and st.completions:
            gen = sum(len(c.token_ids) for c in st.completions.values())
            metrics.update({
                "spec_num_verify": st.spec_verify,
                "spec_num_draft_tokens": st.spec_draft,
                "spec_num_accepted_tokens": st.spec_accepted,
                "spec_mean_accepted_length": st.spec_accepted / st.spec_verify if st.spec_verify else 0.0,
                "target_forwards": st.num_forwards,
                "target_forwards_per_token": st.num_forwards / gen if gen else 0.0,
            })
        return RequestOutput(st.request_id, st.prompt, list(st.prompt_token_ids), outs, st.finished,
                             error=st.error, num_cached_tokens=st.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=list(st.prompt_logprobs) if st.prompt_logprobs is not None else None)
