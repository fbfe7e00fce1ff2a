"""DFlash block drafting (CPU, float32): one drafter forward per step drafts a whole block from
projected target features of several layers; the target verifies it.

Covers: the drafter's block logits against an fp64 reference written from z-lab's forward
(``fastinfer.reference.dflash``) on transformers' hidden states; greedy outputs identical to plain
decoding (chain and static tree; a mixed batch with opt-outs, stops, n > 1 and forced preemption; no
leaked block); the context-feature pool and the drafter's context K/V equal a fresh computation after
many accept / reject cycles; sampling exactness (chi-square); the deterministic mode bitwise; loading
and option errors naming what is wrong.

The layout is an external convention, written here from its sources: z-lab/dflash ``dflash/model.py``
(``DFlashDraftModel``: ``layers.{i}.*`` Qwen3 decoder layers with q/k norms, ``fc = Linear(m H, H,
bias=False)``, ``hidden_norm``, ``norm``; config ``block_size``, ``dflash_config.mask_token_id`` /
``target_layer_ids``, ``num_target_layers``; default layer ids ``build_target_layer_ids``; context
features ``hidden_states[layer_id + 1]``) and SGLang's loader (``python/sglang/srt/models/dflash.py``:
the same names optionally under ``model.``).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.engine.speculative.dflash_config import default_target_layer_ids
from fastinfer.layers import BatchBuilder
from fastinfer.reference.dflash import dflash_block_logits
from test_eagle3 import _mostly_bigram
from test_spec_decode import (GREEDY, VOCAB, _assert_no_leak, _exact_marginals, _gather, assert_marginals_match,
                              assert_matches_workload, mixed_batch_workload, sample_with_and_without_speculation)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

H = 64  # the test targets' hidden size (test_spec_decode._save_llama): one head of 64


def _save_dflash(path, t, *, block_size, mask_token_id, num_target_layers, target_layer_ids=None, prefix="",
                 dtype=torch.float32, rope_theta=10000.0, put_in_dflash_config=True, hidden=H, heads=1, kv_heads=1,
                 vocab=VOCAB, **extra):
    """A DFlash drafter directory in z-lab's layout: ``t`` the tensors under the checkpoint's names."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    layers = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    save_file({prefix + k: v.to(dtype).contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    dc = {"mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dc["target_layer_ids"] = list(target_layer_ids)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": rope_theta,
           "vocab_size": vocab, "max_position_embeddings": 256,
           "attention_bias": False, "tie_word_embeddings": False, "num_target_layers": num_target_layers,
           "layer_types": ["full_attention"] * layers, "dflash_config": dc, "block_size": block_size}
    if not put_in_dflash_config:  # SGLang also reads these at the top level
        cfg.update(cfg.pop("dflash_config"))
    cfg.update(extra)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _random_drafter(layers, m, seed, hidden=H, heads=1, kv_heads=1):
    """Random drafter tensors (z-lab names): ``layers`` decoder layers (head_dim 64), ``fc`` over ``m``
    target layers."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=0.1):
        return torch.randn(*shape, generator=g) * s

    Hd, q, kv = hidden, 64 * heads, 64 * kv_heads
    t = {"fc.weight": r(Hd, m * Hd), "hidden_norm.weight": 1 + r(Hd), "norm.weight": 1 + r(Hd)}
    for i in range(layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(Hd), p + "post_attention_layernorm.weight": 1 + r(Hd),
                  p + "self_attn.q_proj.weight": r(q, Hd, s=0.3), p + "self_attn.k_proj.weight": r(kv, Hd, s=0.3),
                  p + "self_attn.v_proj.weight": r(kv, Hd, s=0.3), p + "self_attn.o_proj.weight": r(Hd, q, s=0.3),
                  p + "self_attn.q_norm.weight": 1 + r(64), p + "self_attn.k_norm.weight": 1 + r(64),
                  p + "mlp.gate_proj.weight": r(2 * Hd, Hd, s=0.3), p + "mlp.up_proj.weight": r(2 * Hd, Hd, s=0.3),
                  p + "mlp.down_proj.weight": r(Hd, 2 * Hd, s=0.3)})
    return t


def _copying_drafter(hf, m, seed=0):
    """Tensors of a drafter whose every block row predicts the target's next token after the anchor
    (for a target whose layers add little to the embedding, ``_mostly_bigram``, with embedding column 0
    positive for every token but the mask token, see ``_copying_target``): in layer 0 the block rows
    query (q_proj reads column 0, sign flipped, into the lowest-frequency rotary dim, where RoPE barely
    turns over a block) the anchor's key (positive there) and not the mask rows' (negative) or the
    context's (``hidden_norm`` zeroes column 0: key 0), and copy its normed embedding (v, o identity).
    Layer 1 is small random noise. Draft row 1 agrees with the target often; rows 2.. repeat it and
    are mostly rejected."""
    t = _random_drafter(2, m, seed)
    E = torch.zeros(64, H)
    E[31, 0] = 1.0
    p = "layers.0."
    t.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
              p + "self_attn.q_proj.weight": -E, p + "self_attn.k_proj.weight": E.clone(),
              p + "self_attn.q_norm.weight": torch.full((64,), 2.0), p + "self_attn.k_norm.weight": torch.ones(64),
              p + "self_attn.v_proj.weight": torch.eye(64, H), p + "self_attn.o_proj.weight": torch.eye(H, 64),
              p + "mlp.down_proj.weight": torch.zeros(H, 2 * H)})
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        t["layers.1." + name] = t["layers.1." + name] * 0.03
    t["hidden_norm.weight"][0] = 0.0
    t["norm.weight"] = hf.model.norm.weight.detach().clone()
    return t


def _copying_target(path, vocab, layers, seed, mask_token_id, **kw):
    hf = _mostly_bigram(path, vocab, layers, seed, **kw)
    with torch.no_grad():
        hf.model.embed_tokens.weight[:, 0] = 0.05
        hf.model.embed_tokens.weight[mask_token_id, 0] = -0.05
    hf.save_pretrained(path)
    return hf


MASK = VOCAB - 1


def _tokens(seed, n, low, high):
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 6-layer target (default layer ids for 2 drafter layers: (1, 3)) and a copying drafter, block 6."""
    tgt = str(tmp_path_factory.mktemp("dflash-target"))
    hf = _copying_target(tgt, VOCAB, 6, seed=0, mask_token_id=MASK)
    head = str(tmp_path_factory.mktemp("dflash-head"))
    _save_dflash(head, _copying_drafter(hf, 2), block_size=6, mask_token_id=MASK, num_target_layers=6)
    return tgt, head, hf


def test_default_target_layer_ids_rule():
    # z-lab's build_target_layer_ids, worked by hand: Qwen3-8B (36 layers) with 5 drafter layers
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(32, 1) == (16,)
    assert default_target_layer_ids(6, 2) == (1, 3)


# ------------------------------------------------------------------------------------------------
# the block logits against the fp64 reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix,ids", [("", None), ("model.", (0, 4, 2))])
def test_block_logits_match_the_reference(target, tmp_path, prefix, ids):
    """The runner's drafter (fp32, paged KV, our ops: context K/V written, then the block as a
    bidirectional chunk) against the fp64 reference of z-lab's forward on transformers' hidden
    states (``hidden_states[i + 1]``: the output of layer i), for a random drafter of 2 layers."""
    tgt, _, hf = target
    m = 2 if ids is None else len(ids)
    t = _random_drafter(2, m, seed=4)
    head = str(tmp_path / "head")
    B = 5
    _save_dflash(head, t, block_size=B, mask_token_id=7, num_target_layers=6, target_layer_ids=ids, prefix=prefix)
    llm = LLM(tgt, spec_method="dflash", spec_model=head, num_kv_blocks=16)
    dm, model, bs = llm.executor.drafter.model, llm.model, llm.block_size
    layer_ids = ids or default_target_layer_ids(6, 2)
    assert dm.target_layer_ids == tuple(layer_ids)
    tokens = _tokens(7, 23, 3, VOCAB)
    S = len(tokens) - 1  # context: every position before the anchor (the last token)
    nb = -(-(S + B) // bs)
    with torch.inference_mode():
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens[:S], 0, list(range(nb)), logits="all")
        _, aux = model.aux_hidden_states(b.build(), model.allocate_kv_cache(nb, bs), dm.aux_layers)
        kv = dm.allocate_kv_cache(nb, bs)
        for k, v in kv:  # poison: a slot read before it is written turns the logits into NaN
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        pos = torch.arange(S)
        dm.write_context(dm.project(aux), pos, pos.clone(), kv)  # blocks 0.. in order: slot = position
        b = BatchBuilder(bs, llm.device)
        b.prefill([tokens[-1]] + [7] * (B - 1), S, list(range(nb)), mask=torch.ones(B, B, dtype=torch.bool),
                  logits="all")
        got = dm(b.build(), kv).double()
        hs = hf(torch.tensor([tokens[:S]]), output_hidden_states=True).hidden_states
        target_hidden = torch.cat([hs[i + 1][0] for i in layer_ids], -1)
        noise = hf.model.embed_tokens(torch.tensor([tokens[-1]] + [7] * (B - 1)))
    ref = dflash_block_logits(t, hf.lm_head.weight.detach(), target_hidden, noise, torch.arange(S),
                              torch.arange(S, S + B), num_layers=2, num_heads=1, num_kv_heads=1, head_dim=64,
                              eps=1e-6, rope_theta=10000.0)
    err = float((got - ref).norm() / ref.norm())
    # a naive fp32 computation of the same forward errs by ~1e-6 relative
    assert err < 1e-5, err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # the context matters: other context features change the block's logits
    with torch.inference_mode():
        dm.write_context(dm.project(aux.flip(0)), pos, pos.clone(), kv)
        b = BatchBuilder(bs, llm.device)
        b.prefill([tokens[-1]] + [7] * (B - 1), S, list(range(nb)), mask=torch.ones(B, B, dtype=torch.bool),
                  logits="all")
        assert float((dm(b.build(), kv).double() - ref).norm() / ref.norm()) > 1e-3


# ------------------------------------------------------------------------------------------------
# greedy: identical to plain decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,k,tree", [("chain", None, None), ("chain", 3, None),
                                          ("tree", None, [[0], [1], [0, 0], [0, 1], [0, 0, 0], [2]])])
def test_greedy_identical_batch_with_preemption(target, mode, k, tree):
    tgt, head, _ = target
    prompts, params, ref = mixed_batch_workload(tgt)
    llm = LLM(tgt, spec_method="dflash", spec_model=head, spec_mode=mode, num_spec_tokens=k, spec_tree=tree,
              num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=96, seed=0)
    outs = llm.generate(prompts, params)
    st = assert_matches_workload(llm, outs, ref)
    # one drafter forward per step for every speculating sequence
    assert llm.executor.drafter.num_draft_forwards <= st["spec_num_verify"]
    assert any(c.finish_reason == "stop" for o in outs for c in o.outputs)
    _assert_no_leak(llm)


def test_accepts_more_than_one_token_per_forward(target):
    tgt, head, _ = target
    prompt = _tokens(2, 9, 3, VOCAB - 1)
    sp = SamplingParams(max_tokens=40, **GREEDY)
    ref = LLM(tgt, seed=0).generate([prompt], sp)[0].outputs[0].token_ids
    llm = LLM(tgt, spec_method="dflash", spec_model=head, num_kv_blocks=32, seed=0)
    out = llm.generate([prompt], sp)[0]
    assert out.outputs[0].token_ids == ref
    st = llm.stats()
    # a chain of block_size - 1 = 5 by default (shorter near max_tokens)
    assert len(st["spec_depth_offered"]) == 5 and st["spec_num_draft_tokens"] <= 5 * st["spec_num_verify"], st
    assert st["spec_mean_tokens_per_verify"] > 1.3, st
    assert st["spec_acceptance_rate_per_depth"][0] > 0.25, st  # measured 0.36
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# the context pool and the drafter's context K/V after many accept / reject cycles
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_context_and_drafter_kv_match_a_fresh_computation(target, mode):
    tgt, head, _ = target
    prompt = _tokens(5, 21, 3, VOCAB - 1)
    llm = LLM(tgt, spec_method="dflash", spec_model=head, spec_mode=mode, num_kv_blocks=64, seed=0)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=70, **GREEDY))
    seq = llm.engine_core.requests[rid].seqs[0]
    while seq.num_output_tokens < 50:
        llm.step()
    st = llm.stats()
    assert st["spec_num_verify"] >= 5 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    bs, dr = llm.block_size, llm.executor.drafter
    model, dm = llm.model, dr.model
    c, dc = seq.num_computed_tokens, llm.engine_core.proposer.draft_computed(seq)
    assert 0 < dc <= c
    tokens = seq.token_ids[:c]
    nb = -(-c // bs)
    with torch.inference_mode():
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens, 0, list(range(nb)), logits="all")
        _, aux = model.aux_hidden_states(b.build(), model.allocate_kv_cache(nb, bs), dm.aux_layers)
        ctx = dm.project(aux)
        kv = dm.allocate_kv_cache(nb, bs)
        pos = torch.arange(dc)
        dm.write_context(ctx[:dc], pos, pos.clone(), kv)
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(c)])
    torch.testing.assert_close(dr.context[slots], ctx, rtol=1e-4, atol=1e-4)
    for (gk, gv), (rk, rv) in zip(_gather(dr.kv_caches, seq.block_table, dc, bs), _gather(kv, list(range(nb)), dc, bs)):
        torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-4)
    llm.abort_request(rid)
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# sampling: exact
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_distribution_matches(tmp_path, mode):
    tgt = str(tmp_path / "sv-target")
    hf = _copying_target(tgt, 16, 4, seed=10, mask_token_id=15, lm_scale=30.0, eos=15)
    head = str(tmp_path / "h")
    _save_dflash(head, _copying_drafter(hf, 2, seed=3), block_size=4, mask_token_id=15, num_target_layers=4)
    temp, steps, n = 0.8, 4, 1500
    prompt = [3, 7, 11, 2, 9]
    tree = [[0], [1], [0, 0], [0, 1], [0, 0, 0]] if mode == "tree" else None
    spec, base, llm = sample_with_and_without_speculation(tgt, prompt, n, steps, temp, spec_method="dflash",
                                                          spec_model=head, spec_mode=mode, spec_tree=tree)
    assert_marginals_match(spec, base, _exact_marginals(hf, prompt, steps, temp))
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# the deterministic mode: bitwise the same alone and in a busy batch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 5)], ids=["greedy", "seeded"])
def test_deterministic_mode_bitwise(target, temperature, seed):
    tgt, head, _ = target
    probe = _tokens(11, 17, 3, VOCAB - 1)
    sp = SamplingParams(max_tokens=24, temperature=temperature, seed=seed, ignore_eos=True, logprobs=2)

    def run(prompts, params, **kw):
        llm = LLM(tgt, spec_method="dflash", spec_model=head, deterministic=True, seed=0, **kw)
        out = llm.generate(prompts, params)
        _assert_no_leak(llm)
        return llm, out

    _, alone = run([probe], [sp], num_kv_blocks=64)
    r = random.Random(1)
    prompts = [[r.randrange(3, VOCAB - 1) for _ in range(r.randint(10, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=r.randint(5, 25), temperature=r.choice([0.0, 0.7]), seed=i, ignore_eos=True)
              for i in range(12)]
    llm, busy = run(prompts[:4] + [probe] + prompts[4:], params[:4] + [sp] + params[4:], num_kv_blocks=8,
                    max_num_seqs=16, max_num_batched_tokens=64)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["spec_num_verify"] > 0
    a, b = alone[0].outputs[0], busy[4].outputs[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # floats compared with ==


# ------------------------------------------------------------------------------------------------
# loading and options
# ------------------------------------------------------------------------------------------------
def test_loading_errors_name_the_problem(target, tmp_path):
    tgt, _, hf = target
    t = _random_drafter(2, 2, seed=1)
    kw = dict(block_size=4, mask_token_id=MASK, num_target_layers=6)

    def err(d, **over):
        with pytest.raises(ValueError) as e:
            LLM(tgt, spec_method="dflash", spec_model=str(d), num_kv_blocks=16, **over)
        return str(e.value)

    d = tmp_path / "missing"
    _save_dflash(str(d), {k: v for k, v in t.items() if k != "layers.1.self_attn.k_norm.weight"}, **kw)
    assert "layers.1.self_attn.k_norm.weight" in err(d)
    d = tmp_path / "extra"
    _save_dflash(str(d), dict(t, **{"fc.bias": torch.ones(H)}), **kw)
    assert "fc.bias" in err(d)
    d = tmp_path / "shape"
    _save_dflash(str(d), dict(t, **{"fc.weight": torch.zeros(H, 3 * H)}), **kw)
    assert "fc.weight" in err(d)
    d = tmp_path / "layers"
    _save_dflash(str(d), t, block_size=4, mask_token_id=MASK, num_target_layers=32)
    assert "num_target_layers=32" in err(d)
    d = tmp_path / "last"
    _save_dflash(str(d), t, target_layer_ids=[1, 5], **kw)
    assert "target_layer_ids [5]" in err(d)
    d = tmp_path / "mask"
    _save_dflash(str(d), t, block_size=4, mask_token_id=VOCAB, num_target_layers=6)
    assert "mask_token_id" in err(d)
    d = tmp_path / "nomask"
    _save_dflash(str(d), t, block_size=4, mask_token_id=None, num_target_layers=6)
    assert "mask_token_id" in err(d)
    d = tmp_path / "noblock"
    _save_dflash(str(d), t, block_size=None, mask_token_id=MASK, num_target_layers=6)
    assert "block_size" in err(d)
    d = tmp_path / "sliding"
    _save_dflash(str(d), t, **kw, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                 use_sliding_window=True)
    assert "sliding" in err(d)
    d = tmp_path / "ok"
    _save_dflash(str(d), t, **kw)
    assert "num_spec_tokens=4" in err(d, num_spec_tokens=4)  # a block of 4 drafts 3 positions
    assert "deeper" in err(d, spec_mode="tree", spec_tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        LLM(tgt, spec_method="dflash", spec_model=object(), num_kv_blocks=16)


def test_top_level_fields_and_fp16_weights_load(target, tmp_path):
    """SGLang reads block_size / mask_token_id / target_layer_ids at the top level too; weights in
    fp16 are computed in the target's dtype."""
    tgt, _, _ = target
    t = _random_drafter(1, 1, seed=2)
    d = str(tmp_path / "top")
    _save_dflash(d, t, block_size=3, mask_token_id=5, num_target_layers=6, target_layer_ids=[2],
                 put_in_dflash_config=False, dtype=torch.float16)
    llm = LLM(tgt, spec_method="dflash", spec_model=d, num_kv_blocks=16)
    dm = llm.executor.drafter.model
    assert (dm.block_size, dm.mask_token_id, dm.target_layer_ids, dm.aux_layers) == (3, 5, (2,), (3,))
    assert dm.fc.weight.dtype == llm.model.dtype
    torch.testing.assert_close(dm.fc.weight, t["fc.weight"].half().float())


# ------------------------------------------------------------------------------------------------
# the end of the context window, an fp8 KV pool, the proposer's reservation, the CLI
# ------------------------------------------------------------------------------------------------
def test_block_reservation_and_the_end_of_the_context_window(target):
    """A step reserves the whole block's slots; within a block of max_model_len a sequence decodes
    normally, and the output stays identical up to the last position."""
    tgt, head, _ = target
    llm = LLM(tgt, spec_method="dflash", spec_model=head, spec_mode="chain", num_spec_tokens=2, max_model_len=48,
              num_kv_blocks=16, seed=0)
    proposer = llm.engine_core.proposer
    assert proposer.block_size == 6 and proposer._span(2) == 6 and proposer._span(1) == 6
    prompt = _tokens(3, 20, 3, VOCAB - 1)
    sp = SamplingParams(max_tokens=28, **GREEDY)  # to position 47, the last one
    ref = LLM(tgt, max_model_len=48, num_kv_blocks=16, seed=0).generate([prompt], sp)[0].outputs[0].token_ids
    out = llm.generate([prompt], sp)[0]
    assert out.outputs[0].token_ids == ref and len(ref) == 28
    assert out.metrics["spec_num_verify"] > 0
    _assert_no_leak(llm)


def test_fp8_kv_pool_greedy_identical(target):
    """With an fp8 KV cache the drafter's context K/V are written with the layers' scales; greedy
    outputs stay those of the target with the same cache."""
    tgt, head, _ = target
    prompts = [_tokens(s, 12 + s, 3, VOCAB - 1) for s in range(3)]
    sp = SamplingParams(max_tokens=20, **GREEDY)
    ref = LLM(tgt, kv_cache_dtype="fp8", num_kv_blocks=32, seed=0).generate(prompts, sp)
    llm = LLM(tgt, spec_method="dflash", spec_model=head, kv_cache_dtype="fp8", num_kv_blocks=32, seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(k.element_size() == 1 and v.element_size() == 1 for k, v in llm.executor.drafter.kv_caches)
    assert llm.stats()["spec_num_accepted_tokens"] > 0
    _assert_no_leak(llm)


def test_cli_generate(tmp_path):
    """``fastinfer generate --spec-method dflash --spec-model DIR`` on the shipped model (a random
    drafter of its shape): the same text as without speculation."""
    import contextlib
    import io

    from fastinfer.entrypoints.cli import main

    head = str(tmp_path / "dflash")
    _save_dflash(head, _random_drafter(1, 1, seed=0, hidden=256, heads=4, kv_heads=2), block_size=4, mask_token_id=3,
                 num_target_layers=5, hidden=256, heads=4, kv_heads=2, vocab=4096)
    out = []
    for extra in (["--spec-method", "dflash", "--spec-model", head, "--spec-mode", "tree"], []):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["generate", *extra, "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
        out.append(json.loads(buf.getvalue())[0]["outputs"])
    assert out[0] == out[1]
