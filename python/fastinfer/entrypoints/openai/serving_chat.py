"""``POST /v1/chat/completions``: the messages rendered with the tokenizer's chat template, one engine
request with ``n`` completions; logprobs as OpenAI's ``{"content": [{token, logprob, bytes,
top_logprobs}]}``; vLLM's ``prompt_logprobs`` (the rendered prompt's) on the response."""

from __future__ import annotations

from typing import Any, AsyncIterator, Dict, List, Optional

from starlette.responses import JSONResponse, Response

from ...engine import CompletionOutput, SamplingParams
from .protocol import APIError, ChatCompletionRequest, ChatMessage
from .serving import SSE_DONE, EventStream, OpenAIServing, random_id, sse

__all__ = ["ServingChat"]


class ServingChat(OpenAIServing):
    def render(self, messages: List[ChatMessage], add_generation_prompt: bool) -> List[int]:
        """Token ids of the conversation (the template writes the special tokens)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        convo = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(convo, add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError: the template refused the conversation
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
        return self.token_ids(self.tokenizer.encode(text, add_special_tokens=False), param="messages")

    def prepare(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is not supported", param="tool_choice")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format {req.response_format.type!r} is not supported (only 'text')",
                           param="response_format")
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= self.limits.max_logprobs:
                raise APIError(400, f"top_logprobs must be in [0, {self.limits.max_logprobs}], got "
                                    f"{req.top_logprobs}", param="top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        self.check_prompt_logprobs(req)
        ids = self.render(req.messages, req.add_generation_prompt)
        which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = self.max_tokens_for(len(ids), asked, which, prompt_param="messages")
        params = self.sampling_params(req, budget, (req.top_logprobs or 0) if req.logprobs else None, which,
                                      prompt_logprobs=req.prompt_logprobs)
        self.check_capacity(1)
        return ids, params

    def _logprobs(self, c: CompletionOutput, start: int, top: int) -> Optional[Dict[str, Any]]:
        if c.logprobs is None:
            return None

        def entry(tid: int, lp: float) -> Dict[str, Any]:
            s = self.token_str(tid)
            return {"token": s, "logprob": self.logprob(lp), "bytes": list(s.encode("utf-8"))}

        content = []
        for tid, d in zip(c.token_ids[start:], c.logprobs[start:]):
            best = sorted(d.items(), key=lambda kv: -kv[1])[:top]
            content.append(dict(entry(tid, d[tid]), top_logprobs=[entry(t, v) for t, v in best]))
        return {"content": content}

    async def create(self, req: ChatCompletionRequest) -> Response:
        ids, params = self.prepare(req)
        rid = random_id("chatcmpl")
        top = req.top_logprobs or 0
        if req.stream:
            return EventStream(self._stream(req, rid, ids, params))
        (out,) = await self.final_outputs(rid, [ids], params)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c, 0, top), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in out.outputs]
        usage = self.usage(len(ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
        body = {"id": rid, "object": "chat.completion", "created": self.created(), "model": self.model_name,
                "choices": choices, "usage": usage, "system_fingerprint": None}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(self, req: ChatCompletionRequest, rid: str, ids: List[int],
                      params: SamplingParams) -> AsyncIterator[bytes]:
        created, top = self.created(), req.top_logprobs or 0
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats
        sent_text: Dict[int, int] = {}
        sent_tok: Dict[int, int] = {}
        finished = set()
        gen, cached = 0, 0

        def chunk(choices: List[Dict[str, Any]], usage=None) -> bytes:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "system_fingerprint": None, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        try:
            usage0 = self.usage(len(ids), 0, 0) if continuous else None
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)], usage0)
            async for _, out in self.run_all(rid, [ids], params):
                gen = sum(len(c.token_ids) for c in out.outputs)
                cached = out.num_cached_tokens
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    t0, s0 = sent_tok.get(c.index, 0), sent_text.get(c.index, 0)
                    delta = c.text[s0:]
                    if not delta and c.finish_reason is None and len(c.token_ids) == t0:
                        continue
                    sent_text[c.index], sent_tok[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    choice = {"index": c.index, "delta": {"content": delta} if delta else {},
                              "logprobs": self._logprobs(c, t0, top), "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    yield chunk([choice], self.usage(len(ids), gen, cached) if continuous else None)
            if include_usage:
                yield chunk([], self.usage(len(ids), gen, cached))
        except APIError as e:
            yield self.stream_error(e)
        yield SSE_DONE
