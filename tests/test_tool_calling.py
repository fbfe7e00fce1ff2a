"""Tool calling in the chat API: the output parsers (hermes, llama3_json) on hand-written outputs and
split at every position, tools rendered through a chat template (transformers' ``apply_chat_template``
is the oracle), and the server end to end with the pinned ``openai`` client on a scripted engine
(a tiny random model does not call tools on its own)."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from fastinfer.entrypoints.openai.tool_parsers import make_tool_call_parser, parse_tool_calls

WEATHER = {"city": "Paris", "unit": "celsius"}


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# ---- hermes -----------------------------------------------------------------------------------
def test_hermes_one_call_no_content():
    out = parse_tool_calls("hermes", '<tool_call>\n{"name": "get_weather", "arguments": '
                                     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>')
    assert out.content is None
    assert _calls(out) == [("get_weather", WEATHER)]
    assert out.calls[0].id.startswith("call_")


def test_hermes_several_calls_with_text_before_between_and_after():
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n  Done.  ')
    out = parse_tool_calls("hermes", text)
    assert _calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # the whitespace that only separated the text from a call is dropped, the rest is kept
    assert out.content == "Let me check both.Done.  "
    assert len({c.id for c in out.calls}) == 2


def test_hermes_arguments_as_a_json_string_and_missing():
    out = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
                                     '<tool_call>{"name": "g"}</tool_call>')
    assert _calls(out) == [("f", {"a": [1, 2]}), ("g", {})]


def test_hermes_unclosed_block_at_the_end_counts_when_complete():
    out = parse_tool_calls("hermes", 'ok <tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert out.content == "ok" and _calls(out) == [("f", {"x": 1})]
    cut = 'ok <tool_call>{"name": "f", "arguments": {"x": '
    assert parse_tool_calls("hermes", cut).calls == []
    assert parse_tool_calls("hermes", cut).content == cut


@pytest.mark.parametrize("block", [
    '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # malformed JSON
    '<tool_call>["f"]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
])
def test_hermes_malformed_block_stays_content(block):
    text = f"Here: {block} \n"
    assert parse_tool_calls("hermes", text).calls == []
    assert parse_tool_calls("hermes", text).content == text
    # next to a good call, the bad block is content and the good one a call
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    out = parse_tool_calls("hermes", f"{block}\n{good}")
    assert _calls(out) == [("g", {})] and out.content == block


def test_plain_text_is_content_unchanged():
    for name in ("hermes", "llama3_json"):
        for text in ("", "  hello\n", "a <tool_ b", "x < y and {not json}", "<tool_call"):
            out = parse_tool_calls(name, text)
            assert out.calls == [] and out.content == text


# ---- llama3_json ------------------------------------------------------------------------------
def test_llama3_json_whole_message_with_and_without_python_tag():
    for prefix in ("", "<|python_tag|>", "  \n<|python_tag|>"):
        out = parse_tool_calls("llama3_json", prefix + '{"name": "get_weather", "parameters": '
                                                       '{"city": "Paris", "unit": "celsius"}}')
        assert out.content is None and _calls(out) == [("get_weather", WEATHER)]


def test_llama3_json_several_calls_and_arguments_key():
    out = parse_tool_calls("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": '
                                          '"{\\"b\\": 2}"} ;{"name": "h", "parameters": {"n": {"deep": []}}}\n')
    assert _calls(out) == [("f", {"a": 1}), ("g", {"b": 2}), ("h", {"n": {"deep": []}})]


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {"a": 1}',  # malformed
    '{"name": "f", "parameters": {"a": 1}} and then some words',  # not the whole message
    '{"name": "f", "parameters": {}}; ',  # a dangling separator
    '{"name": "f", "parameters": {}}x{"name": "g", "parameters": {}}',  # not separated by ";"
    '{"parameters": {}}',
    'Sure: {"name": "f", "parameters": {}}',  # a call must be the whole message
    '<|python_tag|>print("hi")',
])
def test_llama3_json_not_a_call_is_content(text):
    out = parse_tool_calls("llama3_json", text)
    assert out.calls == [] and out.content == text


# ---- streaming: any split reassembles to the whole-text parse ----------------------------------
STREAM_CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call> bye '),
    ("hermes", 'a <tool_call>{"bad": </tool_call> b <tool_call>{"name": "f", "arguments": {"é": "<tool_call>"}}'),
    ("hermes", "no calls at all, just < and <tool and text\n"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": "x;y"}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", ' {"name": "f", "parameters": {"a": 1}} trailing words'),
    ("llama3_json", "<|python_ta"),
]


def _stream(name, pieces):
    parser = make_tool_call_parser(name)
    content, calls = "", []
    for piece in pieces:
        c, new = parser.feed(piece)
        content, calls = content + c, calls + new
    c, new = parser.finish()
    return content + c, calls + new


@pytest.mark.parametrize("name,text", STREAM_CASES)
def test_streaming_split_at_every_position_reassembles(name, text):
    whole = parse_tool_calls(name, text)
    want = ([(c.name, c.arguments) for c in whole.calls], whole.content or "")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            content, calls = _stream(name, [text[:i], text[i:j], text[j:]])
            assert ([(c.name, c.arguments) for c in calls], content) == want, (i, j)
    content, calls = _stream(name, list(text))  # one character at a time
    assert ([(c.name, c.arguments) for c in calls], content) == want


def test_streaming_emits_text_before_a_call_before_the_call_ends():
    parser = make_tool_call_parser("hermes")
    assert parser.feed("Checking the weather ") == ("Checking the weather", [])
    assert parser.feed('<tool_call>{"name": "f", ') == ("", [])
    content, calls = parser.feed('"arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]
    assert parser.finish() == ("", [])


# ---- rendering: transformers' apply_chat_template is the oracle ---------------------------------
# Qwen2.5's chat template (the tool parts as it writes them), on the shipped tiny model's tokenizer
QWEN_STYLE_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city (°C or °F).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL_ID = "call_0123456789abcdef01234567"
# the history after a call, with the arguments as the templates take them: an object
TEMPLATE_HISTORY = ASK + [
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}]},
    {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": CALL_ID}]


def _tokenizer():
    from fastinfer.engine.config import default_model_path
    from fastinfer.engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def _transformers_render(messages, tools):
    transformers = pytest.importorskip("transformers")
    from fastinfer.engine.config import default_model_path

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{default_model_path()}/tokenizer.json")
    return hf.apply_chat_template(messages, tools=tools, chat_template=QWEN_STYLE_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)


@pytest.mark.parametrize("messages,tools", [(ASK, TOOLS), (TEMPLATE_HISTORY, TOOLS), (ASK, None)])
def test_template_renders_tools_as_transformers_does(messages, tools):
    ours = _tokenizer().apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    assert ours == _transformers_render(messages, tools)
    if tools:
        assert json.dumps(TOOLS[0], ensure_ascii=False) in ours
    else:
        assert "<tools>" not in ours
    if len(messages) > 2:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in ours
        assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in ours


# ---- the server end to end, on a scripted engine -------------------------------------------------
class ScriptedEngine:
    """What the server needs of an :class:`~fastinfer.engine.async_llm.AsyncLLM`, answering every
    request with ``script`` (each completion the same), a few characters per step, one made-up token
    per step; the prompts it got are kept."""

    max_model_len = 4096
    num_waiting = 0
    dead = None
    is_running = True

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.llm = type("ScriptedLLM", (), {"vocab_size": tokenizer.vocab_size})()
        self.script = ""
        self.prompts = []

    def start(self):
        pass

    def shutdown(self, reason=""):
        pass

    def stats(self):
        return {}

    async def generate(self, prompt, params, request_id):
        from fastinfer.engine.params import CompletionOutput, RequestOutput

        ids = prompt["prompt_token_ids"]
        self.prompts.append(self.tokenizer.decode(ids, skip_special_tokens=False))
        steps = [self.script[i:i + 5] for i in range(0, len(self.script), 5)] or [""]
        for k in range(1, len(steps) + 1):
            done = k == len(steps)
            outs = [CompletionOutput(i, "".join(steps[:k]), [7] * k, "stop" if done else None)
                    for i in range(params.n)]
            yield RequestOutput(request_id, None, ids, outs, done)


class ThreadedServer:
    """The real app under uvicorn on a free loopback port, in a thread; stopped with a deadline."""

    def __init__(self, app):
        import threading

        import uvicorn
        from serve_helpers import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def post(self, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def _serve(engine, tool_call_parser):
    from fastinfer.entrypoints.openai.api_server import build_app

    return ThreadedServer(build_app(engine, MODEL, tool_call_parser=tool_call_parser))


MODEL = "scripted"
HERMES_REPLY = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Lyon"}}\n</tool_call>')


@pytest.fixture(scope="module")
def scripted():
    pytest.importorskip("fastapi")
    engine = ScriptedEngine(_tokenizer())
    servers = {name: _serve(engine, name) for name in ("hermes", "llama3_json", None)}
    try:
        yield engine, servers
    finally:
        for s in servers.values():
            s.stop()


def _client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_tool_calls_through_the_openai_client(scripted):
    engine, servers = scripted
    client = _client(servers["hermes"])
    engine.script = HERMES_REPLY
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in engine.prompts[-1]
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will look it up."
        calls = choice.message.tool_calls
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("function", "get_weather", WEATHER), ("function", "get_weather", {"city": "Lyon"})]
        assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    # streamed: the SDK's accumulator reassembles the same message
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert streamed.message.content == "I will look it up."
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]

    # raw chunks: the text streams as content before the calls; each call's id and name come first
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]) == "I will look it up."
    call_deltas = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.id is not None, t.function.name) for t in call_deltas] == [
        (0, True, "get_weather"), (0, False, None), (1, True, "get_weather"), (1, False, None)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the follow-up with the call and its result: rendered as the template renders them
    call = out.choices[0].message.tool_calls[0]
    follow_up = ASK + [out.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    engine.script = "It is 21 °C in Paris."
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS)
    assert answer.choices[0].message.content == "It is 21 °C in Paris."
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
    history = [dict(m) for m in follow_up]
    history[2] = {"role": "assistant", "content": "I will look it up.", "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                      "arguments": json.loads(c.function.arguments)}}
        for c in out.choices[0].message.tool_calls]}
    assert engine.prompts[-1] == _transformers_render(history, TOOLS)


def test_llama3_json_calls_and_plain_answers(scripted):
    engine, servers = scripted
    client = _client(servers["llama3_json"])
    engine.script = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    for stream in (False, True):
        if stream:
            with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS) as s:
                for _ in s:
                    pass
                choice = s.get_final_completion().choices[0]
        else:
            choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", WEATHER)]
    # text that is not a call is the content, unchanged; tool_choice "none": not parsed
    engine.script = "No call {here}"
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert plain.choices[0].message.content == "No call {here}" and plain.choices[0].finish_reason == "stop"
    engine.script = '{"name": "get_weather", "parameters": {}}'
    unparsed = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert unparsed.choices[0].message.content == engine.script and unparsed.choices[0].message.tool_calls is None
    assert json.dumps(TOOLS[0], ensure_ascii=False) in engine.prompts[-1]  # "none" still renders the tools


def test_forced_tool_choice_constrains_and_reads_the_json(scripted):
    """"required" and a named function: the engine gets the JSON schema of the calls as its
    constraint and the calls are read from that JSON (no parser configured), streamed and not;
    an output cut before its JSON closed is content."""
    from fastinfer.entrypoints.openai.tool_parsers import tool_choice_schema

    engine, servers = scripted
    client = _client(servers[None])
    seen = []
    generate = engine.generate

    def spy(prompt, params, request_id):
        seen.append(params.structured)
        return generate(prompt, params, request_id)

    engine.generate = spy
    try:
        cases = [("required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]',
                  [("get_weather", WEATHER)], tool_choice_schema(TOOLS, None)),
                 ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Lyon"}',
                  [("get_weather", {"city": "Lyon"})], TOOLS[0]["function"]["parameters"])]
        for choice, script, calls, schema in cases:
            engine.script = script
            for stream in (False, True):
                kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
                if stream:
                    with client.chat.completions.stream(**kw) as s:
                        for _ in s:
                            pass
                        out = s.get_final_completion().choices[0]
                else:
                    out = client.chat.completions.create(**kw).choices[0]
                assert out.finish_reason == "tool_calls" and not out.message.content
                assert [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls] == calls
                assert seen[-1].json == schema
        engine.script = '[{"name": "get_weather", "parameters": {"ci'
        cut = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
        assert cut.choices[0].message.content == engine.script and cut.choices[0].message.tool_calls is None
    finally:
        engine.generate = generate


def test_tool_choice_schema():
    from fastinfer.entrypoints.openai.tool_parsers import tool_choice_schema

    one = tool_choice_schema(TOOLS[:1], None)
    assert one == {"type": "array", "minItems": 1, "items": {
        "type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                         "parameters": TOOLS[0]["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False}}
    no_params = [{"type": "function", "function": {"name": "ping"}}]
    two = tool_choice_schema(TOOLS + no_params, None)
    assert [c["properties"]["name"]["enum"] for c in two["items"]["anyOf"]] == [["get_weather"], ["ping"]]
    assert tool_choice_schema(no_params, "ping") == {"type": "object", "properties": {}}


BAD_TOOL_REQUESTS = [
    ("hermes", {"tools": "get_weather"}, "tools", "tools"),
    ("hermes", {"tools": [{"type": "retrieval"}]}, "tools", "only function tools"),
    ("hermes", {"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ("hermes", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
     "parameters"),
    ("hermes", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("hermes", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "one output constraint per request"),
    ("hermes", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ("hermes", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ("hermes", {"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}]},
     "messages", "function"),
    (None, {"tools": TOOLS}, "tools", "--tool-call-parser"),
]


@pytest.mark.parametrize("parser,fields,param,message", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_get_a_400_naming_the_field(scripted, parser, fields, param, message):
    engine, servers = scripted
    server = servers[parser]
    status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, **fields})
    error = json.loads(body)["error"]
    assert (status, error["param"]) == (400, param), error
    assert message in error["message"], error
    engine.script = "still here"
    status, body = server.post("/v1/chat/completions", {"model": MODEL, "messages": ASK})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "still here"


def test_tools_with_tool_choice_none_need_no_parser(scripted):
    engine, servers = scripted
    engine.script = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    out = _client(servers[None]).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.content == engine.script and out.choices[0].message.tool_calls is None


def test_serve_options(capsys):
    from fastinfer.entrypoints.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert args.tool_call_parser == "hermes"
    assert main(["serve", "--tool-call-parser", "xml"]) == 2  # refused before the model loads
    assert "unknown tool call parser 'xml' (known: hermes, llama3_json)" in capsys.readouterr().err
