"""compressed-tensors and Hugging Face fine-grained FP8 checkpoints, written by their producer libraries,
on Llama and Qwen3 (CPU, float32).

Producers. compressed-tensors checkpoints are quantised and saved by the ``compressed-tensors``
package itself (pinned in the ``test`` extra): ``apply_quantization_config`` with its preset schemes,
scales and zero points from its ``calculate_qparams`` over the min/max that llm-compressor's
memoryless min-max observer would see (the weights; for static activation scales the calibration
inputs), then ``ModelCompressor.compress_model`` + ``save_pretrained`` + ``update_config``: the
steps of llm-compressor's save wrapper (``llmcompressor`` itself pins torch <= 2.14.0 and
transformers <= 5.17, older than this project's). compressed-tensors 0.20.1 no longer writes
``actorder="group"`` (``weight_g_idx``); that variant is built from its documented convention with
compressed-tensors' own ``pack_to_int32``. Fine-grained FP8 checkpoints come from transformers'
own FP8 quantiser op (``FineGrainedFP8HfQuantizer.get_quantize_ops()``, what ``from_pretrained(...,
quantization_config=FineGrainedFP8Config())`` runs; that entry point refuses to run without a GPU).

References. Every model is compared with the same model dequantised in float by the producer
(compressed-tensors' ``decompress_model``; transformers' loader, which dequantises fine-grained FP8
on a CPU), run by transformers: int4 directly (W4A16 leaves activations alone; rel. logit error
< 1e-5 asserted, < 1e-3 required), fp8 with every quantised linear's input fake-quantised like the
op (per token, per 1 x 128 group, or with the static scale) by the fp64 oracle
``reference.fp8_quantize``. fp8 follows FlashAttention's rule: the reference runs in float64 and in
float32 (the same computation with torch in the runner's precision), and the runner's max logit
error against the float64 one may be at most twice the float32 one's (plus 1e-5 absolute, about
1e-5 of the logits' scale). Where transformers loads the checkpoint directory itself
(compressed-tensors, through compressed-tensors' own forward, fake-quantising activations as its
scheme says) its logits are compared too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

import fastinfer  # noqa: E402,F401
from fastinfer import reference as ref  # noqa: E402
from fastinfer.engine.checkpoints import load_checkpoint  # noqa: E402
from fastinfer.engine.llm import LLM  # noqa: E402
from fastinfer.engine.params import SamplingParams  # noqa: E402
from fastinfer.layers import UnquantizedLinearMethod  # noqa: E402
from fastinfer.quant import Fp8BlockLinearMethod, Fp8LinearMethod, Int4LinearMethod, Int8LinearMethod  # noqa: E402
from model_helpers import prefill_logits, unfused_norm_quant  # noqa: E402

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402
from ct_helpers import compress  # noqa: E402

PROMPT = [5, 17, 42, 99, 123, 7, 8, 250, 300, 3, 77, 211, 400, 12, 13, 14, 15, 500, 61, 9, 2, 33, 88, 123, 4]
LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
SLOTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FP8_FLOOR = 1e-5

# Llama: kv projections of 64 rows (fp8 blocks split the fused qkv GEMM into q+k and v), untied
# lm_head. Qwen3: q/k norms, GQA 4/2, every size a multiple of 128, tied embeddings (as the small
# Qwen3s). "llama-k320": MLP width 320, a partial 128-wide fp8 block along down_proj's K (which
# compressed-tensors pads; it refuses partial int4 groups). "llama-aligned" (fine-grained FP8): a
# Llama whose projections all tile into 128 x 128 blocks (transformers leaves others in float).
_LLAMA = dict(hidden_size=128, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
              tie_word_embeddings=False)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA),
    "llama-k320": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA, intermediate_size=320)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(hidden_size=128, intermediate_size=256,
                                                       num_attention_heads=4, num_key_value_heads=2,
                                                       head_dim=64, tie_word_embeddings=True)),
    "llama-aligned": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, intermediate_size=384,
                                                               num_attention_heads=2, num_key_value_heads=1,
                                                               head_dim=128, tie_word_embeddings=False)),
}
CT_ARCHS = ["llama", "qwen3"]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def float_model(arch: str, seed: int = 0):
    cfg_name, cls_name, kw = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(num_hidden_layers=2, vocab_size=512, max_position_embeddings=256,
                                          bos_token_id=0, eos_token_id=1, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger weights than the default init: every layer matters for the logits
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif "proj" in name:
                p.copy_(0.08 * r)
            else:
                p.copy_(r)
    return model


def ct_checkpoint(arch: str, groups: dict, ignore, dst: str, calib=PROMPT):
    """Quantise a fresh ``float_model(arch)`` with compressed-tensors (:func:`ct_helpers.compress`)."""
    return compress(float_model(arch), groups, ignore, dst, calib)


def _fp8_codes(x2: torch.Tensor, mode: str, scale):
    """The fp64 oracle's e4m3 codes of ``x2 [M, K]`` and the scale broadcast to them (groups of 128,
    or of 64 for ``mode`` "act" (fused_moe_fp8's activations), zero-padded at the end of a row, as
    the runner does)."""
    m, k = x2.shape
    if mode in ("group", "act"):
        size = 128 if mode == "group" else 64
        kp = -(-k // size) * size
        q, s = ref.fp8_quantize(torch.nn.functional.pad(x2, (0, kp - k)), "group", size)
        return q[:, :k], s.repeat_interleave(size, dim=1)[:, :k]
    q, s = ref.fp8_quantize(x2, "tensor" if mode == "static" else mode, scale=scale)
    return q, (s[:, None] if mode == "token" else s.reshape(1, 1)).expand(m, k)


def _snap_ties(q: torch.Tensor, s: torch.Tensor, x2: torch.Tensor, q_run: torch.Tensor, stats: dict) -> torch.Tensor:
    """``q`` with the runner's code ``q_run`` where the two are adjacent e4m3 values and the
    reference's ``x2 / s`` sits within 1% of a step of the rounding boundary between them: such an
    input is a tie within float32 noise, which either side may round either way (and a flipped
    code is a discrete jump the network then amplifies). Any other difference stays."""
    diff = q.float() != q_run.float()
    if not bool(diff.any()):
        return q
    a, b = q.float()[diff], q_run.float()[diff]
    bits = (q.view(torch.uint8)[diff].int() - q_run.view(torch.uint8)[diff].int()).abs()
    v = (x2.double()[diff] / s.double()[diff])
    tie = (bits == 1) & ((v - (a.double() + b.double()) / 2).abs() <= 0.01 * (a - b).abs().double())
    idx = diff.nonzero()[tie]
    q = q.clone()
    q[idx[:, 0], idx[:, 1]] = q_run[idx[:, 0], idx[:, 1]]
    stats["snapped"] = stats.get("snapped", 0) + int(tie.sum())
    return q


def _fake_quant_hook(name: str, mode: str, scale, runner_inputs, stats):
    """A forward pre-hook replacing a linear's input by its fp8 fake-quantisation (fp64 oracle), ties
    resolved as the runner did (``runner_inputs[name]``: the runner's input of that linear)."""

    def hook(mod, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        q, s = _fp8_codes(x2, mode, scale)
        if runner_inputs is not None:
            q = _snap_ties(q, s, x2, _fp8_codes(runner_inputs[name], mode, scale)[0], stats)
        stats["codes"] = stats.get("codes", 0) + q.numel()
        return ((q.double() * s.double()).to(x.dtype).reshape(x.shape),)

    return hook


def reference_logits(deq_path: str, fake_quant: dict, dtype, runner_inputs=None, stats=None) -> torch.Tensor:
    """transformers on the dequantised checkpoint, in ``dtype``; ``fake_quant``: module name ->
    (mode, static scale or None) for the linears whose inputs the quantised model quantises."""
    model = transformers.AutoModelForCausalLM.from_pretrained(deq_path, dtype=dtype).eval()
    stats = {} if stats is None else stats
    for name, (mode, scale) in fake_quant.items():
        model.get_submodule(name).register_forward_pre_hook(_fake_quant_hook(name, mode, scale, runner_inputs, stats))
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].double()


_PARTS = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
          "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


def runner_logits_and_inputs(llm: LLM):
    """The runner's logits and every decoder linear's input, by checkpoint module name."""
    inputs, hooks = {}, []
    for i, layer in enumerate(llm.model.layers):
        for slot, parts in _PARTS.items():
            def hook(mod, args, i=i, parts=parts):
                for p in parts:
                    inputs[f"model.layers.{i}.{p}"] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
            hooks.append(getattr(layer, slot).register_forward_pre_hook(hook))
    try:
        with unfused_norm_quant(llm.model):
            return runner_logits(llm), inputs
    finally:
        for h in hooks:
            h.remove()


def check_fp8(llm: LLM, deq_path: str, fake_quant: dict, what: str) -> int:
    """FlashAttention's rule for an fp8 model against its fake-quantised float reference; returns how
    many reference codes were ties resolved as the runner did."""
    out, inputs = runner_logits_and_inputs(llm)
    stats: dict = {}
    ref64 = reference_logits(deq_path, fake_quant, torch.float64, inputs, stats)
    naive = reference_logits(deq_path, fake_quant, torch.float32, inputs, stats)
    err = float((out.double() - ref64).abs().max())
    naive_err = float((naive.double() - ref64).abs().max())
    rel = rel_norm(out, ref64)
    print(f"{what}: max err {err:.2e} (torch fp32: {naive_err:.2e}), rel {rel:.2e}; "
          f"{stats.get('snapped', 0)} of {stats['codes']} reference codes at a tie rounded as the runner did")
    assert stats.get("snapped", 0) <= 1e-4 * stats["codes"]
    assert err <= 2 * naive_err + FP8_FLOOR, (what, err, naive_err)
    assert rel < 1e-5, (what, rel)
    return stats.get("snapped", 0)


def original_logits(arch: str) -> torch.Tensor:
    """transformers' logits of the float model before quantisation."""
    with torch.no_grad():
        return float_model(arch)(torch.tensor([PROMPT])).logits[0].double()


def runner_logits(path_or_llm) -> torch.Tensor:
    llm = path_or_llm if isinstance(path_or_llm, LLM) else LLM(path_or_llm, num_kv_blocks=8, dtype="float32")
    return prefill_logits(llm.model, PROMPT)


def _ct_scale(path: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return f.get_tensor(name).float().reshape(1)


# ------------------------------------------------------------------------------------------------
# compressed-tensors
# ------------------------------------------------------------------------------------------------


def _w4(strategy: str, symmetric: bool, group_size=None, actorder=None):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy=strategy, group_size=group_size, symmetric=symmetric, actorder=actorder))


CT_VARIANTS = {  # name -> (config groups, int4 | fp8 mode of the activations)
    "W4A16": (lambda: {"group_0": preset_name_to_scheme("W4A16", ["Linear"])}, "int4"),
    "W4A16_ASYM": (lambda: {"group_0": preset_name_to_scheme("W4A16_ASYM", ["Linear"])}, "int4"),
    "W4A16-channel-asym": (lambda: {"group_0": _w4("channel", False)}, "int4"),
    "W4A16-g64-actorder-weight": (lambda: {"group_0": _w4("group", True, 64, "weight")}, "int4"),
    "FP8_DYNAMIC": (lambda: {"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}, "token"),
    "FP8": (lambda: {"group_0": preset_name_to_scheme("FP8", ["Linear"])}, "static"),
    "FP8_BLOCK": (lambda: {"group_0": preset_name_to_scheme("FP8_BLOCK", ["Linear"])}, "group"),
    "FP8-channel-dynamic-tensor": (lambda: {"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="channel"),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=True))}, "tensor"),
}
_CACHE: dict = {}


@pytest.fixture(scope="module")
def ct_ckpt(tmp_path_factory):
    def get(arch: str, variant: str):
        key = (arch, variant)
        if key not in _CACHE:
            groups, _ = CT_VARIANTS[variant]
            dst = str(tmp_path_factory.mktemp(f"{arch}-{variant}") / "m")
            _CACHE[key] = ct_checkpoint(arch, groups(), ["lm_head"], dst)
        return _CACHE[key]

    return get


def _fake_quant_map(ct_path: str, schemes: dict, mode: str) -> dict:
    out = {}
    for name in schemes:
        scale = _ct_scale(ct_path, name + ".input_scale") if mode == "static" else None
        out[name] = (mode, scale)
    return out


@pytest.mark.parametrize("arch,variant", [(a, v) for a in CT_ARCHS for v in CT_VARIANTS] +
                         [("llama-k320", "FP8_BLOCK")])
def test_compressed_tensors_matches_dequantised_float(ct_ckpt, arch, variant):
    ct_path, deq_path, schemes = ct_ckpt(arch, variant)
    qc = json.load(open(os.path.join(ct_path, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    mode = CT_VARIANTS[variant][1]
    ties = 0
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8)
    cls = {"int4": Int4LinearMethod, "group": Fp8BlockLinearMethod}.get(mode, Fp8LinearMethod)
    for layer in llm.model.layers:
        for slot in SLOTS:
            assert type(getattr(layer, slot).method) is cls, (slot, getattr(layer, slot).method)
    assert isinstance(llm.model.lm_head.method, UnquantizedLinearMethod)
    out = runner_logits(llm)
    assert torch.isfinite(out).all()
    assert rel_norm(out, original_logits(arch)) > 1e-3  # the checkpoint really is quantised
    if mode == "int4":
        err = rel_norm(out, reference_logits(deq_path, {}, torch.float64))
        print(f"{arch} {variant}: rel err vs dequantised float {err:.2e}")
        assert err < 1e-5, err
    else:
        fq = _fake_quant_map(ct_path, schemes, mode)
        if mode == "static":  # the fused projections saw the same calibration input: equal scales
            layer = llm.model.layers[0]
            q, k = (_ct_scale(ct_path, f"model.layers.0.self_attn.{p}_proj.input_scale") for p in "qk")
            assert torch.equal(q, k) and torch.equal(layer.qkv_proj.input_scale.cpu(), q)
        ties = check_fp8(llm, deq_path, fq, f"{arch} {variant}")
    # transformers loading the same directory (compressed-tensors' own forward); transformers 5.24
    # cannot load compressed-tensors 0.20.1's packed asymmetric zero points ("size mismatch"), and
    # compressed-tensors' forward cannot quantise a partial activation group (K = 320)
    if variant not in ("W4A16_ASYM", "W4A16-channel-asym") and arch != "llama-k320":
        hf = transformers.AutoModelForCausalLM.from_pretrained(ct_path, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(torch.tensor([PROMPT])).logits[0]
        err = rel_norm(out, theirs)
        print(f"{arch} {variant}: rel err vs transformers + compressed-tensors {err:.2e}")
        # fp8: unless an activation sat at a rounding tie, which compressed-tensors' forward may round
        # the other way (a discrete jump, then amplified: ~1e-2 here)
        assert err < (1e-5 if mode == "int4" else 1e-4 if not ties else 5e-2), err


def test_compressed_tensors_layout_and_generation(ct_ckpt, tmp_path):
    """The checkpoint holds what the format documents (int32 words of 8 nibbles, [N, G] scales,
    zero points packed along N); the runner decodes through the engine."""
    from safetensors.torch import load_file

    ct_path, _, _ = ct_ckpt("llama", "W4A16_ASYM")
    t = load_file(os.path.join(ct_path, "model.safetensors"))
    p = "model.layers.0.mlp.down_proj"  # N 128, K 384: 3 groups of 128
    assert t[p + ".weight_packed"].dtype == torch.int32 and t[p + ".weight_packed"].shape == (128, 48)
    assert t[p + ".weight_scale"].shape == (128, 3) and t[p + ".weight_zero_point"].shape == (16, 3)
    assert t[p + ".weight_shape"].tolist() == [128, 384]
    # word j of row n: nibble i = the code of column 8 j + i plus 8; zero points likewise along N
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from fastinfer.quant.math import unpack_int4_words

    codes = unpack_from_int32(t[p + ".weight_packed"], 4, torch.Size([128, 384]))
    assert torch.equal(unpack_int4_words(t[p + ".weight_packed"]).to(torch.int16) - 8, codes.to(torch.int16))
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=16)
    down = llm.model.layers[0].down_proj
    assert down.kq == 384 and down.method.describe(down) == "int4-g128"
    res = llm.generate(PROMPT[:5], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert res.error is None and len(res.outputs[0].token_ids) == 6
    # zero points stored unpacked, one signed int8 per row and group, read the same
    import shutil

    from safetensors.torch import save_file

    old = str(tmp_path / "unpacked-zp")
    shutil.copytree(ct_path, old)
    for name in [k for k in t if k.endswith(".weight_zero_point")]:
        n = t[name.replace("weight_zero_point", "weight_shape")].tolist()[0]
        t[name] = (unpack_int4_words(t[name].t().contiguous())[:, :n].t().to(torch.int16) - 8).to(torch.int8).contiguous()
    save_file(t, os.path.join(old, "model.safetensors"), metadata={"format": "pt"})
    assert t[p + ".weight_zero_point"].dtype == torch.int8 and t[p + ".weight_zero_point"].shape == (128, 3)
    assert torch.equal(runner_logits(old), runner_logits(llm))


def _act_order_checkpoint(arch: str, dst: str):
    """actorder="group": per linear a random act-order ``weight_g_idx``, codes / zero points packed
    by compressed-tensors' ``pack_to_int32`` in the checkpoint's column order, the scales of group
    ``g_idx[k]`` applying to column k (what compressed-tensors < 0.20 wrote for GPTQ with
    actorder="group"). Built on a W4A16_ASYM group-64 checkpoint of the same model. Returns the
    directory and a float checkpoint of its dequantised weights (computed in float64)."""
    from safetensors.torch import load_file, save_file

    group = 64
    ct_path, deq_path, schemes = ct_checkpoint(
        arch, {"group_0": _w4("group", False, group)}, ["lm_head"], dst)
    t = load_file(os.path.join(ct_path, "model.safetensors"))
    deq = load_file(os.path.join(deq_path, "model.safetensors"))
    args = next(iter(schemes.values())).weights
    gen = torch.Generator().manual_seed(5)
    for name in schemes:
        w = deq[name + ".weight"].clone()
        n, k = w.shape
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
        groups = -(-k // group)
        lo = torch.stack([w[:, g_idx == i].amin(1) for i in range(groups)], 1)
        hi = torch.stack([w[:, g_idx == i].amax(1) for i in range(groups)], 1)
        s, z = calculate_qparams(lo, hi, args)  # [n, groups], signed int8 zero points
        q = torch.clamp(torch.round(w / s[:, g_idx]) + z[:, g_idx].float(), -8, 7).to(torch.int8)
        t[name + ".weight_packed"] = pack_to_int32(q, 4)
        t[name + ".weight_scale"] = s.to(t[name + ".weight_scale"].dtype)
        t[name + ".weight_zero_point"] = pack_to_int32(z.to(torch.int8), 4, packed_dim=0)
        t[name + ".weight_g_idx"] = g_idx.to(torch.int32)
        deq[name + ".weight"] = ((q.double() - z.double()[:, g_idx]) * s.double()[:, g_idx]).float()
    save_file(t, os.path.join(ct_path, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_path, "model.safetensors"), metadata={"format": "pt"})
    cfg_file = os.path.join(ct_path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    json.dump(cfg, open(cfg_file, "w"))
    return ct_path, deq_path


@pytest.mark.parametrize("arch", CT_ARCHS)
def test_compressed_tensors_act_order_group(tmp_path, arch):
    from fastinfer.ops import int4_repack

    ct_path, deq_path = _act_order_checkpoint(arch, str(tmp_path / "ao"))
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8)
    layer = llm.model.layers[0]
    assert layer.qkv_proj.num_parts == 3  # q, k, v have different permutations: one GEMM each
    perm = layer.qkv_proj.method.part(layer.qkv_proj, 0).perm
    assert perm is not None
    # the same permutation int4_repack derives from a GPTQ g_idx
    from safetensors import safe_open

    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        g_idx = f.get_tensor("model.layers.0.self_attn.q_proj.weight_g_idx")
    k = g_idx.shape[0]
    qw = torch.zeros(k // 8, 16, dtype=torch.int32)
    assert torch.equal(int4_repack(qw, torch.zeros(k // 64, 2, dtype=torch.int32), "gptq", g_idx).perm, perm)
    err = rel_norm(runner_logits(llm), reference_logits(deq_path, {}, torch.float64))
    print(f"{arch} act-order group: rel err vs dequantised float {err:.2e}")
    assert err < 1e-5, err


def test_compressed_tensors_targets_ignore_and_mixed_schemes(tmp_path):
    """Two config groups by regex target (int4 MLP, fp8 attention: format "mixed-precision"), a
    regex ignore entry leaving one layer in float."""
    groups = {"mlp": preset_name_to_scheme("W4A16", [r"re:.*mlp\.(gate|up|down)_proj$"]),
              "attn": preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*self_attn\.(q|k|v|o)_proj$"])}
    ignore = ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"]
    ct_path, deq_path, schemes = ct_checkpoint("qwen3", groups, ignore, str(tmp_path / "mixed"))
    qc = json.load(open(os.path.join(ct_path, "config.json")))["quantization_config"]
    assert qc["format"] == "mixed-precision"
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8)
    l0, l1 = llm.model.layers
    assert type(l0.qkv_proj.method) is Fp8LinearMethod and type(l0.o_proj.method) is Fp8LinearMethod
    assert type(l0.gate_up_proj.method) is Int4LinearMethod and type(l0.down_proj.method) is Int4LinearMethod
    assert type(l1.down_proj.method) is UnquantizedLinearMethod  # ignored: loads in float
    assert "model.layers.1.mlp.down_proj" not in schemes
    fq = {name: ("token", None) for name, s in schemes.items() if s.input_activations is not None}
    assert len(fq) == 8
    check_fp8(llm, deq_path, fq, "mixed int4 / fp8")
    with pytest.raises(ValueError, match=r"already quantised \(compressed-tensors\); quantization='int4' cannot.*"
                                         r"pass quantization=None to"):
        LLM(ct_path, num_kv_blocks=8, quantization="int4")


def test_compressed_tensors_quantised_lm_head(tmp_path):
    """An empty ignore list: compressed-tensors quantises lm_head too (it is a Linear), and so does the
    runner (an untied head); ``quantization="int4"`` runs it as stored."""
    groups = {"group_0": preset_name_to_scheme("W4A16", ["Linear"])}
    ct_path, deq_path, schemes = ct_checkpoint("llama", groups, [], str(tmp_path / "head"))
    assert "lm_head" in schemes
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8, quantization="int4")
    assert type(llm.model.lm_head.method) is Int4LinearMethod
    out = runner_logits(llm)
    assert out.dtype == torch.float32
    err = rel_norm(out, reference_logits(deq_path, {}, torch.float64))
    print(f"int4 lm_head: rel err vs dequantised float {err:.2e}")
    assert err < 1e-5, err


# ------------------------------------------------------------------------------------------------
# Hugging Face fine-grained FP8
# ------------------------------------------------------------------------------------------------


def hf_fp8_checkpoint(arch: str, dst: str, not_convert=()):
    """A fine-grained FP8 checkpoint of ``float_model(arch)`` by transformers' quantiser op (every
    decoder linear but ``not_convert``, listed in ``modules_to_not_convert``; ``lm_head`` and the
    embedding stay float as transformers keeps them); returns it and the float checkpoint it came
    from."""
    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    model = float_model(arch)
    model.save_pretrained(dst + "-float")
    qcfg = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=list(not_convert) or None)
    op = FineGrainedFP8HfQuantizer(qcfg).get_quantize_ops()
    t = load_file(os.path.join(dst + "-float", "model.safetensors"))
    out = {}
    for name, w in t.items():
        if ".layers." in name and name.endswith("proj.weight") and name[:-len(".weight")] not in not_convert:
            out.update(op.convert({name: w}))
        else:
            out[name] = w
    os.makedirs(dst + "-fp8", exist_ok=True)
    save_file(out, os.path.join(dst + "-fp8", "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst + "-float", "config.json")))
    cfg["quantization_config"] = qcfg.to_dict()
    json.dump(cfg, open(os.path.join(dst + "-fp8", "config.json"), "w"))
    return dst + "-fp8", dst + "-float"


@pytest.mark.parametrize("arch", ["qwen3", "llama-aligned"])
def test_hf_fine_grained_fp8(tmp_path, arch):
    from safetensors.torch import load_file

    skip = ["model.layers.1.mlp.down_proj"] if arch == "qwen3" else []
    fp8_path, float_path = hf_fp8_checkpoint(arch, str(tmp_path / "m"), skip)
    qc = json.load(open(os.path.join(fp8_path, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
    t = load_file(os.path.join(fp8_path, "model.safetensors"))
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    llm = LLM(fp8_path, dtype="float32", num_kv_blocks=8)
    for layer in llm.model.layers:
        for slot in SLOTS:
            m = getattr(layer, slot)
            if m.prefix in skip:  # stored in float (modules_to_not_convert): a float linear
                assert type(m.method) is UnquantizedLinearMethod
                continue
            assert type(m.method) is Fp8BlockLinearMethod and m.num_parts == 1, slot
    assert isinstance(llm.model.lm_head.method, UnquantizedLinearMethod)
    out = runner_logits(llm)
    # transformers dequantises the directory on a CPU (no activation quantisation): that is the
    # float model of the dequantised weights; with fake-quantised linear inputs it is the reference
    from safetensors.torch import save_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_path, dtype=torch.float32).eval()
    deq_path = str(tmp_path / "deq")  # its weights with the float checkpoint's config
    os.makedirs(deq_path)
    save_file({k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()},
              os.path.join(deq_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(float_path, "config.json")) as f, open(os.path.join(deq_path, "config.json"), "w") as g:
        g.write(f.read())
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    assert rel_norm(theirs, runner_logits(deq_path)) < 1e-5  # the same dequantised weights
    assert rel_norm(out, original_logits(arch)) > 1e-3
    names = [f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS]
    fq = {n: ("group", None) for n in names if n not in skip}
    check_fp8(llm, deq_path, fq, f"fine-grained fp8 {arch}")
    as_stored = LLM(fp8_path, dtype="float32", num_kv_blocks=8, quantization="fp8")
    assert torch.equal(runner_logits(as_stored), out)


def test_hf_fp8_convention_hand_checked(tmp_path):
    """One 256 x 256 weight whose four 128 x 128 blocks have amax 448 * (0.5, 1, 2, 4) /
    1024: transformers writes ``weight_scale_inv`` = amax / 448 per block (the dequantisation
    multiplier, whatever the name) and codes = weight / scale_inv; the runner's block scales and
    its dequantised weight are exactly those."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    g = torch.Generator().manual_seed(0)
    w = torch.rand(256, 256, generator=g) * 2 - 1
    amax = torch.tensor([[0.5, 1.0], [2.0, 4.0]]) * 448 / 1024
    w = w / w.abs().reshape(2, 128, 2, 128).amax((1, 3))[:, None, :, None].expand(2, 128, 2, 128).reshape(256, 256)
    w = w * amax[:, None, :, None].expand(2, 128, 2, 128).reshape(256, 256)
    op = FineGrainedFP8HfQuantizer(FineGrainedFP8Config()).get_quantize_ops()
    res = op.convert({"x.weight": w})
    assert torch.equal(res["x.weight_scale_inv"], amax / 448)  # = (0.5, 1, 2, 4) / 1024, exact
    codes = res["x.weight"]
    assert float(codes.float().abs().amax()) == 448.0
    expect = (w / (amax / 448)[:, None, :, None].expand(2, 128, 2, 128).reshape(256, 256)).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expect.view(torch.uint8))
    # the runner reads exactly that: block scales as stored, W = codes * scale_inv per block
    from fastinfer.layers import Linear, TensorDictReader, WeightPart
    from fastinfer.ops import backend
    from fastinfer.quant import StoredQuantization, CheckpointQuantization

    qc = CheckpointQuantization(StoredQuantization("fp8", "fp8", FineGrainedFP8Config().to_dict()))
    lin = Linear(256, [WeightPart("x", 256)], False, dtype=torch.float32, device="cpu", ops=backend("fastinfer"),
                 quant_config=qc)
    lin.load_from(TensorDictReader(res))
    assert torch.equal(lin.weight_scale0, amax / 448) and torch.equal(lin.weight0.view(torch.uint8), codes.view(torch.uint8))
    x = torch.randn(3, 256, generator=g)
    xq, xs = ref.fp8_quantize(x, "group", 128)
    xd = (xq.double().view(3, 2, 128) * xs.double()[..., None]).view(3, 256)
    wd = ref.fp8_dequantize(codes, (amax / 448).repeat_interleave(128, 0))  # rows: one scale row per 128
    assert rel_norm(wd, w) < 2.0 ** -4  # e4m3 keeps 3 mantissa bits
    assert rel_norm(lin(x), xd @ wd.double().t()) < 1e-6


# ------------------------------------------------------------------------------------------------
# bad input: one clear line naming the scheme and the layer
# ------------------------------------------------------------------------------------------------


def _with_config(src: str, dst, edit) -> str:
    import shutil

    shutil.copytree(src, dst)
    cfg_file = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_file))
    edit(cfg["quantization_config"])
    json.dump(cfg, open(cfg_file, "w"))
    return str(dst)


def _int8_act(symmetric: bool):
    return QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=symmetric)


CT_INT8 = {  # name -> (config groups, symmetric activations)
    "W8A8": (lambda: {"group_0": preset_name_to_scheme("W8A8", ["Linear"])}, True),
    "W8A8-asym-activations": (lambda: {"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
        input_activations=_int8_act(False))}, False),
    "W8A8-tensor-weights": (lambda: {"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True),
        input_activations=_int8_act(True))}, True),
}


def _int8_fake_quant_hook(name: str, symmetric: bool, runner_inputs, stats):
    """A forward pre-hook replacing a linear's input by its per-token int8 fake-quantisation (the fp64
    module's oracle ``reference.int8_quantize``), codes at a rounding tie (x / scale within 1% of a
    step of .5) taken from the runner's own quantisation of its input."""

    def hook(mod, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1])
        out = ref.int8_quantize(x2, "token", None, symmetric)
        q, s, z = out[0], out[1], (None if symmetric else out[2])
        q_run = ref.int8_quantize(runner_inputs[name], "token", None, symmetric)[0]
        v = x2.double() / s.double()[:, None]
        tie = (q != q_run) & ((q.int() - q_run.int()).abs() == 1) & (((v - v.floor()) - 0.5).abs() < 0.01)
        stats["snapped"] = stats.get("snapped", 0) + int(tie.sum())
        stats["codes"] = stats.get("codes", 0) + q.numel()
        q = torch.where(tie, q_run, q)
        return (ref.int8_dequantize(q, s, z).to(x.dtype).reshape(x.shape),)

    return hook


@pytest.mark.parametrize("arch", CT_ARCHS)
@pytest.mark.parametrize("variant", list(CT_INT8))
def test_compressed_tensors_int8(tmp_path, arch, variant):
    """compressed-tensors ``int-quantized`` W8A8 written by the package itself (symmetric int8 weights,
    amax / 127.5 scales, codes down to -128): the runner against transformers on the producer's
    dequantised weights with every linear's input fake-quantised per token by the fp64 oracle
    (the same activation arithmetic as the runner), FlashAttention's rule; then against
    transformers + compressed-tensors' own forward, whose per-token activation scale is
    amax / 127.5 (ours and vLLM's: amax / 127), so that comparison is loose."""
    groups, sym = CT_INT8[variant]
    ct_path, deq_path, schemes = ct_checkpoint(arch, groups(), ["lm_head"], str(tmp_path / "m"))
    qc = json.load(open(os.path.join(ct_path, "config.json")))["quantization_config"]
    assert qc["format"] == "int-quantized"
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8)
    for layer in llm.model.layers:
        for slot in SLOTS:
            m = getattr(layer, slot).method
            assert type(m) is Int8LinearMethod and m.activation == ("token" if sym else "token-asym"), (slot, m)
    assert isinstance(llm.model.lm_head.method, UnquantizedLinearMethod)
    out, inputs = runner_logits_and_inputs(llm)
    assert rel_norm(out, original_logits(arch)) > 1e-3  # the checkpoint really is quantised
    stats: dict = {}
    models = {}
    for dtype in (torch.float64, torch.float32):
        m = transformers.AutoModelForCausalLM.from_pretrained(deq_path, dtype=dtype).eval()
        for name in schemes:
            m.get_submodule(name).register_forward_pre_hook(_int8_fake_quant_hook(name, sym, inputs, stats))
        with torch.no_grad():
            models[dtype] = m(torch.tensor([PROMPT])).logits[0].double()
    ref64, naive = models[torch.float64], models[torch.float32]
    err = float((out.double() - ref64).abs().max())
    naive_err = float((naive - ref64).abs().max())
    print(f"{arch} {variant}: max err {err:.2e} (torch fp32: {naive_err:.2e}), rel {rel_norm(out, ref64):.2e}; "
          f"{stats.get('snapped', 0)} of {stats['codes']} reference codes at a tie")
    assert stats.get("snapped", 0) <= 1e-3 * stats["codes"]
    assert err <= 2 * naive_err + FP8_FLOOR and rel_norm(out, ref64) < 1e-5, (err, naive_err)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ct_path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    err_ct = rel_norm(out, theirs)
    print(f"{arch} {variant}: rel err vs transformers + compressed-tensors {err_ct:.2e}")
    assert err_ct < 5e-2, err_ct


def test_unsupported_int8_scheme_names_scheme_and_layer(tmp_path):
    """int8 weight-only (W8A16) is not supported: one line naming the scheme and the layer."""
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=8, type="int", strategy="channel", symmetric=True))}
    ct_path, _, _ = ct_checkpoint("llama", groups, ["lm_head"], str(tmp_path / "int8"))
    with pytest.raises(ValueError) as e:
        LLM(ct_path, num_kv_blocks=8)
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    assert msg.startswith("model.layers.0.self_attn.q_proj: compressed-tensors scheme W8A16 int8 (weights int8 "
                          "channel, input activations none"), msg


@pytest.mark.parametrize("edit,match", [
    (lambda qc: qc["config_groups"]["group_0"].update(
        weights={"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True},
        format="nvfp4-pack-quantized",
        input_activations={"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                           "dynamic": "local"}),
     r"^model\.layers\.0\.self_attn\.q_proj: compressed-tensors scheme NVFP4 \(weights float4 tensor_group.*"
     r"fp4 activations \(NVFP4 W4A4\)"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations=None, format="float-quantized"),
     r"^model\.layers\.0\.self_attn\.q_proj: compressed-tensors scheme FP8 weight-only \(W8A16\)"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(block_structure=[64, 64]),
     r"q_proj: .*fp8 block_structure \[64, 64\] \(only \[128, 128\]\)"),
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                                           "targets": ["Linear"], "ignore": ["lm_head"]}),
     r"^model\.layers\.0\.self_attn\.q_proj: compressed-tensors sparsity '2:4' \(format 'sparse-24-bitmask'\) "
     r"is not supported$"),
    # an fp8 KV-cache scheme loads (tests/test_kv_cache_fp8.py); an int8 or asymmetric one does not
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}),
     r"^compressed-tensors: kv_cache_scheme \(int8 tensor\) is not supported: only an fp8 \(float, 8 bits\) KV "
     r"cache$"),
    (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}),
     r"^compressed-tensors: kv_cache_scheme \(float8 tensor asymmetric\) is not supported: asymmetric"),
])
def test_unsupported_schemes(ct_ckpt, tmp_path, edit, match):
    ct_path, _, _ = ct_ckpt("llama", "FP8_BLOCK")
    bad = _with_config(ct_path, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=match) as e:
        LLM(bad, num_kv_blocks=8)
    assert "\n" not in str(e.value)


def test_fused_projections_with_different_schemes(ct_ckpt, tmp_path):
    ct_path, _, _ = ct_ckpt("llama", "W4A16")
    bad = _with_config(ct_path, tmp_path / "bad", lambda qc: qc["ignore"].append("model.layers.0.self_attn.k_proj"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: the projections fused into this "
                                         r"layer have different compressed-tensors schemes \(q_proj: group_0, "
                                         r"k_proj: ignored \(float\), v_proj: group_0\)"):
        LLM(bad, num_kv_blocks=8)


@pytest.mark.parametrize("variant,tensor,shape,expect", [
    ("W4A16_ASYM", "model.layers.0.mlp.down_proj.weight_scale", (128, 2), r"\[128, 3\]"),
    ("W4A16_ASYM", "model.layers.1.self_attn.k_proj.weight_zero_point", (8, 2), r"\[8, 1\]"),
    ("W4A16", "model.layers.0.self_attn.o_proj.weight_packed", (128, 8), r"\[128, 16\]"),
    ("FP8_DYNAMIC", "model.layers.0.mlp.up_proj.weight_scale", (1, 384), r"\[384, 1\] or \[384\]"),
    ("FP8", "model.layers.1.self_attn.v_proj.input_scale", (2,), r"\[1\] or \[\] or \[1, 1\]"),
    ("FP8_BLOCK", "model.layers.0.mlp.gate_proj.weight_scale", (2, 1), r"\[3, 1\]"),
])
def test_mismatched_scale_shapes_name_the_tensor(ct_ckpt, tmp_path, variant, tensor, shape, expect):
    import shutil

    from safetensors.torch import load_file, save_file

    ct_path, _, _ = ct_ckpt("llama", variant)
    bad = tmp_path / "bad"
    shutil.copytree(ct_path, bad)
    t = load_file(os.path.join(bad, "model.safetensors"))
    t[tensor] = torch.zeros(shape, dtype=t[tensor].dtype)
    save_file(t, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{tensor}' has shape \[{', '.join(map(str, shape))}\], "
                                         rf"expected {expect}"):
        LLM(str(bad), num_kv_blocks=8)


def test_hf_fp8_bad_configs_and_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_path, _ = hf_fp8_checkpoint("qwen3", str(tmp_path / "m"))
    for edit, match in [
        (lambda qc: qc.update(weight_block_size=[64, 64]), r"fp8: only weight_block_size \[128, 128\]"),
        (lambda qc: qc.update(weight_block_size=None), r"fp8: only weight_block_size \[128, 128\].*None"),
        (lambda qc: qc.update(activation_scheme="static"), r"fp8: only activation_scheme 'dynamic'"),
        (lambda qc: qc.update(scale_fmt="ue8m0"), r"fp8: only float32 block scales"),
    ]:
        bad = _with_config(fp8_path, tmp_path / f"bad{len(os.listdir(tmp_path))}", edit)
        with pytest.raises(ValueError, match=match):
            LLM(bad, num_kv_blocks=8)
    t = load_file(os.path.join(fp8_path, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    t[name] = t[name][:, :1].contiguous()
    save_file(t, os.path.join(fp8_path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[1, 1\], expected \[1, 2\]"):
        LLM(fp8_path, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# the CUDA kernel sources (simt emulator)
# ------------------------------------------------------------------------------------------------


@pytest.mark.sim
@pytest.mark.parametrize("variant", ["FP8_BLOCK", "FP8"])
def test_sim_compressed_tensors_fp8(ct_ckpt, variant):
    """bf16 prefill of a Qwen3 compressed-tensors fp8 model through ``torch.ops.fastinfer_sim`` (the
    blockwise / static-scale fp8 GEMM and the q/k norms on the kernel sources), bit-identical across
    schedule seeds, at most 2x as far from the fp32 CPU result as the CPU ops in bf16 (the rule of
    tests/test_quantization.py's sim test)."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    require_sim()
    ct_path, _, _ = ct_ckpt("qwen3", variant)
    ref32 = runner_logits(ct_path)
    model = LLM(ct_path, num_kv_blocks=8, dtype="bfloat16").model
    ids = PROMPT[:17]
    naive = prefill_logits(model, ids)
    # the same checkpoint loaded as the engine loads it, on the emulated kernels
    model = load_checkpoint(ct_path, torch.bfloat16, "cpu", None, fastinfer.ops.backend("fastinfer_sim"))
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(prefill_logits(model, ids))
    err, err_naive = rel_norm(results[0], ref32[:17]), rel_norm(naive, ref32[:17])
    print(f"sim {variant}: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"


# ------------------------------------------------------------------------------------------------
# compressed-tensors NVFP4 (W4A16) on fp4_gemm
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compressed_tensors_nvfp4(tmp_path, arch):
    """An NVFP4A16 checkpoint written by compressed-tensors (``nvfp4-pack-quantized``: e2m1 codes,
    an e4m3 scale per 16 input features, a global scale) loads with every decoder linear on
    fp4_gemm: each weight (read back by multiplying the identity, in float32) is the producer's
    fp32 dequantisation and the float64 oracle's (fastinfer.reference.fp4) within fp32 rounding,
    and its own decompressed model (which rounds each weight to bf16 on the way) within bf16's;
    the logits follow that model within the bf16 rounding (rel 1e-2) and the float original
    within the fp4 error."""
    from safetensors import safe_open

    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from fastinfer.quant import Fp4LinearMethod

    ct_path, deq_path, schemes = ct_checkpoint(arch, {"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                                               ["lm_head"], str(tmp_path / "nvfp4"))
    llm = LLM(ct_path, dtype="float32", num_kv_blocks=8)
    linears = [m for m in llm.model.linear_layers() if m is not llm.model.lm_head]
    assert all(type(m.method) is Fp4LinearMethod for m in linears)
    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f, \
            safe_open(os.path.join(deq_path, "model.safetensors"), "pt") as d:
        name = "model.layers.1.mlp.down_proj"
        layer = llm.model.layers[1].down_proj
        scale, gs = f.get_tensor(name + ".weight_scale"), f.get_tensor(name + ".weight_global_scale")
        codes = ref.fp4.e2m1_values(ref.fp4.fp4_unpack(f.get_tensor(name + ".weight_packed"))).float()
        theirs_fp32 = dequantize(codes, scale.float(), None, schemes[name].weights, torch.float32, gs)
        with torch.no_grad():
            w = layer.method.apply(layer, torch.eye(layer.in_features), None).t()
        assert w.shape == theirs_fp32.shape
        assert (w - theirs_fp32).abs().max() <= 2 ** -22 * w.abs().max()
        oracle = ref.fp4.nvfp4_dequantize(f.get_tensor(name + ".weight_packed"), scale, gs)
        assert (w.double() - oracle).abs().max() <= 2 ** -22 * oracle.abs().max()
        decompressed = d.get_tensor(name + ".weight")
        assert ((w - decompressed).abs() <= 2 ** -8 * w.abs()).all() and not torch.equal(w, decompressed)
    ours, producer = runner_logits(llm), runner_logits(deq_path)
    err = rel_norm(ours, producer)
    print(f"{arch} NVFP4A16 (fp4_gemm): rel err {err:.2e} against the producer's decompressed (bf16-rounded) model, "
          f"{rel_norm(ours, original_logits(arch)):.2e} against the float original")
    assert 0 < err < 1e-2



# ------------------------------------------------------------------------------------------------
# the norms fused with the activation quantisation
# ------------------------------------------------------------------------------------------------

NORM_QUANT_VARIANTS = {  # name -> config groups; each a W8A8 scheme whose input the norm may quantise
    "FP8_DYNAMIC": CT_VARIANTS["FP8_DYNAMIC"][0],
    "FP8": CT_VARIANTS["FP8"][0],  # static per-tensor activation scales
    "W8A8": CT_INT8["W8A8"][0],
    "W8A8-static": lambda: {"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor", dynamic=False,
                                           symmetric=True))},
}


@pytest.fixture(scope="module")
def norm_quant_ckpt(tmp_path_factory):
    made = {}

    def get(variant: str) -> str:
        if variant not in made:
            dst = str(tmp_path_factory.mktemp(f"normquant-{variant}") / "m")
            made[variant] = ct_checkpoint("llama", NORM_QUANT_VARIANTS[variant](), ["lm_head"], dst)[0]
        return made[variant]

    return get


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(NORM_QUANT_VARIANTS))
def test_norm_quant_fusion_is_bit_exact(norm_quant_ckpt, monkeypatch, variant, dtype):
    """Where a norm feeds an fp8 / int8 linear with per-token or static activation scales (every
    layer's input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj), the runner
    calls rms_norm_quant / fused_add_rms_norm_quant; the logits are bit for bit those of the
    unfused norm and quantiser."""
    llm = LLM(norm_quant_ckpt(variant), dtype=dtype, num_kv_blocks=8)
    static = variant in ("FP8", "W8A8-static")
    code = torch.int8 if variant.startswith("W8A8") else torch.float8_e4m3fn
    for layer in llm.model.layers:
        for slot in ("qkv_proj", "gate_up_proj"):
            lin = getattr(layer, slot)
            got = lin.method.input_quantization(lin)
            assert got is not None and got[0] == code and (got[1] is not None) == static, (slot, got)
    ops = llm.model.layers[0].input_layernorm.ops
    calls = []
    for name in ("rms_norm_quant", "fused_add_rms_norm_quant"):
        fn = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    fused = runner_logits(llm)
    n = len(llm.model.layers)
    assert calls.count("rms_norm_quant") == 1 and calls.count("fused_add_rms_norm_quant") == 2 * n - 1, calls
    calls.clear()
    with unfused_norm_quant(llm.model):
        unfused = runner_logits(llm)
    assert not calls
    assert fused.dtype == torch.float32 and torch.isfinite(fused).all()
    assert torch.equal(fused.view(torch.int32), unfused.view(torch.int32))
