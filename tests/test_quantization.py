"""Runner-side quantisation (fastinfer.quant): ``fastinfer quantize``, the quantised runner, AutoAWQ /
AutoGPTQ loading, held-out perplexity of the shipped model, bad input. CPU, float32 unless stated.

Error bounds. Each quantised model is checked EXACTLY against a float reference built by the test
from the stored codes: for int4 a float model whose weights are the dequantised ones (W4A16 does not
touch activations; ``(q - z) * s`` is exact in fp32); for fp8 the same with every linear's input
fake-quantised per token by the fp64 oracle ``reference.fp8_quantize``; for int8 by
``reference.int8_quantize`` (after SmoothQuant's explicit o_proj scale; a code at a rounding tie
takes the runner's rounding, counted). Only fp32 summation order (and, for fp8, a rare activation
code flipping at a rounding tie as a consequence) differs: rel-norm <= 1e-5 (measured: ~3e-7 fp8
and int8, 0 int4 on CPU). SmoothQuant int8 (``--smoothquant``) is calibrated on a text file.
Against the ORIGINAL float model the error is the quantisation error as the network propagates it;
that check only says "quantised, but not broken": above 1e-4, and below 4 x the stored weights'
relative error (measured in the test from the checkpoint) plus, for fp8, 2^-4 (e4m3's relative
rounding bound) for the activations. The random test network amplifies a weight error by 2-3x
(measured with the dequantised float models, which involve no fastinfer quantisation code).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import fastinfer  # noqa: F401  (loads the ops)
from fastinfer import reference as ref
from fastinfer.engine.checkpoints import load_checkpoint
from fastinfer.engine.llm import LLM
from fastinfer.engine.params import SamplingParams
from fastinfer.entrypoints.cli import main as cli_main
from fastinfer.layers import UnquantizedLinearMethod
from fastinfer.quant import Fp8LinearMethod, Int4LinearMethod, Int8LinearMethod, unpack_nibbles
from model_helpers import make_forward_batch, prefill_logits, unfused_norm_quant

ASSETS = os.path.join(os.path.dirname(fastinfer.__file__), "assets", "tiny-llama")
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
PROMPT = [5, 17, 42, 99, 123, 7, 8, 250, 1000, 3, 77, 2048, 4000, 12, 13, 14, 15]
NUM_LAYERS = 2
GROUP = 32


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def logits_of(path_or_llm, **kw) -> torch.Tensor:
    """Prefill logits of ``PROMPT``; a path loads in float32 unless ``kw`` says otherwise."""
    llm = path_or_llm if isinstance(path_or_llm, LLM) else LLM(path_or_llm, num_kv_blocks=8,
                                                               **{"dtype": "float32", **kw})
    return prefill_logits(llm.model, PROMPT)


def _safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _save(path: str, tensors: dict, config: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """A random tiny Llama (hidden 64, MLP 128, q 128 / kv 64) written by transformers, with the
    shipped tokenizer and generation config."""
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path_factory.mktemp("float"))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=4096, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the default init: layers matter for the logits
        for name, p in model.named_parameters():
            if "proj" in name:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(os.path.join(ASSETS, f), os.path.join(path, f))
    return path


@pytest.fixture(scope="module")
def float_logits(float_ckpt):
    return logits_of(float_ckpt)


VARIANTS = {
    "fp8": (["--method", "fp8"], "fp8", None),
    "int4": (["--method", "int4", "--group-size", str(GROUP)], "int4", {"group_size": GROUP}),
    "int4-sym": (["--method", "int4", "--group-size", "64", "--symmetric"], "int4",
                 {"group_size": 64, "symmetric": True}),
    "int8": (["--method", "int8"], "int8", None),
    # SmoothQuant, calibrated on the prompt's text (a file of its own tokens decoded)
    "int8-sq": (["--method", "int8", "--smoothquant", "0.5", "--calibration", "{calib}"], "int8", None),
}
METHOD_CLS = {"fp8": Fp8LinearMethod, "int4": Int4LinearMethod, "int8": Int8LinearMethod}


@pytest.fixture(scope="module")
def calib_file(float_ckpt, tmp_path_factory):
    from fastinfer.engine.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    ids = torch.randint(3, 4096, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    path.write_text(Tokenizer(float_ckpt).decode(ids), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def quant_ckpts(float_ckpt, calib_file, tmp_path_factory):
    out = {}
    for name, (args, _, _) in VARIANTS.items():
        path = str(tmp_path_factory.mktemp(name))
        args = [a.format(calib=calib_file) for a in args]
        assert cli_main(["quantize", "--quiet", *args, float_ckpt, path]) == 0
        out[name] = path
    return out


class _FakeQuantFp8(torch.nn.Module):
    """A float linear whose input is quantised per token by the fp64 oracle and dequantised."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        q, s = ref.fp8_quantize(x.reshape(-1, x.shape[-1]), "token")
        xd = (q.double() * s.double()[:, None]).to(x.dtype)
        return torch.nn.functional.linear(xd, self.lin.weight, self.lin.bias).reshape(*x.shape[:-1], -1)


class _FakeQuantInt8(torch.nn.Module):
    """A float linear whose input is divided by the SmoothQuant ``smooth`` factors (if any), then
    quantised per token by the fp64 oracle ``reference.int8_quantize`` and dequantised. A code at a
    rounding tie (x / scale within 1% of a step of .5) that the runner, on its own input
    ``runner_x``, rounded the other way takes the runner's code (counted in ``stats``): such an
    input is a tie within float32 noise, and one flipped code moves this tiny model's logits by
    ~1e-3."""

    def __init__(self, lin, smooth, runner_x, stats):
        super().__init__()
        self.lin, self.smooth, self.runner_x, self.stats = lin, smooth, runner_x, stats

    def _smoothed(self, x2):
        return x2 if self.smooth is None else x2 * (1.0 / self.smooth.double()).to(x2.dtype)

    def forward(self, x):
        x2 = self._smoothed(x.reshape(-1, x.shape[-1]))
        q, s = ref.int8_quantize(x2, "token")
        q_run = ref.int8_quantize(self._smoothed(self.runner_x), "token")[0]
        v = x2.double() / s.double()[:, None]
        tie = (q != q_run) & ((q.int() - q_run.int()).abs() == 1) & (((v - v.floor()) - 0.5).abs() < 0.01)
        self.stats["snapped"] = self.stats.get("snapped", 0) + int(tie.sum())
        self.stats["codes"] = self.stats.get("codes", 0) + q.numel()
        xd = ref.int8_dequantize(torch.where(tie, q_run, q), s).to(x.dtype)
        return torch.nn.functional.linear(xd, self.lin.weight, self.lin.bias).reshape(*x.shape[:-1], -1)


def _linear_inputs(llm) -> dict:
    """The logits of ``llm`` (computed, discarded) and every decoder linear's input by (layer, slot)."""
    seen, hooks = {}, []
    for i, layer in enumerate(llm.model.layers):
        for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            hooks.append(getattr(layer, slot).register_forward_pre_hook(
                lambda mod, args, k=(i, slot): seen.__setitem__(k, args[0].detach().reshape(-1, args[0].shape[-1]))))
    try:
        with unfused_norm_quant(llm.model):
            logits_of(llm)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _part(layer, i: int = 0):
    return layer.method.part(layer, i)


def _dequantised_ckpt(float_ckpt: str, quant_ckpt: str, dst: str) -> str:
    """A float checkpoint whose linears are the dequantised weights of ``quant_ckpt``."""
    with open(os.path.join(quant_ckpt, "config.json")) as f:
        cfg = json.load(f)
    qc = cfg.pop("quantization_config")
    t = _safetensors(quant_ckpt)
    # the non-linear tensors as stored (SmoothQuant rewrites the norms), the linears dequantised
    out = {k: t.get(k, v) for k, v in _safetensors(float_ckpt).items()}
    for i in range(NUM_LAYERS):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            k = out[p + ".weight"].shape[1]
            if qc["method"] == "fp8":
                w = ref.fp8_dequantize(t[p + ".weight"], t[p + ".weight_scale"])
            elif qc["method"] == "int8":
                w = ref.int8_dequantize(t[p + ".weight"], t[p + ".weight_scale"])
            else:
                q = unpack_nibbles(t[p + ".weight_packed"])
                w = ref.int4_dequantize(q, t[p + ".weight_scale"], t.get(p + ".weight_zero_point"), qc["group_size"])
            out[p + ".weight"] = w[:, :k].float()
    _save(dst, out, cfg)
    return dst


# ------------------------------------------------------------------------------------------------
# fastinfer's own format
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantize_cli_format_matches_doc(float_ckpt, quant_ckpts, variant):
    path = quant_ckpts[variant]
    _, method, qopts = VARIANTS[variant]
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(path, f)), f
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "fastinfer" and qc["format_version"] == 1 and qc["method"] == method
    assert qc["modules_not_quantized"] == ["lm_head"]
    src = _safetensors(float_ckpt)
    t = _safetensors(path)
    expected = set(src)
    for i in range(NUM_LAYERS):
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            n, k = src[p + ".weight"].shape
            if method == "fp8":
                assert t[p + ".weight"].dtype == torch.float8_e4m3fn and t[p + ".weight"].shape == (n, k)
                assert t[p + ".weight_scale"].dtype == torch.float32 and t[p + ".weight_scale"].shape == (n,)
                expected |= {p + ".weight_scale"}
                # per output channel: the largest code of every row is +-448
                assert torch.all(t[p + ".weight"].float().abs().amax(1) == 448.0)
            elif method == "int8":
                assert t[p + ".weight"].dtype == torch.int8 and t[p + ".weight"].shape == (n, k)
                assert t[p + ".weight_scale"].dtype == torch.float32 and t[p + ".weight_scale"].shape == (n,)
                expected |= {p + ".weight_scale"}
                assert torch.all(t[p + ".weight"].int().abs().amax(1) == 127)  # symmetric, per output channel
                if qc["smoothquant"] is None:  # the doc's formula on the source weight
                    q, sc = ref.int8_quantize(src[p + ".weight"], "token")
                    assert torch.equal(t[p + ".weight"], q) and torch.equal(t[p + ".weight_scale"], sc)
                elif lin == "self_attn.o_proj":
                    expected |= {p + ".smooth_scale"}
                    assert t[p + ".smooth_scale"].shape == (k,) and bool((t[p + ".smooth_scale"] != 1).any())
            else:
                g, sym = qc["group_size"], qc["symmetric"]
                assert (g, sym) == (qopts["group_size"], qopts.get("symmetric", False))
                expected -= {p + ".weight"}
                expected |= {p + ".weight_packed", p + ".weight_scale"}
                assert t[p + ".weight_packed"].dtype == torch.uint8 and t[p + ".weight_packed"].shape == (n, k // 2)
                assert t[p + ".weight_scale"].dtype == src[p + ".weight"].dtype
                assert t[p + ".weight_scale"].shape == (k // g, n)
                if sym:
                    assert p + ".weight_zero_point" not in t
                    assert int(unpack_nibbles(t[p + ".weight_packed"]).min()) >= 1  # q - 8 in -7..7
                else:
                    expected |= {p + ".weight_zero_point"}
                    z = t[p + ".weight_zero_point"]
                    assert z.dtype == torch.uint8 and z.shape == (k // g, n) and int(z.max()) <= 15
                # the stored codes and scales reproduce the RTN quantiser (the doc's formulas)
                q, s, z = ref.quantize_int4(src[p + ".weight"], g, sym)
                assert torch.equal(unpack_nibbles(t[p + ".weight_packed"]), q)
                assert torch.equal(t[p + ".weight_scale"], s)
    assert set(t) == expected
    smoothed = method == "int8" and qc["smoothquant"] is not None
    for name in src:  # non-linear tensors unchanged (SmoothQuant: all but the decoder norms)
        if not any(name.endswith(lin + ".weight") for lin in LINEARS):
            if smoothed and name.endswith("layernorm.weight"):
                assert t[name].dtype == torch.float32 and not torch.equal(t[name], src[name].float()), name
            else:
                assert torch.equal(t[name], src[name]), name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantized_model_close_to_float_and_generates(float_ckpt, float_logits, quant_ckpts, variant, tmp_path):
    _, method, _ = VARIANTS[variant]
    llm = LLM(quant_ckpts[variant], num_kv_blocks=16, dtype="float32")
    cls = METHOD_CLS[method]
    for layer in llm.model.layers:
        for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert isinstance(getattr(layer, slot).method, cls), slot
    assert type(llm.model.lm_head.method) is UnquantizedLinearMethod  # lm_head stays unquantised
    out = logits_of(llm)
    assert torch.isfinite(out).all()
    # exact: a float model with the dequantised weights (fp8: and fake-quantised activations)
    deq_path = _dequantised_ckpt(float_ckpt, quant_ckpts[variant], str(tmp_path / "deq"))
    deq = LLM(deq_path, num_kv_blocks=8, dtype="float32")
    if method == "fp8":
        for layer in deq.model.layers:
            for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                setattr(layer, slot, _FakeQuantFp8(getattr(layer, slot)))
    stats: dict = {}
    if method == "int8":
        t, inputs = _safetensors(quant_ckpts[variant]), _linear_inputs(llm)
        for i, layer in enumerate(deq.model.layers):
            for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                smooth = t.get(f"model.layers.{i}.self_attn.o_proj.smooth_scale") if slot == "o_proj" else None
                setattr(layer, slot, _FakeQuantInt8(getattr(layer, slot), smooth, inputs[(i, slot)], stats))
    err_deq = rel_norm(out, logits_of(deq))
    print(f"{variant}: rel err vs the dequantised model {err_deq:.2e}; {stats.get('snapped', 0)} of "
          f"{stats.get('codes', 0)} reference codes at a tie rounded as the runner did")
    assert err_deq < 1e-5 and stats.get("snapped", 0) <= 1e-3 * max(1, stats.get("codes", 0)), err_deq
    # against the original float model: quantised, but not broken
    src, dq = _safetensors(float_ckpt), _safetensors(deq_path)
    names = [k for k in src if ".layers." in k and k.endswith("proj.weight")]
    w_err = (sum(float((dq[k].double() - src[k].double()).norm() ** 2) for k in names)
             / sum(float(src[k].double().norm() ** 2) for k in names)) ** 0.5
    err = rel_norm(out, float_logits)
    if variant != "int8-sq":  # (smoothed weights are not the source's: w_err would mean nothing)
        act = {"fp8": 2.0 ** -4, "int8": 2.0 ** -7}.get(method, 0.0)  # the activation codes' rounding
        assert 1e-4 < err < 4 * w_err + act, (err, w_err)
    else:
        assert 1e-4 < err < 0.1, err
    res = llm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert res.error is None and len(res.outputs[0].token_ids) == 6
    assert res.outputs[0].text is not None


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "int8-sq"])  # (no smoothing on load)
def test_on_the_fly_equals_prequantized(float_ckpt, quant_ckpts, variant):
    _, method, qopts = VARIANTS[variant]
    a = logits_of(float_ckpt, quantization=method, quantization_config=qopts)
    b = logits_of(quant_ckpts[variant])
    assert torch.equal(a, b)
    # "as stored": asking for the stored method is allowed and changes nothing
    assert torch.equal(logits_of(quant_ckpts[variant], quantization=method), b)


def test_bf16_runner_and_sharded_output(float_ckpt, tmp_path):
    from fastinfer.quant import QuantOptions, quantize_checkpoint

    out = str(tmp_path / "sharded")
    res = quantize_checkpoint(float_ckpt, out, QuantOptions("int4", group_size=GROUP), max_shard_bytes=200_000)
    assert len(res["weights"]) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    a = LLM(out, num_kv_blocks=8, dtype="bfloat16")
    b = LLM(float_ckpt, num_kv_blocks=8, dtype="bfloat16", quantization="int4", quantization_config={"group_size": GROUP})
    la, lb = prefill_logits(a.model, PROMPT), prefill_logits(b.model, PROMPT)
    assert torch.equal(la, lb)
    assert rel_norm(la, logits_of(float_ckpt)) < 0.2


def test_pad_groups(float_ckpt, tmp_path):
    """G = 128 does not divide K = 64: zero-padded groups by default (an error with --no-pad-groups)."""
    out = str(tmp_path / "padded")
    assert cli_main(["quantize", "--quiet", "--method", "int4", "--group-size", "128", float_ckpt, out]) == 0
    t = _safetensors(out)
    assert t["model.layers.0.self_attn.q_proj.weight_packed"].shape == (128, 64)  # Kq = 128
    q = unpack_nibbles(t["model.layers.0.self_attn.q_proj.weight_packed"])
    z = t["model.layers.0.self_attn.q_proj.weight_zero_point"]
    assert torch.equal(q[:, 64:], z[0].unsqueeze(1).expand(-1, 64))  # padding codes = zero point
    llm = LLM(out, num_kv_blocks=8, dtype="float32")
    assert llm.model.layers[0].qkv_proj.kq == 128
    err = rel_norm(logits_of(llm), logits_of(_dequantised_ckpt(float_ckpt, out, str(tmp_path / "deq"))))
    assert err < 1e-5, err
    assert torch.equal(logits_of(llm), logits_of(float_ckpt, quantization="int4",
                                                 quantization_config={"group_size": 128, "pad_groups": True}))


# ------------------------------------------------------------------------------------------------
# AutoAWQ / AutoGPTQ
# ------------------------------------------------------------------------------------------------


def _act_order(k: int, group: int, gen: torch.Generator) -> torch.Tensor:
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).to(torch.int32)
    return g_idx


def _int4_checkpoint(float_ckpt: str, dst: str, fmt: str, act_order: bool, float_modules=()):
    """(AWQ or GPTQ checkpoint, float checkpoint of its dequantised weights) built from ``float_ckpt``.

    Act-order: q, k, v (and down) get different random g_idx, gate and up share one (so the runner
    can fuse those two). GPTQ checkpoints also carry the all-zero biases AutoGPTQ writes.
    ``float_modules``: projections left in float (AWQ ``modules_to_not_convert``).
    """
    src = _safetensors(float_ckpt)
    with open(os.path.join(float_ckpt, "config.json")) as f:
        cfg = json.load(f)
    gen = torch.Generator().manual_seed(3)
    qt, deq = {}, {}
    for name, t in src.items():
        qt[name] = t
        deq[name] = t
    for i in range(NUM_LAYERS):
        shared = None
        for lin in LINEARS:
            p = f"model.layers.{i}.{lin}"
            w = src[p + ".weight"]
            n, k = w.shape
            if p in float_modules:
                continue
            del qt[p + ".weight"]
            g_idx = None
            if act_order and lin != "self_attn.o_proj":
                if lin in ("mlp.gate_proj", "mlp.up_proj"):
                    shared = shared if shared is not None else _act_order(k, GROUP, gen)
                    g_idx = shared.clone()
                else:
                    g_idx = _act_order(k, GROUP, gen)
            order = torch.argsort(g_idx.long(), stable=True) if g_idx is not None else torch.arange(k)
            q_sorted, s, z = ref.quantize_int4(w[:, order], GROUP, symmetric=False)
            q = torch.empty_like(q_sorted)
            q[:, order] = q_sorted
            s = s.to(torch.float16)  # AutoAWQ / AutoGPTQ store fp16 scales
            groups = g_idx.long() if g_idx is not None else torch.arange(k) // GROUP
            deq[p + ".weight"] = ((q.double() - z.double()[groups].t()) * s.double()[groups].t()).float()
            if fmt == "awq":
                qt[p + ".qweight"], qt[p + ".qzeros"] = ref.awq_pack(q, z)
            else:
                qt[p + ".qweight"], qt[p + ".qzeros"] = ref.gptq_pack(q, z)
                qt[p + ".g_idx"] = g_idx if g_idx is not None else (torch.arange(k) // GROUP).to(torch.int32)
                qt[p + ".bias"] = torch.zeros(n, dtype=torch.float16)
            qt[p + ".scales"] = s
    qcfg = dict(cfg)
    if fmt == "awq":
        qcfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                                       "version": "gemm", "modules_to_not_convert": list(float_modules) or None}
    else:
        qcfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                       "desc_act": act_order, "sym": False, "checkpoint_format": "gptq"}
    _save(dst + "-q", qt, qcfg)
    _save(dst + "-deq", deq, cfg)
    return dst + "-q", dst + "-deq"


@pytest.mark.parametrize("fmt,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_awq_gptq_checkpoints_equal_dequantised_float(float_ckpt, tmp_path, fmt, act_order):
    float_modules = ("model.layers.1.self_attn.o_proj",) if fmt == "awq" else ()
    qpath, deqpath = _int4_checkpoint(float_ckpt, str(tmp_path / fmt), fmt, act_order, float_modules)
    llm = LLM(qpath, num_kv_blocks=8, dtype="float32")
    if float_modules:  # a module the checkpoint leaves in float loads as a float linear
        assert type(llm.model.layers[1].o_proj.method) is UnquantizedLinearMethod
    layer = llm.model.layers[0]
    for slot in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert isinstance(getattr(layer, slot).method, Int4LinearMethod)
    if act_order:  # q/k/v have different permutations: three GEMMs; gate/up share one: fused
        assert layer.qkv_proj.num_parts == 3 and _part(layer.qkv_proj).perm is not None
        assert layer.gate_up_proj.num_parts == 1 and _part(layer.gate_up_proj).perm is not None
        assert _part(layer.o_proj).perm is None  # trivial g_idx: no permutation
    else:
        assert layer.qkv_proj.num_parts == 1 and _part(layer.qkv_proj).perm is None
    out = logits_of(llm)
    expect = logits_of(deqpath)
    err = rel_norm(out, expect)
    assert err < 1e-5, err
    assert rel_norm(expect, logits_of(float_ckpt)) > 1e-3  # the checkpoint really is quantised
    # quantization="int4" on an int4 checkpoint: as stored
    assert torch.equal(logits_of(qpath, quantization="int4"), out)
    res = llm.generate(PROMPT[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(res.outputs[0].token_ids) == 4


def test_gptq_nonzero_bias_without_model_bias_is_an_error(float_ckpt, tmp_path):
    qpath, _ = _int4_checkpoint(float_ckpt, str(tmp_path / "g"), "gptq", False)
    t = _safetensors(qpath)
    t["model.layers.1.mlp.up_proj.bias"] = torch.full_like(t["model.layers.1.mlp.up_proj.bias"], 0.5)
    with open(os.path.join(qpath, "config.json")) as f:
        cfg = json.load(f)
    _save(qpath, t, cfg)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.bias.*non-zero bias"):
        LLM(qpath, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# held-out perplexity of the shipped model
# ------------------------------------------------------------------------------------------------

PPL_TOKENS = 4096  # 16 windows of 256 predictions
INT8_PPL_TARGET = 1.01


@pytest.fixture(scope="module")
def heldout_stream():
    from fastinfer.engine.tokenizer import Tokenizer
    from fastinfer.entrypoints.eval import heldout_files, token_stream

    try:
        files = heldout_files()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return token_stream(Tokenizer(ASSETS), files)


def _ppl(stream, path=ASSETS, **kw) -> float:
    from fastinfer.entrypoints.eval import perplexity

    llm = LLM(path, num_kv_blocks=1, dtype="bfloat16", **kw)
    ppl, n = perplexity(llm.model, stream, max_tokens=PPL_TOKENS)
    assert n == PPL_TOKENS
    return ppl


@pytest.fixture(scope="module")
def bf16_ppl(heldout_stream):
    return _ppl(heldout_stream)


@pytest.mark.parametrize("quant,qcfg,target", [
    ("fp8", None, 1.01),
    ("int4", {"group_size": 128, "pad_groups": True}, 1.05),  # the MLP width 704 is not a multiple of 128
    ("int4", {"group_size": 128, "pad_groups": True, "symmetric": True}, 1.05),
    ("int8", None, INT8_PPL_TARGET),
])
def test_heldout_perplexity_within_target(heldout_stream, bf16_ppl, quant, qcfg, target):
    ppl = _ppl(heldout_stream, quantization=quant, quantization_config=qcfg)
    print(f"held-out ppl {quant} {qcfg}: {ppl:.4f} (bf16 {bf16_ppl:.4f})")
    assert 3.0 < bf16_ppl < 30.0
    assert ppl <= target * bf16_ppl, (ppl, bf16_ppl)
    assert ppl != bf16_ppl  # quantisation happened


def test_heldout_perplexity_int8_smoothquant(heldout_stream, bf16_ppl, tmp_path):
    """``fastinfer quantize --method int8 --smoothquant 0.5`` on the shipped model, calibrated on its
    training split (the default): within +1% of bf16 (the quantisation target)."""
    path = str(tmp_path / "sq")
    assert cli_main(["quantize", "--quiet", "--method", "int8", "--smoothquant", "0.5", ASSETS, path]) == 0
    ppl = _ppl(heldout_stream, path)
    print(f"held-out ppl int8 + SmoothQuant 0.5: {ppl:.4f} (bf16 {bf16_ppl:.4f})")
    assert ppl <= 1.01 * bf16_ppl and ppl != bf16_ppl, (ppl, bf16_ppl)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def test_unknown_method(float_ckpt, tmp_path, capsys):
    assert cli_main(["quantize", "--method", "int3", float_ckpt, str(tmp_path / "x")]) == 2
    assert "unknown quantization method 'int3' (one of fp8, int4, int8, nvfp4, mxfp4)" in capsys.readouterr().err
    assert cli_main(["quantize", "--method", "fp8", "--smoothquant", "0.5", float_ckpt, str(tmp_path / "y")]) == 2
    assert "--smoothquant / --calibration apply to --method int8 only" in capsys.readouterr().err
    assert cli_main(["quantize", "--method", "int8", "--smoothquant", "1.5", float_ckpt, str(tmp_path / "z")]) == 2
    assert "smoothquant alpha must be in [0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown quantization method 'nf4'"):
        LLM(float_ckpt, num_kv_blocks=8, quantization="nf4")
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32"):
        LLM(float_ckpt, num_kv_blocks=8, quantization="int4", quantization_config={"group_size": 48})
    with pytest.raises(ValueError, match="unknown quantization_config keys"):
        LLM(float_ckpt, num_kv_blocks=8, quantization="int4", quantization_config={"bits": 3})
    assert cli_main(["generate", "--model", float_ckpt, "--symmetric", "--prompt", "x"]) == 2
    assert "need --quantization int4" in capsys.readouterr().err


def test_group_size_not_dividing_k(float_ckpt, tmp_path, capsys):
    out = str(tmp_path / "bad")
    assert cli_main(["quantize", "--quiet", "--method", "int4", "--group-size", "128", "--no-pad-groups",
                     float_ckpt, out]) == 2
    err = capsys.readouterr().err
    assert "group_size 128 does not divide the input size K=64" in err and "--no-pad-groups" in err
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.weight: group_size 128 does not divide the input size K=64"):
        LLM(float_ckpt, num_kv_blocks=8, quantization="int4", quantization_config={"pad_groups": False})


def test_quantization_of_another_method_on_quantized_checkpoint(float_ckpt, quant_ckpts, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"already quantised \(fastinfer int4\); quantization='fp8' cannot"):
        LLM(quant_ckpts["int4"], num_kv_blocks=8, quantization="fp8")
    with pytest.raises(ValueError, match=r"already quantised \(fastinfer fp8\); quantization='int4' cannot"):
        LLM(quant_ckpts["fp8"], num_kv_blocks=8, quantization="int4")
    awq, _ = _int4_checkpoint(float_ckpt, str(tmp_path / "awq"), "awq", False)
    with pytest.raises(ValueError, match=r"already quantised \(awq\); quantization='fp8' cannot"):
        LLM(awq, num_kv_blocks=8, quantization="fp8")
    # quantize CLI on an already quantised checkpoint
    assert cli_main(["quantize", "--quiet", "--method", "fp8", quant_ckpts["int4"], str(tmp_path / "y")]) == 2
    assert "is already quantised" in capsys.readouterr().err


def test_bad_checkpoints(float_ckpt, quant_ckpts, tmp_path, capsys):
    # output directory that already holds weights
    assert cli_main(["quantize", "--quiet", "--method", "fp8", float_ckpt, quant_ckpts["fp8"]]) == 2
    assert "already holds weights" in capsys.readouterr().err
    # unsupported quantization_config
    bad = str(tmp_path / "bnb")
    shutil.copytree(quant_ckpts["fp8"], bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported quantization_config quant_method 'bitsandbytes'"):
        LLM(bad, num_kv_blocks=8)
    # a quantised tensor with the wrong shape names the tensor
    t = _safetensors(quant_ckpts["int4"])
    t["model.layers.0.mlp.down_proj.weight_scale"] = t["model.layers.0.mlp.down_proj.weight_scale"][:1]
    with open(os.path.join(quant_ckpts["int4"], "config.json")) as f:
        cfg = json.load(f)
    broken = str(tmp_path / "broken")
    _save(broken, t, cfg)
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale' has shape \[1, 64\], expected \[4, 64\]"):
        LLM(broken, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------


def test_cli_generate_and_bench_with_quantization(float_ckpt, quant_ckpts, capsys):
    for args in (["--model", quant_ckpts["int4"]], ["--model", float_ckpt, "--quantization", "fp8"],
                 ["--model", float_ckpt, "--quantization", "int4", "--group-size", "64", "--symmetric"],
                 ["--model", quant_ckpts["int8-sq"]], ["--model", float_ckpt, "--quantization", "int8"]):
        assert cli_main(["generate", *args, "--prompt", "def f(x):", "--max-tokens", "4", "--ignore-eos",
                         "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out[0]["error"] is None and len(out[0]["outputs"][0]["token_ids"]) == 4
    # bench quantises an already built random-weight model (LLM(model, quantization=...) rebuilds it)
    for q in ("fp8", "int4", "int8"):
        assert cli_main(["bench", "--preset", "tiny", "--random-weights", "--batch", "2", "--input-len", "8",
                         "--output-len", "3", "--warmup", "0", "--quantization", q, "--json"]) == 0
        res = json.loads(capsys.readouterr().out)
        assert res["quantization"] == q and res["output_tokens_per_s"] > 0


# ------------------------------------------------------------------------------------------------
# the quantised runner on the CUDA kernel sources (simt emulator)
# ------------------------------------------------------------------------------------------------


@pytest.mark.sim
@pytest.mark.parametrize("kind", ["fp8", "int8-sq", "gptq-act-order"])
def test_sim_quantized_model(float_ckpt, quant_ckpts, tmp_path, kind):
    """bf16 prefill + decode of a quantised model through ``torch.ops.fastinfer_sim`` (the fp8 and
    int4 GEMM kernel sources; act-order: three int4 GEMMs with permutations for q/k/v), bit-identical
    across emulator schedule seeds. Error rule of conftest (FlashAttention's): against the same
    quantised model in float32 on the CPU ops, the sim result may be at most 2x as wrong as the CPU
    ops in bf16. (A direct sim-vs-CPU-bf16 bound would be noise: a bf16 ulp difference flips an
    fp8 activation code, a 2^-4 relative change, which the network carries on; both sit ~5% from
    the fp32 result for fp8, and first rows agree bit for bit.)"""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    require_sim()
    path = quant_ckpts[kind] if kind in quant_ckpts else _int4_checkpoint(float_ckpt, str(tmp_path / "g"), "gptq", True)[0]
    model = LLM(path, num_kv_blocks=8, dtype="bfloat16").model
    ids = PROMPT
    ref = logits_of(path)  # float32, CPU ops
    caches = model.allocate_kv_cache(2, 16)
    a = model(make_forward_batch(prefill=[(ids[:-1], 0, [1, 0])], all_logits=True), caches)
    b = model(make_forward_batch(decode=[(ids[-1], len(ids) - 1, [1, 0])]), caches)
    naive = torch.cat([a, b])  # the CPU ops in bf16
    # the same checkpoint loaded as the engine loads it, on the emulated kernels
    model = load_checkpoint(path, torch.bfloat16, "cpu", None, fastinfer.ops.backend("fastinfer_sim"))
    assert model.layers[0].qkv_proj.ops.namespace == "fastinfer_sim"
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            caches = model.allocate_kv_cache(2, 16)
            a = model(make_forward_batch(prefill=[(ids[:-1], 0, [1, 0])], all_logits=True), caches)
            b = model(make_forward_batch(decode=[(ids[-1], len(ids) - 1, [1, 0])]), caches)
            results.append(torch.cat([a, b]))
    err, err_naive = rel_norm(results[0], ref), rel_norm(naive, ref)
    print(f"sim {kind}: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


def test_quantized_load_allocates_no_float_linears(float_ckpt, quant_ckpts):
    """Quantised linears never allocate float weights: the only float parameters are the
    embedding, the norms and lm_head."""
    c = LLM(quant_ckpts["int4"], num_kv_blocks=4).model
    params = {n: p for n, p in c.named_parameters()}
    assert all(p.device.type == "cpu" for p in params.values())
    assert all(not n.startswith("layers.") or "norm" in n for n in params), sorted(params)
    cfg = c.config
    assert sum(p.numel() for p in params.values()) == (
        2 * cfg.vocab_size * cfg.hidden_size + (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size)
    from fastinfer.models import load_model

    assert torch.equal(c.cos_sin_cache, load_model(float_ckpt).cos_sin_cache)


@pytest.mark.parametrize("qc,msg", [
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "only checkpoint_format 'gptq'"),
    ({"quant_method": "gptq", "bits": 8}, "only 4-bit checkpoints"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "only version 'gemm'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point=false"),
    ({"quant_method": "fastinfer", "format_version": 2, "method": "fp8"}, "format_version 2"),
    ({"quant_method": "fastinfer", "format_version": 1, "method": "nf4"}, "method 'nf4'"),
])
def test_unsupported_quantization_configs(qc, msg):
    from fastinfer.quant import stored_quantization

    with pytest.raises(ValueError, match=msg):
        stored_quantization({"quantization_config": qc})
