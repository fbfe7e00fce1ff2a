"""Gemma 2 / Gemma 3 (text) parity: fastinfer's Gemma decoder (CPU ops, float32) against transformers.

Tiny random checkpoints (4 layers, hidden 64, GQA 4/2, vocab 300, sliding window 8: the 40-token
prompts are five windows long) with head_dim 256 (the real models') and 64, written with
``save_pretrained`` and loaded through ``load_model`` / ``LLM``. Weights are re-drawn at a larger
scale than transformers' init, norm weights around 0 (Gemma scales by ``1 + weight``). Checks:
logits at every position of a prompt (relative norm error < 1e-5), a dozen greedy tokens through
the runner (``LLM.generate``: prefill, then decode steps), chunked prefill and a mixed prefill +
decode batch, tensor parallelism (2 ranks), the CPU bfloat16 path, a ``Gemma3ForConditionalGeneration``
checkpoint's text model, config parsing (transformers' defaults, the transformers 4 form of a Gemma
3 config) and the refused configs. GGUF: the same models written as llama.cpp's converter writes
``gemma2`` / ``gemma3`` files (names from the gguf package's tables, ``1 + weight`` stored for the
norms, q/k not permuted), read back by ``load_model`` (and, for gemma2, by transformers' GGUF loader),
and the hyperparameters llama.cpp derives instead of storing. ``test_each_gemma_detail_is_visible`` shows every Gemma-specific
piece (the ``1 + weight`` norms, the embedding scale, ``query_pre_attn_scalar``, both soft-caps, the
sliding window, Gemma 3's local RoPE) moves the logits far beyond the tolerance, so the parity tests
can fail.
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
from fastinfer.models import (  # noqa: E402
    GemmaForCausalLM,
    ModelConfig,
    build_cos_sin_cache,
    load_config,
    load_model,
)
from model_helpers import (  # noqa: E402
    hf_greedy,
    hf_logits,
    lazy_checkpoints,
    make_forward_batch,
    prefill_logits,
    rel_err,
)

VOCAB = 300
PROMPT_LEN = 40
NEW_TOKENS = 12
BS = 16
REL_TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, sliding_window=8)

CASES = {
    # head_dim 256 as in the real models; transformers' defaults for the scale (256) and both
    # soft-caps (attention 50, logits 30); layers 0, 2 sliding
    "gemma2_hd256": ("gemma2", dict(head_dim=256)),
    # head_dim 64 with query_pre_attn_scalar 48 (the scale is not head_dim's), small soft-caps
    # (attention 2, logits 1: tanh far from linear), untied lm_head, q/k/v/o biases
    "gemma2_hd64": ("gemma2", dict(head_dim=64, query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
                                   final_logit_softcapping=1.0, tie_word_embeddings=False, attention_bias=True)),
    # Gemma 3: q/k norms, every 3rd layer global (layers 0, 1, 3 sliding), linear rope scaling on the
    # global layer only, local base 10000 vs global 1e6
    "gemma3_hd256": ("gemma3", dict(head_dim=256, sliding_window_pattern=3, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # head_dim 64, explicit layer_types, final soft-cap 1 (logits are about 0.5), scale from
    # query_pre_attn_scalar 32, local rope base 100 (far from the global 1e6 default)
    "gemma3_hd64": ("gemma3", dict(head_dim=64, query_pre_attn_scalar=32, final_logit_softcapping=1.0,
                                   layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                "full_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 100.0}})),
}


def _hf_classes(kind):
    return {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
            "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM)}[kind]


def reinit_gemma_(model, seed: int):
    """Weights at a scale that makes attention far from uniform; norm weights around 0 (Gemma's
    RMSNorm scales by ``1 + weight``, so dropping the 1 changes everything); small embeddings (with
    the tied lm_head, large ones make every greedy token a copy of the input's last)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.2 * r)
            elif "embed" in name:
                p.copy_(0.05 * r)
            elif name.endswith("bias"):
                p.copy_(0.2 * r)
            else:
                p.copy_(r * (0.9 / p.shape[1] ** 0.5))


def make_gemma(kind: str, seed: int = 0, **overrides):
    cfg_cls, model_cls = _hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**dict(_BASE, **overrides))).eval()
    reinit_gemma_(model, seed)
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Lazily built ``name -> (hf_model, path)``."""
    return lazy_checkpoints(tmp_path_factory, CASES, make_gemma)


def _prompt(n=PROMPT_LEN, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


_rel, _hf_logits, _hf_greedy = rel_err, hf_logits, hf_greedy


def _model_greedy(model, ids, n):
    """Prefill, then n - 1 decode steps on a shuffled block table (the model alone, no engine)."""
    nb = -(-(len(ids) + n) // BS)
    blocks = list(range(nb))
    random.Random(5).shuffle(blocks)
    caches = model.allocate_kv_cache(nb, BS)
    out = [int(model(make_forward_batch(prefill=[(ids, 0, blocks)], block_size=BS), caches)[-1].argmax())]
    while len(out) < n:
        batch = make_forward_batch(decode=[(out[-1], len(ids) + len(out) - 1, blocks)], block_size=BS)
        out.append(int(model(batch, caches)[0].argmax()))
    return out


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, GemmaForCausalLM)
    ids = _prompt()
    ref = _hf_logits(hf, ids)
    out = prefill_logits(model, ids, block_size=BS)
    assert out.dtype == torch.float32 and out.shape == (PROMPT_LEN, VOCAB)
    assert _rel(out, ref) < REL_TOL, f"{name}: rel err {_rel(out, ref):.2e}"
    per_pos = (out - ref).norm(dim=-1) / ref.norm(dim=-1)  # a late masking bug would hide in the norm
    assert per_pos.max().item() < 10 * REL_TOL


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_through_the_runner(ckpts, name):
    """``LLM.generate``: prefill, then decode steps on the paged cache, against transformers'
    greedy continuation (full recompute each token)."""
    hf, path = ckpts(name)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS)
    ids = _prompt(seed=1)
    out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(hf, ids, NEW_TOKENS)


@pytest.mark.parametrize("name", ["gemma2_hd64", "gemma3_hd256"])
def test_chunked_prefill_matches_transformers(ckpts, name):
    """Three prefill chunks (cuts inside blocks and inside windows) on a shuffled block table."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(seed=2)
    ref = _hf_logits(hf, ids)
    blocks = list(range(4))
    random.Random(3).shuffle(blocks)
    caches = model.allocate_kv_cache(4, BS)
    got = []
    for start, end in ((0, 13), (13, 27), (27, PROMPT_LEN)):
        got.append(model(make_forward_batch(prefill=[(ids[start:end], start, blocks)], block_size=BS,
                                            all_logits=True), caches))
    assert _rel(torch.cat(got), ref) < REL_TOL


def test_mixed_prefill_and_decode_batch(ckpts):
    """One forward with a fresh prompt, a continuation chunk and two decode rows equals running each
    sequence alone (the decode rows go through paged_decode_attention with softcap and window)."""
    _, path = ckpts("gemma2_hd64")
    model = load_model(path, dtype=torch.float32)
    seqs = [_prompt(30, seed=s) for s in range(4)]
    caches = model.allocate_kv_cache(12, BS)
    blocks = [[0, 4], [1, 5], [2, 6], [3, 7]]
    model(make_forward_batch(prefill=[(seqs[1][:11], 0, blocks[1]), (seqs[2][:29], 0, blocks[2]),
                                      (seqs[3][:29], 0, blocks[3])], block_size=BS), caches)
    batch = make_forward_batch(prefill=[(seqs[0], 0, blocks[0]), (seqs[1][11:], 11, blocks[1])],
                               decode=[(seqs[2][29], 29, blocks[2]), (seqs[3][29], 29, blocks[3])], block_size=BS)
    got = model(batch, caches)
    for row, s in enumerate(seqs):
        assert _rel(got[row], prefill_logits(model, s, block_size=BS)[-1]) < REL_TOL, f"row {row}"


def test_tensor_parallel_two_ranks(ckpts):
    """TP=2 (rank 0 here, one spawned worker; q/k/v, gate/up column-parallel, o/down row-parallel,
    vocabulary-parallel embedding and tied lm_head, norms and both RoPE tables replicated) equals
    transformers: logits of a prompt and greedy tokens."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    for name in ("gemma2_hd256", "gemma3_hd64"):
        hf, path = ckpts(name)
        llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS, tensor_parallel_size=2)
        try:
            m = llm.model  # rank 0's shard
            c = m.config
            assert m.layers[0].qkv_proj.weight.shape[0] == (c.num_attention_heads + 2 * c.num_key_value_heads) \
                * c.head_dim // 2
            assert m.layers[0].down_proj.weight.shape[1] == c.intermediate_size // 2
            ids = _prompt(seed=4)
            logits, _ = llm.executor.runner.forward(ForwardPlan(chunks=[Chunk(-1, ids, 0, "all")],
                                                                tables={-1: [0, 1, 2]}, finished=[-1]))
            assert _rel(logits, _hf_logits(hf, ids)) < REL_TOL, name
            out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
            assert list(out[0].outputs[0].token_ids) == _hf_greedy(hf, ids, NEW_TOKENS), name
        finally:
            llm.shutdown()


def test_pipeline_parallel_two_stages(ckpts):
    """PP=2 split 1 + 3 (rank 0 here: the embedding and its normaliser, layer 0; one spawned worker:
    layers 1-3, the final norm, soft-capped logits; Gemma 3's per-layer window and RoPE follow the
    layer's index in the whole model) equals transformers: logits of a prompt and greedy tokens."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    for name in ("gemma2_hd64", "gemma3_hd64"):
        hf, path = ckpts(name)
        llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=BS, pipeline_parallel_size=2,
                  pipeline_partition="1,3")
        try:
            assert [layer.layer_idx for layer in llm.model.layers] == [0] and llm.model.lm_head is None
            ids = _prompt(seed=4)
            logits, _ = llm.executor.runner.forward(ForwardPlan(chunks=[Chunk(-1, ids, 0, "all")],
                                                                tables={-1: [0, 1, 2]}, finished=[-1]))
            assert _rel(logits, _hf_logits(hf, ids)) < REL_TOL, name
            out = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
            assert list(out[0].outputs[0].token_ids) == _hf_greedy(hf, ids, NEW_TOKENS), name
        finally:
            llm.shutdown()


def test_cpu_bf16_model(ckpts):
    """The CPU bfloat16 path (``1 + weight`` formed in float32 by the norm ops): chunked prefill +
    decode against the fp32 logits."""
    _, path = ckpts("gemma3_hd256")
    ids = _prompt(33, seed=7)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    model = load_model(path, dtype=torch.bfloat16)
    model.pack_linears_for_cpu()
    caches = model.allocate_kv_cache(3, BS)
    a = model(make_forward_batch(prefill=[(ids[:21], 0, [2, 0, 1])], block_size=BS, all_logits=True), caches)
    b = model(make_forward_batch(prefill=[(ids[21:32], 21, [2, 0, 1])], block_size=BS, all_logits=True), caches)
    c = model(make_forward_batch(decode=[(ids[32], 32, [2, 0, 1])], block_size=BS), caches)
    assert _rel(torch.cat([a, b, c]), ref) < 2e-2


# half-precision tolerances against the fp32 logits: measured CPU ops and emulator alike 1.3e-2 / 2.1e-2
# (bf16) and 1.5e-3 / 2.6e-3 (fp16) on gemma2_hd64 / gemma3_hd64, transformers itself in bf16 1.2e-2 /
# 1.9e-2 (the logit soft-cap of 1 flattens the logits, which inflates relative errors)
HALF_TOLERANCES = [(torch.bfloat16, 4e-2), (torch.float16, 6e-3)]


@pytest.mark.sim
@pytest.mark.parametrize("name", ["gemma2_hd64", "gemma3_hd64", "gemma2_hd256", "gemma3_hd256"])
@pytest.mark.parametrize("dtype, tol", HALF_TOLERANCES)
def test_sim_kernels_end_to_end(ckpts, name, dtype, tol):
    """The CUDA kernel sources (simt emulator: rms_norm, gelu_tanh_and_mul, rotary, the paged
    attention ops with window and softcap) in half precision: chunked prefill + decode against the
    fp32 CPU logits, bit-identical across emulator schedule seeds; head_dim 64 and the real models'
    256."""
    require_sim()
    _, path = ckpts(name)
    ids = _prompt(30, seed=6)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    model = load_model(path, dtype=dtype, ops=fastinfer.ops.backend("fastinfer_sim"))
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, BS)
            a = model(make_forward_batch(prefill=[(ids[:13], 0, [1, 0])], block_size=BS, all_logits=True), caches)
            b = model(make_forward_batch(prefill=[(ids[13:29], 13, [1, 0])], block_size=BS, all_logits=True), caches)
            c = model(make_forward_batch(decode=[(ids[29], 29, [1, 0])], block_size=BS), caches)
            results.append(torch.cat([a, b, c]))
    assert _rel(results[0], ref) < tol
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gemma2_hd64", "gemma3_hd64", "gemma2_hd256", "gemma3_hd256"])
@pytest.mark.parametrize("dtype, tol", HALF_TOLERANCES)
def test_cuda_model_matches_cpu_fp32(ckpts, name, dtype, tol):
    """On a GPU: the CUDA kernels end to end (prefill chunk + decode) against fp32 CPU logits
    (head_dim 64 and the real models' 256)."""
    if not fastinfer.cuda_available():
        pytest.skip("fastinfer built without CUDA kernels or no GPU")
    _, path = ckpts(name)
    ids = _prompt(seed=7)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    model = load_model(path, dtype=dtype, device="cuda")
    caches = model.allocate_kv_cache(4, BS)
    dev, blocks = model.device, [3, 1, 0, 2]
    a = model(make_forward_batch(prefill=[(ids[:21], 0, blocks)], block_size=BS, all_logits=True, device=dev), caches)
    b = model(make_forward_batch(prefill=[(ids[21:39], 21, blocks)], block_size=BS, all_logits=True, device=dev),
              caches)
    c = model(make_forward_batch(decode=[(ids[39], 39, blocks)], block_size=BS, device=dev), caches)
    assert _rel(torch.cat([a, b, c]).cpu(), ref) < tol


def test_checkpoint_tensors_round_trip(ckpts):
    """``checkpoint_tensors`` gives the checkpoint's norm weights back exactly (the layer holds them
    as stored), and a built model re-loads from them (quantisation of an in-memory model) to
    bit-identical logits."""
    from safetensors.torch import load_file

    from fastinfer.layers import TensorDictReader

    _, path = ckpts("gemma3_hd64")
    model = load_model(path, dtype=torch.float32)
    saved = load_file(os.path.join(path, "model.safetensors"))
    tensors = dict(model.checkpoint_tensors())
    for name, t in saved.items():
        if "norm" in name:
            assert torch.equal(tensors[name], t), name
    again = load_model(TensorDictReader(tensors), config=model.config, dtype=torch.float32)
    ids = _prompt(20, seed=8)
    assert torch.equal(prefill_logits(again, ids), prefill_logits(model, ids))


def test_quantised_linears(ckpts, tmp_path):
    """Quantisation goes through the layers as for Llama: ``fastinfer quantize`` int4 (group 32) gives
    the logits of the float model whose linears are the dequantised int4 weights (W4A16: nothing
    else is rounded), quantising on load gives the same bits as the written checkpoint (int4, fp8,
    int8), and SmoothQuant, whose folds assume Llama's norms, is refused."""
    from safetensors.torch import load_file

    from fastinfer import reference
    from fastinfer.layers import TensorDictReader
    from fastinfer.quant import QuantOptions, quantize_checkpoint, resolve_quantization, unpack_nibbles

    _, path = ckpts("gemma3_hd64")
    conf = load_config(path)
    ids = _prompt(24, seed=10)
    for opts in (QuantOptions("int4", group_size=32), QuantOptions("fp8"), QuantOptions("int8")):
        out = str(tmp_path / opts.method)
        quantize_checkpoint(path, out, opts)
        stored = load_model(out, dtype=torch.float32, quant_config=resolve_quantization(load_config(out)))
        got = prefill_logits(stored, ids)
        on_load = load_model(path, dtype=torch.float32, quant_config=resolve_quantization(conf, opts))
        assert torch.equal(prefill_logits(on_load, ids), got), opts.method
        if opts.method == "int4":
            t = load_file(os.path.join(out, "model.safetensors"))
            tensors = dict(load_file(os.path.join(path, "model.safetensors")))
            for name in [k[: -len(".weight_packed")] for k in t if k.endswith(".weight_packed")]:
                w = reference.int4_dequantize(unpack_nibbles(t[name + ".weight_packed"]), t[name + ".weight_scale"],
                                              t.get(name + ".weight_zero_point"), 32)
                tensors[name + ".weight"] = w[:, : tensors[name + ".weight"].shape[1]].float()
            dequantised = load_model(TensorDictReader(tensors), config=conf, dtype=torch.float32)
            assert _rel(got, prefill_logits(dequantised, ids)) < REL_TOL
    with pytest.raises(ValueError, match="smoothquant"):
        quantize_checkpoint(path, str(tmp_path / "sq"), QuantOptions("int8"), smoothquant=0.5,
                            calibration=torch.arange(64))


# ------------------------------------------------------------------------------------------------
# the parity tests can fail: each Gemma detail matters on these configs
# ------------------------------------------------------------------------------------------------
def _without(model, detail):
    """Undo one Gemma detail in a loaded model (in place)."""
    layers = model.layers
    if detail == "norm +1":
        for mod in model.modules():
            if type(mod).__name__ == "GemmaRMSNorm":
                mod.weight_offset = 0.0
    elif detail == "embedding scale":
        model.embed_scale.fill_(1.0)
    elif detail == "query_pre_attn_scalar":
        for layer in layers:
            layer.attn.scale = model.config.head_dim ** -0.5
    elif detail == "attention softcap":
        for layer in layers:
            layer.attn.softcap = 0.0
    elif detail == "final softcap":
        model.config.final_logit_softcapping = None
    elif detail == "sliding window":
        for layer in layers:
            layer.attn.window_left = -1
    elif detail == "local rope":
        model.has_sliding_rope = False
    elif detail == "global rope scaling":
        plain = dataclasses.replace(model.config, rope_scaling=None)
        model.cos_sin_cache = build_cos_sin_cache(plain, model.max_positions)
    else:
        raise AssertionError(detail)


@pytest.mark.parametrize("name, detail, times", [
    ("gemma2_hd256", "norm +1", 1000), ("gemma2_hd256", "embedding scale", 1000),
    # transformers' default caps (50 on scores of about 1, 30 on logits of about 0.5) change little,
    # but still well past the tolerance
    ("gemma2_hd256", "attention softcap", 10), ("gemma2_hd256", "final softcap", 10),
    ("gemma2_hd256", "sliding window", 1000),
    ("gemma2_hd64", "query_pre_attn_scalar", 1000), ("gemma2_hd64", "attention softcap", 1000),
    ("gemma2_hd64", "final softcap", 1000),
    ("gemma3_hd256", "local rope", 1000), ("gemma3_hd256", "global rope scaling", 100),
    ("gemma3_hd256", "norm +1", 1000), ("gemma3_hd64", "final softcap", 1000),
    ("gemma3_hd64", "local rope", 1000), ("gemma3_hd64", "sliding window", 1000),
])
def test_each_gemma_detail_is_visible(ckpts, name, detail, times):
    """Undoing one detail in the loaded model puts its logits ``times`` x the tolerance away from
    transformers' (measured: the default soft-caps 2.5e-4 and 3.1e-4, the others 5e-2 .. 1)."""
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt()
    with torch.no_grad():
        _without(model, detail)
    err = _rel(prefill_logits(model, ids, block_size=BS), _hf_logits(hf, ids))
    assert err > times * REL_TOL, f"{name} without {detail}: rel err only {err:.2e}"


# ------------------------------------------------------------------------------------------------
# multimodal checkpoint: its text model
# ------------------------------------------------------------------------------------------------
def test_gemma3_conditional_generation_text_model(tmp_path):
    """A ``Gemma3ForConditionalGeneration`` checkpoint runs as its text model (the vision tower and
    projector tensors are skipped): the same logits as transformers' multimodal model on text."""
    text = dict(_BASE, head_dim=64, sliding_window_pattern=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    reinit_gemma_(hf, 5)
    hf.save_pretrained(tmp_path)
    conf = ModelConfig.from_pretrained(str(tmp_path))
    assert conf.architecture == "Gemma3ForCausalLM" and conf.qk_norm
    model = load_model(str(tmp_path), dtype=torch.float32)
    ids = _prompt(seed=9, n=30)
    ids = [i % (VOCAB - 3) for i in ids]  # no image tokens
    want = _hf_logits(hf, ids)
    assert _rel(prefill_logits(model, ids), want) < REL_TOL
    # a built model handed to the engine is re-loaded from its own (text-model) tensors
    llm = LLM(model, num_kv_blocks=8, block_size=BS, deterministic=True)
    assert llm.model is not model
    assert _rel(prefill_logits(llm.model, ids), want) < REL_TOL
    with pytest.raises(ValueError, match="multimodal"):
        from fastinfer.quant import QuantOptions, quantize_checkpoint

        quantize_checkpoint(str(tmp_path), str(tmp_path / "q"), QuantOptions("int8"))


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
def test_config_defaults_are_transformers_defaults():
    """A config.json that states only the architecture means what transformers' config class says."""
    for arch, cls in (("Gemma2ForCausalLM", transformers.Gemma2Config),
                      ("Gemma3ForCausalLM", transformers.Gemma3TextConfig)):
        ours = ModelConfig.from_dict({"architectures": [arch]})
        ref = cls()
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                    "layer_types", "bos_token_id", "pad_token_id", "rms_norm_eps"):
            assert getattr(ours, key) == getattr(ref, key), (arch, key)
        assert ours.eos_token_ids == [ref.eos_token_id]
        assert ours.hidden_act == ref.hidden_activation
        if arch == "Gemma2ForCausalLM":
            assert ours.rope_theta == ref.rope_parameters["rope_theta"] and ours.sliding_rope_theta is None
        else:
            assert ours.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"]
            assert ours.sliding_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"]
        assert ours.max_model_len == ref.max_position_embeddings
    gemma3 = ModelConfig.from_dict({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12})
    assert [gemma3.window_left(i) for i in range(12)] == [4095] * 5 + [-1] + [4095] * 5 + [-1]
    assert gemma3.attention_scale == 256 ** -0.5


def test_gemma3_transformers4_config_form(ckpts):
    """The transformers 4 form of a Gemma 3 config (``rope_theta``, ``rope_scaling`` for the global
    layers, ``rope_local_base_freq``, ``sliding_window_pattern``, no ``layer_types``, as on the Hub)
    means the same here as the transformers 5 form, and the same in transformers."""
    _, path = ckpts("gemma3_hd256")
    with open(os.path.join(path, "config.json")) as f:
        new = json.load(f)
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern")}
    old.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=3,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    a, b = ModelConfig.from_dict(new), ModelConfig.from_dict(old)
    for key in ("rope_theta", "rope_scaling", "sliding_rope_theta", "sliding_rope_scaling", "layer_types",
                "sliding_window"):
        assert getattr(a, key) == getattr(b, key), key
    assert a.rope_scaling == {"rope_type": "linear", "factor": 4.0} and a.sliding_rope_scaling is None
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k not in ("architectures",)})
    assert ref.layer_types == b.layer_types
    assert ref.rope_parameters["full_attention"]["factor"] == 4.0
    assert ref.rope_parameters["sliding_attention"]["rope_theta"] == b.sliding_rope_theta


def _gemma(arch="Gemma2ForCausalLM", **kw):
    return dict({"architectures": [arch], "num_hidden_layers": 4}, **kw)


@pytest.mark.parametrize("bad, what", [
    (_gemma(hidden_activation="gelu"), "hidden_activation"),
    (_gemma("Gemma3ForCausalLM", hidden_activation="silu"), "hidden_activation"),
    (_gemma(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_gemma("Gemma3ForCausalLM", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_gemma("Gemma3ForCausalLM", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (_gemma(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    (_gemma(final_logit_softcapping="30"), "final_logit_softcapping"),
    (_gemma(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    (_gemma(query_pre_attn_scalar=None), "query_pre_attn_scalar"),
    (_gemma(sliding_window=None), "sliding_window"),
    (_gemma(sliding_window=0), "sliding_window"),
    (_gemma(layer_types=["sliding_attention"] * 3), "layer_types"),
    (_gemma(layer_types=["chunked_attention"] * 4), "layer_types"),
    (_gemma("Gemma3ForCausalLM", sliding_window_pattern=0), "sliding_window_pattern"),
    (_gemma("Gemma3ForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters"),
    (_gemma("Gemma3ForCausalLM", rope_parameters={"full_attention": {"rope_type": "longrope", "factor": 2.0}}),
     "longrope"),
    (_gemma(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "text_config"),
    ({"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
])
def test_config_errors(bad, what):
    with pytest.raises(ValueError, match=what):
        ModelConfig.from_dict(bad)


def test_llama_model_refuses_a_gemma_config():
    from fastinfer.models import LlamaForCausalLM

    conf = ModelConfig.from_dict(_gemma(hidden_size=64, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=64, vocab_size=32))
    with pytest.raises(ValueError, match="GemmaForCausalLM"):
        LlamaForCausalLM(conf, device="meta")


# ------------------------------------------------------------------------------------------------
# GGUF (llama.cpp's gemma2 / gemma3 files)
# ------------------------------------------------------------------------------------------------
def _write_gemma_gguf(path, hf, arch: str) -> str:
    """A float32 GGUF of transformers model ``hf`` as llama.cpp's converter (convert_hf_to_gguf.py,
    Gemma2Model / Gemma3Model) writes it: tensor names through the gguf package's own tables,
    ``1 + weight`` stored for every tensor ending in ``norm.weight``, q/k rows not permuted, no
    ``lm_head`` for gemma2 (tied), and the metadata those classes write (gemma2: no RoPE base, the
    two soft-caps and the window; gemma3: the global RoPE base and scaling, the final soft-cap
    when set, the window)."""
    gguf = pytest.importorskip("gguf")
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # the converter states the vocabulary through the tokenizer's token list; there is no tokenizer
    # here, so its size goes in vocab_size (transformers' GGUF loader needs one of the two)
    w.add_vocab_size(c.vocab_size)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        model_arch = gguf.MODEL_ARCH.GEMMA2
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        model_arch = gguf.MODEL_ARCH.GEMMA3
    names = gguf.get_tensor_name_map(model_arch, c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float()
        if name.endswith("norm.weight"):
            a = a + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, a.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


GGUF_CASES = {
    # transformers' defaults for the scale and the soft-caps (so transformers' own GGUF loader, which
    # reads neither, runs the file the same way)
    "gemma2": ("gemma2", dict(head_dim=256)),
    # 7 layers: llama.cpp makes every 6th layer global (layer 5); linear rope scaling there, the
    # local base 10000 llama.cpp assumes; query_pre_attn_scalar = head_dim, as llama.cpp assumes
    "gemma3": ("gemma3", dict(head_dim=64, num_hidden_layers=7, query_pre_attn_scalar=64, final_logit_softcapping=1.0,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


@pytest.mark.parametrize("arch", list(GGUF_CASES))
def test_gguf_matches_transformers(tmp_path, arch):
    pytest.importorskip("gguf")
    kind, over = GGUF_CASES[arch]
    hf = make_gemma(kind, seed=11, **over)
    hf.save_pretrained(tmp_path / "hf")
    path = _write_gemma_gguf(tmp_path / f"{arch}.gguf", hf, arch)
    from_hf, from_gguf = ModelConfig.from_pretrained(str(tmp_path / "hf")), load_config(path)
    for key in ("architecture", "hidden_size", "num_hidden_layers", "head_dim", "layer_types", "sliding_window",
                "rope_theta", "rope_scaling", "sliding_rope_theta", "sliding_rope_scaling", "attention_scale",
                "attn_logit_softcapping", "final_logit_softcapping", "qk_norm", "tie_word_embeddings", "hidden_act"):
        assert getattr(from_gguf, key) == getattr(from_hf, key), key
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(seed=12)
    want = _hf_logits(hf, ids)
    assert _rel(prefill_logits(model, ids, block_size=BS), want) < REL_TOL
    assert _model_greedy(model, ids, NEW_TOKENS) == _hf_greedy(hf, ids, NEW_TOKENS)
    if arch == "gemma2":  # and transformers reads the file the same way (it takes 1 off the norms too)
        hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf",
                                                                    dtype=torch.float32)
        assert _rel(_hf_logits(hf_gguf.eval(), ids), want) < REL_TOL


def _gguf_metadata_only(path, arch, layers, extra=()):
    """A GGUF with metadata and no tensors (for the config alone)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (("context_length", 512), ("embedding_length", 4608), ("block_count", layers),
                 ("feed_forward_length", 1024), ("attention.head_count", 32), ("attention.head_count_kv", 16),
                 ("attention.key_length", 128), ("attention.value_length", 128), ("vocab_size", 300)):
        w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for k, v in extra:
        if isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        elif isinstance(v, list):
            w.add_array(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_config_follows_llama_cpp(tmp_path):
    """What llama.cpp derives instead of storing: the 27B models' attention scale (hidden / heads =
    144 for gemma2's 46 layers, not head_dim 128), gemma2's window 4096 and soft-caps 50 / 30 when
    absent, gemma3's 6-layer pattern, local base 10000, no final soft-cap; a pattern key, a bool
    array, a sliding-window base; gemma3 without a window has no sliding layers; an attention
    soft-cap in a gemma3 file is refused."""
    from fastinfer.models import gguf_model_config

    g2 = gguf_model_config(_gguf_metadata_only(tmp_path / "a.gguf", "gemma2", 46))
    assert g2.query_pre_attn_scalar == 144 and g2.head_dim == 128
    assert g2.sliding_window == 4096 and g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 30.0
    assert g2.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    g2 = gguf_model_config(_gguf_metadata_only(tmp_path / "b.gguf", "gemma2", 42, [
        ("attention.sliding_window_pattern", 3), ("attn_logit_softcapping", 20.0)]))
    assert g2.query_pre_attn_scalar == 128 and g2.attn_logit_softcapping == 20.0
    assert g2.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    g3 = gguf_model_config(_gguf_metadata_only(tmp_path / "c.gguf", "gemma3", 62, [
        ("attention.sliding_window", 1024), ("rope.freq_base", 1e6)]))
    assert g3.query_pre_attn_scalar == 144 and g3.final_logit_softcapping is None
    assert g3.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert g3.rope_theta == 1e6 and g3.sliding_rope_theta == 10000.0 and g3.window_left(0) == 1023
    g3 = gguf_model_config(_gguf_metadata_only(tmp_path / "d.gguf", "gemma3", 4, [
        ("attention.sliding_window", 512), ("rope.freq_base_swa", 500.0),
        ("attention.sliding_window_pattern", [True, False, False, True])]))
    assert g3.layer_types == ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    assert g3.sliding_rope_theta == 500.0
    g3 = gguf_model_config(_gguf_metadata_only(tmp_path / "e.gguf", "gemma3", 4))
    assert g3.layer_types == ["full_attention"] * 4 and g3.sliding_window is None
    with pytest.raises(ValueError, match="gemma3.attn_logit_softcapping"):
        gguf_model_config(_gguf_metadata_only(tmp_path / "f.gguf", "gemma3", 4, [("attn_logit_softcapping", 50.0)]))
