"""``POST /v1/chat/completions``: the messages rendered with the tokenizer's chat template, one engine
request with ``n`` completions; logprobs as OpenAI's ``{"content": [{token, logprob, bytes,
top_logprobs}]}``; vLLM's ``prompt_logprobs`` (the rendered prompt's) on the response.

Tool calling: ``tools`` go to the template (its ``tools`` variable), as do assistant ``tool_calls`` and
``role: "tool"`` results in the history. With ``tool_choice`` "auto" (the default with tools) the
output is parsed by the server's ``--tool-call-parser`` (:mod:`.tool_parsers`) into
``message.tool_calls``, ``finish_reason: "tool_calls"``; streamed, a call is sent once complete (its
id, type and name, then its arguments) while the text around it streams as content. With "none" the
tools are still rendered, as vLLM does, and the output is plain content. "required" and a named
function constrain the output (structured output) to the JSON schema of the function's parameters
(named) or of a non-empty list of ``{"name", "parameters"}`` calls of the tools ("required"), as vLLM
does; the calls are read from that JSON (:class:`~.tool_parsers.ConstrainedToolCallParser`).

Structured output: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`` (what the openai SDK's ``parse()`` sends), or vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; one constraint per
request. A constraint that does not compile is a 400 naming its field.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from starlette.responses import JSONResponse, Response

from ...engine.params import CompletionOutput, SamplingParams, StructuredOutputs
from .protocol import APIError, ChatCompletionRequest, ChatMessage, MessageToolCall
from .serving import SSE_DONE, EventStream, OpenAIServing, random_id, sse
from .tool_parsers import (TOOL_CALL_PARSERS, ConstrainedToolCallParser, StreamingToolCallParser,
                           check_tool_call_parser, make_tool_call_parser, parse_whole, tool_choice_schema)

__all__ = ["ServingChat"]


def _template_arguments(arguments: Any) -> Any:
    """A history call's arguments as the templates expect them: an object. Qwen2.5's and Hermes'
    templates write ``arguments | tojson``, which would quote OpenAI's JSON string a second time."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _template_tool_call(call: MessageToolCall) -> Dict[str, Any]:
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": _template_arguments(call.function.arguments)}}


def _template_message(m: ChatMessage) -> Dict[str, Any]:
    """A message as the chat template sees it (transformers' convention)."""
    out: Dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def check_tools(tools: Any) -> List[Dict[str, Any]]:
    """OpenAI function tools, each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?: JSON schema object}}``; anything else is a 400 naming ``tools``."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where}: only function tools are supported: {{\"type\": \"function\", "
                                f"\"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}", param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.function.name must be a non-empty string", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object", param="tools")
        if not isinstance(function.get("description", ""), str):
            raise APIError(400, f"{where}.function.description must be a string", param="tools")
    return tools


_TOOL_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
# how the calls of a response are read: None (no tools to parse) or a parser per choice
ParserFactory = Optional[Callable[[], StreamingToolCallParser]]


class ServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_call_parser: Optional[str] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        check_tool_call_parser(tool_call_parser)
        self.tool_call_parser = tool_call_parser

    def render(self, messages: List[ChatMessage], add_generation_prompt: bool,
               tools: Optional[List[Dict[str, Any]]] = None) -> List[int]:
        """Token ids of the conversation (the template writes the special tokens)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        convo = [_template_message(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(convo, add_generation_prompt, tools=tools)
        except Exception as e:  # jinja2's TemplateError: the template refused the conversation
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
        return self.token_ids(self.tokenizer.encode(text, add_special_tokens=False), param="messages")

    def tool_calling(self, req: ChatCompletionRequest) -> Tuple[Optional[List[Dict[str, Any]]], ParserFactory,
                                                                Optional[StructuredOutputs]]:
        """The tools to render, how to read calls from the output, and the constraint that
        "required" or a named function puts on it."""
        tools = check_tools(req.tools) if req.tools else None
        choice = req.tool_choice
        if isinstance(choice, dict) or choice == "required":
            function = None
            if isinstance(choice, dict):
                spec = choice.get("function")
                function = spec.get("name") if isinstance(spec, dict) else None
                if choice.get("type") != "function" or not isinstance(function, str):
                    raise APIError(400, f"tool_choice must be {_TOOL_CHOICES}", param="tool_choice")
                if function not in {t["function"]["name"] for t in tools or []}:
                    raise APIError(400, f"tool_choice names the function {function!r}, which is not among the "
                                        "tools", param="tool_choice")
            elif tools is None:
                raise APIError(400, 'tool_choice "required" needs tools', param="tool_choice")
            structured = StructuredOutputs(json=tool_choice_schema(tools, function))
            return tools, lambda: ConstrainedToolCallParser(function), structured
        if choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice must be {_TOOL_CHOICES}, got {choice!r}", param="tool_choice")
        if tools is None or choice == "none":
            return tools, None, None
        if self.tool_call_parser is None:
            raise APIError(400, "tools need tool calling, which is not enabled on this server: start it with "
                                f"--tool-call-parser {{{'|'.join(TOOL_CALL_PARSERS)}}} (or send tool_choice: "
                                '"none")', param="tools")
        name = self.tool_call_parser
        return tools, lambda: make_tool_call_parser(name), None

    def structured_output(self, req: ChatCompletionRequest,
                          tool_constraint: Optional[StructuredOutputs]) -> Tuple[Optional[StructuredOutputs], Optional[str]]:
        """The request's one output constraint and the field that gave it (None, None: none)."""
        given: List[Tuple[StructuredOutputs, str]] = []
        if tool_constraint is not None:
            given.append((tool_constraint, "tools"))
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                given.append((StructuredOutputs(json_object=True), "response_format"))
            elif fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise APIError(400, 'response_format {"type": "json_schema"} needs json_schema.schema',
                                   param="response_format")
                given.append((StructuredOutputs(json=fmt.json_schema.schema_), "response_format"))
            else:
                raise APIError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                                    f"{fmt.type!r}", param="response_format")
        guided = self.guided(req)
        if guided is not None:
            given.append(guided)
        if len(given) > 1:
            names = ["tool_choice" if f == "tools" else f for _, f in given]
            raise APIError(400, f"one output constraint per request: got {' and '.join(names)}", param=names[1])
        return given[0] if given else (None, None)

    def prepare(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        tools, parse_calls, tool_constraint = self.tool_calling(req)
        structured, structured_param = self.structured_output(req, tool_constraint)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= self.limits.max_logprobs:
                raise APIError(400, f"top_logprobs must be in [0, {self.limits.max_logprobs}], got "
                                    f"{req.top_logprobs}", param="top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        self.check_prompt_logprobs(req)
        ids = self.render(req.messages, req.add_generation_prompt, tools)
        which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = self.max_tokens_for(len(ids), asked, which, prompt_param="messages")
        params = self.sampling_params(req, budget, (req.top_logprobs or 0) if req.logprobs else None, which,
                                      prompt_logprobs=req.prompt_logprobs, structured=structured)
        self.check_capacity(1)
        return ids, params, parse_calls, structured_param

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

    def _message(self, c: CompletionOutput, parse_calls: ParserFactory) -> Tuple[Dict[str, Any], Optional[str]]:
        """The assistant message of a finished completion, and its finish reason."""
        if parse_calls is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        parsed = parse_whole(parse_calls(), c.text)
        if not parsed.calls:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        message = {"role": "assistant", "content": parsed.content,
                   "tool_calls": [call.to_openai() for call in parsed.calls]}
        return message, _finish_reason(c.finish_reason, True)

    async def create(self, req: ChatCompletionRequest) -> Response:
        ids, params, parse_calls, structured_param = self.prepare(req)
        rid = random_id("chatcmpl")
        top = req.top_logprobs or 0
        if req.stream:
            return EventStream(self._stream(req, rid, ids, params, parse_calls, structured_param))
        (out,) = await self.final_outputs(rid, [ids], params, structured_param)
        choices = []
        for c in out.outputs:
            message, finish_reason = self._message(c, parse_calls)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, 0, top),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        usage = self.usage(len(ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens)
        body = {"id": rid, "object": "chat.completion", "created": self.created(), "model": self.model_name,
                "choices": choices, "usage": usage, "system_fingerprint": None}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs, req.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(self, req: ChatCompletionRequest, rid: str, ids: List[int],
                      params: SamplingParams, parse_calls: ParserFactory,
                      structured_param: Optional[str]) -> AsyncIterator[bytes]:
        created, top = self.created(), req.top_logprobs or 0
        opts = req.stream_options
        include_usage = opts is not None and opts.include_usage
        continuous = include_usage and opts.continuous_usage_stats
        sent_text: Dict[int, int] = {}
        sent_tok: Dict[int, int] = {}
        finished = set()
        gen, cached = 0, 0
        parsers = {i: parse_calls() for i in range(params.n)} if parse_calls is not None else {}
        num_calls: Dict[int, int] = {}  # per choice: calls sent so far (their delta indices)

        def chunk(choices: List[Dict[str, Any]], usage=None) -> bytes:
            body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "system_fingerprint": None, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return sse(body)

        def deltas(index: int, text: str, done: bool) -> List[Dict[str, Any]]:
            """The deltas that ``text`` (new output text of choice ``index``) makes: content, then
            each completed call as two deltas (id, type and name; then its arguments)."""
            parser = parsers.get(index)
            if parser is None:
                return [{"content": text}] if text else []
            content, calls = parser.feed(text)
            if done:
                rest, more = parser.finish()
                content, calls = content + rest, calls + more
            out: List[Dict[str, Any]] = [{"content": content}] if content else []
            for call in calls:
                k = num_calls.get(index, 0)
                num_calls[index] = k + 1
                out.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
                out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
            return out

        try:
            usage0 = self.usage(len(ids), 0, 0) if continuous else None
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)], usage0)
            async for _, out in self.run_all(rid, [ids], params, structured_param):
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
                    pieces = deltas(c.index, delta, c.finish_reason is not None) or [{}]
                    finish_reason = _finish_reason(c.finish_reason, num_calls.get(c.index, 0) > 0)
                    usage = self.usage(len(ids), gen, cached) if continuous else None
                    for k, piece in enumerate(pieces):
                        last = k == len(pieces) - 1
                        choice = {"index": c.index, "delta": piece,
                                  "logprobs": self._logprobs(c, t0, top) if k == 0 else None,
                                  "finish_reason": finish_reason if last else None,
                                  "stop_reason": c.stop_reason if last else None}
                        yield chunk([choice], usage)
            if include_usage:
                yield chunk([], self.usage(len(ids), gen, cached))
        except APIError as e:
            yield self.stream_error(e)
        yield SSE_DONE


def _finish_reason(reason: Optional[str], made_calls: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for an output that ended on its own after making calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason
