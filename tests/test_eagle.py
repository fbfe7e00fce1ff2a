"""EAGLE-1/2 draft heads (CPU, float32): ``fc`` over [embed(token); target feature] and one Llama
decoder layer draft a chain or an EAGLE-2 tree on their own features, with their own paged KV pool;
the target verifies with tree attention and ``tree_verify``.

Covers: greedy outputs identical to plain decoding (shipped model; random Llama targets with heads
written in the EAGLE repository's layout, with and without the first layer's input norm, plain and
``model.``-prefixed names; a mixed batch with opt-outs, stops, n > 1 and preemption; no leaked block),
the draft's KV rows and the feature pool equal a fresh computation from the target's true features
(after many accept / reject cycles and a prefix-cache hit), sampling exactness (chi-square), loading
errors naming the tensor, the CLI.

The layout is the EAGLE repository's (SafeAILab/EAGLE ``model/cnets.py``, Llama targets):
``fc = Linear(2H, H)`` over ``cat(inputs_embeds, hidden_states)``; ``layers.0`` a LlamaDecoderLayer
whose first instance has no ``input_layernorm``; the target's embedding and lm_head.
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
from fastinfer.engine.speculative.eagle import load_eagle
from fastinfer.layers import BatchBuilder
from fastinfer.layers.weights import CheckpointModule
from test_spec_decode import (GREEDY, _assert_no_leak, _exact_marginals, _gather, _save_llama, assert_marginals_match,
                              assert_matches_workload, mixed_batch_workload, sample_with_and_without_speculation)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _save_eagle(path, target_dir, layer_tensors, fc_w, fc_b=None, input_norm=True, prefix=""):
    """An EAGLE head directory: config.json (the target's, one layer) and model.safetensors with the
    EAGLE names (``layer_tensors``: the layer's tensors under HF Llama names without ``model.layers.0.``)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    sd = {f"{prefix}layers.0.{k}": v.contiguous() for k, v in layer_tensors.items()
          if input_norm or k != "input_layernorm.weight"}
    sd[f"{prefix}fc.weight"] = fc_w.contiguous()
    if fc_b is not None:
        sd[f"{prefix}fc.bias"] = fc_b.contiguous()
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sd


def _layer_tensors(state_dict, layer=0):
    pre = f"model.layers.{layer}."
    return {k[len(pre):]: v.detach().clone() for k, v in state_dict.items() if k.startswith(pre)}


def _near_copy(path, target_dir, hf, H, **kw):
    """A head that copies the (1-layer) target's layer on the token embedding: it agrees with the
    target often (it only misses the first token's key), not always."""
    fc = torch.cat([torch.eye(H), torch.zeros(H, H)], 1)
    return _save_eagle(path, target_dir, _layer_tensors(hf.state_dict()), fc, **kw)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tgt = str(tmp_path_factory.mktemp("eagle-target"))
    hf = _save_llama(tgt, 300, 1, seed=0)
    head = str(tmp_path_factory.mktemp("eagle-head"))
    _near_copy(head, tgt, hf, 64)
    return tgt, head, hf


# ------------------------------------------------------------------------------------------------
# greedy: identical to plain decoding
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped_head(tmp_path_factory):
    """An EAGLE-1 layout head (no input norm, an fc bias) for the shipped model: its last layer."""
    from safetensors.torch import load_file

    base_path = default_model_path()
    sd = load_file(os.path.join(base_path, "model.safetensors"))
    H = json.load(open(os.path.join(base_path, "config.json")))["hidden_size"]
    g = torch.Generator().manual_seed(0)
    fc = torch.cat([torch.eye(H), torch.randn(H, H, generator=g) * 0.02], 1)
    path = str(tmp_path_factory.mktemp("shipped-eagle"))
    _save_eagle(path, base_path, _layer_tensors({k: v.float() for k, v in sd.items()}, 4), fc,
                fc_b=torch.randn(H, generator=g) * 0.01, input_norm=False)
    return path


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_greedy_identical_shipped_model(shipped_head, mode):
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\nclass"]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    base = LLM(seed=0).generate(prompts, sp)
    llm = LLM(spec_method="eagle", spec_model=shipped_head, spec_mode=mode, seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert llm.stats()["spec_num_verify"] > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("mode,k,topk,depth", [("chain", 3, 2, None), ("tree", 6, 2, 4)])
def test_greedy_identical_batch_with_preemption(target, mode, k, topk, depth):
    tgt, head, _ = target
    prompts, params, ref = mixed_batch_workload(tgt)
    llm = LLM(tgt, spec_method="eagle", spec_model=head, spec_mode=mode, num_spec_tokens=k, spec_tree_topk=topk,
              spec_tree_depth=depth, num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=96, seed=0)
    outs = llm.generate(prompts, params)
    st = assert_matches_workload(llm, outs, ref)
    assert st["spec_mean_accepted_length"] > 0.5, st  # the near-copy head is a good draft
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# the draft's KV and the feature pool after many accept / reject cycles
# ------------------------------------------------------------------------------------------------
def _fresh_rows(llm, tokens, n_rows):
    """The target's features f_0 .. f_{n-1} of ``tokens`` and the head's K/V of rows 0 .. n_rows - 1
    ((f_p, t_{p+1}) at position p), each from a one-shot prefill on fresh caches."""
    bs = llm.block_size
    model, head = llm.model, llm.executor.drafter.model
    nb = -(-len(tokens) // bs)
    with torch.inference_mode():
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens, 0, list(range(nb)), logits="all")
        feats = model.hidden_states(b.build(), model.allocate_kv_cache(nb, bs))
        b = BatchBuilder(bs, llm.device)
        b.prefill(tokens[1:n_rows + 1], 0, list(range(nb)), logits="all")
        kv = head.allocate_kv_cache(nb, bs)
        head(b.build(), kv, feats[:n_rows])
    return feats, _gather(kv, list(range(nb)), n_rows, bs)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_draft_kv_and_features_match_a_fresh_computation(target, mode):
    tgt, head, _ = target
    prompt = [random.Random(5).randrange(3, 300) for _ in range(21)]
    llm = LLM(tgt, spec_method="eagle", spec_model=head, spec_mode=mode, num_spec_tokens=6, spec_tree_topk=2,
              spec_tree_depth=4, num_kv_blocks=64, seed=0)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=90, **GREEDY))
    seq = llm.engine_core.requests[rid].seqs[0]
    while seq.num_output_tokens < 60:
        llm.step()
    st = llm.stats()
    assert st["spec_num_verify"] >= 5 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    bs, dr = llm.block_size, llm.executor.drafter

    def check(s):
        c, dc = s.num_computed_tokens, llm.engine_core.proposer.draft_computed(s)
        assert c - 8 <= dc <= c - 1  # rows of the last accepted tokens come with the next catch-up
        feats, kv = _fresh_rows(llm, s.token_ids[:c], dc)
        slots = torch.tensor([s.block_table[p // bs] * bs + p % bs for p in range(c)])
        torch.testing.assert_close(dr.features[slots], feats, rtol=1e-4, atol=1e-4)
        for (gk, gv), (rk, rv) in zip(_gather(dr.kv_caches, s.block_table, dc, bs), kv):
            torch.testing.assert_close(gk, rk, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(gv, rv, rtol=1e-4, atol=1e-4)

    check(seq)
    # a second request hits the first one's cached blocks: features and draft rows found again
    prompt2 = seq.token_ids[:2 * bs + 5] + [7, 8, 9]
    rid2 = llm.add_request(prompt2, SamplingParams(max_tokens=30, **GREEDY))
    seq2 = llm.engine_core.requests[rid2].seqs[0]
    llm.step()
    assert seq2.num_cached_tokens == 2 * bs and llm.engine_core.proposer.draft_computed(seq2) == 2 * bs - 1
    while seq2.num_output_tokens < 12:
        llm.step()
    check(seq2)
    llm.abort_request(rid)
    llm.abort_request(rid2)
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# sampling: exact
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampling_distribution_matches(tmp_path, mode):
    tgt = str(tmp_path / "sv-target")
    hf = _save_llama(tgt, 16, 1, seed=10, lm_scale=30.0, eos=15)
    _near_copy(str(tmp_path / "h"), tgt, hf, 64, input_norm=False)
    temp, steps, n = 0.8, 4, 1500
    prompt = [3, 7, 11, 2, 9]
    spec, base, llm = sample_with_and_without_speculation(tgt, prompt, n, steps, temp, spec_method="eagle",
                                                          spec_model=str(tmp_path / "h"), spec_mode=mode,
                                                          num_spec_tokens=3, spec_tree_topk=2, spec_tree_depth=3)
    assert_marginals_match(spec, base, _exact_marginals(hf, prompt, steps, temp))
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
def test_layouts_and_loading_errors(target, tmp_path):
    from safetensors.torch import load_file, save_file

    tgt, head, hf = target
    llm = LLM(tgt, num_kv_blocks=8)
    # model.-prefixed names (vLLM / SGLang) load to the same head
    pref = str(tmp_path / "prefixed")
    _near_copy(pref, tgt, hf, 64, prefix="model.")
    sd = load_file(os.path.join(head, "model.safetensors"))
    for path in (head, pref):  # every written tensor is where the head reads it
        m = load_eagle(path, llm.model)
        got = {n[len("model."):]: t for mod in m.layer.modules() if isinstance(mod, CheckpointModule)
               for n, t in mod.checkpoint_tensors()}
        got["fc.weight"] = m.fc_weight
        assert sorted(got) == sorted(sd)
        for name, t in sd.items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=0)
    f = os.path.join(str(tmp_path / "bad"), "model.safetensors")
    _near_copy(str(tmp_path / "bad"), tgt, hf, 64)
    for bad, msg in (({k: v for k, v in sd.items() if k != "layers.0.mlp.down_proj.weight"},
                      "missing tensor 'model.layers.0.mlp.down_proj.weight'"),
                     (dict(sd, **{"fc.weight": torch.randn(64, 64)}),
                      r"'model.fc.weight' has shape \[64, 64\], expected \[64, 128\]"),
                     (dict(sd, **{"layers.1.mlp.down_proj.weight": torch.randn(64, 128)}),
                      "unexpected tensors .*model.layers.1.mlp.down_proj.weight")):
        save_file(bad, f)
        with pytest.raises(ValueError, match=msg):
            load_eagle(str(tmp_path / "bad"), llm.model)
    os.remove(f)
    torch.save(sd, os.path.join(str(tmp_path / "bad"), "pytorch_model.bin"))
    with pytest.raises(ValueError, match="only pickles: pytorch_model.bin"):
        load_eagle(str(tmp_path / "bad"), llm.model)
    other = str(tmp_path / "v301")
    hf2 = _save_llama(other, 301, 1, seed=2)
    _near_copy(str(tmp_path / "h301"), other, hf2, 64)
    with pytest.raises(ValueError, match="vocab_size=301, the target 300"):
        LLM(tgt, spec_method="eagle", spec_model=str(tmp_path / "h301"))


def test_cli_generate(shipped_head, capsys):
    from fastinfer.entrypoints.cli import main

    assert main(["generate", "--spec-method", "eagle", "--spec-model", shipped_head, "--spec-mode", "tree",
                 "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outputs"] == spec_out[0]["outputs"]


# ------------------------------------------------------------------------------------------------
# the shipped trained heads (tools/train_draft_heads.py)
# ------------------------------------------------------------------------------------------------
ASSETS = os.path.dirname(default_model_path())
# tokens per target forward, measured 1.168 (Medusa), 1.394 (EAGLE chain 4), 1.750 (EAGLE tree 8) on
# these prompts (48 tokens each, the float16 heads); the bounds leave room, and would fail for
# untrained heads (~1.0)
MEDUSA_MIN, EAGLE_CHAIN_MIN, EAGLE_TREE_MIN = 1.08, 1.2, 1.4


@pytest.mark.parametrize("kw,min_tokens_per_verify", [
    (dict(spec_method="medusa", spec_model=os.path.join(ASSETS, "tiny-llama-medusa")), MEDUSA_MIN),
    (dict(spec_method="eagle", spec_model=os.path.join(ASSETS, "tiny-llama-eagle"), spec_mode="chain",
          num_spec_tokens=4), EAGLE_CHAIN_MIN),
    (dict(spec_method="eagle", spec_model=os.path.join(ASSETS, "tiny-llama-eagle"), spec_mode="tree",
          num_spec_tokens=8), EAGLE_TREE_MIN)])
def test_shipped_trained_heads(kw, min_tokens_per_verify):
    """Lossless on the shipped model, and they learned something: more than one token per target
    forward on code prompts (the measured figures are in the assets README)."""
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\nclass", "    def __init__(self, name):\n"]
    sp = SamplingParams(max_tokens=48, **GREEDY)
    base = LLM(seed=0).generate(prompts, sp)
    llm = LLM(seed=0, **kw)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert llm.stats()["spec_mean_tokens_per_verify"] > min_tokens_per_verify, llm.stats()
    _assert_no_leak(llm)


def test_train_draft_heads_smoke(tmp_path):
    """tools/train_draft_heads.py --smoke writes heads the runner loads and speculates with."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import train_draft_heads

    assert train_draft_heads.main(["--out", str(tmp_path), "--smoke", "--threads", "1"]) == 0
    sp = SamplingParams(max_tokens=12, **GREEDY)
    base = LLM(seed=0).generate("def main(", sp)[0].outputs[0].token_ids
    for method in ("medusa", "eagle"):
        llm = LLM(spec_method=method, spec_model=str(tmp_path / f"tiny-llama-{method}"), seed=0)
        assert llm.generate("def main(", sp)[0].outputs[0].token_ids == base
        assert llm.stats()["spec_num_verify"] > 0
