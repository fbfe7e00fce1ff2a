"""gpt-oss parity: fastinfer's GptOssForCausalLM (CPU ops, float32) against transformers' ``gpt_oss``
modeling file.

Tiny random checkpoints written with ``save_pretrained`` (hidden 128, head_dim 64, GQA 4/2 or 4/1,
vocab 300, 4 or 8 experts of width 64, 2 or 3 per token, YaRN rope with ``truncate`` false, sliding
window 24 on the even layers or as ``layer_types`` says, q/k/v/o biases, router and expert biases,
attention sinks). Weights are re-drawn at a larger scale than transformers' init (the sinks around
1, so that they take a visible share of each softmax) and one case clamps the SwiGLU at 1.0 so that
its limits bind. Checks: logits at every position of a prompt (relative norm error < 1e-5), 32
greedy tokens through the runner, chunked prefill, a batch with prefix caching, chunked prefill and
preemption against each prompt alone, tensor parallelism (2 ranks), expert parallelism (2 ranks,
bit for bit), pipeline parallelism (2 stages), draft-model speculation (chain and tree) giving the tokens of plain decoding, the
emulated CUDA kernels, the MXFP4 checkpoint layout (``*_blocks`` / ``*_scales``, ``quant_method
"mxfp4"``) against transformers dequantising the same files, the config against transformers'
defaults and its reading of a hub-style config.json, refusals, and
``test_each_gpt_oss_detail_is_visible`` (each detail undone moves the logits far beyond the
tolerance, so the parity tests can fail).
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastinfer  # noqa: E402,F401
from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed  # noqa: E402
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.engine.checkpoints import load_checkpoint  # noqa: E402
from fastinfer.layers import UnquantizedFusedMoEMethod  # noqa: E402
from fastinfer.models import GptOssForCausalLM, ModelConfig, load_model  # noqa: E402
from fastinfer.quant import Fp4FusedMoEMethod  # noqa: E402
from model_helpers import (  # noqa: E402
    check_batching_prefix_caching_and_preemption,
    hf_greedy,
    hf_logits,
    lazy_checkpoints,
    make_forward_batch,
    prefill_logits,
    random_prompt,
    reinit_,
    rel_err,
)

VOCAB = 300
PROMPT_LEN = 40
BS = 16
REL_TOL = 1e-5
GREEDY = dict(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, sliding_window=24,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
CASES = {
    # 4 experts, 2 per token; layers 0 and 2 slide (transformers' default alternation)
    "base": dict(num_local_experts=4, num_experts_per_tok=2),
    # 8 experts, 3 per token, one KV head, the SwiGLU clamped at 1.0 with alpha 1.2, full attention
    # first (layer_types given)
    "clamped": dict(num_local_experts=8, num_experts_per_tok=3, num_key_value_heads=1, swiglu_limit=1.0,
                    swiglu_alpha=1.2, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}


def make_gpt_oss(kind, seed, **overrides):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**dict(BASE, **overrides))).eval()
    reinit_(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks near the scores' scale: a visible share of each softmax
            layer.self_attn.sinks.copy_(1.0 + torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory, {k: ("gpt_oss", v) for k, v in CASES.items()}, make_gpt_oss)


def _prompt(n=PROMPT_LEN, seed=0):
    return random_prompt(n, VOCAB, seed)


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, GptOssForCausalLM)
    ids = _prompt()
    ref = hf_logits(hf, ids)
    out = prefill_logits(model, ids, block_size=BS)
    assert out.shape == (PROMPT_LEN, VOCAB)
    err = rel_err(out, ref)
    print(f"{name}: prefill logits rel err {err:.2e}")
    assert err < REL_TOL, f"{name}: rel err {err:.2e}"
    per_pos = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_pos.max().item() < 10 * REL_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_32_tokens_through_the_runner(ckpts, name):
    hf, path = ckpts(name)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
    ids = _prompt(seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=32, **GREEDY))
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, 32)


def test_layers_follow_the_config(ckpts):
    hf, path = ckpts("clamped")
    model = load_model(path, dtype=torch.float32)
    assert [layer.attn.window_left for layer in model.layers] == [-1, 23, 23]
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    moe = model.layers[0].moe
    assert (moe.scoring, moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("topk_softmax", "swiglu_oai", 1.2, 1.0)
    assert moe.top_k == 3 and not moe.renormalize and moe.router.bias is not None
    assert torch.equal(model.layers[1].attn.sinks, hf.model.layers[1].self_attn.sinks.float())


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_prefill_matches_transformers(ckpts, name):
    """Three prefill chunks (cuts inside blocks and inside the window) on a shuffled block table."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(seed=2)
    blocks = list(range(3))
    random.Random(3).shuffle(blocks)
    caches = model.allocate_kv_cache(3, BS)
    got = [model(make_forward_batch(prefill=[(ids[a:b], a, blocks)], block_size=BS, all_logits=True), caches)
           for a, b in ((0, 13), (13, 27), (27, PROMPT_LEN))]
    assert rel_err(torch.cat(got), hf_logits(hf, ids)) < REL_TOL


def test_batching_prefix_caching_and_preemption(ckpts):
    """A batch with shared prefixes, chunked prefills and preemption: each prompt's tokens alone, and
    transformers' (model_helpers.check_batching_prefix_caching_and_preemption)."""
    hf, path = ckpts("clamped")
    check_batching_prefix_caching_and_preemption(hf, path, VOCAB, BS, GREEDY)


def test_tensor_parallel_two_ranks(ckpts):
    """TP=2: each rank half the query heads (and their sinks), each expert's intermediate rows split
    (the gate/up biases with them, the down bias added by rank 0), equals transformers."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    hf, path = ckpts("base")
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS, tensor_parallel_size=2)
    try:
        layer = llm.model.layers[0]  # rank 0's shard
        assert layer.attn.sinks.shape == (2,) and layer.moe.w13.shape[1] == 64 and layer.moe.w13_bias.shape == (4, 64)
        assert torch.equal(layer.attn.sinks, hf.model.layers[0].self_attn.sinks[:2])
        ids = _prompt(seed=4)
        logits, _ = llm.executor.runner.forward(ForwardPlan(chunks=[Chunk(-1, ids, 0, "all")],
                                                            tables={-1: [0, 1, 2]}, finished=[-1]))
        assert rel_err(logits, hf_logits(hf, ids)) < REL_TOL
        out = llm.generate([ids], SamplingParams(max_tokens=12, **GREEDY))
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, 12)
    finally:
        llm.shutdown()


def test_expert_parallel_two_ranks_is_one_process(ckpts, monkeypatch):
    """expert_parallel_size=2: each rank holds half the experts whole (their biases whole), the
    attention whole; float32 logits (a prefill, every row, and a decode row) equal one process's bit
    for bit, and the greedy tokens too."""
    from model_helpers import plan_logits

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")  # every rank's kernels as this process's
    hf, path = ckpts("clamped")
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
    one = LLM(path, **kw)
    ep = LLM(path, expert_parallel_size=2, **kw)
    try:
        moe = ep.model.layers[0].moe  # rank 0's half
        assert moe.w13.shape[0] == 4 and moe.w2_bias.shape == (4, 128) and ep.executor.runner.worker_pids
        ids = _prompt(seed=7)
        a, b = plan_logits(one, ids), plan_logits(ep, ids)
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
        assert rel_err(a[:-1], hf_logits(hf, ids)) < REL_TOL
        sp = SamplingParams(max_tokens=12, **GREEDY)
        assert ep.generate([ids], sp)[0].outputs[0].token_ids == one.generate([ids], sp)[0].outputs[0].token_ids
    finally:
        ep.shutdown()


def test_pipeline_parallel_two_stages(ckpts):
    """pipeline_parallel_size=2: each stage holds its layers (and reads only their experts' stacked
    tensors); the greedy tokens are transformers'."""
    hf, path = ckpts("clamped")
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS, pipeline_parallel_size=2)
    try:
        assert len(llm.model.layers) < hf.config.num_hidden_layers
        ids = _prompt(seed=3)
        out = llm.generate([ids], SamplingParams(max_tokens=12, **GREEDY))
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, 12)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def draft(ckpts, tmp_path_factory):
    """A one-layer gpt-oss draft of the "clamped" target (its first layer, embedding, final norm and
    head, as transformers builds the same config with one layer)."""
    hf, _ = ckpts("clamped")
    over = dict(CASES["clamped"], num_hidden_layers=1, layer_types=["full_attention"])
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**dict(BASE, **over))).eval()
    target = hf.state_dict()
    model.load_state_dict({k: v for k, v in target.items() if k in model.state_dict()}, strict=True)
    path = tmp_path_factory.mktemp("gpt-oss-draft")
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode, sizes", [("chain", dict(num_spec_tokens=4)),
                                         ("tree", dict(num_spec_tokens=6, spec_tree_topk=2))])
def test_draft_model_speculation_gives_the_tokens_of_plain_decoding(ckpts, draft, mode, sizes):
    """A one-layer draft proposes chains / trees; the target verifies them in one forward (sinks and
    windows under the tree mask) in a batch that preempts: the tokens of plain decoding (the
    deterministic mode), having drafted, accepted and rejected, every block freed."""
    _, path = ckpts("clamped")
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
               for i in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(8, 24), **GREEDY) for _ in prompts]
    ref = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS, deterministic=True).generate(prompts, params)
    llm = LLM(path, dtype="float32", draft_model=draft, spec_mode=mode, **sizes, num_kv_blocks=12, block_size=BS,
              max_num_seqs=8, max_num_batched_tokens=64, deterministic=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_kv_blocks"], st


@pytest.mark.sim
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sim_kernels_end_to_end(ckpts, dtype):
    """The whole model on the CUDA kernel sources (simt emulator: moe_topk's topk_softmax, fused_moe's
    swiglu_oai with biases, attention with sinks and windows) in half precision: chunked prefill +
    decode against the fp32 CPU logits, at most 2x as wrong as the CPU ops in the same dtype,
    bit-identical across emulator schedule seeds."""
    require_sim()
    _, path = ckpts("base")
    ids = _prompt(30, seed=6)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids, block_size=BS)
    naive = prefill_logits(load_model(path, dtype=dtype), ids, block_size=BS)
    model = load_model(path, dtype=dtype, ops=fastinfer.ops.backend("fastinfer_sim"))
    blocks = [1, 0]
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, BS)
            a = model(make_forward_batch(prefill=[(ids[:13], 0, blocks)], block_size=BS, all_logits=True), caches)
            b = model(make_forward_batch(prefill=[(ids[13:29], 13, blocks)], block_size=BS, all_logits=True), caches)
            c = model(make_forward_batch(decode=[(ids[29], 29, blocks)], block_size=BS), caches)
            results.append(torch.cat([a, b, c]))
    err, err_naive = rel_err(results[0].float(), ref), rel_err(naive.float(), ref)
    print(f"sim {dtype}: rel err {err:.2e} (cpu ops in {dtype}: {err_naive:.2e})")
    assert 0 < err_naive < 0.05 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


# ------------------------------------------------------------------------------------------------
# each detail matters
# ------------------------------------------------------------------------------------------------
def _without(model, detail):
    for layer in model.layers:
        m = layer.moe
        if detail == "sinks":
            layer.attn.sinks = None
        elif detail == "sliding window":
            layer.attn.window_left = -1
        elif detail == "topk_softmax":
            m.scoring = "softmax"
        elif detail == "swiglu limit":
            m.swiglu_limit = 1e6
        elif detail == "swiglu alpha":
            m.swiglu_alpha = 1.702 if m.swiglu_alpha != 1.702 else 1.0
        elif detail == "router bias":
            m.router.bias.zero_()
        elif detail == "expert biases":
            m.w13_bias.zero_()
            m.w2_bias.zero_()
        elif detail == "gate / up order":
            local = m.local_intermediate_size
            m.w13.copy_(torch.cat([m.w13[:, local:], m.w13[:, :local]], dim=1))
        elif detail == "attention biases":
            layer.qkv_proj.bias.zero_()
        else:
            raise AssertionError(detail)


@pytest.mark.parametrize("name, detail", [
    ("base", "sinks"), ("base", "sliding window"), ("base", "topk_softmax"), ("base", "router bias"),
    ("base", "expert biases"), ("base", "gate / up order"), ("base", "attention biases"),
    ("clamped", "swiglu limit"), ("clamped", "swiglu alpha"), ("clamped", "sinks"),
])
def test_each_gpt_oss_detail_is_visible(ckpts, name, detail):
    """Undoing one detail in the loaded model puts its logits 1000 x the tolerance away."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt()
    with torch.no_grad():
        _without(model, detail)
    err = rel_err(prefill_logits(model, ids, block_size=BS), hf_logits(hf, ids))
    assert err > 1000 * REL_TOL, f"{name} without {detail}: rel err only {err:.2e}"


# ------------------------------------------------------------------------------------------------
# MXFP4 experts (the published layout)
# ------------------------------------------------------------------------------------------------
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def _write_mxfp4(src: str, dst: str, quantization_config=MXFP4_CONFIG) -> None:
    """``src``'s checkpoint with its expert weights in gpt-oss's MXFP4 layout: per expert, the float
    weight as stored one row per output feature (``gate_up_proj[e].T [2I, H]``, ``down_proj[e].T
    [H, I]``), quantised by fastinfer's MXFP4 quantiser, packed ``*_blocks [E, N, K / 32, 16]``,
    ``*_scales [E, N, K / 32]``; everything else as it was."""
    from safetensors.torch import load_file, save_file

    from fastinfer.quant.math import quantize_mxfp4_weight

    os.makedirs(dst, exist_ok=True)
    out = {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            per_expert = [quantize_mxfp4_weight(w.t().contiguous()) for w in t]
            out[name + "_blocks"] = torch.stack([p.reshape(p.shape[0], -1, 16) for p, _ in per_expert])
            out[name + "_scales"] = torch.stack([s for _, s in per_expert])
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


# the MXFP4 cases: the float cases above, and one whose experts (width 128) split over two ranks
# in whole 64-feature tiles of fused_moe_fp4
MXFP4_CASES = {"base": ("gpt_oss", CASES["base"]), "clamped": ("gpt_oss", CASES["clamped"]),
               "wide": ("gpt_oss", dict(CASES["clamped"], intermediate_size=128))}


@pytest.fixture(scope="module")
def mx_ckpts(tmp_path_factory):
    """``name -> (float hf model, mxfp4 path, transformers on the MXFP4 files)``: MXFP4_CASES[name]
    written with its experts in the published layout, and transformers loading those files with
    ``Mxfp4Config(dequantize=True)`` (its converter, ``integrations/mxfp4.py``; on a CPU without its
    triton kernels transformers falls back to the same dequantisation by itself, the option pins it)."""
    floats = lazy_checkpoints(tmp_path_factory, MXFP4_CASES, make_gpt_oss)
    cache = {}

    def get(name):
        if name not in cache:
            hf_float, path = floats(name)
            mx = str(tmp_path_factory.mktemp(name + "-mxfp4"))
            _write_mxfp4(path, mx)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                mx, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
            cache[name] = (hf_float, mx, hf)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MXFP4_CASES))
def test_mxfp4_experts_run_as_stored(mx_ckpts, name, caplog):
    """The published tensor names and ``quant_method "mxfp4"``: the experts run as stored on
    fused_moe_fp4 (e2m1 codes and e8m0 scales of the checkpoint, gpt-oss's clamped SwiGLU and
    biases in the op), no dequantised copy; the logits equal transformers dequantising the same
    files (relative 1e-5: the same weights, exact in float32) and so do 12 greedy tokens; the MXFP4
    error against the float model is visible (so the experts were quantised)."""
    hf_float, mx, hf = mx_ckpts(name)
    with caplog.at_level("WARNING"):
        model = load_checkpoint(mx, torch.float32, "cpu", None, fastinfer.ops.backend())
    assert "dequantised" not in caplog.text
    for layer in model.layers:
        m = layer.moe
        E, H, I = m.num_experts, m.hidden_size, m.intermediate_size
        assert type(m.method) is Fp4FusedMoEMethod and m.method.format == "mxfp4"
        assert m.w13.shape == (E, H // 64, 8 * 2 * I) and m.w13_scales.shape == (E, H // 32, 2 * I)
        assert m.w2.shape == (E, I // 64, 8 * H) and m.w2_scales.shape == (E, I // 32, H)
        assert m.w13_global_scale is None and m.w2_bias.shape == (E, H) and not hasattr(m, "w13_float")
    ids = _prompt()
    ours = prefill_logits(model, ids, block_size=BS)
    err, fp4_err = rel_err(ours, hf_logits(hf, ids)), rel_err(ours, hf_logits(hf_float, ids))
    print(f"{name} mxfp4 experts on fused_moe_fp4: rel err {err:.2e} against transformers dequantising them, "
          f"{fp4_err:.3f} against the float model")
    assert err < REL_TOL
    assert 1e-3 < fp4_err < 0.5
    llm = LLM(mx, dtype="float32", num_kv_blocks=16, block_size=BS)
    out = llm.generate([ids], SamplingParams(max_tokens=12, **GREEDY))
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, 12)


def test_mxfp4_experts_dequantised_when_asked_or_when_shards_do_not_fit(mx_ckpts, caplog):
    """``fp4_weights="float"`` dequantises the experts while loading (a warning says why), the same
    logits; tensor_parallel_size=2 of width-64 experts (32 per rank: not whole 64-feature tiles of
    fused_moe_fp4) dequantises them too, each rank its rows, and gives transformers' greedy tokens."""
    _, mx, hf = mx_ckpts("base")
    with caplog.at_level("WARNING"):
        model = load_checkpoint(mx, torch.float32, "cpu", None, fastinfer.ops.backend(), fp4_weights="float")
    assert "MXFP4 experts dequantised to float32 while loading (fp4_weights='float')" in caplog.text
    assert type(model.layers[0].moe.method) is UnquantizedFusedMoEMethod
    ids = _prompt()
    err = rel_err(prefill_logits(model, ids, block_size=BS), hf_logits(hf, ids))
    print(f"mxfp4 experts dequantised: rel err {err:.2e} against transformers dequantising them")
    assert err < REL_TOL
    tp2 = LLM(mx, dtype="float32", num_kv_blocks=16, block_size=BS, tensor_parallel_size=2)
    try:  # each rank dequantises the whole stacked tensor and keeps its rows
        moe = tp2.model.layers[0].moe
        assert type(moe.method) is UnquantizedFusedMoEMethod and moe.w13.shape[1] == 64
        out = tp2.generate([ids], SamplingParams(max_tokens=12, **GREEDY))
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, 12)
    finally:
        tp2.shutdown()
    from fastinfer.distributed import ParallelInfo
    from fastinfer.models import load_config
    from fastinfer.quant import resolve_quantization

    qc = resolve_quantization(load_config(mx))
    GptOssForCausalLM(load_config(mx), device="meta", quant_config=qc, tp=ParallelInfo(0, 2))
    assert qc.dequantized_why == {"fused_moe_fp4 needs the hidden size (128) and each rank's expert intermediate "
                                  "size (32) to be multiples of 64"}


def test_mxfp4_tp2_and_ep2_equal_one_rank(mx_ckpts, engines, monkeypatch):
    """Width-128 MXFP4 experts: ``tensor_parallel_size=2`` holds each expert's gate / up rows and down
    input features (whole 64-feature tiles and 32-groups) with their e8m0 scales on fused_moe_fp4,
    the down bias on rank 0, and gives one rank's logits within 1e-5 (the activations are not
    quantised: only the all-reduce's order differs) and its greedy tokens;
    ``expert_parallel_size=2``, half the experts whole on each rank, gives them bit for bit."""
    from model_helpers import plan_logits

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    _, mx, hf = mx_ckpts("wide")
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
    ids = _prompt(seed=4)
    one = engines(mx, **kw)
    sp = SamplingParams(max_tokens=12, **GREEDY)
    tokens = one.generate([ids], sp)[0].outputs[0].token_ids
    assert list(tokens) == hf_greedy(hf, ids, 12)
    a = plan_logits(one, ids)

    tp = engines(mx, tensor_parallel_size=2, **kw)
    moe = tp.model.layers[0].moe  # rank 0's shard
    assert type(moe.method) is Fp4FusedMoEMethod and moe.w13.shape[2] == 8 * 128 and moe.w2.shape[1] == 1
    err = rel_err(plan_logits(tp, ids), a)
    print(f"wide mxfp4: tensor_parallel_size=2 against one rank: rel err {err:.2e}")
    assert err < REL_TOL
    assert tp.generate([ids], sp)[0].outputs[0].token_ids == tokens

    ep = engines(mx, expert_parallel_size=2, **kw)
    moe = ep.model.layers[0].moe
    assert type(moe.method) is Fp4FusedMoEMethod and moe.w13.shape[0] == 4
    b = plan_logits(ep, ids)
    assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
    assert ep.generate([ids], sp)[0].outputs[0].token_ids == tokens


@pytest.mark.parametrize("detail", ["expert biases", "gate / up halves", "scales"])
def test_each_mxfp4_detail_is_visible(mx_ckpts, detail):
    """The stored experts' biases zeroed, their gate and up halves swapped, or their e8m0 scales one
    step off each put the logits 1000 x the tolerance away from transformers'."""
    _, mx, hf = mx_ckpts("base")
    model = load_checkpoint(mx, torch.float32, "cpu", None, fastinfer.ops.backend())
    with torch.no_grad():
        for layer in model.layers:
            m = layer.moe
            I = m.local_intermediate_size
            if detail == "expert biases":
                m.w13_bias.zero_()
                m.w2_bias.zero_()
            elif detail == "gate / up halves":
                m.w13.copy_(torch.cat([m.w13[:, :, 8 * I:], m.w13[:, :, :8 * I]], dim=2))
                m.w13_scales.copy_(torch.cat([m.w13_scales[:, :, I:], m.w13_scales[:, :, :I]], dim=2))
            else:
                m.w2_scales.add_(1)
    ids = _prompt()
    err = rel_err(prefill_logits(model, ids, block_size=BS), hf_logits(hf, ids))
    print(f"mxfp4 without {detail}: rel err {err:.2e}")
    assert err > 1000 * REL_TOL, f"without {detail}: rel err only {err:.2e}"


@pytest.mark.sim
def test_sim_mxfp4_experts(mx_ckpts):
    """The MXFP4 model on the CUDA kernel sources (simt emulator: fused_moe_fp4's mxfp4 decoder with
    swiglu_oai and biases, moe_topk, attention with sinks) in bfloat16, chunked prefill + decode
    against the fp32 CPU logits, at most 2x as wrong as the CPU ops in bfloat16, bit-identical across
    emulator schedule seeds (test_sim_kernels_end_to_end's rule)."""
    require_sim()
    _, mx, _ = mx_ckpts("clamped")
    dtype = torch.bfloat16
    ids = _prompt(30, seed=6)
    ops = fastinfer.ops.backend()
    ref = prefill_logits(load_checkpoint(mx, torch.float32, "cpu", None, ops), ids, block_size=BS)
    naive = prefill_logits(load_checkpoint(mx, dtype, "cpu", None, ops), ids, block_size=BS)
    model = load_checkpoint(mx, dtype, "cpu", None, fastinfer.ops.backend("fastinfer_sim"))
    assert type(model.layers[0].moe.method) is Fp4FusedMoEMethod
    blocks = [1, 0]
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, BS)
            a = model(make_forward_batch(prefill=[(ids[:13], 0, blocks)], block_size=BS, all_logits=True), caches)
            b = model(make_forward_batch(prefill=[(ids[13:29], 13, blocks)], block_size=BS, all_logits=True), caches)
            c = model(make_forward_batch(decode=[(ids[29], 29, blocks)], block_size=BS), caches)
            results.append(torch.cat([a, b, c]))
    err, err_naive = rel_err(results[0].float(), ref), rel_err(naive.float(), ref)
    print(f"sim mxfp4 {dtype}: rel err {err:.2e} (cpu ops in {dtype}: {err_naive:.2e})")
    assert 0 < err_naive < 0.05 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


def test_mxfp4_refusals(ckpts, tmp_path):
    _, path = ckpts("base")
    bare = str(tmp_path / "bare")
    _write_mxfp4(path, bare, quantization_config=None)
    with pytest.raises(ValueError, match=r"stores model\.layers\.0\.mlp\.experts\.\*_blocks \(MXFP4 experts\) but "
                                         r"its config.json has no quantization_config"):
        LLM(bare, dtype="float32", num_kv_blocks=8)
    from fastinfer.quant import resolve_quantization

    conf = ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"], "quantization_config": MXFP4_CONFIG})
    with pytest.raises(ValueError, match="'mxfp4' is gpt-oss's expert format; MixtralForCausalLM"):
        resolve_quantization(conf)


@pytest.mark.parametrize("method", ["fp8", "int4", "int8", "nvfp4", "mxfp4"])
def test_quantised_experts_are_refused(ckpts, method):
    """The quantised expert kernels run SiLU without biases: gpt-oss's experts are refused by name."""
    _, path = ckpts("base")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp: .*(experts run SiLU experts without biases|"
                                         r"does not quantise mixture-of-experts experts)"):
        LLM(path, dtype="float32", num_kv_blocks=8, quantization=method)


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_defaults_are_transformers_defaults():
    ours = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"]})
    ref = transformers.GptOssConfig()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps",
                "num_experts_per_tok", "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.num_experts == ref.num_local_experts and ours.moe_intermediate_size == ref.intermediate_size
    assert ours.qkv_bias and ours.o_bias and ref.attention_bias and ours.attention_sinks
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    rp = ref.rope_parameters
    assert ours.rope_scaling["rope_type"] == rp["rope_type"] == "yarn"
    for key in ("factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"):
        assert ours.rope_scaling[key] == rp[key], key
    # the published config.json's transformers-4 form (rope_scaling + rope_theta)
    pub = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"], "rope_theta": 150000, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False}})
    assert (pub.rope_theta, pub.rope_scaling) == (ours.rope_theta, ours.rope_scaling)


def test_hub_style_config_reads_as_transformers_reads_it():
    """A config.json in the form the gpt-oss releases use (transformers-4 ``rope_scaling`` with
    ``rope_theta``, ``layer_types`` listed, ``num_local_experts``, an ``mxfp4`` quantization_config)
    means what transformers' GptOssConfig makes of the same dict."""
    d = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64, "hidden_act": "silu",
         "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
         "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 6, "num_key_value_heads": 8,
         "num_local_experts": 32, "layer_types": ["sliding_attention", "full_attention"] * 3, "rms_norm_eps": 1e-05,
         "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                          "rope_type": "yarn", "truncate": False},
         "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
         "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999, "quantization_config": MXFP4_CONFIG}
    ours = ModelConfig.from_dict(d)
    ref = transformers.GptOssConfig.from_dict({k: v for k, v in d.items() if k != "quantization_config"})
    assert ours.num_experts == ref.num_local_experts == 32
    for key in ("num_hidden_layers", "layer_types", "sliding_window", "swiglu_limit", "swiglu_alpha", "head_dim",
                "num_key_value_heads"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    for key in ("factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"):
        assert ours.rope_scaling[key] == ref.rope_parameters[key], key
    assert ours.eos_token_ids == [ref.eos_token_id] and ours.pad_token_id == ref.pad_token_id
    assert [ours.window_left(i) for i in range(6)] == [127, -1] * 3


def test_rope_table_is_transformers(ckpts):
    """The YaRN cos / sin (``truncate`` false, attention factor ``0.1 ln(8) + 1``) of the tiny config,
    within transformers' float32 evaluation of ``position * inv_freq`` (angles up to 200 rad: 2e-5)."""
    hf, path = ckpts("base")
    model = load_model(path, dtype=torch.float32)
    pos = torch.arange(200)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    half = model.cos_sin_cache.shape[1] // 2
    assert (model.cos_sin_cache[:200, :half] - cos[0]).abs().max() < 2e-5
    assert (model.cos_sin_cache[:200, half:] - sin[0]).abs().max() < 2e-5
    assert abs(model.cos_sin_cache[0, 0].item() - (0.1 * math.log(8.0) + 1)) < 1e-7


@pytest.mark.parametrize("bad, what", [
    ({"swiglu_limit": 0}, "swiglu_limit"),
    ({"swiglu_alpha": "1.7"}, "swiglu_alpha"),
    ({"num_experts_per_tok": 129}, "larger than the number of experts"),
    ({"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": None}, "sliding_window is null"),
])
def test_config_errors(bad, what):
    with pytest.raises(ValueError, match=what):
        ModelConfig.from_dict(dict({"architectures": ["GptOssForCausalLM"]}, **bad))


def test_mxfp4_dequantisation_is_the_oracle():
    """The loader's MXFP4 decoding equals the fp64 oracle (fastinfer.reference.fp4, itself checked
    against transformers' converter in test_fp4_formats.py) bit for bit, the extreme scales of
    float32 included (e8m0 0 and 252); a NaN scale (255) and wrong shapes are refused."""
    from fastinfer import reference as ref
    from fastinfer.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 4), generator=g, dtype=torch.int32).to(torch.uint8)
    scales[0, 0, 0], scales[0, 0, 1], scales[1, 2, 3] = 0, 252, 1
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.dtype == torch.float32 and ours.shape == (3, 5, 128)
    assert torch.equal(ours.double(), ref.fp4.mxfp4_dequantize(blocks, scales))
    with pytest.raises(ValueError, match="255"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match="blocks uint8"):
        dequantize_mxfp4(blocks[..., :8], scales)
