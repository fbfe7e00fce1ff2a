"""Tool calls in a model's output text, in the formats the supported chat templates teach.

``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, any number, anywhere in the text; a block left open when the output ends counts when its
JSON is complete. The text outside the blocks is the message content, less the whitespace that
only separated it from a block.

``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole message is the call(s),
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``;``, optionally
after ``<|python_tag|>``; a message that does not start that way is plain content.

A call whose JSON does not parse, is not an object, has no string ``name`` or whose arguments are
not an object stays in the content as the model wrote it. Names are not checked against the
request's tools: the client sees what the model asked for.

``tool_choice`` "required" or a named function: the output is constrained (structured output) to
the JSON that :func:`tool_choice_schema` gives, and :class:`ConstrainedToolCallParser` reads the
calls from it: for a named function its arguments object, for "required" a list of
``{"name", "parameters"}`` (vLLM's format). Such an output is never content, unless it was cut
before its JSON completed (``max_tokens``): then it is returned as content, as written.

One implementation serves both responses: :class:`StreamingToolCallParser` takes the text as it
is generated and holds back only what may still turn out to be part of a call; :func:`parse_tool_calls`
is the same machine fed the whole text at once, so a streamed response reassembles to the
non-streamed one however the text is split.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["ToolCall", "ParsedOutput", "StreamingToolCallParser", "HermesToolCallParser",
           "Llama3JsonToolCallParser", "ConstrainedToolCallParser", "TOOL_CALL_PARSERS", "parse_tool_calls", "parse_whole",
           "make_tool_call_parser", "check_tool_call_parser", "tool_choice_schema"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> Dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: Optional[str]  # None when there is no text outside the calls
    calls: List[ToolCall]


def _call_from_json(text: str, arguments_keys: Tuple[str, ...]) -> Optional[ToolCall]:
    """The call that ``text`` (one JSON object) describes, or None if it is not a well-formed one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments: Any = {} if key is None else obj[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class StreamingToolCallParser:
    """Feed the generated text piece by piece; each call returns ``(content delta, new calls)``."""

    def feed(self, delta: str) -> Tuple[str, List[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> Tuple[str, List[ToolCall]]:
        """The end of the output: whatever was held back, as content or calls."""
        raise NotImplementedError


class HermesToolCallParser(StreamingToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.pending = ""  # text not yet classified
        self.held_whitespace = ""  # content whitespace that a following call would drop
        self.in_call = False
        self.after_call = False  # the content's leading whitespace is dropped

    def _content(self, text: str) -> str:
        """Emit ``text`` as content, holding back its trailing whitespace (a call may follow)."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return ""
            self.after_call = False
        body = text.rstrip()
        if not body:
            self.held_whitespace += text
            return ""
        out = self.held_whitespace + body
        self.held_whitespace = text[len(body):]
        return out

    def _close_call(self, raw: str) -> Tuple[str, List[ToolCall]]:
        call = _call_from_json(raw.strip(), ("arguments",))
        if call is not None:
            self.held_whitespace, self.after_call = "", True
            return "", [call]
        # not a call: the block is content as written, the whitespace around it kept
        out = self.held_whitespace + self.START + raw
        self.held_whitespace, self.after_call = "", False
        return out, []

    def feed(self, delta: str) -> Tuple[str, List[ToolCall]]:
        self.pending += delta
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0:
                    return content, calls
                text, new = self._close_call(self.pending[:end])
                if not new:
                    text += self.END
                content, calls = content + text, calls + new
                self.pending, self.in_call = self.pending[end + len(self.END):], False
                continue
            start = self.pending.find(self.START)
            if start < 0:
                safe = len(self.pending) - _partial_suffix(self.pending, self.START)
                content += self._content(self.pending[:safe])
                self.pending = self.pending[safe:]
                return content, calls
            # the text before the block; its trailing whitespace stays held until the block is judged
            content += self._content(self.pending[:start])
            self.pending, self.in_call = self.pending[start + len(self.START):], True

    def finish(self) -> Tuple[str, List[ToolCall]]:
        if self.in_call:  # an unclosed block: a call if its JSON is complete
            self.in_call = False
            text, calls = self._close_call(self.pending)
            self.pending = ""
            return text, calls
        out = ("" if self.after_call else self.held_whitespace) + self.pending
        if self.after_call:
            out = out.lstrip()
        self.pending = self.held_whitespace = ""
        return out, []


class Llama3JsonToolCallParser(StreamingToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.pending = ""
        self.decided: Optional[str] = None  # "content" or "calls" once the message's start says

    def _decide(self) -> None:
        head = self.pending.lstrip()
        if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
            return  # too early to tell
        self.decided = "calls" if head.startswith((self.PYTHON_TAG, "{")) else "content"

    def feed(self, delta: str) -> Tuple[str, List[ToolCall]]:
        self.pending += delta
        if self.decided is None:
            self._decide()
        if self.decided == "content":
            out, self.pending = self.pending, ""
            return out, []
        return "", []  # a call is the whole message: judged at the end

    def finish(self) -> Tuple[str, List[ToolCall]]:
        text, self.pending = self.pending, ""
        if self.decided != "calls":
            return text, []
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):]
        calls = self._calls(body)
        return ("", calls) if calls else (text, [])

    @staticmethod
    def _calls(body: str) -> List[ToolCall]:
        """The ``;``-separated calls that make up ``body``, or [] if anything else is there."""
        decoder = json.JSONDecoder()
        calls: List[ToolCall] = []
        pos = 0
        while True:
            while pos < len(body) and body[pos].isspace():
                pos += 1
            try:
                _, end = decoder.raw_decode(body, pos)
            except ValueError:
                return []
            call = _call_from_json(body[pos:end], ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                return calls
            if not rest.startswith(";"):
                return []
            pos = len(body) - len(rest) + 1


class ConstrainedToolCallParser(StreamingToolCallParser):
    """The calls of an output constrained to :func:`tool_choice_schema`, all at the end."""

    def __init__(self, function: Optional[str]) -> None:
        self.function = function  # a named function; None: "required"
        self.text = ""

    def feed(self, delta: str) -> Tuple[str, List[ToolCall]]:
        self.text += delta
        return "", []

    def finish(self) -> Tuple[str, List[ToolCall]]:
        try:
            obj = json.loads(self.text)
        except ValueError:
            return self.text, []
        if self.function is not None:
            items = [{"name": self.function, "parameters": obj}]
        else:
            items = obj if isinstance(obj, list) else []
        calls = [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
                 if isinstance(i, dict) and isinstance(i.get("name"), str) and isinstance(i.get("parameters"), dict)]
        return ("", calls) if calls and len(calls) == len(items) else (self.text, [])


def tool_choice_schema(tools: List[Dict[str, Any]], function: Optional[str]) -> Dict[str, Any]:
    """The JSON schema an output must follow for ``tool_choice`` naming ``function`` (its
    parameters) or "required" (``function`` None: a non-empty list of calls of any of the tools)."""
    def parameters(tool: Dict[str, Any]) -> Dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    if function is not None:
        return parameters(next(t for t in tools if t["function"]["name"] == function))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


TOOL_CALL_PARSERS = {"hermes": HermesToolCallParser, "llama3_json": Llama3JsonToolCallParser}


def check_tool_call_parser(name: Optional[str]) -> None:
    """A ``ValueError`` naming the known parsers unless ``name`` is one of them (or None)."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {', '.join(TOOL_CALL_PARSERS)})")


def make_tool_call_parser(name: str) -> StreamingToolCallParser:
    return TOOL_CALL_PARSERS[name]()


def parse_tool_calls(name: str, text: str) -> ParsedOutput:
    """The calls and the content of a whole output ``text`` in format ``name``."""
    return parse_whole(make_tool_call_parser(name), text)


def parse_whole(parser: StreamingToolCallParser, text: str) -> ParsedOutput:
    """The calls and the content of a whole output ``text``: ``parser`` fed it at once."""
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content += rest
    calls += more
    if not calls:
        return ParsedOutput(text, [])
    return ParsedOutput(content or None, calls)
