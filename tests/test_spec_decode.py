"""Speculative decoding in the runner (CPU, float32): a draft model proposes a chain or an
EAGLE-2-style tree, the target verifies it in one forward with tree attention, ``tree_verify`` picks
the accepted path, ``move_kv_slots`` compacts the accepted K/V.

Covers: greedy outputs identical to non-speculative decoding (shipped pair; random checkpoints with
a batch of mixed requests, opt-outs, stop tokens, n > 1, a KV pool small enough to preempt, no
leaked block), KV integrity of target and draft after many accept/reject cycles, seeded sampling
reproducibility, the exactness of sampling (chi-square of the next-token distributions against
the exact marginals and against non-speculative sampling), logprobs, requests whose sampler
features disable speculation, bad arguments, the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.config import default_model_path
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from model_helpers import make_forward_batch

VOCAB = 300
DRAFT_PATH = os.path.join(os.path.dirname(default_model_path()), "tiny-llama-draft")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def _save_llama(path, vocab, layers, seed, lm_scale=8.0, eos=1, hidden=64, from_model=None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=1,
        num_key_value_heads=1, head_dim=64, vocab_size=vocab, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=eos, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        if from_model is not None:  # a truncated copy: the draft agrees with the target often, not always
            sd = from_model.state_dict()
            model.load_state_dict({k: v for k, v in sd.items() if k in model.state_dict()}, strict=True)
        else:
            model.lm_head.weight.mul_(lm_scale)  # sharper distributions: fewer near-ties
    model.save_pretrained(path)
    return model


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random target (2 layers) and a draft made of its first layer (same vocab)."""
    tgt = str(tmp_path_factory.mktemp("spec-target"))
    dft = str(tmp_path_factory.mktemp("spec-draft"))
    m = _save_llama(tgt, VOCAB, 2, seed=0)
    _save_llama(dft, VOCAB, 1, seed=1, from_model=m)
    return tgt, dft


def mixed_batch_workload(target: str):
    """The mixed batch the speculative tests run: 20 greedy requests (a shared 35-token prefix on
    every 3rd, every 4th opting out of speculation, n = 2 on some, every 5th stopping on a token its
    greedy completion emits mid-way, and on eos), with the non-speculative target's outputs:
    ``(prompts, params, ref)``."""
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(35)]
    prompts, params = [], []
    for i in range(20):
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        prompts.append(shared + body if i % 3 == 0 else body)
        kw = dict(GREEDY)
        if i % 4 == 1:
            kw["speculative"] = False  # opts out: decodes normally in the same steps
        if i % 7 == 3:
            kw["n"] = 2
        params.append(SamplingParams(max_tokens=rng.randint(2, 30), **kw))
    base = LLM(target, num_kv_blocks=256, seed=0)
    free_run = base.generate(prompts, params)
    for i in range(2, len(prompts), 5):
        toks = free_run[i].outputs[0].token_ids
        if len(toks) >= 4:
            params[i] = dataclasses.replace(params[i], ignore_eos=False, stop_token_ids=[toks[len(toks) // 2]])
    return prompts, params, base.generate(prompts, params)


def assert_matches_workload(llm, outs, ref):
    """A mixed_batch_workload run: every request's tokens and finish reasons as the reference's, with
    preemption on the way, and speculation that drafted, accepted and rejected."""
    for o, r in zip(outs, ref):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in r.outputs]
        assert [c.finish_reason for c in o.outputs] == [c.finish_reason for c in r.outputs]
    st = llm.stats()
    assert st["num_preemptions"] > 0, st
    assert st["spec_num_verify"] > 0 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    return st


def _assert_no_leak(llm):
    st = llm.stats()
    assert st["num_free_blocks"] == st["num_kv_blocks"], st
    llm.engine_core.block_manager.check_invariants()
    assert all(b.ref_count == 0 for b in llm.engine_core.block_manager.blocks)
    assert not llm.has_unfinished_requests()


# ------------------------------------------------------------------------------------------------
# greedy: identical to non-speculative decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,k", [("chain", 4), ("tree", 8)])
def test_greedy_identical_shipped_pair(mode, k):
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\nclass"]
    sp = SamplingParams(max_tokens=32, **GREEDY)
    base = LLM(seed=0).generate(prompts, sp)
    llm = LLM(draft_model=DRAFT_PATH, spec_mode=mode, num_spec_tokens=k, seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in base]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and st["spec_num_accepted_tokens"] > 0, st
    assert st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st  # rejections happened too
    assert st["target_forwards_per_generated_token"] < 0.5, st  # 2 prompts: < 1 forward per token each
    m = outs[0].metrics
    assert m["spec_num_verify"] > 0 and 0 < m["target_forwards_per_token"] < 1.0, m
    _assert_no_leak(llm)


@pytest.mark.parametrize("mode,k,topk,depth", [("chain", 3, 2, None), ("tree", 6, 2, 4), ("tree", 5, 3, None)])
def test_greedy_identical_mixed_batch_preemption(pair, mode, k, topk, depth):
    tgt, dft = pair
    prompts, params, ref = mixed_batch_workload(tgt)
    llm = LLM(tgt, draft_model=dft, spec_mode=mode, num_spec_tokens=k, spec_tree_topk=topk, spec_tree_depth=depth,
              num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=96, seed=0)
    outs = llm.generate(prompts, params)
    assert_matches_workload(llm, outs, ref)
    for o, p in zip(outs, params):
        if p.speculative is False:
            assert o.metrics["spec_num_verify"] == 0
    # some completions stop on a stop token in the middle of an accepted draft
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    _assert_no_leak(llm)


def test_stream_and_abort_with_speculation(pair):
    tgt, dft = pair
    llm = LLM(tgt, draft_model=dft, spec_mode="tree", num_spec_tokens=4, num_kv_blocks=32, seed=0)
    sp = SamplingParams(max_tokens=20, **GREEDY)
    ref = LLM(tgt, seed=0).generate([9, 8, 7], sp)[0].outputs[0].token_ids
    parts = list(llm.stream([9, 8, 7], sp))
    assert parts[-1].finished and parts[-1].outputs[0].token_ids == ref
    assert len(parts) < len(ref)  # several tokens per step
    it = llm.stream([9, 8, 7, 6], SamplingParams(max_tokens=50, **GREEDY))
    next(it), next(it), next(it)
    it.close()  # aborts mid-generation: blocks of both pools' ids come back
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# KV integrity after many accept/reject cycles
# ------------------------------------------------------------------------------------------------
def _gather(kv_caches, table, n, bs):
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    return [(k.reshape(-1, *k.shape[2:])[slots].clone(), v.reshape(-1, *v.shape[2:])[slots].clone())
            for k, v in kv_caches]


def _fresh_prefill_kv(model, tokens, bs):
    nb = -(-len(tokens) // bs)
    caches = model.allocate_kv_cache(nb, bs)
    model(make_forward_batch(prefill=[(tokens, 0, list(range(nb)))], block_size=bs), caches)
    return _gather(caches, list(range(nb)), len(tokens), bs)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_kv_integrity(pair, mode):
    tgt, dft = pair
    prompt = [random.Random(5).randrange(3, VOCAB) for _ in range(21)]
    sp = SamplingParams(max_tokens=90, **GREEDY)
    llm = LLM(tgt, draft_model=dft, spec_mode=mode, num_spec_tokens=6, spec_tree_topk=2, spec_tree_depth=4,
              num_kv_blocks=64, seed=0)
    rid = llm.add_request(prompt, sp)
    seq = llm.engine_core.requests[rid].seqs[0]
    while seq.num_output_tokens < 60:
        llm.step()
    st = llm.stats()
    assert st["spec_num_verify"] >= 10 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    bs = llm.block_size
    c = seq.num_computed_tokens
    got = _gather(llm.executor.kv_caches, seq.block_table, c, bs)
    # the same tokens, decoded without speculation
    base = LLM(tgt, num_kv_blocks=64, seed=0)
    brid = base.add_request(prompt, sp)
    bseq = base.engine_core.requests[brid].seqs[0]
    while bseq.num_computed_tokens < c:
        base.step()
    assert bseq.token_ids[:c] == seq.token_ids[:c]
    ref = _gather(base.executor.kv_caches, bseq.block_table, c, bs)
    for (gk, gv), (rk, rv) in zip(got, ref):
        torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-5)
    # the draft's pool holds its K/V of every token it claims (compacted tree nodes included)
    dc = llm.engine_core.proposer.draft_computed(seq)
    assert c - 1 <= dc <= c
    dgot = _gather(llm.executor.drafter.kv_caches, seq.block_table, dc, bs)
    dref = _fresh_prefill_kv(llm.draft_model, seq.token_ids[:dc], bs)
    for (gk, gv), (rk, rv) in zip(dgot, dref):
        torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-5)
    # and the target's rows equal a one-shot prefill of the committed tokens
    assert (got[0][0][:dc] - _fresh_prefill_kv(llm.model, seq.token_ids[:dc], bs)[0][0]).abs().max() < 1e-4

    # a second request hits the first one's cached blocks: the draft reuses its K/V of those blocks
    prompt2 = seq.token_ids[:2 * bs + 5] + [7, 8, 9]
    rid2 = llm.add_request(prompt2, SamplingParams(max_tokens=30, **GREEDY))
    seq2 = llm.engine_core.requests[rid2].seqs[0]
    llm.step()
    assert seq2.num_cached_tokens == 2 * bs and llm.engine_core.proposer.draft_computed(seq2) == 2 * bs
    while seq2.num_output_tokens < 12:
        llm.step()
    for model, caches, n in ((llm.model, llm.executor.kv_caches, seq2.num_computed_tokens),
                             (llm.draft_model, llm.executor.drafter.kv_caches,
                              llm.engine_core.proposer.draft_computed(seq2))):
        for (gk, gv), (rk, rv) in zip(_gather(caches, seq2.block_table, n, bs),
                                      _fresh_prefill_kv(model, seq2.token_ids[:n], bs)):
            torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-5)
    llm.abort_request(rid)
    llm.abort_request(rid2)
    base.abort_request(brid)
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# sampling: reproducible and exact
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_seeded_sampling_reproducible(pair, mode):
    tgt, dft = pair
    llm = LLM(tgt, draft_model=dft, spec_mode=mode, num_spec_tokens=4, seed=0)
    prompt = [5, 17, 42, 99, 123]
    others = [[7, 8, 9], [200, 201, 202, 203]]
    sp = SamplingParams(temperature=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    a = llm.generate([prompt] + others, [sp] + [SamplingParams(temperature=1.0, max_tokens=30)] * 2)[0]
    b = llm.generate(others[::-1] + [prompt], [SamplingParams(temperature=0.5, max_tokens=5)] * 2 + [sp])[-1]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    c = llm.generate(prompt, SamplingParams(temperature=0.9, max_tokens=24, seed=4321, ignore_eos=True))[0]
    assert c.outputs[0].token_ids != a.outputs[0].token_ids
    assert a.metrics["spec_num_verify"] > 0


def _chi2_sf(x: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def _gof_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; bins with expected count < 5 are pooled."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < 5
    c = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    e = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = e > 0
    c, e = c[keep], e[keep]
    return _chi2_sf(float(((c - e) ** 2 / e).sum()), int(keep.sum()) - 1)


def _two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    keep = (a + b) >= 10
    a = torch.cat([a[keep], a[~keep].sum().reshape(1)])
    b = torch.cat([b[keep], b[~keep].sum().reshape(1)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    tot = a + b
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    x = float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum())
    return _chi2_sf(x, int(keep.sum()) - 1)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """V = 16: a random target and an unrelated random draft (frequent rejections)."""
    tgt = str(tmp_path_factory.mktemp("sv-target"))
    dft = str(tmp_path_factory.mktemp("sv-draft"))
    t = _save_llama(tgt, 16, 1, seed=10, lm_scale=30.0, eos=15)
    d = _save_llama(dft, 16, 1, seed=11, lm_scale=30.0, eos=15)
    return tgt, dft, t, d


def sample_with_and_without_speculation(target, prompt, n, steps, temperature, **spec):
    """n seeded samples of `steps` tokens after `prompt` with speculation (the LLM arguments `spec`)
    and without: (spec_tokens [n, steps], base_tokens, the speculative LLM); the speculation must have
    verified every request and accepted and rejected some drafts."""
    kw = dict(num_kv_blocks=1200, max_num_seqs=256, seed=0)
    llm = LLM(target, **spec, **kw)
    params = [SamplingParams(temperature=temperature, max_tokens=steps, seed=s, ignore_eos=True) for s in range(n)]
    spec_tokens = torch.tensor([o.outputs[0].token_ids for o in llm.generate([prompt] * n, params)])
    st = llm.stats()
    assert st["spec_num_verify"] >= n and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    base = torch.tensor([o.outputs[0].token_ids for o in LLM(target, **kw).generate([prompt] * n, params)])
    return spec_tokens, base, llm


def assert_marginals_match(spec, base, exact, vocab=16):
    """Per position after the first (token 0 comes from the prefill's ordinary sampling): the
    speculative samples fit the exact marginals and the non-speculative samples."""
    for i in range(1, spec.shape[1]):
        cs = torch.bincount(spec[:, i], minlength=vocab)
        cb = torch.bincount(base[:, i], minlength=vocab)
        assert _gof_pvalue(cs, exact[i]) > 1e-3, (i, cs, exact[i] * spec.shape[0])
        assert _two_sample_pvalue(cs, cb) > 1e-3, (i, cs, cb)


def _exact_marginals(hf, prompt, steps, temperature):
    """Exact marginal distribution of each of the first ``steps`` generated tokens (fp64)."""
    V = hf.config.vocab_size
    seqs = torch.tensor([prompt])
    joint = torch.ones(1, dtype=torch.float64)
    margs = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(seqs).logits[:, -1].double()
            p = torch.softmax(logits / temperature, -1)  # [S, V]
            j = joint[:, None] * p
            margs.append(j.sum(0))
            joint = j.reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(seqs.shape[0])[:, None]], 1)
    return margs


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_distribution_matches(small_vocab_pair, mode):
    tgt, dft, hf_t, hf_d = small_vocab_pair
    temp, steps, n = 0.8, 4, 1500
    prompt = [3, 7, 11, 2, 9]
    spec, base, llm = sample_with_and_without_speculation(tgt, prompt, n, steps, temp, draft_model=dft, spec_mode=mode,
                                                          num_spec_tokens=3, spec_tree_topk=2, spec_tree_depth=3)
    assert_marginals_match(spec, base, _exact_marginals(hf_t, prompt, steps, temp))
    draft_m = _exact_marginals(hf_d, prompt, steps, temp)
    worst_draft = min(_gof_pvalue(torch.bincount(spec[:, i], minlength=16), draft_m[i]) for i in range(1, steps))
    assert worst_draft < 1e-6  # the test can tell the draft's distribution from the target's
    _assert_no_leak(llm)


def test_logprobs_with_speculation(pair):
    tgt, dft = pair
    sp = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    prompt = [5, 17, 42, 99]
    ref = LLM(tgt, seed=0).generate(prompt, sp)[0].outputs[0]
    got = LLM(tgt, draft_model=dft, spec_mode="tree", num_spec_tokens=4, seed=0).generate(prompt, sp)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    for g, r in zip(got.logprobs, ref.logprobs):
        assert g.keys() == r.keys()
        for t in g:
            assert abs(g[t] - r[t]) < 1e-4
    assert abs(got.cumulative_logprob - ref.cumulative_logprob) < 1e-3


def test_unsupported_sampler_features_decode_normally(pair):
    tgt, dft = pair
    prompt = [5, 17, 42, 99]
    sps = [SamplingParams(temperature=0.8, top_k=5, max_tokens=10, seed=1),
           SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=2),
           SamplingParams(temperature=0.8, min_p=0.1, max_tokens=10, seed=3),
           SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10)]
    llm = LLM(tgt, draft_model=dft, num_spec_tokens=3, seed=0)
    outs = llm.generate([prompt] * 4, sps)
    ref = LLM(tgt, seed=0).generate([prompt] * 4, sps)
    for o, r in zip(outs, ref):
        assert o.metrics["spec_num_verify"] == 0
        assert o.outputs[0].token_ids == r.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sliding_window_models_speculate_losslessly(tmp_path, mode):
    """Mistral-style target and draft whose window (16) is shorter than the prompt: tree attention
    applies the window by tree position, so greedy speculation equals plain decoding."""
    transformers = pytest.importorskip("transformers")

    def mistral(path, layers, seed):
        torch.manual_seed(seed)
        m = transformers.MistralForCausalLM(transformers.MistralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=16))
        with torch.no_grad():
            m.lm_head.weight.mul_(8.0)
        m.save_pretrained(path)
        return m

    tgt, dft = str(tmp_path / "t"), str(tmp_path / "d")
    t = mistral(tgt, 2, 0)
    d = mistral(dft, 1, 1)
    d.load_state_dict({k: v for k, v in t.state_dict().items() if k in d.state_dict()})
    d.save_pretrained(dft)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 23, 5)]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    ref = LLM(tgt, seed=0).generate(prompts, sp)
    llm = LLM(tgt, draft_model=dft, spec_mode=mode, num_spec_tokens=6, seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def test_bad_spec_arguments(pair, tmp_path):
    tgt, dft = pair
    with pytest.raises(ValueError, match="spec_mode must be one of"):
        LLM(tgt, draft_model=dft, spec_mode="beam")
    for k in (0, -1, 2.5):
        with pytest.raises(ValueError, match="num_spec_tokens"):
            LLM(tgt, draft_model=dft, num_spec_tokens=k)
    with pytest.raises(ValueError, match="spec_tree_topk"):
        LLM(tgt, draft_model=dft, spec_mode="tree", spec_tree_topk=0)
    with pytest.raises(ValueError, match="spec_tree_depth"):
        LLM(tgt, draft_model=dft, spec_mode="tree", spec_tree_depth=0)
    with pytest.raises(ValueError, match="draft_model directory not found"):
        LLM(tgt, draft_model=str(tmp_path / "nope"))
    other = str(tmp_path / "v301")
    _save_llama(other, VOCAB + 1, 1, seed=2)
    with pytest.raises(ValueError, match="vocab_size 301, the target 300"):
        LLM(tgt, draft_model=other)
    with pytest.raises(ValueError, match="speculative must be"):
        SamplingParams(speculative="yes")


def test_draft_with_other_tokenizer_rejected(tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(DRAFT_PATH, bad)
    with open(bad / "tokenizer.json") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    with open(bad / "tokenizer.json", "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="tokenizer.json differs from the target's"):
        LLM(draft_model=str(bad))


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_cli_generate_and_bench(capsys):
    from fastinfer.entrypoints.cli import main

    assert main(["generate", "--draft-model", DRAFT_PATH, "--prompt", "def main(", "--max-tokens", "12",
                 "--json"]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", "def main(", "--max-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outputs"] == spec_out[0]["outputs"]
    assert main(["bench", "--model", default_model_path(), "--draft-model", DRAFT_PATH, "--spec-mode", "tree",
                 "--num-spec-tokens", "6", "--spec-tree-topk", "2", "--batch", "2", "--input-len", "16",
                 "--output-len", "16", "--compare-no-spec", "--json", "--warmup", "0"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["spec_mode"] == "tree" and res["num_spec_tokens"] == 6
    assert res["spec_verifications"] > 0 and res["mean_accepted_length"] > 0
    assert 0 < res["target_forwards_per_generated_token"] < 1
    assert res["no_spec_target_forwards_per_generated_token"] == pytest.approx(1.0, abs=0.1)
    assert res["greedy_outputs_identical"] == "2/2" and res["speedup_vs_no_spec"] > 0
    assert len(res["acceptance_rate_per_depth"]) >= 1
