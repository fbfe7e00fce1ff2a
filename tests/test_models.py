"""Model runner parity: fastinfer's Llama-family model (CPU ops, float32) against transformers.

Tiny random checkpoints (2 layers, hidden 128, head_dim 64, vocab 300) are written with
``save_pretrained`` and loaded by ``fastinfer.models.load_model``. Weights are re-drawn with a larger
scale than transformers' init (std 0.02 makes attention nearly uniform and would hide RoPE or mask
bugs). Checks: logits at every position of a 100-token prompt (relative norm error < 1e-4),
32-token greedy continuation through the decode path, chunked prefill, a mixed prefill + decode
batch on a scattered block table, RoPE tables against transformers' ROPE_INIT_FUNCTIONS, config
parsing and loader errors.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import fastinfer  # noqa: E402,F401
from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed  # noqa: E402
from fastinfer.layers import BatchBuilder  # noqa: E402
from fastinfer.models import (  # noqa: E402
    ForwardBatch,
    ModelConfig,
    build_cos_sin_cache,
    compute_inv_freq,
    load_model,
)
from model_helpers import (  # noqa: E402
    HF_BASE,
    hf_greedy,
    hf_logits,
    lazy_checkpoints,
    make_forward_batch,
    make_hf_model,
    prefill_logits,
    rel_err,
)

VOCAB = 300
PROMPT_LEN = 100
NEW_TOKENS = 32
BS = 16
REL_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------

_BASE = HF_BASE

CASES = {
    # GQA 4/2, llama3 rope scaling, untied lm_head
    "llama3": ("llama", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
    # tied embeddings, MHA-ish (4/4), attention_bias + mlp_bias on, rope_theta != default
    "llama_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                 mlp_bias=True, rope_theta=50000.0)),
    # sliding window (24) smaller than the prompt
    "mistral": ("mistral", dict(sliding_window=24, num_key_value_heads=1)),
    # qkv bias; sliding window only on layer 1 (max_window_layers=1)
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=40, max_window_layers=1,
                            tie_word_embeddings=False, rope_theta=1e6)),
    # Qwen3: per-head q/k RMSNorm before RoPE, explicit head_dim (64 != hidden / heads = 32), GQA 4/2,
    # untied lm_head
    "qwen3": ("qwen3", dict(tie_word_embeddings=False, rope_theta=1e6)),
    # Qwen3, tied embeddings, GQA 4/1, attention_bias (q, k, v and o), sliding window on layer 1 only
    "qwen3_tied": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True,
                                 use_sliding_window=True, sliding_window=40, max_window_layers=1)),
    "yarn": ("llama", dict(max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.5})),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Lazily built ``name -> (hf_model, path)``."""
    return lazy_checkpoints(tmp_path_factory, CASES, make_hf_model)


def _prompt(n=PROMPT_LEN, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


_rel, _hf_logits, _hf_greedy = rel_err, hf_logits, hf_greedy


def _scattered_blocks(n, seed=0):
    blocks = list(range(n))
    random.Random(seed).shuffle(blocks)
    return blocks


def _fi_greedy(model, ids, n):
    """Prefill the prompt, then n-1 decode steps (decode path), on a shuffled block table."""
    total = len(ids) + n
    nb = (total + BS - 1) // BS
    blocks = _scattered_blocks(nb + 3)[:nb]
    caches = model.allocate_kv_cache(nb + 3, BS)
    logits = model(make_forward_batch(prefill=[(ids, 0, blocks)], block_size=BS), caches)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        pos = len(ids) + len(out) - 1
        logits = model(make_forward_batch(decode=[(out[-1], pos, blocks)], block_size=BS), caches)
        out.append(int(logits[0].argmax()))
    return out


# ------------------------------------------------------------------------------------------------
# parity
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_tied", "yarn",
                                  "linear"])
def test_prefill_logits_match_transformers(ckpts, name):
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt()
    ref = _hf_logits(hf, ids)
    out = prefill_logits(model, ids, block_size=BS)
    assert out.dtype == torch.float32 and out.shape == (PROMPT_LEN, VOCAB)
    assert _rel(out, ref) < REL_TOL, f"{name}: rel err {_rel(out, ref):.2e}"
    # every position individually too (a masking bug late in the prompt would hide in the norm)
    per_pos = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_pos.max().item() < 10 * REL_TOL


@pytest.mark.parametrize("name", ["llama3", "llama_tied", "mistral", "qwen2", "qwen3", "qwen3_tied"])
def test_greedy_decode_matches_transformers(ckpts, name):
    hf, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(seed=1)
    assert _fi_greedy(model, ids, NEW_TOKENS) == _hf_greedy(hf, ids, NEW_TOKENS)


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_chunked_prefill_equals_single_shot(ckpts, name):
    _, path = ckpts(name)
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(seed=2)
    full = prefill_logits(model, ids, block_size=BS)
    nb = (len(ids) + BS - 1) // BS
    blocks = _scattered_blocks(nb, seed=3)
    caches = model.allocate_kv_cache(nb, BS)
    cut = 37  # not a block boundary
    a = model(make_forward_batch(prefill=[(ids[:cut], 0, blocks)], block_size=BS, all_logits=True), caches)
    b = model(make_forward_batch(prefill=[(ids[cut:], cut, blocks)], block_size=BS, all_logits=True), caches)
    got = torch.cat([a, b])
    assert _rel(got, full) < 1e-5


def test_mixed_prefill_and_decode_batch(ckpts):
    """One forward with two prefill chunks (a fresh prompt and a continuation) and two decode
    rows, on interleaved physical blocks, equals running each sequence alone."""
    _, path = ckpts("mistral")
    model = load_model(path, dtype=torch.float32)
    seqs = [_prompt(45, seed=s) for s in range(4)]
    caches = model.allocate_kv_cache(24, BS)
    blocks = [[0, 5, 9, 13], [1, 6, 10, 14], [2, 7, 11, 15], [3, 8, 12, 16]]
    # history: seq1 has 20 tokens cached, seq2 and seq3 have 44 cached (decode their 45th)
    model(make_forward_batch(prefill=[(seqs[1][:20], 0, blocks[1]), (seqs[2][:44], 0, blocks[2]),
                                      (seqs[3][:44], 0, blocks[3])], block_size=BS), caches)
    batch = make_forward_batch(
        prefill=[(seqs[0], 0, blocks[0]), (seqs[1][20:], 20, blocks[1])],
        decode=[(seqs[2][44], 44, blocks[2]), (seqs[3][44], 44, blocks[3])],
        block_size=BS,
    )
    assert batch.num_prefill_tokens == 45 + 25 and batch.num_decode_tokens == 2
    got = model(batch, caches)
    for row, s in enumerate(seqs):
        ref = prefill_logits(model, s, block_size=BS)[-1]
        assert _rel(got[row], ref) < 1e-5, f"row {row}"


def test_custom_mask_chain_equals_causal(ckpts):
    """A tree mask that is a chain (lower-triangular) reproduces plain causal prefill."""
    _, path = ckpts("llama3")
    model = load_model(path, dtype=torch.float32)
    ids = _prompt(40, seed=4)
    full = prefill_logits(model, ids, block_size=BS)
    caches = model.allocate_kv_cache(3, BS)
    model(make_forward_batch(prefill=[(ids[:30], 0, [0, 1, 2])], block_size=BS), caches)
    b = BatchBuilder(BS)
    b.prefill(ids[30:], 30, [0, 1, 2], mask=torch.tril(torch.ones(10, 10, dtype=torch.bool)), logits="all")
    got = model(b.build(), caches)
    assert _rel(got, full[30:]) < 1e-5


@pytest.mark.sim
@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3_tied"])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_sim_kernels_end_to_end(ckpts, name, dtype, tol):
    """The whole model on the CUDA kernel sources (simt emulator, ``torch.ops.fastinfer_sim``) in
    half precision: chunked prefill + decode against the fp32 CPU logits, bit-identical across
    emulator schedule seeds."""
    require_sim()
    _, path = ckpts(name)
    ids = _prompt(50, seed=6)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    model = load_model(path, dtype=dtype, ops=fastinfer.ops.backend("fastinfer_sim"))
    blocks = [3, 0, 2, 1]
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(4, BS)
            a = model(make_forward_batch(prefill=[(ids[:21], 0, blocks)], block_size=BS, all_logits=True), caches)
            b = model(make_forward_batch(prefill=[(ids[21:49], 21, blocks)], block_size=BS, all_logits=True), caches)
            c = model(make_forward_batch(decode=[(ids[49], 49, blocks)], block_size=BS), caches)
            results.append(torch.cat([a, b, c]))
    assert _rel(results[0], ref) < tol
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_cpu_bf16_model_with_packed_linears(ckpts, name):
    """The CPU bf16 path the runner uses (oneDNN-packed linears, flash prefill, vectorised decode):
    chunked prefill with a prefix + decode against the fp32 CPU logits; packing changes nothing
    beyond bf16 rounding order."""
    _, path = ckpts(name)
    ids = _prompt(50, seed=7)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    blocks = [3, 0, 2, 1]
    outs = []
    for pack in (False, True):
        model = load_model(path, dtype=torch.bfloat16)
        if pack and not model.pack_linears_for_cpu():
            pytest.skip("no oneDNN bf16 linear packing here (needs mkldnn and AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
        caches = model.allocate_kv_cache(4, BS)
        a = model(make_forward_batch(prefill=[(ids[:21], 0, blocks)], block_size=BS, all_logits=True), caches)
        b = model(make_forward_batch(prefill=[(ids[21:49], 21, blocks)], block_size=BS, all_logits=True), caches)
        c = model(make_forward_batch(decode=[(ids[49], 49, blocks)], block_size=BS), caches)
        outs.append(torch.cat([a, b, c]))
    assert _rel(outs[0], ref) < 2e-2
    assert _rel(outs[1], ref) < 2e-2
    assert _rel(outs[1], outs[0]) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2", "qwen3", "qwen3_tied"])
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_cuda_model_matches_cpu_fp32(ckpts, name, dtype, tol):
    """On a GPU: the CUDA kernels end to end (prefill chunk + decode) against fp32 CPU logits."""
    if not fastinfer.cuda_available():
        pytest.skip("fastinfer built without CUDA kernels or no GPU")
    _, path = ckpts(name)
    ids = _prompt(seed=7)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    model = load_model(path, dtype=dtype, device="cuda")
    blocks = _scattered_blocks(8, seed=1)[:7]
    caches = model.allocate_kv_cache(8, BS)
    dev = model.device
    a = model(make_forward_batch(prefill=[(ids[:60], 0, blocks)], block_size=BS, all_logits=True, device=dev), caches)
    b = model(make_forward_batch(prefill=[(ids[60:99], 60, blocks)], block_size=BS, all_logits=True, device=dev), caches)
    c = model(make_forward_batch(decode=[(ids[99], 99, blocks)], block_size=BS, device=dev), caches)
    got = torch.cat([a, b, c]).cpu()
    assert _rel(got, ref) < tol


@pytest.mark.parametrize("asset", ["tiny-llama"])
def test_shipped_asset_matches_transformers(asset):
    here = Path(__file__).resolve().parent.parent / "python" / "fastinfer" / "assets" / asset
    installed = Path(fastinfer.__file__).resolve().parent / "assets" / asset
    path = next((p for p in (here, installed) if (p / "config.json").is_file()), None)
    if path is None:
        pytest.skip(f"{asset} not present")
    conf = ModelConfig.from_pretrained(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = load_model(str(path), dtype=torch.float32)
    n = min(64, conf.max_model_len)
    ids = torch.randint(0, conf.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    assert _rel(prefill_logits(model, ids), _hf_logits(hf, ids)) < REL_TOL
    assert _fi_greedy(model, ids[:16], 8) == _hf_greedy(hf, ids[:16], 8)


# ------------------------------------------------------------------------------------------------
# RoPE tables
# ------------------------------------------------------------------------------------------------

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_implicit_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn_notrunc": {"rope_type": "yarn", "factor": 2.56, "original_max_position_embeddings": 100,
                     "truncate": False, "attention_factor": 1.25},
}


def _hf_rope_config(scaling, max_pos=256, theta=10000.0, head_dim=64):
    kw = dict(_BASE, max_position_embeddings=max_pos, head_dim=head_dim, rope_theta=theta)
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return transformers.LlamaConfig(**kw)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling = ROPE_CASES[case]
    hf_cfg = _hf_rope_config(scaling, theta=500000.0)
    conf = ModelConfig.from_dict(json.loads(hf_cfg.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    assert conf.rope_type == (scaling or {"rope_type": "default"})["rope_type"]
    inv, att = compute_inv_freq(64, conf.rope_theta, conf.rope_scaling, conf.max_position_embeddings)
    if scaling is None:
        ref_inv, ref_att = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref_inv, ref_att = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    torch.testing.assert_close(inv, ref_inv.double(), rtol=2e-6, atol=0)
    assert att == pytest.approx(ref_att, rel=1e-12)

    # the op table against transformers' rotary embedding (cos/sin already scaled)
    n = 256
    table = build_cos_sin_cache(conf, n)
    assert table.shape == (n, 64) and table.dtype == torch.float32
    rot = LlamaRotaryEmbedding(hf_cfg)
    pos = torch.arange(n)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(table[:, :32], cos[0, :, :32], rtol=0, atol=5e-5)
    torch.testing.assert_close(table[:, 32:], sin[0, :, :32], rtol=0, atol=5e-5)


def test_dynamic_rope_beyond_max_positions():
    """Row p >= max_position_embeddings uses transformers' dynamic frequencies for seq_len=p+1."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _hf_rope_config({"rope_type": "dynamic", "factor": 2.0}, max_pos=64)
    conf = ModelConfig.from_dict(json.loads(hf_cfg.to_json_string()) | {"architectures": ["LlamaForCausalLM"]})
    assert conf.max_model_len == 128
    table = build_cos_sin_cache(conf).double()
    assert table.shape == (128, 64)
    for p in (0, 63, 64, 90, 127):
        inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, "cpu", seq_len=p + 1)
        ang = p * inv.double()
        torch.testing.assert_close(table[p], torch.cat([ang.cos(), ang.sin()]), rtol=0, atol=5e-5)


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


def _llama_dict(**kw):
    d = {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 300}
    d.update(kw)
    return d


def test_config_fields_and_defaults():
    c = ModelConfig.from_dict(_llama_dict(eos_token_id=[5, 7], rope_theta=1e6,
                                          rope_scaling={"type": "linear", "factor": 2}, torch_dtype="bfloat16"))
    assert (c.num_key_value_heads, c.head_dim, c.rms_norm_eps) == (2, 64, 1e-6)
    assert c.eos_token_ids == [5, 7] and c.bos_token_id == 1
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.torch_dtype == torch.bfloat16 and c.max_model_len == 2048 * 2
    assert not (c.qkv_bias or c.o_bias or c.mlp_bias) and c.window_left(0) == -1
    # transformers 5 form
    c = ModelConfig.from_dict(_llama_dict(rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
                                          dtype="float16", eos_token_id=9, attention_bias=True))
    assert c.rope_theta == 5e5 and c.rope_scaling is None and c.torch_dtype == torch.float16
    assert c.eos_token_ids == [9] and c.qkv_bias and c.o_bias and not c.mlp_bias
    # Mistral: window on every layer, inclusive mapping W - 1; missing key -> transformers' 4096
    m = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "hidden_size": 128,
                               "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 24})
    assert [m.window_left(i) for i in range(m.num_hidden_layers)] == [23] * 32
    m = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert m.window_left(0) == -1
    # Qwen2: bias on q/k/v only; sliding only with use_sliding_window, from max_window_layers on
    q = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
                               "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2})
    assert q.qkv_bias and not q.o_bias and [q.window_left(i) for i in range(4)] == [-1, -1, 7, 7]
    q = ModelConfig.from_dict({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8})
    assert q.window_left(31) == -1 and not q.qk_norm
    # Qwen3: q/k norm, transformers' defaults (head_dim 128 whatever hidden / heads is), attention_bias
    # on q, k, v and o, Qwen2's sliding-window rule
    q = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
                               "num_attention_heads": 4, "num_key_value_heads": 2})
    assert q.qk_norm and q.head_dim == 128 and q.q_size == 512 and q.vocab_size == 151936
    assert not (q.qkv_bias or q.o_bias or q.mlp_bias) and q.window_left(31) == -1 and not q.tie_word_embeddings
    q = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 3, "attention_bias": True,
                               "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
    assert q.qkv_bias and q.o_bias and not q.mlp_bias and [q.window_left(i) for i in range(3)] == [-1, 7, 7]


@pytest.mark.parametrize("bad, what", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    (_llama_dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    (_llama_dict(hidden_act="gelu"), "gelu"),
    (_llama_dict(num_key_value_heads=3), "num_key_value_heads"),
    (_llama_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (_llama_dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_config_errors(bad, what):
    with pytest.raises(ValueError, match=what):
        ModelConfig.from_dict(bad)


def test_generation_config_eos_ids_are_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_dict(eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 8]}))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == [2, 8]


# ------------------------------------------------------------------------------------------------
# loader
# ------------------------------------------------------------------------------------------------


def _copy_ckpt(src, dst, edit):
    """Copy config + rewrite model.safetensors through ``edit(dict) -> dict``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".json"):
            (dst / f).write_text((Path(src) / f).read_text())
    sd = safetensors_torch.load_file(str(Path(src) / "model.safetensors"))
    safetensors_torch.save_file(edit(sd), str(dst / "model.safetensors"))
    return str(dst)


def test_loader_errors(ckpts, tmp_path):
    _, path = ckpts("llama3")
    k = "model.layers.1.self_attn.k_proj.weight"

    def drop(sd):
        del sd[k]
        return sd

    def extra(sd):
        sd["model.layers.0.self_attn.mystery.weight"] = torch.zeros(3)
        return sd

    def reshape(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(255, 128)
        return sd

    def with_inv_freq(sd):
        sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(32)
        return sd

    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_model(_copy_ckpt(path, tmp_path / "a", drop))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.mystery.weight'"):
        load_model(_copy_ckpt(path, tmp_path / "b", extra))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight' has shape \[255, 128\]"):
        load_model(_copy_ckpt(path, tmp_path / "c", reshape))
    load_model(_copy_ckpt(path, tmp_path / "d", with_inv_freq))  # ignored

    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    bad = tmp_path / "e"
    _copy_ckpt(path, bad, lambda sd: sd)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_model(str(bad))
    # a Qwen3 checkpoint without its q/k norms (e.g. a Qwen2 one relabelled) names the missing tensor
    _, q3 = ckpts("qwen3")
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.self_attn.q_norm.weight'"):
        load_model(_copy_ckpt(q3, tmp_path / "g", lambda sd: {k: v for k, v in sd.items() if "_norm" not in k}))

    pick = tmp_path / "f"
    pick.mkdir()
    (pick / "config.json").write_text((Path(path) / "config.json").read_text())
    (pick / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safetensors only"):
        load_model(str(pick))


def test_loader_sharded_and_tied_variants(ckpts, tmp_path):
    hf, path = ckpts("llama_tied")
    ids = _prompt(20, seed=5)
    ref = prefill_logits(load_model(path, dtype=torch.float32), ids)
    # sharded save (several shards + index), with tqdm progress
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    m = load_model(str(tmp_path / "sharded"), dtype=torch.float32, progress=True)
    assert m.lm_head.weight is m.embed_tokens.weight
    torch.testing.assert_close(prefill_logits(m, ids), ref, rtol=0, atol=0)

    # a tied checkpoint that still carries an lm_head.weight copy: ignored, like transformers
    def add_head(sd):
        sd["lm_head.weight"] = torch.zeros(VOCAB, 128)
        return sd

    m = load_model(_copy_ckpt(path, tmp_path / "with_head", add_head), dtype=torch.float32)
    torch.testing.assert_close(prefill_logits(m, ids), ref, rtol=0, atol=0)


def test_loader_dtype_and_kv_cache_helpers(ckpts):
    _, path = ckpts("llama3")
    m = load_model(path, dtype=torch.bfloat16)
    assert m.embed_tokens.weight.dtype == torch.bfloat16
    assert m.kv_cache_shape(7, 16) == (7, 16, 2, 64)
    caches = m.allocate_kv_cache(7, 16)
    assert len(caches) == 2 and caches[0][0].shape == (7, 16, 2, 64) and caches[0][1].dtype == torch.bfloat16
    assert m.layers[0].qkv_proj.weight.shape == ((4 + 2 * 2) * 64, 128)
    assert m.layers[0].gate_up_proj.weight.shape == (512, 128)
    # bf16 on the CPU ops runs end to end
    out = m(make_forward_batch(prefill=[(_prompt(20), 0, [0, 1])], block_size=16), caches)
    assert out.dtype == torch.float32 and out.shape == (1, VOCAB) and torch.isfinite(out).all()
    assert m(make_forward_batch(), caches).shape == (0, VOCAB)  # empty step


def test_forward_batch_builder_layout():
    b = BatchBuilder(16)
    assert b.decode(9, 8, [3]) == 0  # logits rows come in call order; token rows: prefill part first
    assert b.prefill([1, 2, 3], 0, [4]) == [1]
    assert b.prefill([5], 17, [0, 2], logits="all") == [2]
    b = b.build()
    assert isinstance(b, ForwardBatch)
    assert b.input_ids.tolist() == [1, 2, 3, 5, 9]
    assert b.positions.tolist() == [0, 1, 2, 17, 8]
    assert b.slot_mapping.tolist() == [64, 65, 66, 2 * 16 + 1, 3 * 16 + 8]
    assert b.prefill_cu_seqlens_q.tolist() == [0, 3, 4] and b.prefill_seq_lens_k.tolist() == [3, 18]
    assert b.decode_seq_lens.tolist() == [9] and b.logits_indices.tolist() == [4, 2, 3]
    assert b.num_prefill_tokens == 4 and b.num_decode_tokens == 1 and b.prefill_max_seqlen_q == 3
    assert b.custom_mask is None
    # tree rows: rotary positions by depth, a mask block per chunk (causal for the plain one)
    t = BatchBuilder(16)
    t.prefill([7, 8], 0, [0])
    t.prefill([1, 2, 3], 5, [1], positions=[5, 6, 6], mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool(),
              logits="all")
    t = t.build()
    assert t.positions.tolist() == [0, 1, 5, 6, 6] and t.slot_mapping.tolist() == [0, 1, 21, 22, 23]
    assert t.custom_mask.tolist() == [True, False, True, True] + [True, False, False, True, True, False, True, False, True]
    with pytest.raises(ValueError, match="outside the 1 blocks"):
        BatchBuilder(16).prefill([1] * 3, 15, [0])