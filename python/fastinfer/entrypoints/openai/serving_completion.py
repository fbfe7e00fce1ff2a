"""``POST /v1/completions``: one engine request per prompt (text or token ids, one or a list);
choice ``index`` = prompt index * n + completion index, as OpenAI and vLLM number them."""

from __future__ import annotations

from typing import Any, AsyncIterator, Dict, List, Optional

from starlette.responses import JSONResponse, Response

from ...engine import CompletionOutput, SamplingParams
from .protocol import APIError, CompletionRequest
from .serving import SSE_DONE, EventStream, OpenAIServing, random_id, sse

__all__ = ["ServingCompletion"]


class ServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> List[List[int]]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items: List[Any] = [p]
        else:
            items = list(p)
        if not items:
            raise APIError(400, "prompt: the list of prompts is empty", param="prompt")
        return [self.token_ids(x) for x in items]

    def prepare(self, req: CompletionRequest):
        self.check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= self.limits.max_logprobs:
            raise APIError(400, f"logprobs must be in [0, {self.limits.max_logprobs}], got {req.logprobs}",
                           param="logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        prompts = self._prompts(req)
        budgets = [self.max_tokens_for(len(ids), req.max_tokens) for ids in prompts]
        params = self.sampling_params(req, min(budgets), req.logprobs)
        self.check_capacity(len(prompts))
        return prompts, params

    def _logprobs(self, c: CompletionOutput, start: int, text_offset: int) -> Optional[Dict[str, Any]]:
        """OpenAI's legacy logprobs object for tokens ``start:`` of ``c``."""
        if c.logprobs is None:
            return None
        tokens, lps, tops, offsets = [], [], [], []
        off = text_offset
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            s = self.token_str(tid)
            tokens.append(s)
            lps.append(self.logprob(d[tid]))
            tops.append({self.token_str(t): self.logprob(v) for t, v in d.items()})
            offsets.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def create(self, req: CompletionRequest) -> Response:
        prompts, params = self.prepare(req)
        rid = random_id("cmpl")
        if req.stream:
            return EventStream(self._stream(req, rid, prompts, params))
        finals = await self.final_outputs(rid, prompts, params)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choices.append({"index": i * params.n + c.index, "text": c.text, "logprobs": self._logprobs(c, 0, 0),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        usage = self.usage(sum(map(len, prompts)), sum(len(c.token_ids) for o in finals for c in o.outputs),
                           sum(o.num_cached_tokens for o in finals))
        return JSONResponse({"id": rid, "object": "text_completion", "created": self.created(),
                             "model": self.model_name, "choices": choices, "usage": usage,
                             "system_fingerprint": None})

    async def _stream(self, req: CompletionRequest, rid: str, prompts: List[List[int]],
                      params: SamplingParams) -> AsyncIterator[bytes]:
        created, n = self.created(), params.n
        sent_text: Dict[int, int] = {}  # choice index -> characters sent
        sent_tok: Dict[int, int] = {}  # choice index -> tokens sent
        finished = set()
        gen_tokens: Dict[int, int] = {}
        cached: Dict[int, int] = {}
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats

        def chunk(choices: List[Dict[str, Any]], usage=None) -> bytes:
            body = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        def current_usage():
            return self.usage(sum(map(len, prompts)), sum(gen_tokens.values()), sum(cached.values()))

        try:
            async for i, out in self.run_all(rid, prompts, params):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    k = i * n + c.index
                    if k in finished:
                        continue
                    gen_tokens[(k)] = len(c.token_ids)
                    t0, s0 = sent_tok.get(k, 0), sent_text.get(k, 0)
                    delta = c.text[s0:]
                    if not delta and c.finish_reason is None and len(c.token_ids) == t0:
                        continue
                    sent_text[k], sent_tok[k] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(k)
                    choice = {"index": k, "text": delta, "logprobs": self._logprobs(c, t0, s0),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    yield chunk([choice], current_usage() if continuous else None)
            if include_usage:
                yield chunk([], current_usage())
        except APIError as e:
            yield self.stream_error(e)
        yield SSE_DONE
