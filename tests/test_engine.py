"""Engine tests (CPU, float32, tiny random Llama checkpoints written by ``transformers``).

Covers: parity with transformers' greedy generate, batch invariance under continuous batching with
preemption + prefix caching + chunked prefill (and no leaked blocks), seeded sampling, the sampler's
logits processors on hand-made logits, stop strings / stop token ids / max_tokens, logprobs, n > 1,
per-request errors, streaming, the tokenizer (round trip, chat template, incremental detokenisation).
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.block_manager import BlockManager
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.engine.sampler import Sampler, apply_repetition_penalty, apply_top_k_top_p_min_p
from fastinfer.engine.sequence import Request, Sequence
from fastinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer

VOCAB = 300
TEXTS = [
    "Once upon a time there was a tiny llama who liked to run fast.",
    "The quick brown fox jumps over the lazy dog. Café, naïve, déjà vu, 東京, emoji 🦙!",
    "Hello world! Paged attention splits the KV cache into blocks of sixteen tokens.",
    "user: hi\nassistant: hello, how can I help you today?",
] * 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _make_tokenizer(path: str) -> int:
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 4, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, f)
    assert tok.get_vocab_size() <= VOCAB
    return tok.token_to_id("</s>")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    eos = _make_tokenizer(path)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=VOCAB, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=eos, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions than the default init: fewer near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", num_kv_blocks=128, seed=0)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def _rand_prompts(rng: random.Random, n: int, shared_prefix: list) -> list:
    prompts = []
    for i in range(n):
        body = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 40))]
        prompts.append(shared_prefix + body if i % 3 == 0 else body)
    return prompts


# ------------------------------------------------------------------------------------------------
def test_greedy_matches_transformers(ckpt, llm):
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    prompt = [5, 17, 42, 99, 123, 7, 8, 250]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0]
    assert out.outputs[0].token_ids == ref
    assert out.outputs[0].finish_reason == "length"


def test_batch_invariance_preemption_prefix_cache(ckpt, llm):
    rng = random.Random(1)
    shared = [rng.randrange(1, VOCAB) for _ in range(35)]
    prompts = _rand_prompts(rng, 48, shared)
    params = [SamplingParams(max_tokens=rng.randint(1, 20), **GREEDY) for _ in prompts]
    # alone (one request at a time, roomy KV pool)
    ref = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    # together: small pool forces preemption; small token budget forces chunked prefill
    small = LLM(ckpt, dtype="float32", num_kv_blocks=20, max_num_seqs=24, max_num_batched_tokens=96)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o, sp in zip(outs, params))
    st = small.stats()
    assert st["num_preemptions"] > 0, st
    assert st["prefix_cache_hits"] > 0, st
    assert st["num_free_blocks"] == st["num_kv_blocks"], st  # nothing leaked
    small.engine_core.block_manager.check_invariants()
    assert all(b.ref_count == 0 for b in small.engine_core.block_manager.blocks)
    assert not small.has_unfinished_requests()


def test_chunked_prefill_same_output(ckpt, llm):
    prompts = [list(range(1, 60)), list(range(100, 133)), [7]]
    sp = SamplingParams(max_tokens=8, **GREEDY)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    chunked = LLM(ckpt, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, sp)] == ref


def test_prefix_cache_hit_same_output(ckpt):
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=64)
    p = list(range(1, 50))
    sp = SamplingParams(max_tokens=6, **GREEDY)
    a = eng.generate(p, sp)[0]
    b = eng.generate(p, sp)[0]
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 48
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seeded_sampling_reproducible(llm):
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    sp = lambda s: SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)  # noqa: E731
    a = llm.generate(p, sp(123))[0].outputs[0].token_ids
    others = [[i + 1, i + 2, i + 3] for i in range(5)]
    batch = llm.generate([others[0], p, *others[1:]], [sp(7), sp(123)] + [SamplingParams(temperature=1.0)] * 4)
    assert batch[1].outputs[0].token_ids == a
    c = llm.generate(p, sp(124))[0].outputs[0].token_ids
    assert c != a


def test_n_completions_share_prompt(ckpt):
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=64)
    p = list(range(1, 40))  # 2 full blocks + 7 tokens
    g = eng.generate(p, SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0].token_ids
    eng.reset_prefix_cache()
    out = eng.generate(p, SamplingParams(n=3, max_tokens=10, **GREEDY))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == g for c in out.outputs)  # forks see the same KV
    s = eng.generate(p, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in s.outputs}) > 1
    one = eng.generate(p, SamplingParams(n=3, max_tokens=1, **GREEDY))[0]  # parent finishes at once
    assert all(c.token_ids == g[:1] and c.finish_reason == "length" for c in one.outputs)
    assert eng.stats()["num_free_blocks"] == 64
    eng.engine_core.block_manager.check_invariants()


def test_max_tokens_and_stop_token_ids(llm):
    p = [10, 20, 30]
    base = llm.generate(p, SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop_tok = base.token_ids[4]
    first = base.token_ids.index(stop_tok)
    o = llm.generate(p, SamplingParams(max_tokens=10, stop_token_ids=[stop_tok], **GREEDY))[0].outputs[0]
    assert o.token_ids == base.token_ids[: first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok


def test_eos_stops_unless_ignored(ckpt):
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=32)
    base = eng.generate([1, 2], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0]
    eng.engine_core.eos_token_ids = {base.token_ids[2]}
    o = eng.generate([1, 2], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == base.token_ids[2]
    assert len(o.token_ids) == base.token_ids.index(base.token_ids[2]) + 1
    o = eng.generate([1, 2], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0]
    assert o.token_ids == base.token_ids


def test_stop_strings_truncate(llm):
    p = "Once upon a time"
    base = llm.generate(p, SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    text = base.text
    assert len(text) >= 6, text
    stop = text[3:5]
    o = llm.generate(p, SamplingParams(max_tokens=24, stop=[stop, "\x00never"], **GREEDY))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[: text.index(stop)]
    assert stop not in o.text
    o2 = llm.generate(p, SamplingParams(max_tokens=24, stop=stop, include_stop_str_in_output=True, **GREEDY))[0]
    assert o2.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_logprobs(llm):
    o = llm.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.8, seed=1, logprobs=3,
                                               ignore_eos=True))[0].outputs[0]
    assert len(o.logprobs) == 5
    for tok, d in zip(o.token_ids, o.logprobs):
        assert tok in d and 3 <= len(d) <= 4
        assert all(v <= 0 for v in d.values())
    full = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, logprobs=VOCAB, **GREEDY))[0].outputs[0]
    for tok, d in zip(full.token_ids, full.logprobs):
        assert len(d) == VOCAB
        assert abs(torch.logsumexp(torch.tensor(list(d.values())), 0).item()) < 1e-4
        assert d[tok] == max(d.values())  # greedy picks the most likely
    assert math.isclose(full.cumulative_logprob, sum(d[t] for t, d in zip(full.token_ids, full.logprobs)),
                        rel_tol=1e-5)


def test_bad_inputs_per_request(llm):
    ok = [5, 6, 7]
    outs = llm.generate([ok, [], list(range(1, 250)) * 2, [1, VOCAB + 5], "text ok"],
                        SamplingParams(max_tokens=4, **GREEDY))
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 4
    for o, word in zip(outs[1:4], ["empty", "max_model_len", "vocabulary"]):
        assert o.finished and o.outputs[0].finish_reason == "error" and word in o.error
    assert outs[4].outputs[0].finish_reason == "length"
    for bad in [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(n=0), dict(max_tokens=0),
                dict(min_p=1.5), dict(repetition_penalty=0), dict(stop=[""]), dict(logprobs=-1)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stream(llm):
    p = "Hello world"
    sp = SamplingParams(max_tokens=12, **GREEDY)
    final = llm.generate(p, sp)[0].outputs[0]
    snaps = list(llm.stream(p, sp))
    assert snaps[-1].finished and snaps[-1].outputs[0].text == final.text
    texts = [s.outputs[0].text for s in snaps]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(snaps) >= 2


def test_stream_close_aborts_and_frees(ckpt):
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=32)
    it = eng.stream([1, 2, 3], SamplingParams(max_tokens=50, **GREEDY))
    next(it)
    it.close()
    assert not eng.has_unfinished_requests()
    assert eng.stats()["num_free_blocks"] == 32


def test_cli(ckpt, capsys):
    from fastinfer.entrypoints.cli import main

    assert main(["generate", "--model", ckpt, "--prompt", "Hello", "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out[0]["outputs"][0]["finish_reason"] in ("length", "stop")
    assert main(["bench", "--preset", "tiny", "--random-weights", "--batch", "2", "--input-len", "8",
                 "--output-len", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["output_tokens_per_s"] > 0 and res["ttft_ms_mean"] > 0 and res["tpot_ms_mean"] > 0
    assert res["deterministic"] is False
    assert main(["bench", "--preset", "tiny", "--random-weights", "--batch", "2", "--input-len", "8",
                 "--output-len", "3", "--deterministic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deterministic"] is True


# ------------------------------------------------------------------------------------------------
# sampler units
# ------------------------------------------------------------------------------------------------
def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    one = lambda k=0, p=1.0, m=0.0: apply_top_k_top_p_min_p(  # noqa: E731
        logits, torch.tensor([k]), torch.tensor([p]), torch.tensor([m]))[0].isfinite().tolist()
    assert one(k=2) == [True, True, False, False]
    assert one(p=0.7) == [True, True, False, False]   # 0.5 < 0.7, 0.75 >= 0.7
    assert one(p=0.74) == [True, True, False, False]
    assert one(p=0.76) == [True, True, True, False]
    assert one(p=0.1) == [True, False, False, False]   # the top token always survives
    assert one(m=0.35) == [True, True, False, False]   # 0.15 < 0.35 * 0.5
    assert one(m=0.15) == [True, True, True, True]
    assert one(k=3, p=0.9) == [True, True, True, False]


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    apply_repetition_penalty(logits, [[0, 1, 1]], [2.0])
    assert logits.tolist() == [[1.0, -4.0, 1.0, -1.0]]
    try:
        from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    except ImportError:
        return
    x = torch.randn(1, 50)
    ids = [[3, 7, 7, 20]]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids), x.clone())
    assert torch.equal(apply_repetition_penalty(x.clone(), ids, [1.3]), ref)


def test_sampler_distribution_and_filters():
    g = torch.Generator().manual_seed(0)
    s = Sampler(g)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    sp = SamplingParams(temperature=1.0)
    toks, _ = s(logits, [sp] * 4000, [[]] * 4000, [None] * 4000)
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq
    toks, _ = s(logits[:500], [SamplingParams(top_k=2)] * 500, [[]] * 500, [None] * 500)
    assert set(toks) == {0, 1}
    toks, _ = s(logits[:500], [SamplingParams(min_p=0.4)] * 500, [[]] * 500, [None] * 500)
    assert set(toks) == {0, 1}
    toks, _ = s(logits[:2], [SamplingParams(temperature=0.0)] * 2, [[]] * 2, [None] * 2)
    assert toks == [0, 0]
    # repetition penalty changes the greedy choice
    toks, _ = s(torch.tensor([[1.0, 0.9]]), [SamplingParams(temperature=0.0, repetition_penalty=1.2)], [[0]], [None])
    assert toks == [1]
    # per-row generators: same seed, same draw, whatever the other rows are
    mk = lambda: torch.Generator().manual_seed(42)  # noqa: E731
    a, _ = s(logits[:1], [sp], [[]], [mk()])
    b, _ = s(torch.randn(3, 4), [sp] * 3, [[]] * 3, [None, mk(), None])
    b2, _ = s(torch.cat([torch.randn(1, 4), logits[:1]]), [sp] * 2, [[]] * 2, [None, mk()])
    assert a[0] == b2[1]


def test_block_manager_prefix_lru():
    bm = BlockManager(4, 4)
    sp = SamplingParams()

    def seq(ids):
        return Sequence(0, Request("r", ids, sp), 0, ids, sp)

    a = seq(list(range(9)))  # 2 full blocks + 1
    bm.allocate_prefix(a, bm.match_prefix(a))
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.register_full_blocks(a)
    assert len(bm.hash_to_block) == 2
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(8)) + [100, 101])
    hits = bm.match_prefix(b)
    assert hits == a_blocks if (a_blocks := hits) else False
    assert len(hits) == 2
    bm.allocate_prefix(b, hits)
    assert b.num_computed_tokens == 8 and bm.prefix_cache_hits == 8
    c = seq([9, 9, 9, 9, 9])
    assert bm.match_prefix(c) == []
    bm.allocate(c, 5)  # takes the 2 never-cached blocks first
    assert len(bm.hash_to_block) == 2
    bm.free(b)
    d = seq(list(range(20)))
    assert bm.can_allocate(d, 8) and not bm.can_allocate(d, 9)
    bm.allocate(d, 8)  # must evict the cached blocks now
    assert len(bm.hash_to_block) == 0
    bm.free(c)
    bm.free(d)
    bm.check_invariants()


# ------------------------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------------------------
def test_tokenizer_roundtrip_and_chat(ckpt):
    tok = Tokenizer(ckpt)
    for t in TEXTS[:4]:
        ids = tok.encode(t)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == t
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<s><|user|>hi</s><|assistant|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("text", TEXTS[:3])
def test_incremental_detokenizer_matches_full_decode(ckpt, text):
    tok = Tokenizer(ckpt)
    prompt = tok.encode("Prompt: ")
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt)
    pieces = [det.add(i) for i in ids]
    pieces.append(det.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_and_generated_text(llm):
    outs = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=8, **GREEDY))
    o = outs[0].outputs[0]
    assert outs[0].prompt.endswith("<|assistant|>")
    assert o.text == llm.tokenizer.decode(o.token_ids)


SHIPPED = os.path.join(os.path.dirname(fastinfer.__file__), "assets", "tiny-llama")


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "tokenizer.json")), reason="no shipped model")
def test_shipped_tokenizer():
    tok = Tokenizer(SHIPPED)
    t = "Once upon a time, a llama said: héllo 🦙."
    ids = tok.encode(t, add_special_tokens=False)
    assert tok.decode(ids) == t
    det = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert "".join(det.add(i) for i in ids) + det.flush() == t
    if tok.chat_template:
        s = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert "hi" in s


def test_decode_graph_buffers_match_eager(ckpt):
    """The decode-graph path (static input buffers, batches padded to a bucket with slot -1 /
    length 0 rows) gives the same tokens as the eager path. On a GPU the same buffers are what
    the CUDA graphs replay; here they run eagerly (no GPU needed)."""
    from fastinfer.engine.cuda_graphs import decode_buckets

    assert decode_buckets(1) == [1]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(11)]
    sp = [SamplingParams(max_tokens=4 + i, **GREEDY) for i in range(11)]  # the batch shrinks
    eager = LLM(ckpt, dtype="float32", num_kv_blocks=128, max_num_seqs=11)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    graphed = LLM(ckpt, dtype="float32", num_kv_blocks=128, max_num_seqs=11)
    graphs = graphed.executor.enable_decode_graphs(11, 8, use_graphs=False)
    assert graphs.buckets == [1, 2, 4, 8, 11]
    calls = []
    run = graphs.run
    graphs.run = lambda *a: calls.append(len(a[0])) or run(*a)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, sp)]
    assert got == want
    assert calls and max(calls) == 11 and min(calls) < 11  # padded buckets were used
    assert graphed.stats()["num_free_blocks"] == graphed.stats()["num_kv_blocks"]


@pytest.mark.cuda
def test_cuda_graph_decode_matches_eager(ckpt):
    """On a GPU: decode steps replayed from CUDA graphs give the tokens of the eager path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    rng = random.Random(6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 40))] for _ in range(19)]
    sp = [SamplingParams(max_tokens=4 + i, **GREEDY) for i in range(19)]
    outs = []
    for eager in (True, False):
        eng = LLM(ckpt, device="cuda", dtype="bfloat16", num_kv_blocks=128, max_num_seqs=19, enforce_eager=eager)
        assert (eng.executor.decode_graphs is None) == eager
        outs.append([o.outputs[0].token_ids for o in eng.generate(prompts, sp)])
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------------------------------
# engine structure: request lifetime, interleaved streams, the executor's hidden-state hook
# ------------------------------------------------------------------------------------------------
def test_long_running_loop_keeps_a_bounded_registry(ckpt):
    """A server-style loop (add_request / step) over 1,000 requests in sequence: every request's
    final output comes exactly once, finished requests leave the core and the output processor
    (their ids can be reused), and the KV pool is whole again at the end."""
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=32, max_num_seqs=8)
    rng = random.Random(7)
    pending, num_final, peak = set(), 0, 0

    def step():
        nonlocal num_final
        for o in eng.step():
            if o.finished:
                pending.remove(o.request_id)  # KeyError: a second final output
                num_final += 1

    for i in range(1000):
        rid = f"r{i % 50}"
        assert rid not in pending
        eng.add_request([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))],
                        SamplingParams(max_tokens=rng.randint(1, 3), **GREEDY), request_id=rid)
        pending.add(rid)
        step()
        peak = max(peak, len(eng.output_processor), len(eng.engine_core.requests))
        if i % 4 == 3:  # let a few requests overlap, then drain
            while eng.has_unfinished_requests():
                step()
    assert num_final == 1000 and not pending
    assert 1 < peak <= 4 and len(eng.output_processor) == 0 and len(eng.engine_core.requests) == 0
    st = eng.stats()
    assert st["num_free_blocks"] == st["num_kv_blocks"] and st["num_registered_requests"] == 0
    eng.add_request([1, 2], SamplingParams(max_tokens=50), request_id="x")
    with pytest.raises(ValueError, match="duplicate request id"):
        eng.add_request([1, 2], SamplingParams(max_tokens=50), request_id="x")
    eng.abort_request("x")
    assert len(eng.output_processor) == 0 and not eng.has_unfinished_requests()


def test_errored_request_output_comes_with_next_step(llm):
    rid = llm.add_request([], SamplingParams(max_tokens=3))
    outs = llm.step()
    assert [o.request_id for o in outs] == [rid] and outs[0].finished and "empty" in outs[0].error
    assert llm.step() == [] and len(llm.output_processor) == 0


def test_interleaved_streams_each_end_with_their_own_output(ckpt, llm):
    """Two stream() iterators advanced alternately: each sees only its own request and ends with
    its own finished=True output, equal to generate()."""
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8]]
    sps = [SamplingParams(max_tokens=5, **GREEDY), SamplingParams(max_tokens=9, **GREEDY)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sps)]
    eng = LLM(ckpt, dtype="float32", num_kv_blocks=32)
    its = [eng.stream(p, sp) for p, sp in zip(prompts, sps)]
    got = [[], []]
    live = [0, 1]
    while live:
        for k in list(live):
            try:
                got[k].append(next(its[k]))
            except StopIteration:
                live.remove(k)
    for k in (0, 1):
        assert got[k] and all(o.request_id == got[k][0].request_id for o in got[k])
        assert got[k][-1].finished and not any(o.finished for o in got[k][:-1])
        assert got[k][-1].outputs[0].token_ids == want[k]
    assert got[0][0].request_id != got[1][0].request_id
    assert not eng.has_unfinished_requests() and len(eng.output_processor) == 0


def test_executor_hands_hidden_states_to_a_drafter_that_asks(ckpt):
    """The executor computes the target's final hidden states for a drafter that wants them (draft
    heads): one row per logits row, and lm_head of those rows is the step's logits."""
    from fastinfer.engine.speculative.drafter import Drafter

    eng = LLM(ckpt, dtype="float32", num_kv_blocks=32)
    seen = []

    class Recorder(Drafter):
        wants_hidden_states = True

        def observe_hidden_states(self, seqs, hidden):
            seen.append((len(seqs), hidden.clone()))

    ex = eng.executor
    ex.drafter = Recorder()
    real = ex.model.compute_logits
    logits = []
    ex.model.compute_logits = lambda h: logits.append(real(h)) or logits[-1]
    prompts, sp = [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, **GREEDY)
    out = eng.generate(prompts, sp)
    ex.model.compute_logits = real
    want = LLM(ckpt, dtype="float32", num_kv_blocks=32).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in want]
    assert [n for n, _ in seen] == [2, 2, 2]
    for (n, h), lg in zip(seen, logits):
        assert h.shape == (n, ex.model.config.hidden_size)
        torch.testing.assert_close(real(h), lg)


def test_every_cli_option_is_documented():
    """`fastinfer <command> --help`: every option says what it does, and its default unless it is
    a flag (off by default) or required."""
    import argparse

    from fastinfer.entrypoints.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bad = []
    for cmd, p in sub.choices.items():
        for a in p._actions:
            if isinstance(a, argparse._HelpAction) or not a.option_strings:
                continue
            h = a.help or ""
            flag = isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            if len(h) < 12 or not (flag or a.required or "default" in h):
                bad.append(f"{cmd} {a.option_strings[0]}: {h!r}")
    assert not bad, "\n".join(bad)
