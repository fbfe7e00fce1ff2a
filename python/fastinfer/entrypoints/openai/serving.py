"""What the completions and chat endpoints share: the served model's name, per-request limits,
request -> :class:`~fastinfer.SamplingParams` (every range checked, a 400 naming the field), prompt
length against ``max_model_len``, admission (503 past ``--max-waiting``), running engine requests
(metrics, abort on disconnect), merging the streams of several prompts, SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Dict, List, Optional, Tuple, Union

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ...engine.async_llm import AsyncLLM, EngineDeadError
from ...engine.params import RequestOutput, SamplingParams, StructuredOutputs
from .metrics import ServerMetrics
from .protocol import APIError, error_body

__all__ = ["ServeLimits", "OpenAIServing", "sse", "SSE_DONE", "EventStream", "until_disconnect", "random_id"]

SSE_DONE = b"data: [DONE]\n\n"
_INT64 = 2 ** 63


def sse(obj: Dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServeLimits:
    """Per-request and admission limits (``fastinfer serve`` options)."""

    max_n: int = 16
    max_tokens: int = 4096
    max_logprobs: int = 20
    max_stop: int = 16
    max_waiting: int = 1024


class EventStream(StreamingResponse):
    """SSE; the body generator is closed however the response ends (a client that left included),
    so the engine requests under it are aborted at once, not when it is garbage-collected."""

    def __init__(self, body: AsyncIterator[bytes]):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work``; if the client disconnects first, cancel it (its engine requests abort)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, limits: ServeLimits, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.llm.vocab_size
        self.max_model_len = engine.max_model_len

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{self.model_name}`).",
                           param="model", code="model_not_found")

    def check_capacity(self, num_requests: int) -> None:
        if not self.engine.is_running:
            raise APIError(503, f"the engine is not running: {self.engine.dead}", code="engine_dead")
        waiting = self.engine.num_waiting
        if waiting + num_requests > self.limits.max_waiting:
            raise APIError(503, f"the server is overloaded: {waiting} requests are waiting (--max-waiting "
                                f"{self.limits.max_waiting}); retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    def token_ids(self, prompt: Union[str, List[int]], add_special_tokens: bool = True,
                  param: str = "prompt") -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param=param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

    def max_tokens_for(self, num_prompt: int, requested: Optional[int], param: str = "max_tokens",
                       prompt_param: str = "prompt") -> int:
        """The completion budget: ``requested`` (checked) or what is left of ``max_model_len``."""
        room = self.max_model_len - num_prompt
        if requested is None:
            if room < 1:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, your prompt has {num_prompt} tokens; please reduce its length.",
                               param=prompt_param)
            return min(room, self.limits.max_tokens)
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} "
                                f"in the completion). Please reduce the length of the prompt or completion.",
                           param=param)
        return requested

    def check_prompt_logprobs(self, req: Any) -> None:
        """vLLM's ``prompt_logprobs`` extension: in [0, --max-logprobs], not with streaming."""
        k = req.prompt_logprobs
        if k is None:
            return
        if not 0 <= k <= self.limits.max_logprobs:
            raise APIError(400, f"prompt_logprobs must be in [0, {self.limits.max_logprobs}], got {k}",
                           param="prompt_logprobs")
        if req.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")

    def logit_bias(self, bias: Optional[Dict[str, float]]) -> Optional[Dict[int, float]]:
        """OpenAI's ``logit_bias`` ({"token id": bias}) as {int: float}: ids in [0, vocab), biases in
        [-100, 100], else a 400 naming the field."""
        if not bias:
            return None
        out: Dict[int, float] = {}
        for key, value in bias.items():
            try:
                tid = int(key)
            except ValueError:
                tid = -1
            if not 0 <= tid < self.vocab_size:
                raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {self.vocab_size})",
                               param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias: the bias of token {key} must be in [-100, 100], got {value!r}",
                               param="logit_bias")
            out[tid] = float(value)
        return out

    @staticmethod
    def guided(req: Any) -> Optional[Tuple[StructuredOutputs, str]]:
        """vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (one
        at most) as a structured-output constraint and the field that gave it."""
        given = [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(req, f) is not None]
        if not given:
            return None
        if len(given) > 1:
            raise APIError(400, f"at most one of {', '.join(given)} may be given", param=given[1])
        field = given[0]
        value = getattr(req, field)
        if field == "guided_json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise APIError(400, f"guided_json must be a JSON schema: {e}", param=field) from None
        try:
            spec = StructuredOutputs(**{field[len("guided_"):]: value})
            spec.verify()
        except ValueError as e:
            raise APIError(400, f"{field}: {str(e).split('structured: ', 1)[-1]}", param=field) from None
        return spec, field

    def sampling_params(self, req: Any, max_tokens: int, logprobs: Optional[int],
                        max_tokens_param: str = "max_tokens", prompt_logprobs: Optional[int] = None,
                        structured: Optional[StructuredOutputs] = None) -> SamplingParams:
        lim = self.limits

        def need(ok: bool, param: str, what: str) -> None:
            if not ok:
                raise APIError(400, f"{param} {what}, got {getattr(req, param, None)!r}", param=param)

        need(1 <= req.n <= lim.max_n, "n", f"must be in [1, {lim.max_n}] (--max-n)")
        need(req.temperature is None or 0.0 <= req.temperature <= 2.0, "temperature", "must be in [0, 2]")
        need(req.top_p is None or 0.0 < req.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(req.top_k is None or req.top_k >= -1, "top_k", "must be -1 (off), 0 (off) or a positive int")
        need(req.min_p is None or 0.0 <= req.min_p <= 1.0, "min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            need(v is None or -2.0 <= v <= 2.0, name, "must be in [-2, 2]")
        need(req.repetition_penalty is None or 0.0 < req.repetition_penalty <= 2.0, "repetition_penalty",
             "must be in (0, 2]")
        need(req.seed is None or -_INT64 <= req.seed < _INT64, "seed", "must be a 64-bit integer")
        logit_bias = self.logit_bias(req.logit_bias)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        need(len(stop) <= lim.max_stop and all(stop), "stop", f"must be at most {lim.max_stop} non-empty strings")
        need(not stop or self.tokenizer is not None, "stop", "needs a tokenizer")
        need(all(0 <= t < self.vocab_size for t in req.stop_token_ids or []), "stop_token_ids",
             f"must be token ids in [0, {self.vocab_size})")
        if max_tokens < 1 or max_tokens > lim.max_tokens:
            raise APIError(400, f"{max_tokens_param} must be in [1, {lim.max_tokens}] (--max-tokens-limit), got "
                                f"{max_tokens}", param=max_tokens_param)
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                seed=req.seed, max_tokens=max_tokens, stop=stop, stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logit_bias=logit_bias, skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, structured=structured)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    # ---- running ------------------------------------------------------------------------------
    async def run(self, request_id: str, prompt_ids: List[int], params: SamplingParams,
                  structured_param: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """One engine request; its metrics are recorded however it ends. ``structured_param``: the
        request field that gave ``params.structured`` (a refusal of the constraint names it)."""
        last: Optional[RequestOutput] = None
        finished = False
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id):
                if out.error is not None:
                    finished = True
                    param = structured_param if out.error.startswith("structured output") else None
                    raise APIError(400, out.error, param=param)
                last, finished = out, out.finished
                yield out
        except EngineDeadError as e:
            finished = True
            raise APIError(503, f"the request was interrupted: {e}", code="engine_dead") from None
        finally:
            if last is not None or not finished:
                self.metrics.observe(last, len(prompt_ids), finished)

    async def run_all(self, base_id: str, prompts: List[List[int]], params: SamplingParams,
                      structured_param: Optional[str] = None) -> AsyncIterator[Tuple[int, RequestOutput]]:
        """Several prompts at once: ``(prompt index, output)`` as they come."""
        gens = [self.run(f"{base_id}-{i}", ids, params, structured_param) for i, ids in enumerate(prompts)]
        if len(gens) == 1:
            async with contextlib.aclosing(gens[0]) as g:
                async for out in g:
                    yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async with contextlib.aclosing(gen) as g:
                    async for out in g:
                        q.put_nowait((i, out))
                q.put_nowait((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def final_outputs(self, base_id: str, prompts: List[List[int]], params: SamplingParams,
                            structured_param: Optional[str] = None) -> List[RequestOutput]:
        finals: List[Optional[RequestOutput]] = [None] * len(prompts)
        async for i, out in self.run_all(base_id, prompts, params, structured_param):
            if out.finished:
                finals[i] = out
        if any(f is None for f in finals):
            raise APIError(503, "the request was aborted by the server")
        return finals  # type: ignore[return-value]

    @staticmethod
    def stream_error(e: Exception) -> bytes:
        if isinstance(e, APIError):
            return sse(error_body(e.status, e.message, e.param, e.code))
        return sse(error_body(500, f"internal error: {e!r}"))

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def logprob(v: float) -> float:
        """JSON has no -inf: vLLM's floor."""
        return max(float(v), -9999.0)

    def prompt_logprobs_json(self, prompt_logprobs: Optional[List[Optional[Dict[int, float]]]],
                             top: int) -> Optional[List[Optional[Dict[str, Any]]]]:
        """vLLM's ``prompt_logprobs`` response field: per prompt token None (the first) or
        {token id: {"logprob", "rank", "decoded_token"}} with the prompt token and the ``top`` most
        likely ones (rank: 1 = most likely; null for a prompt token outside the top)."""
        if prompt_logprobs is None:
            return None
        out: List[Optional[Dict[str, Any]]] = []
        for d in prompt_logprobs:
            if d is None:
                out.append(None)
                continue
            ranked = sorted(d.items(), key=lambda kv: -kv[1])
            out.append({str(t): {"logprob": self.logprob(v), "rank": r + 1 if r < top else None,
                                 "decoded_token": self.token_str(t)} for r, (t, v) in enumerate(ranked)})
        return out

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer is not None else str(tid)

    @staticmethod
    def created() -> int:
        return int(time.time())
