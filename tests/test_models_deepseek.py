"""DeepSeek-V3 (Kimi K2's architecture) and DeepSeek-V2 / V2-Lite parity: fastinfer's multi-head
latent attention decoder (CPU ops, float32) against transformers' ``deepseek_v3`` / ``deepseek_v2``.

Tiny random checkpoints written with ``save_pretrained`` (hidden 128, 4 heads, the latent of 512 + 64
the MLA ops run, 3 layers, vocab 300, 8 experts of width 64 with 2 shared experts, the first layer
dense), weights re-drawn at a larger scale than transformers' init and the V3 correction bias drawn
too, so the routing is far from uniform:

- ``v3``: q LoRA, interleaved rotary, 4 groups of which 2 are kept, 3 experts per token,
  renormalised, routed scaling 2.5; nope 128 + rope 64 (the expanded prefill pads 192 to 256);
- ``v3_yarn``: YaRN (factor 4, mscale 0.9 / mscale_all_dim 1.0: both the cos/sin attention factor
  and the softmax-scale correction), rotary by halves (``rope_interleave=False``), not renormalised;
- ``v2_lite``: no q LoRA, ``greedy`` softmax routing, YaRN with V2-Lite's mscale 0.707, nope 64
  and v 96 (the expanded prefill pads v to 128);
- ``v2_grouped``: q LoRA, ``group_limited_greedy`` (a group's best expert), routed scaling 1.5.

Checks: logits at every position of a fresh prompt (the expanded form) and of a chunk continuing a
cached one plus a decode row (the absorbed form) within 1e-5 relative norm error of transformers;
32 greedy tokens through the engine equal to transformers'; the router against transformers' router
module; batching with prefix caching, chunked prefill and preemption against each prompt alone and
transformers; draft-model speculation (chain and tree) giving the tokens of plain decoding; a
block-FP8 checkpoint (e4m3 weights with 128 x 128 ``weight_scale_inv`` written by transformers'
fine-grained FP8 quantiser op) against transformers' dequantisation of it (and under TP = 2 x EP = 2
against one process); TP = 2, EP = 2 (bit for bit), TP = 2 x EP = 2 and PP = 2 engines (rank 0 here,
spawned workers) against one process and transformers; the config fields against transformers';
refusals (a head count that does not split over the tensor-parallel ranks among them). ``test_each_deepseek_detail_is_visible`` shows each routing and attention
detail moves the logits far beyond the tolerance, so the parity tests can fail.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastinfer  # noqa: E402
from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed  # noqa: E402
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.distributed import ParallelInfo  # noqa: E402
from fastinfer.models import DeepseekForCausalLM, ModelConfig, load_model  # noqa: E402
from fastinfer.models.deepseek import grouped_topk  # noqa: E402
from model_helpers import (  # noqa: E402
    check_batching_prefix_caching_and_preemption,
    hf_greedy,
    hf_logits,
    lazy_checkpoints,
    make_forward_batch,
    plan_logits,
    prefill_logits,
    random_prompt,
    reinit_,
    rel_err,
)

VOCAB = 300
BS = 16
REL_TOL = 1e-5
GREEDY = dict(temperature=0.0)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=512, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
            first_k_dense_replace=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
            beta_slow=1.0)
CASES = {
    "v3": ("v3", dict(q_lora_rank=96, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    "v3_yarn": ("v3", dict(q_lora_rank=96, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=False,
                           rope_interleave=False, rope_parameters=dict(YARN, mscale=0.9, mscale_all_dim=1.0))),
    "v2_lite": ("v2", dict(q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=96, topk_method="greedy",
                           rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))),
    "v2_grouped": ("v2", dict(q_lora_rank=64, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5)),
}


def hf_deepseek(kind: str, seed: int = 0, **overrides):
    """A random transformers DeepSeek-V3 (``kind`` "v3") or V2 model of ``BASE`` + ``overrides``."""
    cfg_cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if kind == "v3" else
                          (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**dict(BASE, **overrides))).eval()
    reinit_(model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # transformers initialises the correction bias to zeros: draw it too
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory, CASES, hf_deepseek)


def _prompt(n: int = 40, seed: int = 0):
    return random_prompt(n, VOCAB, seed)


# ------------------------------------------------------------------------------------------------
# logits and greedy tokens
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(ckpts, name):
    """Every position of a fresh 40-token prompt (the expanded form); the same prompt as a 25-token
    chunk then a 15-token chunk continuing it (the absorbed form over the cached latents) and one
    decode row; all within 1e-5 of transformers."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, DeepseekForCausalLM)
    ids = _prompt()
    ref = hf_logits(hf, ids)
    assert rel_err(prefill_logits(model, ids), ref) < REL_TOL
    caches = model.allocate_kv_cache(4, BS)
    table = [3, 0, 2, 1]
    first = model(make_forward_batch([(ids[:25], 0, table)], device=model.device, all_logits=True), caches)
    assert rel_err(first, ref[:25]) < REL_TOL
    second = model(make_forward_batch([(ids[25:], 25, table)], device=model.device, all_logits=True), caches)
    assert rel_err(second, ref[25:]) < REL_TOL
    nxt = int(ref[-1].argmax())
    dec = model(make_forward_batch(decode=[(nxt, len(ids), table)], device=model.device), caches)
    assert rel_err(dec, hf_logits(hf, ids + [nxt])[-1:]) < REL_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_32_tokens_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    ids = _prompt(20, seed=3)
    llm = LLM(path, dtype="float32", num_kv_blocks=16, block_size=BS)
    out = llm.generate([ids], SamplingParams(max_tokens=32, **GREEDY))[0].outputs[0].token_ids
    assert list(out) == hf_greedy(hf, ids, 32)


@pytest.mark.parametrize("name", ["v3", "v2_grouped"])
def test_router_matches_transformers_router(ckpts, name):
    """The routing of a routed layer against transformers' router module on 64 random tokens: the
    same experts, the same weights (routed scaling included)."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    x = torch.randn(64, BASE["hidden_size"], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, theirs_w, theirs_ids = hf.model.layers[1].mlp.gate(x)
        ours_w, ours_ids = model.layers[1].mlp.gate(x)
    assert ours_ids.dtype == torch.int32 and ours_w.dtype == torch.float32
    order_t, order_o = theirs_ids.argsort(-1), ours_ids.long().argsort(-1)
    assert torch.equal(theirs_ids.gather(1, order_t), ours_ids.long().gather(1, order_o))
    torch.testing.assert_close(ours_w.gather(1, order_o), theirs_w.gather(1, order_t).float(), rtol=1e-6, atol=1e-7)


def test_grouped_topk_keeps_the_best_groups():
    """A hand-worked V3 row: 8 experts in 4 groups, 2 groups kept, 2 experts per token. Scores (after
    sigmoid) + bias: the group sums of the best two are (0.9+0.8, 0.99+0.1, 0.7+0.6, 0.5+0.4) = (1.7,
    1.09, 1.3, 0.9): groups 0 and 2 are kept, so expert 2 (0.99, in group 1) is not chosen; the
    experts are 0 and 1, weighed by their scores without the bias (the bias only chooses)."""
    choice = torch.tensor([[0.9, 0.8, 0.99, 0.1, 0.7, 0.6, 0.5, 0.4]], dtype=torch.float64)
    bias = torch.tensor([0.2, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    scores = choice - bias.double()
    logits = torch.log(scores / (1 - scores)).float()  # sigmoid(logits) = scores
    w, ids = grouped_topk(logits, 2, scoring="sigmoid", grouping="top2_sum", num_groups=4, topk_groups=2,
                          renormalize=True, scaling_factor=2.5, correction_bias=bias)
    assert sorted(ids[0].tolist()) == [0, 1]
    s = scores[0, ids[0].long()]
    torch.testing.assert_close(w[0].double(), 2.5 * s / s.sum(), rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_batching_prefix_caching_chunked_prefill_and_preemption(ckpts, name):
    hf, path = ckpts(name)
    check_batching_prefix_caching_and_preemption(hf, path, VOCAB, BS, GREEDY)


@pytest.fixture(scope="module")
def draft(ckpts, tmp_path_factory):
    """A one-layer draft of ``v3`` (its first layer, embedding, final norm and head)."""
    hf, _ = ckpts("v3")
    d = hf_deepseek("v3", **dict(CASES["v3"][1], num_hidden_layers=1))
    target = hf.state_dict()
    d.load_state_dict({k: v for k, v in target.items() if k in d.state_dict()}, strict=True)
    path = tmp_path_factory.mktemp("v3-draft")
    d.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode,sizes", [("chain", dict(num_spec_tokens=4)),
                                        ("tree", dict(num_spec_tokens=6, spec_tree_topk=2))])
def test_draft_model_speculation_gives_the_tokens_of_plain_decoding(ckpts, draft, mode, sizes):
    """A DeepSeek draft proposes chains / trees; the target verifies them (the absorbed form with the
    tree mask over the cached latents) in a pool small enough to preempt; the tokens are those of
    plain decoding, drafts were accepted and rejected, every block is freed."""
    _, path = ckpts("v3")
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
               for i in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(8, 24), **GREEDY) for _ in prompts]
    ref = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS, deterministic=True).generate(prompts, params)
    llm = LLM(path, dtype="float32", draft_model=draft, spec_mode=mode, **sizes, num_kv_blocks=12, block_size=BS,
              max_num_seqs=8, max_num_batched_tokens=64, deterministic=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_kv_blocks"], st


def test_latent_cache_sizing(ckpts):
    """One 576-value latent per token and layer: the pool's bytes per block, the caches' shape."""
    _, path = ckpts("v3")
    llm = LLM(path, dtype="float32", num_kv_blocks=5, block_size=BS)
    runner = llm.executor.runner
    assert runner.model.kv_cache_bytes_per_block(BS) == 3 * BS * 576 * 4
    assert len(runner.kv_caches) == 3
    assert all(c[0].shape == (5, BS, 576) and c[1] is None for c in runner.kv_caches)


# ------------------------------------------------------------------------------------------------
# config, details, refusals
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_config_fields_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    c, h = ModelConfig.from_pretrained(path), hf.config
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        h.q_lora_rank, h.kv_lora_rank, h.qk_nope_head_dim, h.qk_rope_head_dim, h.v_head_dim)
    assert c.head_dim == h.head_dim == c.rotary_dim
    assert c.num_experts == h.n_routed_experts and c.num_experts_per_tok == h.num_experts_per_tok
    assert c.dense_mlp_layers == list(range(h.first_k_dense_replace))
    assert c.shared_expert_intermediate_size == h.n_shared_experts * h.moe_intermediate_size
    assert c.moe_routed_scaling_factor == h.routed_scaling_factor
    assert c.attention_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_each_deepseek_detail_is_visible(ckpts):
    """Each detail, changed alone, moves the logits of a prompt far beyond the parity tolerance: the
    routed scaling factor, the correction bias, the groups, the renormalisation, the rotary layout,
    YaRN (its tables and softmax-scale correction)."""
    ids = _prompt()
    for name, changes in (("v3", dict(moe_routed_scaling_factor=1.0)), ("v3", "no correction bias"),
                          ("v3", dict(moe_grouping=None)), ("v3", dict(moe_renormalize=False)),
                          ("v3", dict(rope_interleave=False)), ("v2_lite", dict(rope_scaling=None)),
                          ("v2_grouped", dict(moe_grouping=None))):
        hf, path = ckpts(name)
        config = ModelConfig.from_pretrained(path)
        model = load_model(path, dtype=torch.float32,
                           config=dataclasses.replace(config, **changes) if isinstance(changes, dict) else config)
        if changes == "no correction bias":
            for layer in model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.zero_()
        assert rel_err(prefill_logits(model, ids), hf_logits(hf, ids)) > 100 * REL_TOL, (name, changes)


def _config(kind: str, **changes) -> dict:
    cfg_cls = transformers.DeepseekV3Config if kind == "v3" else transformers.DeepseekV2Config
    d = cfg_cls(**dict(BASE, **CASES["v3" if kind == "v3" else "v2_grouped"][1])).to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM" if kind == "v3" else "DeepseekV2ForCausalLM"]
    d.update(changes)
    return d


@pytest.mark.parametrize("kind,changes,match", [
    ("v2", dict(topk_method="noaux_tc"), "unsupported topk_method 'noaux_tc'"),
    ("v3", dict(n_group=3), r"n_group \(3\) must divide the number of experts \(8\)"),
    ("v3", dict(topk_group=5), r"topk_group \(5\) is larger than n_group \(4\)"),
    ("v3", dict(n_group=8, topk_group=1), "best two experts"),
    ("v3", dict(num_experts_per_tok=6, topk_group=1), r"num_experts_per_tok \(6\) is larger than the experts"),
    ("v3", dict(kv_lora_rank=256), "unsupported kv_lora_rank 256"),
    ("v3", dict(qk_rope_head_dim=32), "qk_rope_head_dim 32"),
    ("v3", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("v2", dict(mlp_bias=True), "mlp_bias=True is not supported"),
    ("v3", dict(routed_scaling_factor=0), "routed_scaling_factor"),
])
def test_bad_configs_are_refused(kind, changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_config(kind, **changes))


def test_unsupported_runs_are_refused(ckpts):
    """A head count that does not split over the tensor-parallel ranks is refused naming both; a
    DeepSeek config is not a Llama model."""
    from fastinfer.models import LlamaForCausalLM

    _, path = ckpts("v3")
    config = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over tensor_parallel_size=3"):
        DeepseekForCausalLM(config, device="meta", tp=ParallelInfo(0, 3))
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over tensor_parallel_size=3"):
        LLM(path, dtype="float32", num_kv_blocks=8, block_size=BS, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="build it with DeepseekForCausalLM"):
        LlamaForCausalLM(config, device="meta")


# ------------------------------------------------------------------------------------------------
# tensor, expert and pipeline parallelism (rank 0 here, one spawned worker)
# ------------------------------------------------------------------------------------------------
PARALLEL = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
PARALLEL_GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _parallel_prompts():
    return [_prompt(40 - 7 * i, seed=10 + i) for i in range(3)]


def _equal_to_one_process(one, llm, hf, *, bit_for_bit: bool):
    """``llm``'s logits (a fresh prefill: the expanded form, then a decode row: the absorbed form)
    against one process's (within 1e-5, or bit for bit) and transformers', and its greedy tokens."""
    prompts = _parallel_prompts()
    a, b = plan_logits(one, prompts[0]), plan_logits(llm, prompts[0])
    if bit_for_bit:
        assert torch.equal(a, b), f"max |diff| {(a - b).abs().max():.3e}"
    else:
        assert rel_err(b, a) < REL_TOL, rel_err(b, a)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert rel_err(b[:-1], hf_logits(hf, prompts[0])) < REL_TOL
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, PARALLEL_GREEDY)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARALLEL_GREEDY)]
    assert got == ref
    assert list(ref[0]) == hf_greedy(hf, prompts[0], PARALLEL_GREEDY.max_tokens)


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_tensor_parallel_two_ranks(ckpts, engines, monkeypatch, name):
    """TP=2: each rank holds half the query heads (q_b_proj / q_proj and kv_b_proj column-parallel
    by heads, so W_UK / W_UV are its heads; o_proj row-parallel), the replicated q/kv LoRA
    projections and norms, the whole latent cache (576 values per token and layer), each expert's
    and the shared experts' intermediate rows halved (one all-reduce for both) and the dense first
    layer split as Llama's; logits within 1e-5 of one process and transformers, the same greedy
    tokens."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    hf, path = ckpts(name)
    one = engines(path, **PARALLEL)
    llm = engines(path, tensor_parallel_size=2, **PARALLEL)
    c = llm.model.config
    attn = llm.model.layers[0].self_attn  # rank 0's shard
    assert attn.num_heads == c.num_attention_heads // 2
    q_out = (attn.q_proj or attn.q_b_proj).out_features
    assert q_out == attn.num_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    assert attn.kv_b_proj.out_features == attn.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
    assert attn.w_uk_t.shape[0] == attn.w_uv.shape[0] == attn.num_heads
    assert attn.o_proj.in_features == attn.num_heads * c.v_head_dim
    assert attn.kv_a_proj.out_features == 576
    assert all(cache[0].shape[-1] == 576 for cache in llm.executor.runner.kv_caches)
    assert llm.model.layers[0].mlp.down_proj.in_features == c.intermediate_size // 2
    mlp = llm.model.layers[1].mlp
    assert mlp.experts.w2.shape[2] == c.moe_intermediate_size // 2 and not mlp.experts.reduce_results
    assert mlp.shared_experts.down_proj.in_features == c.shared_expert_intermediate_size // 2
    _equal_to_one_process(one, llm, hf, bit_for_bit=False)


def test_expert_parallel_two_ranks_bit_for_bit(ckpts, engines, monkeypatch):
    """EP=2 (attention whole on each rank, half the routed experts whole on each; the router and the
    shared experts replicated) gives one process's logits bit for bit and its greedy tokens; TP=2 x
    EP=2 (the experts' shares and the shared experts' partial sums reduced by one all-reduce) within
    1e-5."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")  # every rank's kernels as this process's
    hf, path = ckpts("v3")
    one = engines(path, **PARALLEL)
    ep = engines(path, expert_parallel_size=2, **PARALLEL)
    experts = ep.model.layers[1].mlp.experts
    assert experts.num_local_experts == experts.num_experts // 2 and ep.executor.runner.worker_pids
    _equal_to_one_process(one, ep, hf, bit_for_bit=True)
    assert sum(ep.stats()["expert_parallel_routed_slots"]) > 0
    one.shutdown()
    ep.shutdown()
    both = engines(path, tensor_parallel_size=2, expert_parallel_size=2, **PARALLEL)
    assert both.model.layers[0].self_attn.num_heads == 2
    _equal_to_one_process(engines(path, **PARALLEL), both, hf, bit_for_bit=False)


def test_pipeline_parallel_two_stages(ckpts, engines, monkeypatch):
    """PP=2 (layers [0, 2) and [2, 3), each stage its own layers' latent caches): one process's
    logits within 1e-5 and its greedy tokens."""
    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    hf, path = ckpts("v2_lite")
    one = engines(path, **PARALLEL)
    pp = engines(path, pipeline_parallel_size=2, **PARALLEL)
    assert [layer.layer_idx for layer in pp.model.layers] == [0, 1]
    assert len(pp.executor.runner.kv_caches) == 2
    _equal_to_one_process(one, pp, hf, bit_for_bit=False)


# ------------------------------------------------------------------------------------------------
# block-FP8 checkpoint
# ------------------------------------------------------------------------------------------------
def test_block_fp8_checkpoint(tmp_path, engines, monkeypatch):
    """``v3`` (experts 128 wide) with every decoder projection in e4m3 with 128 x 128 ``weight_scale_inv`` blocks (as
    DeepSeek ships V3; written by transformers' fine-grained FP8 quantiser op; the router, norms,
    embedding and head float). transformers' dequantisation of the directory is the oracle:
    fastinfer on that float checkpoint within 1e-5 of it, and on the fp8 one (``kv_b_proj``
    dequantised for the absorbed form, the other projections run in fp8 with dynamic fp8
    activations) within what those activations cost, while the codes without their scales are far
    off. Under TP = 2 x EP = 2 (the experts whole: 128-wide fp8 blocks do not split) each rank keeps
    its heads' rows of the dequantised ``kv_b_proj``, and the logits are one process's within
    1e-5."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    # fused_moe_fp8's blocks need experts 128 wide
    path = str(tmp_path / "float")
    hf_deepseek("v3", seed=9, **dict(CASES["v3"][1], moe_intermediate_size=128)).save_pretrained(path)
    qcfg = FineGrainedFP8Config(weight_block_size=(128, 128))
    op = FineGrainedFP8HfQuantizer(qcfg).get_quantize_ops()
    out = {}
    for key, w in load_file(os.path.join(path, "model.safetensors")).items():
        convert = ".layers." in key and key.endswith(("proj.weight", "proj_with_mqa.weight"))
        out.update(op.convert({key: w}) if convert else {key: w})
    assert out["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert list(out["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"].shape) == [8, 4]
    assert out["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert out["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    cfg = json.load(open(os.path.join(path, "config.json")))

    def write(name, tensors, config):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        json.dump(config, open(d / "config.json", "w"))
        return str(d)

    fp8_dir = write("fp8", out, dict(cfg, quantization_config=qcfg.to_dict()))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    deq_dir = write("deq", {k: v.detach().clone().contiguous() for k, v in theirs.state_dict().items()}, cfg)
    ids = _prompt()
    ref = hf_logits(theirs, ids)
    assert rel_err(prefill_logits(load_model(deq_dir, dtype=torch.float32), ids), ref) < REL_TOL
    from fastinfer.models import load_config
    from fastinfer.quant import resolve_quantization

    fp8 = load_model(fp8_dir, dtype=torch.float32, quant_config=resolve_quantization(load_config(fp8_dir)))
    assert fp8.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    err = rel_err(prefill_logits(fp8, ids), ref)
    caches = fp8.allocate_kv_cache(4, BS)
    fp8(make_forward_batch([(ids[:25], 0, [0, 1, 2, 3])], device=fp8.device), caches)
    absorbed = fp8(make_forward_batch([(ids[25:], 25, [0, 1, 2, 3])], device=fp8.device, all_logits=True), caches)
    assert err < 0.1 and rel_err(absorbed, ref[25:]) < 0.1, err
    codes = {k: v.float() if v.dtype == torch.float8_e4m3fn else v for k, v in out.items()
             if not k.endswith("weight_scale_inv")}
    assert rel_err(prefill_logits(load_model(write("codes", codes, cfg), dtype=torch.float32), ids), ref) > 10 * err

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    one = engines(fp8_dir, **PARALLEL)
    tp = engines(fp8_dir, tensor_parallel_size=2, expert_parallel_size=2, **PARALLEL)
    kv_b = tp.model.layers[1].self_attn.kv_b_proj.weight  # rank 0: the first two heads' rows
    assert torch.equal(kv_b, fp8.layers[1].self_attn.kv_b_proj.weight[: kv_b.shape[0]])
    assert kv_b.shape[0] * 2 == fp8.layers[1].self_attn.kv_b_proj.weight.shape[0]
    a, b = plan_logits(one, ids), plan_logits(tp, ids)
    assert rel_err(b, a) < REL_TOL and torch.equal(a.argmax(-1), b.argmax(-1)), rel_err(b, a)


def test_deterministic_mode_rows_do_not_depend_on_chunking(ckpts):
    """The deterministic mode runs the absorbed form for every row: a prompt's logits are the same
    bits whether it is prefilled whole (a fresh chunk) or as a chunk continuing a cached one."""
    from fastinfer.ops import backend

    hf, path = ckpts("v3")
    model = load_model(path, dtype=torch.float32, ops=backend("fastinfer", deterministic=True))
    ids = _prompt()
    whole = prefill_logits(model, ids)
    assert rel_err(whole, hf_logits(hf, ids)) < REL_TOL
    caches = model.allocate_kv_cache(4, BS)
    model(make_forward_batch([(ids[:25], 0, [0, 1, 2, 3])], device=model.device), caches)
    rest = model(make_forward_batch([(ids[25:], 25, [0, 1, 2, 3])], device=model.device, all_logits=True), caches)
    assert torch.equal(rest, whole[25:])


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_fp8_latent_cache_close_to_the_float_cache(ckpts, name):
    """The latent cache in e4m3 (per-tensor scale 1.0): a fresh chunk attends over its own unrounded
    latents (the float cache's logits, bit for bit); a chunk continuing it and a decode row read the
    e4m3 latents, within the fp8 KV cache's 5% of the float cache's logits (and visibly not equal to
    them; measured 0.008-0.014); layer 0's cache holds the e4m3 codes of the float cache's latents."""
    _, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt()
    runs = {}
    for dt in (None, torch.float8_e4m3fn):
        caches = model.allocate_kv_cache(4, BS, dt)
        table = [3, 0, 2, 1]
        first = model(make_forward_batch([(ids[:25], 0, table)], device=model.device, all_logits=True), caches)
        second = model(make_forward_batch([(ids[25:], 25, table)], device=model.device, all_logits=True), caches)
        dec = model(make_forward_batch(decode=[(7, len(ids), table)], device=model.device), caches)
        runs[dt] = (first, second, dec, caches[0][0])
    flt, fp8 = runs[None], runs[torch.float8_e4m3fn]
    assert fp8[3].dtype == torch.float8_e4m3fn
    assert torch.equal(fp8[0], flt[0])
    for got, want in zip(fp8[1:3], flt[1:3]):
        assert 1e-4 < rel_err(got, want) < 0.05, rel_err(got, want)
    assert torch.equal(fp8[3].view(torch.uint8), flt[3].to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_latent_cache_through_the_engine(ckpts):
    """``kv_cache_dtype="fp8"``: a pool of e4m3 latents twice the blocks of a bfloat16 one in the same
    bytes; in the deterministic mode (every row read from the cache) a busy batch that chunks,
    preempts and hits the prefix cache gives each prompt's tokens alone."""
    import random

    from fastinfer import LLM, SamplingParams

    _, path = ckpts("v3")
    model = load_model(path, dtype=torch.bfloat16)
    assert model.kv_cache_bytes_per_block(BS, torch.float8_e4m3fn) * 2 == model.kv_cache_bytes_per_block(BS)
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
               for i in range(9)]
    params = [SamplingParams(max_tokens=rng.randint(1, 8), **GREEDY) for _ in prompts]
    kw = dict(dtype="float32", block_size=BS, deterministic=True, kv_cache_dtype="fp8")
    alone = LLM(path, num_kv_blocks=64, **kw)
    ref = [alone.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    small = LLM(path, num_kv_blocks=10, max_num_seqs=8, max_num_batched_tokens=48, **kw)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == ref
    st = small.stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0, st


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_heads_are_refused(ckpts, tmp_path, method):
    """An EAGLE head's layer rotates with its target's RoPE table, a DeepSeek target's spans the 64
    rotary dims only: refused before any head is read."""
    from fastinfer.engine.speculative.eagle import load_eagle
    from fastinfer.engine.speculative.eagle3 import load_eagle3

    _, path = ckpts("v3")
    model = load_model(path, dtype=torch.float32)
    load = load_eagle if method == "eagle" else load_eagle3
    with pytest.raises(ValueError, match="heads are not supported for DeepseekV3ForCausalLM"):
        load(str(tmp_path), model)


@pytest.mark.sim
@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_sim_kernels_end_to_end(ckpts, name):
    """The whole model on the CUDA kernel sources (simt emulator, ``torch.ops.fastinfer_sim``: the
    expanded form's prefill attention, the MLA cache write and absorbed attention, fused_moe, the
    norm and rotary kernels) in bf16: a fresh chunk, a chunk continuing it and a decode row against
    the fp32 CPU logits, bit-identical across emulator schedule seeds."""
    require_sim()
    _, path = ckpts(name)
    ids = _prompt(30, seed=4)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids, block_size=BS)
    model = load_model(path, dtype=torch.bfloat16, ops=fastinfer.ops.backend("fastinfer_sim"))
    blocks = [1, 0]
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, BS)
            a = model(make_forward_batch(prefill=[(ids[:13], 0, blocks)], block_size=BS, all_logits=True), caches)
            b = model(make_forward_batch(prefill=[(ids[13:29], 13, blocks)], block_size=BS, all_logits=True), caches)
            c = model(make_forward_batch(decode=[(ids[29], 29, blocks)], block_size=BS), caches)
            results.append(torch.cat([a, b, c]))
    err = rel_err(results[0].float(), ref)
    assert err < 2e-2, f"{name}: rel err {err:.2e}"
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"
