"""EAGLE-3 draft heads (CPU, float32): ``fc`` over three target layers' residual streams, a midlayer
whose q/k/v take [input_layernorm(embed); hidden_norm(feature)] (2H), its own final norm and a
reduced-vocabulary ``lm_head`` mapped to target ids by ``d2t``.

Covers: greedy outputs identical to plain decoding (the shipped model with the shipped trained head;
random Llama targets with heads written in the EAGLE repository's layout and in vLLM's; a mixed batch
with opt-outs, stops, n > 1 and forced preemption; no leaked block), the feature pool and the draft's
K/V equal a fresh computation from the target's aux layers, sampling exactness (chi-square) with a
reduced draft vocabulary, loading (both layouts load every tensor where it belongs, fp16 weights,
missing / mis-shaped / extra tensors and a bad ``d2t`` are errors naming the tensor), the CLI.

The layouts are external conventions, written here from their sources: the EAGLE repository
(SafeAILab/EAGLE ``eagle/model/cnets.py``: ``midlayer.*``, ``fc = Linear(3H, H, bias=False)``,
``lm_head = Linear(H, draft_vocab_size)``, buffers ``d2t`` [draft_vocab_size] int64 and ``t2d``
[vocab] bool; aux layers ``(2, L // 2, L - 3)``, the input of those layers, in
``eagle/model/modeling_llama_kv.py``) and vLLM (``llama_eagle3.py``: ``layers.0.*`` for
``midlayer.*``; layer ids ``eagle_aux_hidden_state_layer_ids`` in the config or its ``eagle_config``).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.config import default_model_path
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.engine.speculative.eagle3 import default_aux_layers, load_eagle3
from fastinfer.layers import BatchBuilder
from fastinfer.layers.weights import CheckpointModule
from test_spec_decode import (GREEDY, _assert_no_leak, _exact_marginals, _gather, _save_llama, assert_marginals_match,
                              assert_matches_workload, mixed_batch_workload, sample_with_and_without_speculation)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ASSETS = os.path.dirname(default_model_path())
SHIPPED_HEAD = os.path.join(ASSETS, "tiny-llama-eagle3")


def _save_eagle3(path, target_dir, t, layout="eagle", prefix="", aux=None, aux_in_eagle_config=False,
                 dtype=torch.float32, **cfg_extra):
    """An EAGLE-3 head directory. ``t``: the tensors under the EAGLE repository's names
    (``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``); ``layout``
    "vllm" writes ``layers.0.*`` (with ``prefix``, e.g. "model.", on all but lm_head / d2t / t2d)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    sd = {}
    for k, v in t.items():
        if layout == "vllm" and k not in ("lm_head.weight", "d2t", "t2d"):
            k = prefix + (("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k)
        sd[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, draft_vocab_size=int(t["lm_head.weight"].shape[0]), **cfg_extra)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    if aux is not None:
        if aux_in_eagle_config:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
        else:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sd


def _vocab(V, Vd, seed):
    """A draft vocabulary of Vd target ids (sorted): ``(ids, d2t, t2d)`` in the EAGLE convention."""
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(Vd), t2d


def _near_copy_head(hf, aux_ids, Vd, seed=0, attn_scale=8.0):
    """Tensors (EAGLE names) of a head that predicts the next token of a target whose layers add
    little to the embedding (``_mostly_bigram``): self-attention copies the normed embedding of the
    row's token to the output, ``norm`` / ``lm_head`` are the target's (the draft vocabulary's rows);
    a small random ``fc`` makes the features matter. It agrees with the target often, not always."""
    sd = hf.state_dict()
    H = hf.config.hidden_size
    V = hf.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids, d2t, t2d = _vocab(V, Vd, seed)
    eye = torch.eye(H)
    zero = torch.zeros(H, H)
    qk = torch.cat([eye * attn_scale, zero], 1)  # attend mostly to itself (rotary keeps q_p . k_p largest)
    return {
        "fc.weight": torch.randn(H, len(aux_ids) * H, generator=g) * 0.02,
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.hidden_norm.weight": torch.ones(H) + 0.1 * torch.randn(H, generator=g),
        "midlayer.self_attn.q_proj.weight": qk,
        "midlayer.self_attn.k_proj.weight": qk.clone(),
        "midlayer.self_attn.v_proj.weight": torch.cat([eye, torch.randn(H, H, generator=g) * 0.01], 1),
        "midlayer.self_attn.o_proj.weight": eye.clone(),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": torch.randn(2 * H, H, generator=g) * 0.1,
        "midlayer.mlp.up_proj.weight": torch.randn(2 * H, H, generator=g) * 0.1,
        "midlayer.mlp.down_proj.weight": torch.randn(H, 2 * H, generator=g) * 0.01,
        "norm.weight": sd["model.norm.weight"].detach().clone(),
        "lm_head.weight": sd["lm_head.weight"].detach()[ids].clone(),
        "d2t": d2t,
        "t2d": t2d,
    }


def _mostly_bigram(path, vocab, layers, seed, **kw):
    """A random Llama target whose layers add a little context to the embedding (o_proj and
    down_proj scaled down): its next token is mostly, not only, a function of the current one."""
    hf = _save_llama(path, vocab, layers, seed, **kw)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.15)
            layer.mlp.down_proj.weight.mul_(0.15)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 4-layer target (default aux ids (2, 2, 1)) and an EAGLE-layout head, 200 of 300 tokens."""
    tgt = str(tmp_path_factory.mktemp("eagle3-target"))
    hf = _mostly_bigram(tgt, 300, 4, seed=0)
    head = str(tmp_path_factory.mktemp("eagle3-head"))
    t = _near_copy_head(hf, default_aux_layers(4), 200)
    _save_eagle3(head, tgt, t)
    return tgt, head, hf, t


# ------------------------------------------------------------------------------------------------
# greedy: identical to plain decoding
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,k", [("chain", 4), ("tree", 8)])
def test_greedy_identical_shipped_model(mode, k):
    """The shipped trained head (fp16, reduced vocabulary): lossless, and it learned something."""
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\nclass", "    def __init__(self, name):\n"]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    base = LLM(seed=0).generate(prompts, sp)
    llm = LLM(spec_method="eagle3", spec_model=SHIPPED_HEAD, spec_mode=mode, num_spec_tokens=k, seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    st = llm.stats()
    assert st["spec_mean_tokens_per_verify"] > 1.2, st  # ~1.0 for an untrained head
    _assert_no_leak(llm)


@pytest.mark.parametrize("layout,prefix,aux,in_eagle_cfg", [("eagle", "", None, False),
                                                             ("vllm", "", (0, 1, 3), True),
                                                             ("vllm", "model.", (3, 2, 1), False)])
def test_greedy_identical_layouts(target, tmp_path, layout, prefix, aux, in_eagle_cfg):
    tgt, head, hf, t = target
    if layout != "eagle":
        head = str(tmp_path / "h")
        _save_eagle3(head, tgt, _near_copy_head(hf, aux, 200, seed=1), layout, prefix, aux, in_eagle_cfg)
    prompts = [[random.Random(i).randrange(3, 300) for _ in range(5 + 3 * i)] for i in range(3)]
    sp = SamplingParams(max_tokens=20, **GREEDY)
    base = LLM(tgt, seed=0).generate(prompts, sp)
    for mode in ("chain", "tree"):
        llm = LLM(tgt, spec_method="eagle3", spec_model=head, spec_mode=mode, num_spec_tokens=4 if mode == "chain"
                  else 6, seed=0)
        assert llm.executor.drafter.hidden_layers == (aux or (2, 2, 1))
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base], mode
        st = llm.stats()
        assert 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
        _assert_no_leak(llm)


@pytest.mark.parametrize("mode,k,topk,depth", [("chain", 3, 2, None), ("tree", 6, 2, 4)])
def test_greedy_identical_batch_with_preemption(target, mode, k, topk, depth):
    tgt, head, _, _ = target
    prompts, params, ref = mixed_batch_workload(tgt)
    llm = LLM(tgt, spec_method="eagle3", spec_model=head, spec_mode=mode, num_spec_tokens=k, spec_tree_topk=topk,
              spec_tree_depth=depth, num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=96, seed=0)
    outs = llm.generate(prompts, params)
    assert_matches_workload(llm, outs, ref)
    _assert_no_leak(llm)


def _reference_draft_logits(hf, t, aux_ids, tokens):
    """The EAGLE repository's forward (``cnets.py``: ``Model.forward`` + ``LlamaDecoderLayeremb``,
    then ``lm_head(norm(.))``) in plain fp64 torch, on the aux states transformers' Llama returns
    (``hidden_states[i]``: the input of layer i): draft-vocabulary logits of rows 0 .. T-2."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    c = hf.config
    w = {k: v.double() if v.is_floating_point() else v for k, v in t.items()}
    x = torch.tensor([tokens])
    with torch.no_grad():
        hs = hf(x, output_hidden_states=True).hidden_states
        a = torch.cat([hs[i][0].double() for i in aux_ids], -1)[:-1]
        e = hf.model.embed_tokens(x[:, 1:])[0].double()

        def rms(v, name):
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w[name]

        f = a @ w["fc.weight"].T
        h = torch.cat([rms(e, "midlayer.input_layernorm.weight"), rms(f, "midlayer.hidden_norm.weight")], -1)
        T, nh, nkv, D = h.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = (h @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, D).transpose(0, 1)[None]
        k = (h @ w["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, D).transpose(0, 1)[None]
        v = (h @ w["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, D).transpose(0, 1)[None]
        cos, sin = LlamaRotaryEmbedding(c)(v.float(), torch.arange(T)[None])
        q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = (q @ k.transpose(-1, -2)) / D ** 0.5 + torch.full((T, T), float("-inf")).triu(1).double()
        att = (s.softmax(-1) @ v)[0].transpose(0, 1).reshape(T, nh * D)
        r = f + att @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms(r, "midlayer.post_attention_layernorm.weight")
        m = torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)
        g = r + m @ w["midlayer.mlp.down_proj.weight"].T
        return rms(g, "norm.weight") @ w["lm_head.weight"].T


@pytest.mark.parametrize("layout", ["eagle", "vllm"])
def test_draft_logits_match_the_eagle_repository_forward(target, tmp_path, layout):
    """The runner's head (fp32, paged attention, our ops) against the fp64 reference of the EAGLE
    repository's forward on transformers' hidden states; tokens outside the draft vocabulary -inf."""
    tgt, _, hf, t = target
    aux = (0, 3, 1) if layout == "vllm" else None
    head = str(tmp_path / layout)
    _save_eagle3(head, tgt, t, layout, aux=aux)
    llm = LLM(tgt, spec_method="eagle3", spec_model=head, num_kv_blocks=16)
    m3, model, bs = llm.executor.drafter.model, llm.model, llm.block_size
    tokens = [random.Random(7).randrange(3, 300) for _ in range(37)]
    nb = -(-len(tokens) // bs)
    with torch.inference_mode():
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens, 0, list(range(nb)), logits="all")
        _, a = model.aux_hidden_states(b.build(), model.allocate_kv_cache(nb, bs), m3.aux_layers)
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens[1:], 0, list(range(nb)), logits="all")
        logits, _ = m3(b.build(), m3.allocate_kv_cache(nb, bs), m3.fuse(a[:-1]))
    ref = _reference_draft_logits(hf, t, aux or default_aux_layers(4), tokens)
    ids = torch.arange(200) + t["d2t"]
    got = logits[:, ids].double()
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    assert torch.isinf(logits[:, ~t["t2d"]]).all() and torch.equal(got.argmax(-1), ref.argmax(-1))


# ------------------------------------------------------------------------------------------------
# the feature pool and the draft's KV after many accept / reject cycles
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_features_and_draft_kv_match_a_fresh_computation(target, mode):
    tgt, head, _, _ = target
    prompt = [random.Random(5).randrange(3, 300) for _ in range(21)]
    llm = LLM(tgt, spec_method="eagle3", spec_model=head, spec_mode=mode, num_spec_tokens=6, spec_tree_topk=2,
              spec_tree_depth=4, num_kv_blocks=64, seed=0)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=70, **GREEDY))
    seq = llm.engine_core.requests[rid].seqs[0]
    while seq.num_output_tokens < 50:
        llm.step()
    st = llm.stats()
    assert st["spec_num_verify"] >= 5 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    bs, dr = llm.block_size, llm.executor.drafter
    model, m3 = llm.model, dr.model
    c, dc = seq.num_computed_tokens, llm.engine_core.proposer.draft_computed(seq)
    assert c - 8 <= dc <= c - 1
    tokens = seq.token_ids[:c]
    nb = -(-c // bs)
    with torch.inference_mode():
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens, 0, list(range(nb)), logits="all")
        _, aux = model.aux_hidden_states(b.build(), model.allocate_kv_cache(nb, bs), m3.aux_layers)
        # the aux states by hand: the residual stream entering each aux layer (hidden + residual)
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens, 0, list(range(nb)), logits="all")
        batch, kv = b.build(), model.allocate_kv_cache(nb, bs)
        x, res, streams = model.embed_tokens(batch.input_ids), None, []
        for layer, cache in zip(model.layers, kv):
            streams.append(x.clone() if res is None else x + res)
            x, res = layer(x, res, batch, cache, model.cos_sin_cache)
        torch.testing.assert_close(aux, torch.cat([streams[i] for i in m3.aux_layers], -1), rtol=0, atol=0)
        feats = m3.fuse(aux)
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens[1:dc + 1], 0, list(range(nb)), logits="all")
        dkv = m3.allocate_kv_cache(nb, bs)
        m3(b.build(), dkv, feats[:dc])
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(c)])
    torch.testing.assert_close(dr.features[slots], feats, rtol=1e-4, atol=1e-4)
    for (gk, gv), (rk, rv) in zip(_gather(dr.kv_caches, seq.block_table, dc, bs), _gather(dkv, list(range(nb)), dc, bs)):
        torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-4)
    llm.abort_request(rid)
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# sampling: exact, with a reduced draft vocabulary
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_distribution_matches(tmp_path, mode):
    tgt = str(tmp_path / "sv-target")
    hf = _mostly_bigram(tgt, 16, 1, seed=10, lm_scale=30.0, eos=15)
    head = str(tmp_path / "h")
    _save_eagle3(head, tgt, _near_copy_head(hf, (0, 0, 0), 12, seed=3), aux=(0, 0, 0))
    temp, steps, n = 0.8, 4, 1500
    prompt = [3, 7, 11, 2, 9]
    spec, base, llm = sample_with_and_without_speculation(tgt, prompt, n, steps, temp, spec_method="eagle3",
                                                          spec_model=head, spec_mode=mode, num_spec_tokens=3,
                                                          spec_tree_topk=2, spec_tree_depth=3)
    assert_marginals_match(spec, base, _exact_marginals(hf, prompt, steps, temp))
    _assert_no_leak(llm)


def test_chain_draft_probs_zero_outside_the_draft_vocabulary(target):
    tgt, head, _, t = target
    llm = LLM(tgt, spec_method="eagle3", spec_model=head, spec_mode="chain", num_spec_tokens=3, seed=0)
    dr = llm.executor.drafter
    seen = []
    orig = dr.propose

    def spy(items, gens):
        drafts = orig(items, gens)
        seen.extend(d.draft_probs for d in drafts if d.draft_probs is not None)
        return drafts

    dr.propose = spy
    llm.generate([[5, 9, 13, 17]], SamplingParams(temperature=1.0, max_tokens=12, seed=1, ignore_eos=True))
    assert seen
    outside = ~t["t2d"]
    for dp in seen:
        assert torch.all(dp[:-1, outside] == 0) and torch.allclose(dp[:-1].sum(-1), torch.ones(dp.shape[0] - 1))


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
def test_layouts_load_every_tensor_where_it_belongs(target, tmp_path):
    tgt, _, hf, t = target
    llm = LLM(tgt, num_kv_blocks=8)
    for layout, prefix in (("eagle", ""), ("vllm", ""), ("vllm", "model.")):
        path = str(tmp_path / f"{layout}{prefix}")
        _save_eagle3(path, tgt, t, layout, prefix, dtype=torch.float16)
        m = load_eagle3(path, llm.model)
        got = {}
        for mod, pre in ((m.layer, "midlayer."), (m.hidden_norm, "midlayer."), (m.norm, ""), (m.fc, ""),
                         (m.lm_head, "")):
            for sub in mod.modules():
                if isinstance(sub, CheckpointModule):
                    for n, w in sub.checkpoint_tensors():
                        got[n.replace("model.layers.0.", pre).replace("model.", "")] = w
        assert sorted(got) == sorted(k for k in t if k not in ("d2t", "t2d")), layout
        for name, w in got.items():  # fp16 in the file, float32 in the runner: the fp16 values exactly
            assert w.dtype == torch.float32
            torch.testing.assert_close(w, t[name].half().float(), rtol=0, atol=0)
        assert torch.equal(m.draft_to_target.cpu(), torch.arange(200) + t["d2t"])
        assert m.aux_layers == (2, 2, 1) and m.embed is None


def test_loading_errors_name_the_tensor(target, tmp_path):
    tgt, _, hf, t = target
    llm = LLM(tgt, num_kv_blocks=8)
    p = str(tmp_path / "bad")
    H = 64
    cases = [
        ({k: v for k, v in t.items() if k != "midlayer.hidden_norm.weight"},
         {}, "missing tensor 'midlayer.hidden_norm.weight'"),
        (dict(t, **{"fc.weight": torch.randn(H, 2 * H)}), {}, r"'fc.weight' has shape \[64, 128\], expected \[64, 192\]"),
        (dict(t, **{"midlayer.self_attn.q_proj.weight": torch.randn(H, H)}), {},
         r"'midlayer.self_attn.q_proj.weight' has shape \[64, 64\], expected \[64, 128\]"),
        ({k: v for k, v in t.items() if k != "d2t"}, {}, "missing tensor 'd2t'"),
        (dict(t, d2t=t["d2t"].float()), {}, "'d2t' has dtype torch.float32"),
        (dict(t, d2t=t["d2t"] + 200), {}, "'d2t' .* distinct target ids in \\[0, 300\\)"),
        (dict(t, t2d=~t["t2d"]), {}, "'t2d' and 'd2t' .* disagree"),
        ({k: v for k, v in t.items() if k != "norm.weight"}, {}, "missing tensor 'norm.weight'"),
        (dict(t, **{"midlayer.extra.weight": torch.randn(3)}), {}, "unexpected tensors .*midlayer.extra.weight"),
        (t, {"aux": (0, 1, 4)}, r"eagle_aux_hidden_state_layer_ids \[4\] out of range for a target of 4 layers"),
        (t, {"hidden_size": 32}, "hidden_size=32"),
    ]
    for tensors, kw, msg in cases:
        _save_eagle3(p, tgt, tensors, **kw)
        with pytest.raises(ValueError, match=msg):
            load_eagle3(p, llm.model)
    # vLLM names in the error for a vLLM-layout file
    _save_eagle3(p, tgt, {k: v for k, v in t.items() if k != "midlayer.mlp.up_proj.weight"}, "vllm", "model.")
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_eagle3(p, llm.model)
    os.remove(os.path.join(p, "model.safetensors"))
    torch.save(t, os.path.join(p, "pytorch_model.bin"))
    with pytest.raises(ValueError, match="only pickles: pytorch_model.bin"):
        load_eagle3(p, llm.model)
    with pytest.raises(ValueError, match="must be a head directory or Eagle3DraftModel"):
        LLM(tgt, spec_method="eagle3", spec_model=llm.model)


def test_own_embedding_and_full_vocabulary(target, tmp_path):
    """``embed_tokens.weight`` in the checkpoint is the head's own; draft_vocab_size == vocab_size
    needs no d2t / t2d. With the target's embedding copied in, outputs match the default head's."""
    tgt, head, hf, t = target
    full = {k: v for k, v in t.items() if k not in ("d2t", "t2d")}
    full["lm_head.weight"] = hf.state_dict()["lm_head.weight"].detach().clone()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _save_eagle3(a, tgt, full)
    _save_eagle3(b, tgt, dict(full, **{"embed_tokens.weight": hf.state_dict()["model.embed_tokens.weight"]}))
    prompt = [random.Random(2).randrange(3, 300) for _ in range(9)]
    sp = SamplingParams(max_tokens=16, **GREEDY)
    ref = LLM(tgt, seed=0).generate([prompt], sp)[0].outputs[0].token_ids
    st = []
    for path in (a, b):
        llm = LLM(tgt, spec_method="eagle3", spec_model=path, spec_mode="tree", seed=0)
        assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref
        st.append(llm.stats()["spec_num_accepted_tokens"])
    assert (llm.executor.drafter.model.embed is not None) and st[0] == st[1] > 0, st


def test_cli_generate():
    from fastinfer.entrypoints.cli import main
    import contextlib
    import io

    out = []
    for extra in (["--spec-method", "eagle3", "--spec-model", SHIPPED_HEAD, "--spec-mode", "tree"], []):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["generate", *extra, "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
        out.append(json.loads(buf.getvalue())[0]["outputs"])
    assert out[0] == out[1]


def test_train_eagle3_smoke(tmp_path):
    """tools/train_draft_heads.py --smoke --only eagle3 writes a head the runner loads (fp16, the
    EAGLE repository's names, a reduced vocabulary) and speculates with losslessly."""
    import sys

    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import train_draft_heads

    assert train_draft_heads.main(["--out", str(tmp_path), "--smoke", "--threads", "1", "--only", "eagle3"]) == 0
    head = str(tmp_path / "tiny-llama-eagle3")
    sd = load_file(os.path.join(head, "model.safetensors"))
    assert sd["fc.weight"].dtype == torch.float16 and sd["lm_head.weight"].shape[0] == 1024  # --eagle3-vocab
    assert int(sd["t2d"].sum()) == 1024 and sd["d2t"].dtype == torch.int64
    sp = SamplingParams(max_tokens=12, **GREEDY)
    base = LLM(seed=0).generate("def main(", sp)[0].outputs[0].token_ids
    llm = LLM(spec_method="eagle3", spec_model=head, seed=0)
    assert llm.generate("def main(", sp)[0].outputs[0].token_ids == base
    assert llm.stats()["spec_num_verify"] > 0
