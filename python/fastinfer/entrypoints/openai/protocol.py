"""The OpenAI API's request bodies (pydantic, strict JSON: no silent coercion) and its error shape.

Requests carry the OpenAI fields and vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``prompt_logprobs``, ...). A field
OpenAI defines but fastinfer cannot honour (``suffix``, ...) is accepted at its neutral value and
refused otherwise. A top-level field neither API defines is accepted and ignored, as vLLM
does for its clients (which send extras of their own), with one warning per field name in the
server log; a known field of the wrong type is still a 400. Every refusal is an :class:`APIError`,
rendered as OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Literal, Optional, Set, Type, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["APIError", "error_body", "parse_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
           "TokenizeRequest", "DetokenizeRequest", "StreamOptions"]


class APIError(Exception):
    """An error the client caused (4xx) or a server state (503), in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> Dict[str, Any]:
    kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Request(_Strict):
    """A request body: unknown top-level fields are kept aside and ignored (see the module docstring)."""

    model_config = ConfigDict(extra="allow", strict=True)


logger = logging.getLogger("fastinfer.serve")
_warned_fields: Set[str] = set()  # unknown field names already logged


def _warn_ignored(body: BaseModel) -> None:
    for name in sorted(body.model_extra or ()):
        if name not in _warned_fields:
            _warned_fields.add(name)
            logger.warning("ignoring the unknown request field %r (this warning is logged once per field name)",
                           name)


# what the union-typed fields accept, for a readable error
_UNION_HELP = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of content parts ({\"type\": \"text\", \"text\": ...})",
}

M = TypeVar("M", bound=BaseModel)


def parse_body(model: Type[M], body: bytes) -> M:
    """Validate a JSON body; any problem is a 400 naming the field."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type" and not loc:
            raise APIError(400, "the request body must be a JSON object") from None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)}", param=loc[-1]) from None
        field = loc[0] if loc else None
        union = next((k for k in _UNION_HELP if k in loc), None)
        path = ".".join(loc[:loc.index(union) + 1]) if union else ".".join(loc)
        if err["type"] == "missing" and len(loc) == 1:
            raise APIError(400, f"missing required field: {path}", param=field) from None
        raise APIError(400, f"{path}: {_UNION_HELP[union] if union else err['msg']}", param=field) from None
    _warn_ignored(parsed)
    return parsed


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class _Sampling(_Request):
    """The sampling fields both endpoints share."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    # vLLM's structured output fields (one at most; the chat API's response_format is the other way)
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class _Echoed(BaseModel):
    # extra keys (refusal: null, ...) are tolerated on messages: clients echo back what they got
    model_config = ConfigDict(extra="allow", strict=True)


class FunctionCall(_Echoed):
    name: str
    arguments: Union[str, Dict[str, Any]]  # OpenAI sends a JSON string; a dict is accepted too


class MessageToolCall(_Echoed):
    """A tool call of an earlier assistant message, as the response gave it."""

    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Echoed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[MessageToolCall]] = None  # on an assistant message
    tool_call_id: Optional[str] = None  # on a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (the openai SDK's ``parse()`` sends a
    pydantic model's, with ``strict: true``)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: str
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[Dict[str, str]] = None
    service_tier: Optional[str] = None
    # vLLM extension
    add_generation_prompt: bool = True


class TokenizeRequest(_Request):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: List[int]
