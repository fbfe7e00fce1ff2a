"""Mixture-of-experts GGUF files: Mixtral (``llama`` with experts), Qwen2-MoE (``qwen2moe``),
Qwen3-MoE (``qwen3moe``) and OLMoE (``olmoe``), the experts stacked (``blk.{i}.ffn_gate_exps`` /
``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``, the router ``ffn_gate_inp``
``[E, H]``), Qwen2-MoE's shared expert (``ffn_{gate,up,down}_shexp``, its gate
``ffn_gate_inp_shexp`` ``[H]``), OLMoE's q/k norms over the whole projections, unquantised and
quantised.

The files are written here as llama.cpp's converter writes them, from a tiny random transformers
model saved with ``save_pretrained`` (the hub's per-expert tensors): each projection's experts
stacked along a new first dimension, every name given by the gguf package's own ``TensorNameMap``,
llama's q/k rows permuted (llama.cpp's permutation, written out here; the other architectures'
converters permute nothing), the metadata keys the converter writes (expert widths for qwen3moe and
qwen2moe, key_length when the config has a head_dim), the tiny model's byte-level BPE tokenizer.
Tensor types: the routers (the shared expert's gate included: 1-D) and the norms F32 (as llama.cpp's
quantiser leaves them), the experts and the other matrices in the type under test, quantised by the
gguf package (``gguf.quantize``). The models' top-k renormalisation is llama.cpp's for the
architecture (on for Mixtral and Qwen3-MoE, off for Qwen2-MoE and OLMoE), since llama.cpp's graphs
fix it whatever the original config said.

Oracles (outside fastinfer):

* transformers' modelling on the weights the file holds: the source model with each parameter
  passed through the gguf package's quantise -> dequantise for its type (rows are whole blocks, so
  stacked and per-expert tensors round alike). Both runners compute in float32 on the same floats.
* transformers' GGUF loader on the same file (:data:`HF_GGUF_CASES`; it dequantises with the gguf
  package too). It reads no expert widths (the experts are then its config classes' defaults:
  Qwen3-MoE's 768, Qwen2-MoE's 1408 and shared 5632, which those cases use), no attention key
  length for qwen2moe, no attention biases for qwen3moe, no ``llama.expert_count`` (a llama file is a
  dense Llama to it) and no ``olmoe`` at all, so Mixtral's, OLMoE's, the biased Qwen3-MoE's and the
  small Qwen2-MoE's oracle is the first one only.

Measured on the 2-core CPU machine: logits relative error 2.8e-7..4.6e-7 against both oracles
(tolerance 1e-5) for F32, F16, BF16, Q8_0, Q4_0 and Q4_K experts, while the quantised files' logits
are 1.1e-4 (F16 experts) to 7.7e-2 (Q4_0 experts) away from the unquantised model's: the round trip
in the reference is what makes them agree. Swapping the gate and up experts in the file, reading
every expert's slice as expert 0, or swapping the gate and up projections in the reader's mapping
each fails the parity tests; so do renormalising Qwen2-MoE's or OLMoE's top-k weights, permuting
their q/k rows as llama's, and swapping the shared expert's gate and up in the reader's mapping. A
file with the shared expert's gate and up swapped or its gate negated is 2.3e-1 away, one with
OLMoE's q and k norms swapped 3.0e-2.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from fastinfer import LLM, SamplingParams  # noqa: E402
from fastinfer.models import GGUFWeightReader, MoeForCausalLM, load_config, load_model  # noqa: E402
from fastinfer.models.gguf import GGUFFile  # noqa: E402
from gguf_helpers import add_tokenizer, tiny_tokenizer_meta  # noqa: E402
from model_helpers import hf_greedy, hf_logits, make_hf_model, prefill_logits, random_prompt, rel_err  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB = 4096  # the tiny tokenizer's
PROMPT_LEN = 40
NEW_TOKENS = 12
REL_TOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# GGUF architecture, transformers kind, config overrides (HF_BASE: hidden 128, head_dim 64, GQA 4/2)
CASES = {
    # 4 experts of width 64, 2 per token; no sliding window (llama.cpp's llama graph has none)
    "mixtral": ("llama", "mixtral", dict(vocab_size=VOCAB, intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, sliding_window=None, rope_theta=1e6)),
    # 8 experts of width 768 (what transformers' GGUF loader assumes), 3 per token, renormalised (as
    # llama.cpp always does), every layer routed, untied
    "qwen3_moe": ("qwen3moe", "qwen3_moe", dict(vocab_size=VOCAB, num_experts=8, num_experts_per_tok=3,
                                                moe_intermediate_size=768, norm_topk_prob=True, rope_theta=1e6)),
    # q/k/v/o biases (transformers' GGUF loader drops them: no attention_bias in its qwen3moe config
    # mapping), experts of width 64
    "qwen3_moe_bias": ("qwen3moe", "qwen3_moe", dict(vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=64, norm_topk_prob=True,
                                                     attention_bias=True)),
    # tied embeddings; hidden 256 (Q4_K blocks hold 256 values of a row)
    "qwen3_moe_h256": ("qwen3moe", "qwen3_moe", dict(vocab_size=VOCAB, hidden_size=256, num_experts=4,
                                                     num_experts_per_tok=2, moe_intermediate_size=768,
                                                     norm_topk_prob=True, tie_word_embeddings=True)),
    # what transformers' GGUF loader assumes of a qwen2moe file (it reads no expert widths and no
    # key_length): Qwen2MoeConfig's default widths (experts 1408 = 5632 / 4, the shared expert 5632),
    # head_dim = hidden / heads (2 heads of 64, one KV head), top-k weights not renormalised (as
    # llama.cpp runs qwen2moe), q/k/v biases; 6 experts, 4 per token
    "qwen2_moe": ("qwen2moe", "qwen2_moe", dict(vocab_size=VOCAB, num_attention_heads=2, num_key_value_heads=1,
                                                intermediate_size=5632,
                                                num_experts=6, num_experts_per_tok=4, moe_intermediate_size=1408,
                                                shared_expert_intermediate_size=5632, norm_topk_prob=False,
                                                rope_theta=1e6)),
    # small widths (experts 64, the shared expert 96), head_dim 64 (attention.key_length), no q/k/v
    # bias, tied embeddings
    "qwen2_moe_small": ("qwen2moe", "qwen2_moe", dict(vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=64, shared_expert_intermediate_size=96,
                                                      norm_topk_prob=False, qkv_bias=False,
                                                      tie_word_embeddings=True)),
    # as llama.cpp runs OLMoE: one KV head per head (its k norm is [n_embd]), head_dim = hidden / heads
    # (2 heads of 64), 8 experts of width 64, 3 per token, not renormalised, no clip_qkv
    "olmoe": ("olmoe", "olmoe", dict(vocab_size=VOCAB, num_attention_heads=2, num_key_value_heads=2,
                                     intermediate_size=64,
                                     num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None,
                                     eos_token_id=2)),
}
# the cases transformers' GGUF loader reads as it is written (no attention biases for qwen3moe, the
# default widths for qwen2moe; it has no olmoe, and reads a llama file as a dense Llama)
HF_GGUF_CASES = ("qwen3_moe", "qwen3_moe_h256", "qwen2_moe")

_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE,
         "olmoe": gguf.MODEL_ARCH.OLMOE}


# ------------------------------------------------------------------------------------------------
# writing the files
# ------------------------------------------------------------------------------------------------
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kind(hf_name: str) -> str:
    """Which type a tensor gets: ``router`` / ``norm`` (kept F32), ``experts``, ``other``. The shared
    expert's gate is a router too: the converter writes it 1-D ([H]), and 1-D tensors stay F32."""
    if ".experts." in hf_name:
        return "experts"
    if hf_name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.shared_expert_gate.weight")):
        return "router"
    return "norm" if "norm" in hf_name or hf_name.endswith(".bias") else "other"


def _types(experts, other):
    return {"experts": experts, "other": other, "router": Q.F32, "norm": Q.F32}


def round_trip(a: np.ndarray, qtype) -> np.ndarray:
    """``a`` as a GGUF tensor of ``qtype`` holds it, by the gguf package."""
    return a if qtype == Q.F32 else gguf.dequantize(gguf.quantize(np.ascontiguousarray(a, np.float32), qtype), qtype)


def write_moe_gguf(path, hf, hf_dir: str, arch: str, types: dict, *, drop_keys=(), extra_keys=None,
                   tamper=None, squeeze_shared_gate=True) -> str:
    """``hf`` (saved per expert in ``hf_dir``) as llama.cpp's converter writes a GGUF of ``arch``.
    ``drop_keys`` / ``extra_keys``: metadata left out / added (under ``{arch}.``); ``tamper``:
    ``tamper(tensors)`` edits the GGUF-named float32 arrays before they are written (a ``(type,
    data)`` pair is written as given); ``squeeze_shared_gate``: Qwen2-MoE's ``ffn_gate_inp_shexp``
    as ``[H]`` (the converter's squeeze, which llama.cpp's loader declares), else as Hugging Face's
    ``[1, H]`` (what the converter writes since it stopped squeezing)."""
    from safetensors.numpy import load_file

    c = hf.config
    keys = {
        "context_length": ("uint32", c.max_position_embeddings),
        "embedding_length": ("uint32", c.hidden_size),
        "block_count": ("uint32", c.num_hidden_layers),
        "feed_forward_length": ("uint32", c.intermediate_size),
        "attention.head_count": ("uint32", c.num_attention_heads),
        "attention.head_count_kv": ("uint32", c.num_key_value_heads),
        "attention.layer_norm_rms_epsilon": ("float32", c.rms_norm_eps),  # olmoe: the converter's 1e-5
        "rope.freq_base": ("float32", c.rope_parameters["rope_theta"]),
        "vocab_size": ("uint32", c.vocab_size),
        "expert_count": ("uint32", c.num_experts if arch == "qwen2moe" else c.num_local_experts),
        "expert_used_count": ("uint32", c.num_experts_per_tok),
    }
    if getattr(c, "head_dim", None) is not None:  # the converter: when the config has a head_dim
        keys["attention.key_length"] = keys["attention.value_length"] = ("uint32", c.head_dim)
    if arch == "llama":
        keys["rope.dimension_count"] = ("uint32", c.head_dim)
    if arch in ("qwen3moe", "qwen2moe"):
        keys["expert_feed_forward_length"] = ("uint32", c.moe_intermediate_size)
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = ("uint32", c.shared_expert_intermediate_size)
    keys.update(extra_keys or {})
    w = gguf.GGUFWriter(str(path), arch)
    for k, (typ, v) in keys.items():
        if k not in drop_keys:
            getattr(w, f"add_{typ}")(f"{arch}.{k}", v)
    add_tokenizer(w, tiny_tokenizer_meta())

    hub = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = gguf.get_tensor_name_map(_ARCH[arch], c.num_hidden_layers)
    tensors, kinds, stacks = {}, {}, {}
    for name, a in hub.items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = a.astype(np.float32)
        base, suffix = name.rsplit(".", 1)
        if ".experts." in base:  # experts.{e}.w1 -> experts.w1, stacked over e (the converter's merge)
            head, rest = base.split(".experts.")
            e, proj = rest.split(".")
            stacks.setdefault(f"{head}.experts.{proj}", {})[int(e)] = a
            continue
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            a = _llamacpp_permute(a, c.num_attention_heads)
        if arch == "llama" and base.endswith("self_attn.k_proj"):
            a = _llamacpp_permute(a, c.num_key_value_heads)
        if base.endswith("mlp.shared_expert_gate") and squeeze_shared_gate:
            a = a.reshape(-1)
        g = names.get_name(base) + "." + suffix
        tensors[g], kinds[g] = a, _kind(name)
    for base, per_expert in stacks.items():
        g = names.get_name(base) + ".weight"
        tensors[g] = np.stack([per_expert[e] for e in range(len(per_expert))])
        kinds[g] = "experts"
    if tamper is not None:
        tamper(tensors)
    for g, a in tensors.items():
        if isinstance(a, tuple):  # (type, data) from tamper, written as given
            w.add_tensor(g, a[1], raw_dtype=a[0])
            continue
        qtype = types[kinds.get(g, "other")]
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(g, a.astype(np.float16) if qtype == Q.F16 else a)
        else:
            w.add_tensor(g, gguf.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def round_tripped(hf, types: dict):
    """A copy of ``hf`` with every parameter as a GGUF file of ``types`` holds it."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            qtype = types[_kind(name)]
            p.copy_(torch.from_numpy(round_trip(p.detach().numpy(), qtype).reshape(p.shape)))
    return ref


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``name -> (arch, hf model, its save_pretrained directory)``, built on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            arch, kind, over = CASES[name]
            hf = make_hf_model(kind, seed=list(CASES).index(name) + 1, **over)
            path = tmp_path_factory.mktemp(name)
            hf.save_pretrained(path)
            cache[name] = (arch, hf, str(path))
        return cache[name]

    return get


def _hf_gguf(path: str):
    """transformers' GGUF loader on ``path`` (float32)."""
    d, f = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def _prompt(seed=0):
    return random_prompt(PROMPT_LEN, VOCAB, seed)


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_bias", "qwen2_moe", "qwen2_moe_small", "olmoe"])
def test_config_from_metadata(models, name, tmp_path):
    arch, hf, hf_dir = models(name)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, _types(Q.F32, Q.F32))
    conf, c = load_config(path), hf.config
    assert conf.architecture == hf.config.architectures[0]
    width = c.intermediate_size if arch in ("llama", "olmoe") else c.moe_intermediate_size
    assert (conf.num_experts, conf.num_experts_per_tok, conf.moe_intermediate_size) == \
        (c.num_experts if arch == "qwen2moe" else c.num_local_experts, c.num_experts_per_tok, width)
    assert conf.shared_expert_intermediate_size == (c.shared_expert_intermediate_size if arch == "qwen2moe" else 0)
    # llama.cpp renormalises Mixtral's and Qwen3-MoE's top-k weights, not Qwen2-MoE's or OLMoE's
    assert conf.moe_renormalize == (arch in ("llama", "qwen3moe"))
    assert conf.dense_mlp_layers == [] and conf.sliding_window is None
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "tie_word_embeddings"):
        assert getattr(conf, k) == getattr(c, k), k
    assert conf.rope_theta == c.rope_parameters["rope_theta"] and conf.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert conf.qk_norm == (arch == "qwen3moe") and conf.qk_projection_norm == (arch == "olmoe")
    assert conf.qkv_bias == bool(c.qkv_bias if arch == "qwen2moe" else getattr(c, "attention_bias", False))
    assert conf.clip_qkv is None


# ------------------------------------------------------------------------------------------------
# logits and greedy tokens
# ------------------------------------------------------------------------------------------------
PARITY = [  # (case, expert type, type of the other matrices)
    ("mixtral", Q.F32, Q.F32), ("mixtral", Q.F16, Q.F32), ("mixtral", Q.Q8_0, Q.F16), ("mixtral", Q.Q4_0, Q.Q8_0),
    ("qwen3_moe", Q.F32, Q.F32), ("qwen3_moe", Q.BF16, Q.BF16), ("qwen3_moe", Q.Q8_0, Q.F16),
    ("qwen3_moe", Q.Q4_0, Q.Q8_0), ("qwen3_moe_bias", Q.F32, Q.F32), ("qwen3_moe_bias", Q.Q8_0, Q.Q8_0),
    ("qwen2_moe", Q.F32, Q.F32), ("qwen2_moe", Q.BF16, Q.BF16), ("qwen2_moe", Q.Q8_0, Q.F16),
    ("qwen2_moe", Q.Q4_0, Q.Q8_0), ("qwen2_moe_small", Q.F16, Q.F32), ("qwen2_moe_small", Q.Q4_0, Q.Q8_0),
    ("olmoe", Q.F32, Q.F32), ("olmoe", Q.F16, Q.F16), ("olmoe", Q.BF16, Q.F32), ("olmoe", Q.Q8_0, Q.F16),
    ("olmoe", Q.Q4_0, Q.Q8_0),
]


@pytest.mark.parametrize("name, experts, other", PARITY, ids=[f"{n}-{e.name}-{o.name}" for n, e, o in PARITY])
def test_logits_match_transformers(models, name, experts, other, tmp_path):
    arch, hf, hf_dir = models(name)
    types = _types(experts, other)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, types)
    model = load_model(path, dtype=torch.float32)
    assert isinstance(model, MoeForCausalLM)
    moe_name = next(n for n, _ in model.checkpoint_tensors() if ".experts.1." in n)
    assert GGUFWeightReader(path).gguf_type(moe_name) == experts.name  # a per-expert view of the stacked tensor
    ids = _prompt()
    out = prefill_logits(model, ids)
    ref = hf_logits(round_tripped(hf, types), ids)
    err = rel_err(out, ref)
    away = rel_err(out, hf_logits(hf, ids))  # from the unquantised model: what the round trip accounts for
    print(f"{name} {experts.name}/{other.name}: logits rel err vs transformers {err:.1e}, "
          f"vs the unquantised model {away:.1e}")
    assert err < REL_TOL
    if experts != Q.F32:
        assert away > 10 * REL_TOL
    if name in HF_GGUF_CASES:  # transformers' own GGUF loader reads the file alike
        theirs = hf_logits(_hf_gguf(path), ids)
        print(f"  vs transformers' GGUF loader: {rel_err(out, theirs):.1e}")
        assert rel_err(out, theirs) < REL_TOL


def _q4_k_experts(tensors: dict) -> None:
    """Experts as random Q4_K blocks (the gguf package dequantises the K-quants but cannot quantise
    to them): 144 bytes per 256 values of a row, the two f16 super-block scales small and positive."""
    rng = np.random.default_rng(0)
    for g, a in list(tensors.items()):
        if "_exps." in g:
            blocks = rng.integers(0, 256, size=(*a.shape[:-1], a.shape[-1] // 256, 144), dtype=np.uint8)
            blocks[..., 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)  # d
            blocks[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # dmin
            tensors[g] = (Q.Q4_K, blocks.reshape(*a.shape[:-1], -1))


def test_q4_k_experts_match_transformers_gguf_loader(models, tmp_path):
    """Q4_K experts (K-quant super-blocks of 256 values) against transformers loading the same file."""
    arch, hf, hf_dir = models("qwen3_moe_h256")
    path = write_moe_gguf(tmp_path / "k.gguf", hf, hf_dir, arch, _types(Q.F32, Q.F16), tamper=_q4_k_experts)
    model = load_model(path, dtype=torch.float32)
    assert GGUFWeightReader(path).gguf_type("model.layers.0.mlp.experts.3.down_proj.weight") == "Q4_K"
    ids = _prompt()
    out = prefill_logits(model, ids)
    err = rel_err(out, hf_logits(_hf_gguf(path), ids))
    print(f"Q4_K experts: logits rel err vs transformers' GGUF loader {err:.1e}")
    assert err < REL_TOL


GREEDY = [("mixtral", Q.Q8_0, Q.F16), ("qwen3_moe", Q.Q4_0, Q.Q8_0), ("qwen2_moe", Q.Q4_0, Q.Q8_0),
          ("olmoe", Q.Q8_0, Q.F16)]


@pytest.mark.parametrize("name, experts, other", GREEDY, ids=[f"{n}-{e.name}" for n, e, _ in GREEDY])
def test_greedy_generation_through_the_runner(models, name, experts, other, tmp_path):
    arch, hf, hf_dir = models(name)
    types = _types(experts, other)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, types)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=16)
    ids = _prompt(seed=1)
    got = list(llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
               .outputs[0].token_ids)
    assert got == hf_greedy(round_tripped(hf, types), ids, NEW_TOKENS)
    if name in HF_GGUF_CASES:
        assert got == hf_greedy(_hf_gguf(path), ids, NEW_TOKENS)


def test_fp8_on_load_as_from_safetensors(models, tmp_path):
    """``quantization="fp8"`` on a GGUF file with Q8_0 experts quantises the dequantised experts per
    channel exactly as it quantises the same float weights from safetensors (the round-tripped
    model saved by transformers): the same codes and scales, the same logits."""
    from fastinfer.quant import Fp8FusedMoEMethod

    arch, hf, hf_dir = models("mixtral")
    types = _types(experts=Q.Q8_0, other=Q.F32)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, types)
    round_tripped(hf, types).save_pretrained(tmp_path / "st")
    ours = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, quantization="fp8").model
    theirs = LLM(str(tmp_path / "st"), dtype="float32", device="cpu", num_kv_blocks=16, quantization="fp8").model
    a, b = ours.layers[1].moe, theirs.layers[1].moe
    assert type(a.method) is Fp8FusedMoEMethod and a.w13.dtype == torch.float8_e4m3fn
    assert torch.equal(a.w13.view(torch.uint8), b.w13.view(torch.uint8)) and torch.equal(a.w2_scale, b.w2_scale)
    ids = _prompt(seed=2)
    err = rel_err(prefill_logits(ours, ids), prefill_logits(theirs, ids))
    print(f"mixtral Q8_0 experts, fp8 on load: GGUF against safetensors rel err {err:.1e}")
    assert err < REL_TOL


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe_small", "olmoe"])
def test_tensor_parallel_two_ranks(models, name, tmp_path):
    """TP=2 (rank 0 here, one spawned worker): each rank reads its rows of every dequantised expert
    (and of Qwen2-MoE's shared expert; OLMoE's whole q and k projections)."""
    arch, hf, hf_dir = models(name)
    types = _types(experts=Q.Q4_0, other=Q.Q8_0)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, types)
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, block_size=16, tensor_parallel_size=2)
    try:
        moe = llm.model.layers[0].moe
        assert moe.w2.shape[2] == moe.intermediate_size // 2
        ids = _prompt(seed=4)
        got = list(llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
                   .outputs[0].token_ids)
        assert got == hf_greedy(round_tripped(hf, types), ids, NEW_TOKENS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe_small"])
def test_expert_parallel_two_ranks(models, name, tmp_path, monkeypatch):
    """EP=2 (rank 0 here, one spawned worker): each rank dequantises only its half of the experts
    (Qwen2-MoE: and holds the whole shared expert), and the logits are one process's bit for bit."""
    from fastinfer.engine.model_runner import Chunk, ForwardPlan

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")  # every rank's kernels as this process's
    arch, hf, hf_dir = models(name)
    types = _types(experts=Q.Q4_0, other=Q.Q8_0)
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, types)
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=16)
    one, llm = LLM(path, **kw), LLM(path, expert_parallel_size=2, **kw)
    try:
        moe = llm.model.layers[0].moe
        assert moe.w13.shape[0] == moe.num_experts // 2 and moe.w2.shape[2] == moe.intermediate_size
        ids = _prompt(seed=4)
        ref, got = (e.executor.runner.forward(ForwardPlan(chunks=[Chunk(-1, ids, 0, "all")], tables={-1: [0, 1, 2]},
                                                          finished=[-1]))[0] for e in (one, llm))
        assert torch.equal(got, ref)
        assert rel_err(got, hf_logits(round_tripped(hf, types), ids)) < REL_TOL
    finally:
        llm.shutdown()


def test_bf16_model_from_quantised_experts(models, tmp_path):
    """The experts are dequantised at load, then held in the model dtype."""
    arch, hf, hf_dir = models("mixtral")
    path = write_moe_gguf(tmp_path / "m.gguf", hf, hf_dir, arch, _types(Q.Q4_0, Q.F16))
    fp32, bf16 = load_model(path, dtype=torch.float32), load_model(path, dtype=torch.bfloat16)
    a, b = fp32.layers[1].moe, bf16.layers[1].moe
    assert b.w13.dtype == b.w2.dtype == torch.bfloat16
    assert torch.equal(b.w13, a.w13.to(torch.bfloat16)) and torch.equal(b.w2, a.w2.to(torch.bfloat16))
    ids = _prompt()
    assert rel_err(prefill_logits(bf16, ids), prefill_logits(fp32, ids)) < 0.05


def test_swapped_gate_and_up_experts_are_visible(models, tmp_path):
    """The test can fail: the gate and up experts written the wrong way round put the logits far away."""
    arch, hf, hf_dir = models("qwen3_moe")

    def swap(tensors):
        for g in [g for g in tensors if g.endswith("ffn_gate_exps.weight")]:
            up = g.replace("gate_exps", "up_exps")
            tensors[g], tensors[up] = tensors[up], tensors[g]

    path = write_moe_gguf(tmp_path / "s.gguf", hf, hf_dir, arch, _types(Q.F32, Q.F32), tamper=swap)
    ids = _prompt()
    err = rel_err(prefill_logits(load_model(path, dtype=torch.float32), ids), hf_logits(hf, ids))
    assert err > 1000 * REL_TOL, err


def test_qwen2moe_without_the_width_keys(models, tmp_path):
    """A qwen2moe file as converted before the expert width keys (and key_length) existed: llama.cpp
    takes the experts as feed_forward_length / expert_used_count wide and the shared expert as
    feed_forward_length (Qwen1.5-MoE's 5632 / 4 = 1408 and 5632), head_dim as hidden / heads."""
    arch, hf, hf_dir = models("qwen2_moe")
    types = _types(Q.Q8_0, Q.F16)
    path = write_moe_gguf(tmp_path / "old.gguf", hf, hf_dir, arch, types,
                          drop_keys=["expert_feed_forward_length", "expert_shared_feed_forward_length",
                                     "attention.key_length", "attention.value_length"])
    conf = load_config(path)
    assert (conf.moe_intermediate_size, conf.shared_expert_intermediate_size, conf.head_dim) == (1408, 5632, 64)
    ids = _prompt()
    out = prefill_logits(load_model(path, dtype=torch.float32), ids)
    err, theirs = rel_err(out, hf_logits(round_tripped(hf, types), ids)), rel_err(out, hf_logits(_hf_gguf(path), ids))
    print(f"qwen2moe without width keys: logits rel err vs transformers {err:.1e}, vs its GGUF loader {theirs:.1e}")
    assert err < REL_TOL and theirs < REL_TOL


def test_qwen2moe_shared_gate_as_a_row(models, tmp_path):
    """``ffn_gate_inp_shexp`` written ``[1, H]`` (the converter since it stopped squeezing) reads as
    the ``[H]`` one does."""
    arch, hf, hf_dir = models("qwen2_moe_small")
    types = _types(Q.F32, Q.F32)
    row, flat = (write_moe_gguf(tmp_path / f"{n}.gguf", hf, hf_dir, arch, types, squeeze_shared_gate=n == "flat")
                 for n in ("row", "flat"))
    assert GGUFFile(row).shape("blk.0.ffn_gate_inp_shexp.weight") == (1, 128)
    assert GGUFFile(flat).shape("blk.0.ffn_gate_inp_shexp.weight") == (128,)
    ids = _prompt()
    out = prefill_logits(load_model(row, dtype=torch.float32), ids)
    assert rel_err(out, hf_logits(hf, ids)) < REL_TOL
    assert torch.equal(out, prefill_logits(load_model(flat, dtype=torch.float32), ids))


def _swap(a: str, b: str):
    """Swap GGUF tensors ``blk.*.{a}.weight`` and ``blk.*.{b}.weight``."""
    def tamper(tensors):
        for g in [g for g in tensors if g.endswith(f".{a}.weight")]:
            h = g.replace(a, b)
            tensors[g], tensors[h] = tensors[h], tensors[g]
    return tamper


def _negate(kind: str):
    def tamper(tensors):
        for g in [g for g in tensors if g.endswith(f".{kind}.weight")]:
            tensors[g] = -tensors[g]
    return tamper


@pytest.mark.parametrize("name, tamper, what", [
    ("qwen2_moe_small", _swap("ffn_gate_shexp", "ffn_up_shexp"), "shared expert gate / up swapped"),
    ("qwen2_moe_small", _negate("ffn_gate_inp_shexp"), "shared expert gate negated"),
    ("olmoe", _swap("attn_q_norm", "attn_k_norm"), "q / k norms swapped"),
], ids=["qwen2moe-shexp-swapped", "qwen2moe-shexp-gate-negated", "olmoe-qk-norms-swapped"])
def test_tampered_files_are_visible(models, name, tamper, what, tmp_path):
    """The tests can fail: a file whose shared expert or q/k norms are wrong puts the logits far
    from transformers'."""
    arch, hf, hf_dir = models(name)
    path = write_moe_gguf(tmp_path / "t.gguf", hf, hf_dir, arch, _types(Q.F32, Q.F32), tamper=tamper)
    ids = _prompt()
    err = rel_err(prefill_logits(load_model(path, dtype=torch.float32), ids), hf_logits(hf, ids))
    print(f"{what}: logits rel err {err:.1e}")
    assert err > 1000 * REL_TOL, err


# ------------------------------------------------------------------------------------------------
# bad files
# ------------------------------------------------------------------------------------------------
def _drop_expert(g):
    def tamper(tensors):
        tensors[g] = tensors[g][:-1]
    return tamper


def _remove(g):
    def tamper(tensors):
        del tensors[g]
    return tamper


def _reshape(g, shape):
    def tamper(tensors):
        tensors[g] = np.resize(tensors[g], shape)
    return tamper


def _keep_dense_layers(tensors):
    """No expert tensors: a dense MLP in their place."""
    for g in [g for g in tensors if "_exps." in g or "ffn_gate_inp" in g]:
        a = tensors.pop(g)
        if "_exps." in g:
            tensors[g.replace("_exps", "")] = a[0]


BAD = [
    # (case, writer arguments, what load_model says)
    ("qwen3_moe", dict(drop_keys=["expert_count"]), "GGUF metadata qwen3moe.expert_count is missing"),
    ("qwen3_moe", dict(drop_keys=["expert_used_count"]), "GGUF metadata qwen3moe.expert_used_count is missing"),
    ("qwen3_moe", dict(drop_keys=["expert_feed_forward_length"]),
     "GGUF metadata qwen3moe.expert_feed_forward_length is missing"),
    ("mixtral", dict(drop_keys=["expert_count"]),
     r"llama.expert_count is missing or 0, yet the file has experts \(tensor 'blk.0.ffn_gate_inp.weight'\)"),
    ("mixtral", dict(drop_keys=["expert_count"], tamper=_keep_dense_layers),
     r"llama.expert_count is missing or 0, yet the file has experts \(llama.expert_used_count = 2\)"),
    ("mixtral", dict(extra_keys={"expert_used_count": ("uint32", 5)}),
     r"llama.expert_used_count \(5\) is larger than llama.expert_count \(4\)"),
    ("qwen3_moe", dict(extra_keys={"expert_count": ("uint32", 0)}), "qwen3moe.expert_count must be an int >= 1"),
    ("qwen3_moe", dict(extra_keys={"expert_gating_func": ("uint32", 2)}),
     "qwen3moe.expert_gating_func = 2 is not supported"),
    ("qwen3_moe", dict(extra_keys={"expert_weights_scale": ("float32", 2.5)}),
     "qwen3moe.expert_weights_scale is not supported"),
    ("mixtral", dict(extra_keys={"expert_feed_forward_length": ("uint32", 64)}),
     "llama.expert_feed_forward_length is not supported"),
    ("qwen3_moe", dict(tamper=_drop_expert("blk.1.ffn_up_exps.weight")),
     r"tensor 'blk.1.ffn_up_exps.weight' has shape \[7, 768, 128\], expected \[8, 768, 128\]"),
    ("qwen3_moe", dict(extra_keys={"expert_feed_forward_length": ("uint32", 512)}),
     r"tensor 'blk.0.ffn_gate_exps.weight' has shape \[8, 768, 128\], expected \[8, 512, 128\]"),
    ("mixtral", dict(extra_keys={"expert_count": ("uint32", 5)}),
     r"tensor 'blk.0.ffn_gate_inp.weight' has shape \[4, 128\], expected \[5, 128\]"),
    ("mixtral", dict(tamper=_remove("blk.1.ffn_down_exps.weight")),
     "tensor 'blk.1.ffn_down_exps.weight' is missing"),
    ("qwen2_moe_small", dict(tamper=_remove("blk.1.ffn_down_shexp.weight")),
     r"tensor 'blk.1.ffn_down_shexp.weight' is missing \(layer 1 has a shared expert\)"),
    ("qwen2_moe_small", dict(extra_keys={"expert_shared_feed_forward_length": ("uint32", 128)}),
     r"tensor 'blk.0.ffn_gate_shexp.weight' has shape \[96, 128\], expected \[128, 128\] \(hidden 128, "
     r"qwen2moe.expert_shared_feed_forward_length 128\)"),
    ("qwen2_moe_small", dict(tamper=_reshape("blk.1.ffn_gate_inp_shexp.weight", (2, 128))),
     r"tensor 'blk.1.ffn_gate_inp_shexp.weight' has shape \[2, 128\], expected \[128\] or \[1, 128\]"),
    # without the key, llama.cpp's default width 256 / 2 = 128 is not the experts' 64
    ("qwen2_moe_small", dict(drop_keys=["expert_feed_forward_length"]),
     r"tensor 'blk.0.ffn_gate_exps.weight' has shape \[4, 64, 128\], expected \[4, 128, 128\]"),
    ("qwen2_moe_small", dict(extra_keys={"expert_weights_norm": ("bool", True)}),
     "qwen2moe.expert_weights_norm is not supported"),
    ("qwen2_moe_small", dict(extra_keys={"expert_shared_count": ("uint32", 2)}),
     "qwen2moe.expert_shared_count is not supported"),
    ("olmoe", dict(extra_keys={"attention.clamp_kqv": ("float32", 8.0)}),
     "olmoe.attention.clamp_kqv is not supported"),
    ("olmoe", dict(extra_keys={"expert_feed_forward_length": ("uint32", 64)}),
     "olmoe.expert_feed_forward_length is not supported"),
    ("olmoe", dict(drop_keys=["expert_used_count"]), "GGUF metadata olmoe.expert_used_count is missing"),
    ("olmoe", dict(tamper=_drop_expert("blk.0.ffn_down_exps.weight")),
     r"tensor 'blk.0.ffn_down_exps.weight' has shape \[7, 128, 64\], expected \[8, 128, 64\]"),
]


@pytest.mark.parametrize("name, kwargs, what", BAD, ids=[f"{c}-{w[:40]}" for c, _, w in BAD])
def test_bad_files_are_refused(models, name, kwargs, what, tmp_path):
    arch, hf, hf_dir = models(name)
    path = write_moe_gguf(tmp_path / "bad.gguf", hf, hf_dir, arch, _types(Q.F32, Q.F32), **kwargs)
    with pytest.raises(ValueError, match=what):
        load_model(path)


def test_other_moe_architectures_are_refused(tmp_path):
    """An architecture with experts this module does not map: refused by name."""
    for arch, what in [("deepseek2", "unsupported GGUF architecture 'deepseek2'"),
                       ("qwen3", "mixture-of-experts qwen3 GGUF")]:
        w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
        for k, v in (("context_length", 64), ("embedding_length", 64), ("block_count", 1), ("feed_forward_length", 64),
                     ("attention.head_count", 1), ("expert_count", 4), ("expert_used_count", 2)):
            w.add_uint32(f"{arch}.{k}", v)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_tensor("token_embd.weight", np.ones((8, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ValueError, match=what):
            load_config(str(tmp_path / f"{arch}.gguf"))
