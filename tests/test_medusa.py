"""Medusa draft heads (CPU, float32): heads on the target's last hidden state propose a static tree,
the target verifies it with tree attention and ``tree_verify`` (deterministic candidates).

Covers: greedy outputs identical to plain decoding (shipped model; random Llama targets with heads
written in the Medusa repository's and vLLM's layouts; a mixed batch with opt-outs, stops, n > 1
and a KV pool small enough to preempt; no leaked block), sampling exactness (chi-square against the
exact marginals and against plain sampling), the tree arguments, loading (both layouts round-trip;
a missing / wrong-shape / extra tensor is an error naming it), the CLI.

The layouts come from the producers' code: Medusa (FasterDecoding/Medusa, ``medusa_model.py``:
``medusa_head = ModuleList(Sequential(*[ResBlock(H)] * medusa_num_layers, Linear(H, V, bias=False)))``
with ``ResBlock.linear = Linear(H, H)``, so ``medusa_head.{i}.{j}.linear.weight/bias`` and
``medusa_head.{i}.{num_layers}.weight``) and vLLM (``vllm/model_executor/models/medusa.py``:
``blocks.{i}.layers.{j}`` Linear(H, H, bias=medusa_fc_bias), ``lm_heads.{i}``, config ``num_heads``
/ ``num_hidden_layers``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer.engine.config import default_model_path
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.engine.speculative.medusa import load_medusa_heads
from fastinfer.engine.speculative.trees import DEFAULT_MEDUSA_TREE, check_tree, tree_structure
from model_helpers import make_forward_batch
from test_spec_decode import (GREEDY, _assert_no_leak, _exact_marginals, _save_llama, assert_marginals_match,
                              assert_matches_workload, mixed_batch_workload, sample_with_and_without_speculation)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _heads_tensors(H, V, num_heads, num_layers, seed, lm=None, scale=0.3):
    """Random heads: per head ``num_layers`` (W [H, H], b [H]) and a [V, H] projection (``lm``: a
    copy of the target's lm_head, so the heads' guesses are often in the target's top-k)."""
    g = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(num_heads):
        blocks = [(torch.randn(H, H, generator=g) * scale / H ** 0.5, torch.randn(H, generator=g) * 0.1)
                  for _ in range(num_layers)]
        proj = lm.clone() if lm is not None else torch.randn(V, H, generator=g)
        heads.append((blocks, proj))
    return heads


def _save_medusa_repo(path, heads, base="target"):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    nl = len(heads[0][0])
    sd = {}
    for i, (blocks, proj) in enumerate(heads):
        for j, (w, b) in enumerate(blocks):
            sd[f"medusa_head.{i}.{j}.linear.weight"] = w.contiguous()
            sd[f"medusa_head.{i}.{j}.linear.bias"] = b.contiguous()
        sd[f"medusa_head.{i}.{nl}.weight"] = proj.contiguous()
    save_file(sd, os.path.join(path, "medusa_lm_head.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": len(heads), "medusa_num_layers": nl, "base_model_name_or_path": base}, f)
    return sd


def _save_medusa_vllm(path, heads, bias=True, prefix=""):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    H = heads[0][1].shape[1]
    sd = {}
    for i, (blocks, proj) in enumerate(heads):
        for j, (w, b) in enumerate(blocks):
            sd[f"{prefix}blocks.{i}.layers.{j}.weight"] = w.contiguous()
            if bias:
                sd[f"{prefix}blocks.{i}.layers.{j}.bias"] = b.contiguous()
        sd[f"{prefix}lm_heads.{i}.weight"] = proj.contiguous()
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H,
                   "vocab_size": heads[0][1].shape[0], "num_heads": len(heads),
                   "num_hidden_layers": len(heads[0][0]), "medusa_fc_bias": bias, "truncated_vocab_size": None}, f)
    return sd


def _ref_heads(heads, h):
    """fp64 reference of the heads on hidden states ``h [B, H]``: logits [heads, B, V]."""
    out = []
    for blocks, proj in heads:
        x = h.double()
        for w, b in blocks:
            x = x + torch.nn.functional.silu(x @ w.double().T + b.double())
        out.append(x @ proj.double().T)
    return torch.stack(out)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 2-layer Llama (V = 300) and Medusa heads for it in both layouts."""
    tgt = str(tmp_path_factory.mktemp("medusa-target"))
    hf = _save_llama(tgt, 300, 2, seed=0)
    lm = hf.lm_head.weight.detach()
    heads = _heads_tensors(64, 300, 3, 1, seed=5, lm=lm)
    repo = str(tmp_path_factory.mktemp("medusa-repo"))
    _save_medusa_repo(repo, heads)
    vllm = str(tmp_path_factory.mktemp("medusa-vllm"))
    _save_medusa_vllm(vllm, heads, bias=True)
    return tgt, repo, vllm, heads


# ------------------------------------------------------------------------------------------------
# greedy: identical to plain decoding
# ------------------------------------------------------------------------------------------------
def test_greedy_identical_shipped_model(tmp_path):
    from safetensors.torch import load_file

    base_path = default_model_path()
    cfg = json.load(open(os.path.join(base_path, "config.json")))
    emb = load_file(os.path.join(base_path, "model.safetensors"))["model.embed_tokens.weight"].float()
    heads = _heads_tensors(cfg["hidden_size"], cfg["vocab_size"], 4, 1, seed=1, lm=emb, scale=0.5)
    _save_medusa_repo(str(tmp_path / "heads"), heads)
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n\nclass"]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    base = LLM(seed=0).generate(prompts, sp)
    llm = LLM(spec_method="medusa", spec_model=str(tmp_path / "heads"), seed=0)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and st["spec_num_draft_tokens"] > 0, st
    _assert_no_leak(llm)


@pytest.mark.parametrize("layout,tree", [("repo", None), ("vllm", None), ("repo", "chain"),
                                         ("vllm", [[0], [1], [0, 0], [0, 1], [0, 0, 0], [2]])])
def test_greedy_identical_batch_with_preemption(target, layout, tree):
    tgt, repo, vllm, _ = target
    prompts, params, ref = mixed_batch_workload(tgt)
    kw = dict(spec_mode="chain") if tree == "chain" else dict(spec_tree=tree)
    llm = LLM(tgt, spec_method="medusa", spec_model=repo if layout == "repo" else vllm, num_kv_blocks=20,
              max_num_seqs=16, max_num_batched_tokens=96, seed=0, **kw)
    outs = llm.generate(prompts, params)
    assert_matches_workload(llm, outs, ref)
    for o, p in zip(outs, params):
        if p.speculative is False:
            assert o.metrics["spec_num_verify"] == 0
    _assert_no_leak(llm)
    # the hidden states of finished sequences are dropped (the executor hears of them a step later)
    llm.generate([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    assert len(llm.executor.drafter._hidden) <= 1


def test_drafter_proposes_from_the_roots_hidden_state(target):
    """After prefill, accepted and rejected verifications, the kept hidden state is the target's
    at the token before the root (a fresh prefill's), and the draft is the heads' top-k of it."""
    tgt, repo, _, heads = target
    llm = LLM(tgt, spec_method="medusa", spec_model=repo, num_kv_blocks=64, seed=0)
    rid = llm.add_request([5, 17, 42, 99, 123, 7], SamplingParams(max_tokens=60, **GREEDY))
    seq = llm.engine_core.requests[rid].seqs[0]
    dr = llm.executor.drafter
    checked = 0
    for _ in range(12):
        llm.step()
        if seq.is_finished:
            break
        toks = seq.token_ids[:-1]
        nb = -(-len(toks) // 16)
        with torch.inference_mode():
            h = llm.model.hidden_states(make_forward_batch(prefill=[(toks, 0, list(range(nb)))]),
                                        llm.model.allocate_kv_cache(nb, 16))[-1]
        n, kept = dr._hidden[seq.seq_id]
        assert n == seq.num_tokens
        torch.testing.assert_close(kept[-1], h, rtol=1e-4, atol=1e-4)
        d = dr.propose([(seq, 3, 0)], [None])[0]
        top = _ref_heads(heads, h[None].double()).topk(4, dim=-1).indices[:, 0]
        assert d.tokens == [seq.token_ids[-1]] + [int(top[len(p) - 1][p[-1]]) for p in dr.paths]
        checked += 1
    st = llm.stats()
    assert checked >= 5 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st


# ------------------------------------------------------------------------------------------------
# sampling: exact
# ------------------------------------------------------------------------------------------------
def test_sampling_distribution_matches(tmp_path):
    tgt = str(tmp_path / "sv-target")
    hf = _save_llama(tgt, 16, 1, seed=10, lm_scale=30.0, eos=15)
    heads = _heads_tensors(64, 16, 3, 1, seed=12, lm=hf.lm_head.weight.detach())
    _save_medusa_repo(str(tmp_path / "heads"), heads)
    temp, steps, n = 0.8, 4, 1500
    prompt = [3, 7, 11, 2, 9]
    spec, base, llm = sample_with_and_without_speculation(tgt, prompt, n, steps, temp, spec_method="medusa",
                                                          spec_model=str(tmp_path / "heads"))
    assert_marginals_match(spec, base, _exact_marginals(hf, prompt, steps, temp))
    _assert_no_leak(llm)


# ------------------------------------------------------------------------------------------------
# trees and arguments
# ------------------------------------------------------------------------------------------------
def test_tree_structure_and_checks():
    paths = check_tree([[0], [1], [0, 0], [1, 0], [0, 0, 2]])
    assert tree_structure(paths) == ([-1, 0, 0, 1, 2, 3], [0, 1, 1, 2, 2, 3])
    check_tree(DEFAULT_MEDUSA_TREE)
    for bad, msg in (([[0, 0]], "before its parent"), ([[0], [0]], "twice"), ([[]], "non-empty"),
                     ([[-1]], "ints >= 0"), ([], "at least one"), (5, "list of paths")):
        with pytest.raises(ValueError, match=msg):
            check_tree(bad)


def test_bad_arguments(target, tmp_path):
    tgt, repo, _, _ = target
    with pytest.raises(ValueError, match="needs spec_model"):
        LLM(tgt, spec_method="medusa")
    with pytest.raises(ValueError, match="spec_method must be one of"):
        LLM(tgt, spec_method="lookahead", spec_model=repo)
    with pytest.raises(ValueError, match="the EAGLE-3 head has hidden_size"):  # a Medusa directory
        LLM(tgt, spec_method="eagle3", spec_model=repo)
    with pytest.raises(ValueError, match="not both"):
        LLM(tgt, draft_model=tgt, spec_model=repo)
    with pytest.raises(ValueError, match="pass the heads as spec_model"):
        LLM(tgt, draft_model=repo, spec_method="medusa")
    with pytest.raises(ValueError, match="spec_model directory not found"):
        LLM(tgt, spec_method="medusa", spec_model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="spec_tree .* needs spec_method='medusa'"):
        LLM(tgt, draft_model=tgt, spec_tree=[[0]])
    with pytest.raises(ValueError, match=r"path \[0, 0, 0, 0\] is deeper than the 3 heads"):
        LLM(tgt, spec_method="medusa", spec_model=repo, spec_tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["repo", "vllm", "vllm-nobias", "vllm-prefixed"])
def test_layouts_round_trip(tmp_path, layout):
    heads = _heads_tensors(32, 50, 2, 2, seed=3)
    path = str(tmp_path / layout)
    if layout == "repo":
        _save_medusa_repo(path, heads)
    else:
        bias = layout != "vllm-nobias"
        if not bias:
            heads = [([(w, torch.zeros_like(b)) for w, b in blocks], p) for blocks, p in heads]
        _save_medusa_vllm(path, heads, bias=bias, prefix="medusa_heads." if layout == "vllm-prefixed" else "")
    m = load_medusa_heads(path, 32, 50, torch.float32, "cpu")
    assert m.num_heads == 2
    h = torch.randn(5, 32)
    got, ref = m(h), _ref_heads(heads, h)
    assert ((got.double() - ref).norm() / ref.norm()) < 1e-6


def test_loading_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    heads = _heads_tensors(32, 50, 2, 1, seed=3)
    path = str(tmp_path / "h")
    sd = _save_medusa_repo(path, heads)
    f = os.path.join(path, "medusa_lm_head.safetensors")
    with pytest.raises(ValueError, match=r"'medusa_head.0.1.weight' has shape \[50, 32\], expected \[51, 32\]"):
        load_medusa_heads(path, 32, 51, torch.float32, "cpu")  # a target with another vocabulary
    bad = dict(sd)
    bad["medusa_head.1.0.linear.weight"] = torch.randn(32, 31)
    save_file(bad, f)
    with pytest.raises(ValueError, match=r"'medusa_head.1.0.linear.weight' has shape \[32, 31\], expected \[32, 32\]"):
        load_medusa_heads(path, 32, 50, torch.float32, "cpu")
    bad = {k: v for k, v in sd.items() if k != "medusa_head.0.1.weight"}
    save_file(bad, f)
    with pytest.raises(ValueError, match="missing tensor 'medusa_head.0.1.weight'"):
        load_medusa_heads(path, 32, 50, torch.float32, "cpu")
    bad = dict(sd, **{"medusa_head.2.0.linear.weight": torch.randn(32, 32)})
    save_file(bad, f)
    with pytest.raises(ValueError, match="unexpected tensors .*medusa_head.2.0.linear.weight"):
        load_medusa_heads(path, 32, 50, torch.float32, "cpu")
    assert load_file(f)  # still a readable file
    os.remove(f)
    torch.save(sd, os.path.join(path, "medusa_lm_head.pt"))
    with pytest.raises(ValueError, match="only pickles: medusa_lm_head.pt"):
        load_medusa_heads(path, 32, 50, torch.float32, "cpu")
    save_file(sd, f)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({"model_type": "llama"}, fh)
    with pytest.raises(ValueError, match="names no Medusa layout"):
        load_medusa_heads(path, 32, 50, torch.float32, "cpu")


def test_cli_generate_and_bench(tmp_path, capsys):
    from fastinfer.entrypoints.cli import main

    cfg = json.load(open(os.path.join(default_model_path(), "config.json")))
    _save_medusa_vllm(str(tmp_path / "h"), _heads_tensors(cfg["hidden_size"], cfg["vocab_size"], 2, 1, seed=0))
    args = ["--spec-method", "medusa", "--spec-model", str(tmp_path / "h"), "--spec-tree", "[[0], [1], [0, 0]]"]
    assert main(["generate", *args, "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
    spec_out = json.loads(capsys.readouterr().out)
    assert main(["generate", "--prompt", "def main(", "--max-tokens", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["outputs"] == spec_out[0]["outputs"]
    assert main(["bench", "--model", default_model_path(), *args, "--batch", "2", "--input-len", "16",
                 "--output-len", "12", "--compare-no-spec", "--json", "--warmup", "0"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["spec_method"] == "medusa" and res["spec_verifications"] > 0
    assert res["greedy_outputs_identical"] == "2/2"


def test_original_lm_head_without_the_copy_uses_the_targets(target, tmp_path):
    """vLLM's ``original_lm_head``: the heads use the base model's LM head. A file without
    ``lm_heads.0`` (the shipped heads) reads the target's; the same heads with the copy written
    out (what vLLM loads) give the same logits, and greedy decoding is unchanged."""
    from safetensors.torch import save_file

    from fastinfer import LLM

    tgt, _, _, _ = target
    llm = LLM(tgt, dtype=torch.float32, device="cpu")
    lm = llm.model.lm_head.weight.detach()[:300].clone()
    blocks = {f"blocks.{i}.layers.0.{n}": t for i, (bl, _) in enumerate(_heads_tensors(64, 300, 3, 1, seed=5))
              for n, t in zip(("weight", "bias"), bl[0])}
    cfg = {"model_type": "medusa", "hidden_size": 64, "vocab_size": 300, "num_heads": 3, "num_hidden_layers": 1,
           "medusa_fc_bias": True, "original_lm_head": True}
    dirs = {}
    for name, tensors in (("full", dict(blocks, **{"lm_heads.0.weight": lm})), ("tied", blocks)):
        d = dirs[name] = str(tmp_path / name)
        os.makedirs(d)
        save_file(tensors, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
    with pytest.raises(ValueError, match="without lm_heads.0.weight use the target's LM head"):
        load_medusa_heads(dirs["tied"], 64, 300, torch.float32, "cpu")
    h = torch.randn(4, 64)
    a = load_medusa_heads(dirs["full"], 64, 300, torch.float32, "cpu")(h)
    b = load_medusa_heads(dirs["tied"], 64, 300, torch.float32, "cpu", llm.model.lm_head)(h)
    assert a.shape == b.shape == (3, 4, 300)
    assert ((a - b).norm() / a.norm()) < 1e-6
    prompts, sp = [[5, 17, 33, 2, 8], [40, 41, 42]], SamplingParams(max_tokens=12, **GREEDY)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    spec = LLM(tgt, dtype=torch.float32, device="cpu", spec_method="medusa", spec_model=dirs["tied"])
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp)] == plain
