"""``POST /v1/completions``: one engine request per prompt (text or token ids, one or a list);
choice ``index`` = prompt index * n + completion index, as OpenAI and vLLM number them.

``echo``: the text starts with the prompt and, with ``logprobs``, the logprobs object covers the
prompt tokens first (``token_logprobs`` / ``top_logprobs`` null for the first one; the engine
computes the others as prompt logprobs). ``max_tokens: 0`` needs ``echo`` and returns the prompt
alone (one token is generated and dropped, as vLLM does): how lm-evaluation-harness scores
loglikelihoods. Streaming with echo sends the prompt (and its logprobs) in each choice's first chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from starlette.responses import JSONResponse, Response

from ...engine.params import CompletionOutput, RequestOutput, SamplingParams
from .protocol import APIError, CompletionRequest
from .serving import SSE_DONE, EventStream, OpenAIServing, random_id, sse

__all__ = ["ServingCompletion"]


@dataclass
class _Echo:
    """What a request echoes: the prompts' texts, and whether the generated tokens are dropped."""

    texts: List[str]
    only_prompt: bool  # max_tokens 0


class ServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> Tuple[List[Any], List[List[int]]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items: List[Any] = [p]
        else:
            items = list(p)
        if not items:
            raise APIError(400, "prompt: the list of prompts is empty", param="prompt")
        return items, [self.token_ids(x) for x in items]

    def prepare(self, req: CompletionRequest):
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.limits.max_logprobs:
            raise APIError(400, f"logprobs must be in [0, {self.limits.max_logprobs}], got {req.logprobs}",
                           param="logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        self.check_prompt_logprobs(req)
        only_prompt = req.max_tokens == 0
        if only_prompt and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: true)", param="max_tokens")
        items, prompts = self._prompts(req)
        budgets = [self.max_tokens_for(len(ids), 1 if only_prompt else req.max_tokens) for ids in prompts]
        # the echoed prompt's logprobs are prompt logprobs: the engine computes the larger k asked
        wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        structured, structured_param = self.guided(req) or (None, None)
        params = self.sampling_params(req, min(budgets), req.logprobs,
                                      prompt_logprobs=max(wanted) if wanted else None, structured=structured)
        self.check_capacity(len(prompts))
        echo = None
        if req.echo:
            echo = _Echo([x if isinstance(x, str) else self._decode(ids, req.skip_special_tokens)
                          for x, ids in zip(items, prompts)], only_prompt)
        return prompts, params, echo, structured_param

    def _decode(self, ids: List[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens) if self.tokenizer is not None else ""

    def _logprobs(self, token_ids: List[int], logprobs: List[Optional[Dict[int, float]]], top: int,
                  text_offset: int) -> Dict[str, Any]:
        """OpenAI's legacy logprobs object of ``token_ids`` (a None entry: the first prompt token,
        null logprob and top_logprobs); each top_logprobs has the ``top`` most likely tokens and the
        token itself."""
        tokens, lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, d in zip(token_ids, logprobs):
            s = self.token_str(tid)
            tokens.append(s)
            offsets.append(off)
            off += len(s)
            if d is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(self.logprob(d[tid]))
            best = dict(sorted(d.items(), key=lambda kv: -kv[1])[:top])
            best.setdefault(tid, d[tid])
            tops.append({self.token_str(t): self.logprob(v) for t, v in best.items()})
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, echo: Optional[_Echo],
                prompt_text: str, start: int, text_start: int, first: bool) -> Dict[str, Any]:
        """The text and logprobs of completion ``c`` from its token ``start`` / character
        ``text_start`` on, the echoed prompt in front when ``first`` (the whole response, or a
        stream's first chunk of this choice)."""
        gen_ids = [] if echo is not None and echo.only_prompt else c.token_ids[start:]
        text = "" if echo is not None and echo.only_prompt else c.text[text_start:]
        ids: List[int] = []
        lps: List[Optional[Dict[int, float]]] = []
        if echo is not None and first:
            text = prompt_text + text
            ids = list(out.prompt_token_ids)
            lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else []
        logprobs = None
        if req.logprobs is not None:
            ids += gen_ids
            lps += c.logprobs[start:start + len(gen_ids)] if c.logprobs is not None else []
            offset = 0 if first else len(prompt_text if echo is not None else "") + text_start
            logprobs = self._logprobs(ids, lps, req.logprobs, offset)
        if echo is not None and echo.only_prompt:
            return {"text": text, "logprobs": logprobs, "finish_reason": "length" if c.finished else None,
                    "stop_reason": None}
        return {"text": text, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def create(self, req: CompletionRequest) -> Response:
        prompts, params, echo, structured_param = self.prepare(req)
        rid = random_id("cmpl")
        if req.stream:
            return EventStream(self._stream(req, rid, prompts, params, echo, structured_param))
        finals = await self.final_outputs(rid, prompts, params, structured_param)
        choices = []
        for i, out in enumerate(finals):
            prompt_text = echo.texts[i] if echo is not None else ""
            for c in out.outputs:
                choice = {"index": i * params.n + c.index,
                          **self._choice(req, out, c, echo, prompt_text, 0, 0, first=True)}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
                choices.append(choice)
        generated = 0 if echo is not None and echo.only_prompt else sum(
            len(c.token_ids) for o in finals for c in o.outputs)
        usage = self.usage(sum(map(len, prompts)), generated, sum(o.num_cached_tokens for o in finals))
        return JSONResponse({"id": rid, "object": "text_completion", "created": self.created(),
                             "model": self.model_name, "choices": choices, "usage": usage,
                             "system_fingerprint": None})

    async def _stream(self, req: CompletionRequest, rid: str, prompts: List[List[int]],
                      params: SamplingParams, echo: Optional[_Echo],
                      structured_param: Optional[str]) -> AsyncIterator[bytes]:
        created, n = self.created(), params.n
        sent_text: Dict[int, int] = {}  # choice index -> characters of the completion sent
        sent_tok: Dict[int, int] = {}  # choice index -> tokens sent
        finished = set()
        gen_tokens: Dict[int, int] = {}
        cached: Dict[int, int] = {}
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats
        only_prompt = echo is not None and echo.only_prompt

        def chunk(choices: List[Dict[str, Any]], usage=None) -> bytes:
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        def current_usage():
            return self.usage(sum(map(len, prompts)), sum(gen_tokens.values()), sum(cached.values()))

        try:
            async for i, out in self.run_all(rid, prompts, params, structured_param):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    k = i * n + c.index
                    if k in finished:
                        continue
                    gen_tokens[k] = 0 if only_prompt else len(c.token_ids)
                    first = k not in sent_tok
                    t0, s0 = sent_tok.get(k, 0), sent_text.get(k, 0)
                    if not first and not c.text[s0:] and c.finish_reason is None and len(c.token_ids) == t0:
                        continue
                    if only_prompt and not first and c.finish_reason is None:
                        continue
                    sent_text[k], sent_tok[k] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(k)
                    prompt_text = echo.texts[i] if echo is not None else ""
                    choice = {"index": k, **self._choice(req, out, c, echo, prompt_text, t0, s0, first)}
                    yield chunk([choice], current_usage() if continuous else None)
            if include_usage:
                yield chunk([], current_usage())
        except APIError as e:
            yield self.stream_error(e)
        yield SSE_DONE
