"""Mixture-of-experts parity: fastinfer's Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE (CPU ops, float32)
against transformers.

Tiny random checkpoints (hidden 128 or 256, head_dim 64, GQA 4/2 or 2/1, vocab 300, 4 to 8 experts
of width 64 to 256, Qwen2-MoE's shared expert of width 64 or 96) written with ``save_pretrained``
(which writes the hub's per-expert tensors) and loaded through ``load_model`` / ``LLM``;
transformers' in-memory stacked experts through a reader. Weights are re-drawn at a larger scale
than transformers' init, so the routing is far from uniform. Checks: logits at every position of a
prompt (relative norm error < 1e-5), a dozen greedy tokens through the runner, chunked prefill, a
batch with prefix caching, chunked prefill and preemption against each prompt alone, tensor
parallelism (2 ranks; OLMoE with its single KV head replicated), speculative decoding (a draft
model, chain and tree; an EAGLE-3 head) giving the tokens of plain decoding, each architecture on
the CUDA kernel sources in the emulator (bf16 / fp16), the config fields
against transformers' defaults and layer layouts, bad configs. ``test_each_moe_detail_is_visible``
shows each routing and layout detail moves the logits far beyond the tolerance, so the parity
tests can fail.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastinfer  # noqa: E402,F401
from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed  # noqa: E402
from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.layers import TensorDictReader  # noqa: E402
from fastinfer.models import LlamaForCausalLM, ModelConfig, MoeForCausalLM, load_model  # noqa: E402
from model_helpers import (  # noqa: E402
    check_batching_prefix_caching_and_preemption,
    HF_BASE,
    hf_classes,
    hf_greedy,
    hf_logits,
    lazy_checkpoints,
    make_forward_batch,
    make_hf_model,
    prefill_logits,
    random_prompt,
    rel_err,
)

VOCAB = 300
PROMPT_LEN = 40
NEW_TOKENS = 12
BS = 16
REL_TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

CASES = {
    # 4 experts, 2 per token (renormalised), expert width = intermediate_size, sliding window 24
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=24)),
    # norm_topk_prob, 8 experts of width 64, 3 per token; layers 0 and 2 dense (decoder_sparse_step 2
    # skips layer 0, mlp_only_layers names 2), 1 and 3 routed
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2,
                                    mlp_only_layers=[2], rope_theta=1e6)),
    # weights not renormalised, every layer routed, tied embeddings, q/k/v/o biases
    "qwen3_moe_tied": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         tie_word_embeddings=True, attention_bias=True)),
    # a shared expert of width 96 on the routed layers 0, 2 and 3 (mlp_only_layers names 1), 8
    # experts of width 64, 3 per token (renormalised), q/k/v biases; sliding window 24 on layers 0
    # and 2 (the even layers below max_window_layers)
    "qwen2_moe": ("qwen2_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                    norm_topk_prob=True, mlp_only_layers=[1], use_sliding_window=True,
                                    sliding_window=24, max_window_layers=3)),
    # weights not renormalised, no q/k/v bias, tied embeddings, a shared expert of width 64
    "qwen2_moe_tied": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, qkv_bias=False,
                                         tie_word_embeddings=True)),
    # one KV head (replicated under TP=2), 8 experts of width 256, 3 per token (not renormalised:
    # OLMoE's default), q / k / v clipped at 1.5 (after the q/k norms)
    "olmoe": ("olmoe", dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=3,
                            clip_qkv=1.5, eos_token_id=2)),
    # hidden 256 (4 / 2 heads of 64), renormalised weights, q/k/v/o biases, experts of width 128
    "olmoe_bias": ("olmoe", dict(hidden_size=256, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=True, attention_bias=True, eos_token_id=2)),
}
# one case of each architecture
ARCH_CASES = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory, CASES, make_hf_model)


def _prompt(n=PROMPT_LEN, seed=0):
    return random_prompt(n, VOCAB, seed)


GREEDY = dict(temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, MoeForCausalLM)
    ids = _prompt()
    ref = hf_logits(hf, ids)
    out = prefill_logits(model, ids, block_size=BS)
    assert out.dtype == torch.float32 and out.shape == (PROMPT_LEN, VOCAB)
    assert rel_err(out, ref) < REL_TOL, f"{name}: rel err {rel_err(out, ref):.2e}"
    per_pos = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_pos.max().item() < 10 * REL_TOL


@pytest.mark.parametrize("name, kinds", [("qwen3_moe", [False, True, False, True]),
                                         ("qwen2_moe", [True, False, True, True])])
def test_layer_kinds_follow_the_config(ckpts, name, kinds):
    """Qwen's mixed layers are built as transformers builds them (dense where it is dense, Qwen2-MoE's
    shared expert on every routed layer and its sliding layers where transformers' mask slides)."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ours = [layer.moe is not None for layer in model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs == kinds
    routed = model.layers[kinds.index(True)].moe
    assert routed.renormalize and routed.top_k == 3
    shared = [layer.shared_expert is not None for layer in model.layers]
    assert shared == [hasattr(layer.mlp, "shared_expert") for layer in hf.model.layers]
    assert shared == (kinds if name == "qwen2_moe" else [False] * 4)
    if name == "qwen2_moe":
        assert model.config.layer_types == hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
        assert [model.config.window_left(i) for i in range(4)] == [23, -1, 23, -1]


@pytest.mark.parametrize("name", list(CASES))
def test_stacked_experts_load_as_per_expert_ones(ckpts, name):
    """transformers 5's in-memory tensors (``mlp.experts.gate_up_proj`` [E, 2I, H], Mixtral's
    ``block_sparse_moe`` named ``mlp``) give the same model as the saved per-expert checkpoint."""
    hf, path = ckpts(name)
    names = list(hf.state_dict())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    config = ModelConfig.from_pretrained(path)
    stacked = load_model(TensorDictReader(dict(hf.state_dict())), config=config, dtype=torch.float32)
    saved = load_model(path, dtype=torch.float32)
    for (na, a), (nb, b) in zip(stacked.checkpoint_tensors(), saved.checkpoint_tensors()):
        assert na == nb and torch.equal(a, b), na


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_through_the_runner(ckpts, name):
    hf, path = ckpts(name)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
    ids = _prompt(seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, **GREEDY))
    assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, NEW_TOKENS)


# Prompt seeds of the emulator test, one per architecture: among seeds 6..39 the prompt whose
# smallest router gap (k-th minus (k+1)-th router logit, any token, any routed layer, transformers
# in fp32) is largest. A prompt with a nearly tied token may route it differently once rounded to
# half precision, in any implementation (seed 6 had a gap of 7e-4 on OLMoE, whose flip alone gave
# a 4.3e-3 logit error in fp16), and that says nothing of the kernels.
SIM_PROMPT_SEEDS = {"mixtral": 17, "qwen3_moe": 15, "qwen2_moe": 7, "olmoe": 32}
SIM_MIN_ROUTER_GAP = 0.02


def smallest_router_gap(hf, ids) -> float:
    k = hf.config.num_experts_per_tok
    with torch.no_grad():
        router_logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
    gaps = [(s[:, k - 1] - s[:, k]).min().item()
            for s in (r.float().sort(dim=-1, descending=True).values for r in router_logits if r is not None)]
    return min(gaps)


@pytest.mark.sim
@pytest.mark.parametrize("name", ARCH_CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_sim_kernels_end_to_end(ckpts, name, dtype, tol):
    """The whole model on the CUDA kernel sources (simt emulator, ``torch.ops.fastinfer_sim``:
    moe_topk, fused_moe and the attention, norm and GEMM kernels) in half precision: chunked
    prefill + decode against the fp32 CPU logits, bit-identical across emulator schedule seeds, on a
    prompt whose routing is not nearly tied (SIM_PROMPT_SEEDS)."""
    require_sim()
    hf, path = ckpts(name)
    ids = _prompt(30, seed=SIM_PROMPT_SEEDS[name])
    assert smallest_router_gap(hf, ids) >= SIM_MIN_ROUTER_GAP, "the prompt has a nearly tied routing"
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids, block_size=BS)
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
    assert rel_err(results[0].float(), ref) < tol, f"{name} {dtype}: rel err {rel_err(results[0].float(), ref):.2e}"
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


@pytest.mark.parametrize("name", ARCH_CASES)
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


@pytest.mark.parametrize("name", ARCH_CASES)
def test_batching_prefix_caching_and_preemption(ckpts, name):
    """A batch with shared prefixes, chunked prefills and preemption: each prompt's tokens alone, and
    transformers' (model_helpers.check_batching_prefix_caching_and_preemption)."""
    hf, path = ckpts(name)
    check_batching_prefix_caching_and_preemption(hf, path, VOCAB, BS, GREEDY)


def test_tensor_parallel_two_ranks(ckpts):
    """TP=2 (rank 0 here, one spawned worker; each expert's intermediate rows split, one all-reduce
    after the experts, Qwen2-MoE's shared expert split as a dense MLP and reduced with them; OLMoE's
    whole q and k on each rank, its one KV head replicated; the dense layers and attention as
    Llama's) equals transformers."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    for name in ARCH_CASES + ["olmoe_bias"]:  # OLMoE with its KV heads replicated, then split
        hf, path = ckpts(name)
        llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS, tensor_parallel_size=2)
        try:
            layer = next(layer for layer in llm.model.layers if layer.moe is not None)  # rank 0's shard
            moe, c = layer.moe, llm.model.config
            assert moe.w13.shape[1] == moe.intermediate_size and moe.w2.shape[2] == moe.intermediate_size // 2
            if name == "qwen2_moe":
                assert layer.shared_expert.gate_up_proj.out_features == c.shared_expert_intermediate_size
                assert not moe.reduce_results
            if name == "olmoe":  # whole q and k, this rank's v (the one KV head, replicated)
                assert layer.qkv_proj.out_features == c.q_size + 2 * c.kv_size and layer.num_heads == 1
            if name == "olmoe_bias":  # whole q and k, this rank's v (one of the two KV heads)
                assert layer.qkv_proj.out_features == c.q_size + c.kv_size + c.kv_size // 2
            ids = _prompt(seed=4)
            logits, _ = llm.executor.runner.forward(ForwardPlan(chunks=[Chunk(-1, ids, 0, "all")],
                                                                tables={-1: [0, 1, 2]}, finished=[-1]))
            assert rel_err(logits, hf_logits(hf, ids)) < REL_TOL, name
            out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, **GREEDY))
            assert list(out[0].outputs[0].token_ids) == hf_greedy(hf, ids, NEW_TOKENS), name
        finally:
            llm.shutdown()


# ------------------------------------------------------------------------------------------------
# speculative decoding
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafts(ckpts, tmp_path_factory):
    """``name -> path`` of a one-layer draft of that case's target (its first layer, embedding, final
    norm and head, as transformers builds the same config with one layer), built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            hf, _ = ckpts(name)
            kind, over = CASES[name]
            cfg_cls, model_cls = hf_classes(kind)
            draft = model_cls(cfg_cls(**dict(HF_BASE, **dict(over, num_hidden_layers=1)))).eval()
            target = hf.state_dict()
            draft.load_state_dict({k: v for k, v in target.items() if k in draft.state_dict()}, strict=True)
            path = tmp_path_factory.mktemp(f"{name}-draft")
            draft.save_pretrained(path)
            cache[name] = str(path)
        return cache[name]

    return get


def _eagle3_head(hf, target_path, path):
    """An EAGLE-3 head (the EAGLE repository's layout, 200 of the 300 tokens) on the target's aux
    layers: its layer is a Llama one with 64-wide heads, whatever the target's attention."""
    from test_eagle3 import _near_copy_head, _save_eagle3

    layers, H = hf.config.num_hidden_layers, hf.config.hidden_size
    aux = (0, layers // 2, layers - 1)
    _save_eagle3(path, target_path, _near_copy_head(hf, aux, 200), aux=aux, num_attention_heads=H // 64,
                 num_key_value_heads=H // 64, head_dim=64, intermediate_size=2 * H)
    return str(path)


def _speculation_workload():
    """Twelve greedy requests (a 35-token prefix shared by every third, every fourth opting out of
    speculation) of 8 to 24 tokens."""
    rng = random.Random(5)
    shared = [rng.randrange(VOCAB) for _ in range(35)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
               for i in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(8, 24), speculative=False if i % 4 == 1 else None, **GREEDY)
              for i in range(12)]
    return prompts, params


def _assert_speculation_is_lossless(llm, path, prompts, params):
    """``llm`` (speculating, in a pool small enough to preempt) gives each request the tokens of plain
    decoding, both in the deterministic mode (every op batch invariant: verification rows are
    computed as decode rows are), having drafted, accepted and rejected, and frees every block."""
    ref = LLM(path, dtype="float32", num_kv_blocks=64, block_size=BS, deterministic=True).generate(prompts, params)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    st = llm.stats()
    assert st["spec_num_verify"] > 0 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"], st
    assert st["num_preemptions"] > 0 and st["num_free_blocks"] == st["num_kv_blocks"], st
    for o, p in zip(outs, params):
        if p.speculative is False:
            assert o.metrics["spec_num_verify"] == 0


SPEC_SIZES = {"chain": dict(num_spec_tokens=4), "tree": dict(num_spec_tokens=6, spec_tree_topk=2)}


@pytest.mark.parametrize("mode", list(SPEC_SIZES))
@pytest.mark.parametrize("name", ARCH_CASES)
def test_draft_model_speculation_gives_the_tokens_of_plain_decoding(ckpts, drafts, name, mode):
    """A one-layer draft of the same architecture proposes chains / trees; the MoE target verifies
    them in one forward (the experts routing every draft row) in a batch that preempts."""
    _, path = ckpts(name)
    llm = LLM(path, dtype="float32", draft_model=drafts(name), spec_mode=mode, **SPEC_SIZES[mode], num_kv_blocks=12,
              block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, deterministic=True)
    _assert_speculation_is_lossless(llm, path, *_speculation_workload())


@pytest.mark.parametrize("mode", list(SPEC_SIZES))
@pytest.mark.parametrize("name", ["qwen2_moe", "olmoe"])
def test_eagle3_speculation_gives_the_tokens_of_plain_decoding(ckpts, tmp_path, name, mode):
    """An EAGLE-3 head on the MoE target's aux hidden states (the residual streams entering three of
    its layers) drafts; the target verifies, as above."""
    hf, path = ckpts(name)
    head = _eagle3_head(hf, path, tmp_path / "head")
    llm = LLM(path, dtype="float32", spec_method="eagle3", spec_model=head, spec_mode=mode, **SPEC_SIZES[mode],
              num_kv_blocks=12, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, deterministic=True)
    _assert_speculation_is_lossless(llm, path, *_speculation_workload())


# ------------------------------------------------------------------------------------------------
# each detail matters
# ------------------------------------------------------------------------------------------------
def _without(model, detail):
    routed = [layer for layer in model.layers if layer.moe is not None]
    for layer in routed:
        m = layer.moe
        if detail == "shared expert":
            layer.shared_expert = None
        elif detail == "shared expert gate":  # sigmoid(0) = 1/2 for every token
            layer.shared_expert.gate.weight.zero_()
        elif detail == "clip_qkv":
            layer.clip_qkv = None
        elif detail == "renormalize":
            m.renormalize = not m.renormalize
        elif detail == "gate / up order":
            local = m.local_intermediate_size
            m.w13.copy_(torch.cat([m.w13[:, local:], m.w13[:, :local]], dim=1))
        elif detail == "top_k":
            m.top_k -= 1
        else:
            raise AssertionError(detail)


@pytest.mark.parametrize("name, detail", [
    ("mixtral", "renormalize"), ("mixtral", "gate / up order"), ("mixtral", "top_k"),
    ("qwen3_moe", "renormalize"), ("qwen3_moe", "gate / up order"),
    ("qwen3_moe_tied", "renormalize"), ("qwen3_moe_tied", "top_k"),
    ("qwen2_moe", "shared expert"), ("qwen2_moe", "shared expert gate"), ("qwen2_moe", "renormalize"),
    ("qwen2_moe_tied", "shared expert"), ("qwen2_moe_tied", "renormalize"),
    ("olmoe", "clip_qkv"), ("olmoe", "renormalize"), ("olmoe", "top_k"), ("olmoe_bias", "renormalize"),
])
def test_each_moe_detail_is_visible(ckpts, name, detail):
    """Undoing one detail in the loaded model puts its logits 1000 x the tolerance away."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt()
    with torch.no_grad():
        _without(model, detail)
    err = rel_err(prefill_logits(model, ids, block_size=BS), hf_logits(hf, ids))
    assert err > 1000 * REL_TOL, f"{name} without {detail}: rel err only {err:.2e}"


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_defaults_are_transformers_defaults():
    for arch, cls in (("MixtralForCausalLM", transformers.MixtralConfig),
                      ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig),
                      ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig),
                      ("OlmoeForCausalLM", transformers.OlmoeConfig)):
        ours = ModelConfig.from_dict({"architectures": [arch]})
        ref = cls()
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                    "pad_token_id", "rms_norm_eps", "num_experts_per_tok"):
            assert getattr(ours, key) == getattr(ref, key), (arch, key)
        assert ours.eos_token_ids == ([] if ref.eos_token_id is None else [ref.eos_token_id]), arch
        assert ours.rope_theta == ref.rope_parameters["rope_theta"], arch
        assert ours.num_experts == ref.num_experts, arch
        assert ours.head_dim == ref.hidden_size // ref.num_attention_heads, arch
        assert ours.sliding_window is None and ours.layer_types == ["full_attention"] * ref.num_hidden_layers, arch
        assert ours.qk_norm == (arch == "Qwen3MoeForCausalLM"), arch
        assert ours.qk_projection_norm == (arch == "OlmoeForCausalLM"), arch
        assert ours.moe_renormalize == (arch == "MixtralForCausalLM" or ref.norm_topk_prob), arch
        assert ours.dense_mlp_layers == [], arch
        assert ours.shared_expert_intermediate_size == getattr(ref, "shared_expert_intermediate_size", 0), arch
        assert ours.clip_qkv == getattr(ref, "clip_qkv", None), arch
        assert ours.qkv_bias == getattr(ref, "qkv_bias", getattr(ref, "attention_bias", False)), arch
        assert ours.o_bias == (arch != "Qwen2MoeForCausalLM" and getattr(ref, "attention_bias", False)), arch
    mixtral = ModelConfig.from_dict({"architectures": ["MixtralForCausalLM"]})
    assert mixtral.moe_intermediate_size == 14336 and mixtral.moe_renormalize and mixtral.dense_mlp_layers == []
    qwen = ModelConfig.from_dict({"architectures": ["Qwen3MoeForCausalLM"]})
    assert (qwen.moe_intermediate_size, qwen.moe_renormalize) == (768, False)
    qwen2 = ModelConfig.from_dict({"architectures": ["Qwen2MoeForCausalLM"]})
    assert (qwen2.moe_intermediate_size, qwen2.shared_expert_intermediate_size, qwen2.qkv_bias) == (1408, 5632, True)
    olmoe = ModelConfig.from_dict({"architectures": ["OlmoeForCausalLM"]})
    assert (olmoe.moe_intermediate_size, olmoe.moe_renormalize, olmoe.eos_token_ids) == (2048, False, [50279])


def test_qwen3_moe_config_forms():
    """The hub's ``num_experts`` and transformers 5's ``num_local_experts`` mean the same; the
    dense layers follow ``mlp_only_layers`` and ``decoder_sparse_step`` as transformers' layers do."""
    base = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6}
    assert ModelConfig.from_dict(dict(base, num_experts=16)).num_experts == 16
    assert ModelConfig.from_dict(dict(base, num_local_experts=16)).num_experts == 16
    conf = ModelConfig.from_dict(dict(base, decoder_sparse_step=3, mlp_only_layers=[5]))
    hf = transformers.Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=3, mlp_only_layers=[5])
    want = [i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(6)]
    assert [conf.is_moe_layer(i) for i in range(6)] == want == [False, False, True, False, False, False]
    sliding = ModelConfig.from_dict(dict(base, use_sliding_window=True, sliding_window=64))
    assert [sliding.window_left(i) for i in range(6)] == [63] * 6


@pytest.mark.parametrize("use_sliding_window, max_window_layers, layer_types", [
    (False, 28, None), (True, 28, None), (True, 3, None), (True, 0, None),
    (True, 28, ["full_attention", "sliding_attention"] * 3),
])
def test_qwen2_moe_sliding_layers_as_transformers(use_sliding_window, max_window_layers, layer_types):
    """Qwen2-MoE slides on the even layers below ``max_window_layers`` (not Qwen2's rule), or where
    ``layer_types`` says, with ``sliding_window`` keys."""
    kw = dict(num_hidden_layers=6, use_sliding_window=use_sliding_window, max_window_layers=max_window_layers,
              sliding_window=64, layer_types=layer_types)
    ours = ModelConfig.from_dict(dict({"architectures": ["Qwen2MoeForCausalLM"]}, **kw))
    ref = transformers.Qwen2MoeConfig(**kw)
    assert ours.layer_types == ref.layer_types
    assert [ours.window_left(i) for i in range(6)] == [
        ref.sliding_window - 1 if t == "sliding_attention" else -1 for t in ref.layer_types]


def test_expert_count_names_as_transformers():
    """Each config class's field for the number of experts and the alias it maps onto it (none for
    Qwen2-MoE, whose config ignores ``num_local_experts``)."""
    for arch, cls in (("MixtralForCausalLM", transformers.MixtralConfig),
                      ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig),
                      ("Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig),
                      ("OlmoeForCausalLM", transformers.OlmoeConfig)):
        for key in ("num_experts", "num_local_experts"):
            ours = ModelConfig.from_dict({"architectures": [arch], key: 16})
            assert ours.num_experts == cls(**{key: 16}).num_experts, (arch, key)


@pytest.mark.parametrize("arch, bad, what", [
    ("MixtralForCausalLM", {"num_experts_per_tok": 9, "num_local_experts": 8}, "larger than the number of experts"),
    ("MixtralForCausalLM", {"num_local_experts": 0}, "num_local_experts"),
    ("Qwen2MoeForCausalLM", {"num_experts": 0}, "'num_experts' must be an int >= 1"),
    ("Qwen2MoeForCausalLM", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("Qwen2MoeForCausalLM", {"mlp_only_layers": 3}, "mlp_only_layers"),
    ("Qwen2MoeForCausalLM", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
     "use_sliding_window is false"),
    ("Qwen2MoeForCausalLM", {"use_sliding_window": True, "sliding_window": None}, "sliding_window is null"),
    ("Qwen2MoeForCausalLM", {"use_sliding_window": True, "max_window_layers": -1}, "max_window_layers"),
    ("Qwen2MoeForCausalLM", {"num_hidden_layers": 2, "layer_types": ["full_attention"]}, "layer_types"),
    ("OlmoeForCausalLM", {"head_dim": 64}, "head_dim \\* num_attention_heads == hidden_size"),
    ("OlmoeForCausalLM", {"clip_qkv": 0}, "clip_qkv"),
    ("OlmoeForCausalLM", {"clip_qkv": "8"}, "clip_qkv"),
    ("OlmoeForCausalLM", {"num_experts_per_tok": 65}, "larger than the number of experts"),
])
def test_config_errors(arch, bad, what):
    with pytest.raises(ValueError, match=what):
        ModelConfig.from_dict(dict({"architectures": [arch]}, **bad))


def test_refused_model_builds(ckpts):
    _, path = ckpts("mixtral")
    conf = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match="MoeForCausalLM"):
        LlamaForCausalLM(conf, device="meta")
    from fastinfer.quant import QuantOptions, resolve_quantization

    # fp8 and int4 experts: tests/test_models_moe_fp8.py, tests/test_models_moe_int4.py
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe: quantization='int8' does not "
                                         r"quantise mixture-of-experts experts; quantization='fp8' \(experts per "
                                         r"channel\) or 'int4' \(group-wise\) does"):
        load_model(path, quant_config=resolve_quantization(conf, QuantOptions("int8")))
