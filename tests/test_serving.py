"""``fastinfer serve`` as a real process on a loopback port, driven by the pinned ``openai`` client (the
oracle of the API's shape) and raw HTTP; the offline ``LLM`` is the oracle of the texts.

Two servers per module: the default one, and one with an API key, ``--max-waiting 1`` and
``--max-num-seqs 1`` (auth, overload, graceful shutdown). Everything is bounded in time: the client
timeouts, ``asyncio.wait_for`` around the concurrent clients, the servers' deadlines.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
import torch

openai = pytest.importorskip("openai")

from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.engine.sampler import apply_presence_frequency_penalties  # noqa: E402

from serve_helpers import ServerProcess, client, server, sse_events  # noqa: E402,F401 (module fixtures)

PROMPTS = ["Once upon a time", "The quick brown fox", "def fibonacci(n):"]
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")  # the servers' dtype (serve_helpers.ServerProcess)


def _greedy(**kw):
    return dict(temperature=0.0, **kw)


# ---- the oracle: the offline engine ------------------------------------------------------------
def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert server.request("GET", "/health")[0] == 200


def test_greedy_completions_equal_llm_generate(client, llm):
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    for p, r in zip(PROMPTS, ref):
        out = client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
        assert out.choices[0].text == r.outputs[0].text
        assert out.choices[0].finish_reason == r.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(r.prompt_token_ids)
        assert out.usage.completion_tokens == len(r.outputs[0].token_ids)
    # a batch of prompts, token ids among them: one choice per prompt, in order
    ids = llm.tokenizer.encode(PROMPTS[1])
    out = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=8, temperature=0)
    ref = llm.generate([ids, ids[:3]], SamplingParams(temperature=0.0, max_tokens=8))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in ref]


def test_greedy_chat_equals_llm_chat(client, llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    ref = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=12))[0]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # content parts are the same text
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             msgs[1]]
    out2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12, temperature=0)
    assert out2.choices[0].message.content == ref.outputs[0].text


def test_streaming_equals_non_streaming(client):
    for p in PROMPTS:
        full = client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        assert all(c.usage is None for c in chunks[:-1])
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_and_seed_equal_llm(client, llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12)
    ref = [c.text for c in llm.generate([PROMPTS[0]], sp)[0].outputs]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, temperature=1.0, seed=1234, max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == ref
    assert len(set(ref)) > 1  # the seeds of the 3 completions differ
    # streamed n > 1: per choice, the deltas add up to the same texts
    texts = ["", "", ""]
    for ch in client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, temperature=1.0, seed=1234,
                                        max_tokens=12, stream=True):
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == ref
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          temperature=1.0, seed=5, max_tokens=8)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                           temperature=1.0, seed=5, max_tokens=8)
    assert [c.message.content for c in chat.choices] == [c.message.content for c in again.choices]


def test_stop_strings(client, llm):
    text = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    ref = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert ref.finish_reason == "stop" and stop not in ref.text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert streamed == ref.text


def test_logprobs(client, llm):
    ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tid, got, top, want in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        assert got == pytest.approx(want[tid], abs=1e-4)
        assert len(top) == 3 and max(top.values()) == pytest.approx(got, abs=1e-6)  # greedy: the best one
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_sampling_extras_equal_llm(client, llm):
    """Penalties, top-k/top-p/min-p and ignore_eos reach the engine (same output as LLM with them)."""
    kw = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3, top_k=20, top_p=0.9, min_p=0.05)
    ref = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True,
                                                     **kw))[0].outputs[0]
    plain = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=3, max_tokens=20))[0].outputs[0]
    assert ref.text != plain.text
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0.8, seed=3,
                                    presence_penalty=1.5, frequency_penalty=0.7,
                                    extra_body=dict(repetition_penalty=1.3, top_k=20, min_p=0.05, ignore_eos=True),
                                    top_p=0.9)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == 20


def test_presence_frequency_penalty_hand_example():
    """OpenAI's definition (platform.openai.com/docs/advanced-usage, "frequency and presence
    penalties"): mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = apply_presence_frequency_penalties(logits.clone(), [[3, 3, 1]], [0.5], [0.25])
    # token 3 seen twice: 4 - 2 * 0.25 - 0.5 = 3.0; token 1 once: 2 - 0.25 - 0.5 = 1.25
    assert out.tolist() == [[1.0, 1.25, 3.0, 3.0]]


def test_tokenize_detokenize(server, llm):
    st, _, body = server.request("POST", "/tokenize", {"model": MODEL, "prompt": PROMPTS[0]})
    assert st == 200
    res = json.loads(body)
    assert res["tokens"] == llm.tokenizer.encode(PROMPTS[0]) and res["count"] == len(res["tokens"])
    assert res["max_model_len"] == llm.max_model_len
    st, _, body = server.request("POST", "/detokenize", {"tokens": res["tokens"]})
    assert st == 200 and json.loads(body)["prompt"] == llm.tokenizer.decode(res["tokens"])
    msgs = [{"role": "user", "content": "hi"}]
    st, _, body = server.request("POST", "/tokenize", {"messages": msgs})
    assert json.loads(body)["tokens"] == llm.tokenizer.apply_chat_template(msgs, tokenize=True)


# ---- load -------------------------------------------------------------------------------------
def test_64_concurrent_streams(server):
    before = server.wait_idle()
    N = 64
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(N)]
    lengths = [8 + (i * 7) % 33 for i in range(N)]

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def stream(i):
            text, usage = "", None
            s = await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
            async for ch in s:
                if ch.choices:
                    text += ch.choices[0].text
                if ch.usage is not None:
                    usage = ch.usage
            return text, usage

        async def whole(i):
            r = await ac.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0,
                                            extra_body={"ignore_eos": True})
            return r.choices[0].text, r.usage

        try:
            streamed = await asyncio.gather(*[stream(i) for i in range(N)])
            whole_ = await asyncio.gather(*[whole(i) for i in range(N)])
        finally:
            await ac.close()
        return streamed, whole_

    streamed, whole = asyncio.run(asyncio.wait_for(run(), 150))
    for i in range(N):
        assert streamed[i][1].completion_tokens == lengths[i] == whole[i][1].completion_tokens
        assert streamed[i][0] == whole[i][0], i
    after = server.wait_idle()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["fastinfer:request_success_total"] == 2 * N
    assert d["fastinfer:generation_tokens_total"] == 2 * sum(lengths)
    assert d["fastinfer:prompt_tokens_total"] == sum(2 * u.prompt_tokens for _, u in streamed)
    assert d["fastinfer:time_to_first_token_seconds_count"] == 2 * N
    assert d["fastinfer:e2e_request_latency_seconds_count"] == 2 * N
    assert d["fastinfer:request_aborted_total"] == 0
    assert after["fastinfer:kv_cache_free_blocks"] == after["fastinfer:kv_cache_total_blocks"]  # no leak
    assert after["fastinfer:kv_cache_usage_perc"] == 0.0


def test_disconnect_aborts_and_frees_blocks(server, client):
    before = server.wait_idle()
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=900, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for p in PROMPTS]
    for s in streams:
        for _, _ch in zip(range(3), s):
            pass
    busy = server.metrics()
    assert busy["fastinfer:kv_cache_free_blocks"] < busy["fastinfer:kv_cache_total_blocks"]
    for s in streams:
        s.close()
    mid = server.wait_idle(timeout=10)
    assert mid["fastinfer:kv_cache_free_blocks"] == mid["fastinfer:kv_cache_total_blocks"]
    assert mid["fastinfer:request_aborted_total"] - before["fastinfer:request_aborted_total"] == 3
    # a non-streaming request whose client leaves: raw socket, closed while it runs (holds blocks)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 900, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while server.metrics()["fastinfer:kv_cache_free_blocks"] == mid["fastinfer:kv_cache_total_blocks"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    t0 = time.monotonic()
    after = server.wait_idle(timeout=10)
    assert time.monotonic() - t0 < 10
    assert after["fastinfer:kv_cache_free_blocks"] == after["fastinfer:kv_cache_total_blocks"]
    assert after["fastinfer:request_aborted_total"] - before["fastinfer:request_aborted_total"] == 4
    assert after.get("fastinfer:request_success_total", 0) == before.get("fastinfer:request_success_total", 0)


# ---- bad input --------------------------------------------------------------------------------
LONG = " ".join(["word"] * 1100)
BAD = [  # (path, body, status, a piece of the message, param)
    ("/v1/completions", b'{"model": "tiny-llama", "prompt": "a"', 400, "not valid JSON", None),
    ("/v1/completions", b"[1, 2]", 400, "JSON object", None),
    ("/v1/completions", b"", 400, "not valid JSON", None),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "valid integer", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "valid number", "temperature"),
    ("/v1/completions", {"prompt": {"text": "a"}}, 400, "must be a string", "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": [1]}, 400, "must be a string", "stop"),
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"bogus": 1}}, 400,
     "Unrecognized request argument", "bogus"),
    ("/v1/completions", {}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": 2.5}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, 400, "top_k", "top_k"),
    ("/v1/completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p", "min_p"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty", "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": -3}, 400, "frequency_penalty", "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n must be", "n"),
    ("/v1/completions", {"prompt": "a", "n": 17}, 400, "--max-n", "n"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1023}, 400, "maximum context length is 1024", "max_tokens"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400, "maximum context length is 1024", "max_tokens"),
    ("/v1/completions", {"prompt": [5000]}, 400, "outside the vocabulary", "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "empty", "prompt"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400, "[-100, 100]", "logit_bias"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "does not exist", "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "needs logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "maximum context length",
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000}, 400,
     "maximum context length", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404,
     "does not exist", "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools", "tools"),
    ("/v1/nothing-here", {}, 404, "Not Found", None),
    ("/tokenize", {"prompt": "a", "messages": []}, 400, "exactly one", "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
]


@pytest.mark.parametrize("path,body,status,msg,param", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(server, path, body, status, msg, param):
    st, _, raw = server.request("POST", path, body)
    assert st == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert msg in err["message"], err
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


def test_bad_input_through_the_client_then_still_serving(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", temperature=9)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
    assert "maximum context length" in e.value.body["message"]
    st, _, raw = server.request("POST", "/v1/completions", b"x" * (4 << 20 | 1))
    assert st == 413 and "--max-body-bytes" in json.loads(raw)["error"]["message"]
    st, _, raw = server.request("GET", "/v1/completions")
    assert st == 405 and "error" in json.loads(raw)
    # still serving
    assert server.request("GET", "/health")[0] == 200
    out = client.completions.create(model=MODEL, prompt="a", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    m = server.wait_idle()
    assert m["fastinfer:kv_cache_free_blocks"] == m["fastinfer:kv_cache_total_blocks"]


# ---- the guarded server: API key, --max-waiting, shutdown -----------------------------------------
@pytest.fixture(scope="module")
def guarded():
    s = ServerProcess("--api-key", "sekret", "--max-waiting", "1", "--max-num-seqs", "1")
    try:
        yield s
    finally:
        s.stop()


def test_api_key(guarded):
    bad = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    st, _, raw = guarded.request("POST", "/v1/completions", {"prompt": "a"})
    assert st == 401 and "Missing API key" in json.loads(raw)["error"]["message"]
    assert guarded.request("GET", "/health")[0] == 200  # not under /v1
    good = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="sekret", max_retries=0, timeout=30)
    assert good.completions.create(model=MODEL, prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_max_waiting_503_with_retry_after(guarded):
    c = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="sekret", max_retries=0, timeout=60)
    long = dict(model=MODEL, prompt="a", max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    a = c.completions.create(**long)
    next(iter(a))  # A runs (max_num_seqs 1) ...
    b = c.completions.create(**long)  # ... B waits
    deadline = time.monotonic() + 10
    while guarded.metrics()["fastinfer:num_requests_waiting"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=MODEL, prompt="a", max_tokens=2)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert e.value.body["code"] == "overloaded"
    a.close()
    b.close()
    m = guarded.wait_idle()
    assert m["fastinfer:kv_cache_free_blocks"] == m["fastinfer:kv_cache_total_blocks"]
    assert c.completions.create(model=MODEL, prompt="a", max_tokens=2).choices[0].finish_reason is not None


def test_sigterm_ends_streams_with_an_error_event(guarded):
    import os
    import signal

    c = openai.OpenAI(base_url=guarded.base_url + "/v1", api_key="sekret", max_retries=0, timeout=60)
    s = c.completions.with_streaming_response.create(model=MODEL, prompt="a", max_tokens=900, stream=True,
                                                     extra_body={"ignore_eos": True})
    with s as resp:
        it = resp.iter_bytes()
        raw = next(it)
        os.kill(guarded.proc.pid, signal.SIGTERM)
        for b in it:
            raw += b
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_dead" and "shutting down" in events[-2]["error"]["message"]
    assert all("choices" in e for e in events[:-2])
    assert guarded.proc.wait(20) == 0


# ---- bench/serve.py -------------------------------------------------------------------------------
def test_bench_serve_end_to_end(server, tmp_path):
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "serve.py")
    before = server.wait_idle()
    runs = [("mixed", ["--num-prompts", "6", "--request-rate", "20", "--input-max", "40", "--output-max", "9"]),
            ("shared-prefix", ["--num-prompts", "3", "--prefix-len", "40", "--prefix-output", "3"])]
    for workload, extra in runs:
        out = tmp_path / f"{workload}.json"
        p = subprocess.run([sys.executable, script, "--base-url", server.base_url, "--workload", workload,
                            "--json", str(out), *extra], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        r = json.loads(out.read_text())
        n = int(extra[1])
        assert r["completed"] == n and r["failed"] == 0
        assert r["output_tokens"] == r["requested_output_tokens"]  # ignore_eos: exactly what was asked
        assert 0 < r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"] and r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["output_throughput"] > 0 and r["tpot_ms"]["p50"] > 0
    after = server.wait_idle()
    assert after["fastinfer:request_success_total"] - before.get("fastinfer:request_success_total", 0) == 9
