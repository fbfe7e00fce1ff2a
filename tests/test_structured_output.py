"""Structured output in the engine (CPU, float32, the shipped tiny model and its draft): the
constraints of ``SamplingParams(structured=StructuredOutputs(...))`` (JSON schema, JSON object,
regex, choice, EBNF grammar) hold on every completion, and the masked decoding keeps the engine's
guarantees: n > 1, seeds, stop strings, preemption and re-prefill (same tokens as with a roomy
pool), speculative decoding (greedy: the same tokens as without a draft, chain and tree), mixed
batches (an unconstrained request's tokens do not change). xgrammar is the oracle of what a
grammar allows: its own matcher re-checks each output token by token.

The tiny model's weights are random: without the mask its output matches none of the constraints
(checked), so a passing test shows the mask at work.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from fastinfer.engine.config import default_model_path
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams, StructuredOutputs

xgr = pytest.importorskip("xgrammar")

DRAFT = os.path.join(os.path.dirname(default_model_path()), "tiny-llama-draft")
SCHEMA = {"type": "object",
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["color", "ok", "size"]}
REGEX = r"[ab]{2,5}c(x|yz)"
GRAMMAR = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [0-9] | "n"'
CHOICE = ["alpha", "beta", "gamma delta"]
PROMPTS = ["Hello there", "The answer is", "1 2 3"]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=128, seed=0)


def greedy(spec, **kw):
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 48), structured=spec, **kw)


def check(kind, text):
    if kind == "json":
        obj = json.loads(text)
        assert set(obj) == {"color", "ok", "size"} and obj["color"] in ("red", "green", "blue")
        assert isinstance(obj["ok"], bool) and isinstance(obj["size"], int) and 0 <= obj["size"] <= 99
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    elif kind == "grammar":
        assert re.fullmatch(r"\([0-9n](,[0-9n]){0,2}\)", text), text
    else:
        assert isinstance(json.loads(text), dict), text


SPECS = {"json": StructuredOutputs(json=SCHEMA), "regex": StructuredOutputs(regex=REGEX),
         "choice": StructuredOutputs(choice=CHOICE), "grammar": StructuredOutputs(grammar=GRAMMAR),
         "json_object": StructuredOutputs(json_object=True)}


def replay(llm, spec, token_ids):
    """xgrammar's matcher accepts the completion token by token and ends complete (EOS included)."""
    backend = llm.executor.grammar
    m = xgr.GrammarMatcher(backend.compiled(spec))
    for t in token_ids:
        assert m.accept_token(t), f"token {t} refused by the grammar"
    return m


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_constraints_hold(llm, kind):
    spec = SPECS[kind]
    outs = llm.generate(PROMPTS, greedy(spec))
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        check(kind, c.text)
        assert replay(llm, spec, c.token_ids).is_terminated()
    # without the constraint the random model writes none of it: the mask is what made it hold
    for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=48)):
        with pytest.raises((AssertionError, ValueError)):
            check(kind, o.outputs[0].text)


def test_json_object_sampled(llm):
    """Any JSON object, sampled: an output that ended is an object; one cut by max_tokens is a
    prefix the grammar accepts."""
    spec = SPECS["json_object"]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=3, max_tokens=64, structured=spec))
    for o in outs:
        c = o.outputs[0]
        m = replay(llm, spec, c.token_ids)
        if c.finish_reason == "stop":
            assert m.is_terminated()
            check("json_object", c.text)
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")


def test_n_and_seeds(llm):
    """n > 1 sampled completions each hold; a seed reproduces them exactly."""
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=48, structured=SPECS["regex"])
    a = llm.generate(PROMPTS[:2], params)
    b = llm.generate(PROMPTS[:2], params)
    for oa, ob in zip(a, b):
        assert [c.token_ids for c in oa.outputs] == [c.token_ids for c in ob.outputs]
        for c in oa.outputs:
            assert c.finish_reason == "stop"
            check("regex", c.text)
        assert len({c.text for c in oa.outputs}) > 1  # sampled: the completions differ


def test_stop_string_cuts_a_constrained_output(llm):
    spec = StructuredOutputs(regex=r"ab{30}c")
    out = llm.generate("x", SamplingParams(temperature=0.0, max_tokens=40, stop=["bbb"], structured=spec))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "bbb" and re.fullmatch(r"ab{0,2}", c.text), c.text


def test_mixed_batch_and_preemption():
    """Constrained and free requests in one batch with a pool small enough to preempt and chunked
    prefill: the same tokens as each request alone with a roomy pool."""
    roomy = LLM(dtype="float32", num_kv_blocks=128, seed=0)
    prompts = [f"{p} {i}" * 6 for i in range(4) for p in PROMPTS]
    kinds = ["json", "regex", None, "grammar", "choice", None] * 2
    params = [greedy(SPECS[k], max_tokens=40) if k else SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
              for k in kinds]
    ref = [roomy.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    small = LLM(dtype="float32", num_kv_blocks=14, max_num_seqs=12, max_num_batched_tokens=64, seed=0)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert small.stats()["num_preemptions"] > 0
    for o, k in zip(outs, kinds):
        if k:
            check(k, o.outputs[0].text)
    assert small.executor.grammar._matchers == {}  # finished sequences dropped their matchers


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculative_decoding_greedy_matches_plain(llm, mode):
    """Draft tokens are verified against the grammar-masked target logits (each node's mask from the
    matcher advanced along its path, then rolled back): greedy gives the plain masked tokens."""
    spec_llm = LLM(dtype="float32", num_kv_blocks=128, seed=0, draft_model=DRAFT, spec_mode=mode, num_spec_tokens=4)
    for kind in ("json", "regex", "grammar"):
        params = greedy(SPECS[kind], max_tokens=48)
        ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        got = spec_llm.generate(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in got] == ref, kind
    st = spec_llm.stats()
    assert st["spec_num_accepted_tokens"] > 0, st


def test_speculative_sampling_holds(llm):
    spec_llm = LLM(dtype="float32", num_kv_blocks=128, seed=0, draft_model=DRAFT, spec_mode="chain", num_spec_tokens=3)
    outs = spec_llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=48,
                                                     structured=SPECS["json"]))
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            check("json", c.text)


BAD = [
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema does not compile"),
    (StructuredOutputs(json='{"type": "object"'), "JSON schema does not compile"),
    (StructuredOutputs(regex="(ab"), "regex does not compile"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar does not compile"),
]


@pytest.mark.parametrize("spec,message", BAD, ids=["schema", "json-text", "regex", "grammar"])
def test_constraint_that_does_not_compile_is_an_error(llm, spec, message):
    outs = llm.generate(["ok", "fine"], [SamplingParams(max_tokens=4, structured=spec), SamplingParams(max_tokens=4)])
    assert outs[0].error is not None and message in outs[0].error and outs[0].error.startswith("structured output")
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) > 0


@pytest.mark.parametrize("kw,message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(choice=[]), "choice must be"),
    (dict(choice=["a", ""]), "choice must be"),
    (dict(regex=""), "regex must be"),
    (dict(json=3), "json must be"),
])
def test_bad_structured_params(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured=StructuredOutputs(**kw))


def test_ignore_eos_is_refused():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=StructuredOutputs(regex="a"), ignore_eos=True)


def test_compiled_once(llm):
    backend = llm.executor.grammar
    a = backend.compiled(StructuredOutputs(json=dict(SCHEMA)))
    b = backend.compiled(StructuredOutputs(json=json.dumps(SCHEMA, sort_keys=True)))
    assert a is b


def test_tree_bitmask_follows_each_path(llm):
    """Each node's row is the matcher's mask after the node's path; refused nodes are skipped; the
    matcher is back at the committed state afterwards."""
    from fastinfer.engine.sequence import Request, Sequence
    from fastinfer.reference.sampling import unpack_token_bitmask

    tok = llm.tokenizer
    spec = StructuredOutputs(regex=r"ab(c|d)e")
    req = Request("t", [5, 6], SamplingParams(structured=spec))
    seq = Sequence(0, req, 0, [5, 6], req.params)
    a, b, c, d, z = (tok.token_to_id(x) for x in "abcdz")
    backend = llm.executor.grammar
    seq.token_ids.append(a)  # committed: "a" (the root is the last committed token)
    tokens, parents = [a, b, z, c, d, c], [-1, 0, 0, 1, 1, 2]
    mask, nodes = backend.tree_bitmask(seq, tokens, parents)
    assert nodes == [0, 1, 3, 4]  # node 2 ("z") is refused, and its child 5 with it
    allowed = unpack_token_bitmask(mask, llm.vocab_size)
    for node, text in [(0, "a"), (1, "ab"), (3, "abc"), (4, "abd")]:
        m = xgr.GrammarMatcher(backend.compiled(spec))
        for ch in text:
            assert m.accept_token(tok.token_to_id(ch))
        want = xgr.allocate_token_bitmask(1, llm.vocab_size)
        m.fill_next_token_bitmask(want)
        assert (allowed[node] == unpack_token_bitmask(want, llm.vocab_size)[0]).all(), node
    # rolled back: the root's mask again (the matcher stands after the committed "a")
    again, _ = backend.tree_bitmask(seq, [a], [-1])
    assert torch.equal(again[0], mask[0])
    assert allowed[0, b] and not allowed[0, c]


def test_vocab_metadata():
    from fastinfer.engine.structured import vocab_metadata

    assert vocab_metadata(json.dumps({"decoder": {"type": "ByteLevel"}})) == ("byte_level", False)
    seq = {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    assert vocab_metadata(json.dumps({"decoder": seq})) == ("byte_fallback", False)
    meta = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}
    assert vocab_metadata(json.dumps({"decoder": meta})) == ("raw", True)
    assert vocab_metadata(json.dumps({"decoder": None})) == ("raw", False)
