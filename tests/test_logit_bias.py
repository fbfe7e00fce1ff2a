"""``logit_bias`` (OpenAI semantics: {token id: bias in [-100, 100]} added to the logits before
sampling, greedy included), offline and through ``fastinfer serve``; and the server's handling of
request fields it does not know (accepted, ignored, logged once per name) against known fields of
the wrong type (400)."""

from __future__ import annotations

import json

import pytest
import torch

from fastinfer import LLM, SamplingParams
from fastinfer.engine.sampler import Sampler, apply_logit_bias

from serve_helpers import client, server  # noqa: F401 (module fixtures)

MODEL = "tiny-llama"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_apply_logit_bias_adds_to_the_biased_rows_only():
    logits = torch.randn(3, 10)
    out = apply_logit_bias(logits.clone(), [{2: 5.0, 7: -1.5}, None, {0: 100.0}])
    want = logits.clone()
    want[0, 2] += 5.0
    want[0, 7] -= 1.5
    want[2, 0] += 100.0
    assert torch.equal(out, want)


def test_bias_steers_greedy_sampling_and_not_the_logprobs():
    logits = torch.randn(2, 10)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0)]
    tokens, lps = Sampler()(logits, params, [[1], [1]], [None, None])
    assert tokens == [3, int(logits[1].argmax())]
    assert lps[0][3] == pytest.approx(float(logits[0].log_softmax(-1)[3]))  # raw distribution


def test_forcing_and_banning_a_token_offline(llm):
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    forced_id = 42
    forced = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={forced_id: 100}))[0]
    assert forced.outputs[0].token_ids == [forced_id] * 6
    banned_id = greedy.outputs[0].token_ids[0]
    banned = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={banned_id: -100}))[0]
    assert banned_id not in banned.outputs[0].token_ids
    # sampled too, and a batch where only one request has a bias
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=6, seed=3, logit_bias={forced_id: 100}),
                                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == [forced_id] * 6
    assert outs[1].outputs[0].token_ids == greedy.outputs[0].token_ids


def test_invalid_logit_bias(llm):
    for bad in ({1: 101}, {1: -100.5}, {-1: 1.0}, {"1": 1.0}, {1: True}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    # a token id past the vocabulary depends on the model: that request finishes with an error
    out = llm.generate([PROMPT], SamplingParams(logit_bias={llm.vocab_size: 1.0}))[0]
    assert out.outputs[0].finish_reason == "error" and "logit_bias" in out.error


# ---- the server ---------------------------------------------------------------------------------
def test_server_logit_bias_forces_and_bans(client, llm):
    def token(tid):
        return llm.tokenizer.decode([tid], skip_special_tokens=False)

    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].logprobs.tokens == [token(42)] * 5
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={str(greedy): -100}, extra_body={"ignore_eos": True})
    assert token(greedy) not in banned.choices[0].logprobs.tokens
    msgs = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=4, temperature=0,
                                          logit_bias={"42": 100}, logprobs=True, extra_body={"ignore_eos": True})
    assert [t.token for t in chat.choices[0].logprobs.content] == [token(42)] * 4


@pytest.mark.parametrize("bias,what", [
    ({"5": 100.5}, "[-100, 100]"),
    ({"5": -101}, "[-100, 100]"),
    ({"abc": 1}, "not a token id"),
    ({"-1": 1}, "not a token id"),
    ({"100000000": 1}, "not a token id"),
    ({"5": "high"}, "valid number"),
    ([5], "object"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_server_bad_logit_bias_is_a_400_naming_it(server, path, bias, what):
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    status, _, raw = server.request("POST", path, dict(body, logit_bias=bias, max_tokens=1))
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "logit_bias" and what in err["message"], err


# ---- unknown request fields ---------------------------------------------------------------------
def test_unknown_fields_are_accepted_ignored_and_logged_once(server, client):
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                        extra_body={"mystery_knob": 3, "guided_whatever": {"a": 1}})
        assert out.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=1, extra_body={"mystery_knob": "again"})
    assert chat.choices[0].finish_reason is not None
    status, _, _ = server.request("POST", "/tokenize", {"prompt": "a", "mystery_knob": 1})
    assert status == 200
    log = server.output()
    assert log.count("'mystery_knob'") == 1 and log.count("'guided_whatever'") == 1, log


@pytest.mark.parametrize("path,field,value,what", [
    ("/v1/completions", "echo", "yes", "valid boolean"),
    ("/v1/completions", "prompt_logprobs", "2", "valid integer"),
    ("/v1/completions", "max_tokens", 1.5, "valid integer"),
    ("/v1/chat/completions", "logprobs", 1, "valid boolean"),
    ("/v1/chat/completions", "logit_bias", "none", "object"),
])
def test_known_fields_of_the_wrong_type_are_a_400(server, path, field, value, what):
    body = {"prompt": "a"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    status, _, raw = server.request("POST", path, dict(body, **{field: value}))
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == field and what in err["message"], err
