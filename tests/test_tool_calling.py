"""Tool calling in the chat API: the output parsers (hermes, llama3_json) on hand-written outputs and
split at every position, tools rendered through a chat template (transformers' ``apply_chat_template``
is the oracle), and the server end to end with the pinned ``openai`` client on a scripted engine
(a tiny random model does not call tools on its own)."""

from __future__ import annotations

import json

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
    from fastinfer.engine import default_model_path
    from fastinfer.engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path())
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def _transformers_render(messages, tools):
    transformers = pytest.importorskip("transformers")
    from fastinfer.engine import default_model_path

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
