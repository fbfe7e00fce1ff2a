"""FP8 mixture-of-experts models (CPU ops, float32): experts quantised on load (``quantization="fp8"``),
compressed-tensors checkpoints written by compressed-tensors itself and Hugging Face fine-grained FP8
checkpoints written by transformers' quantiser, on Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Producers. compressed-tensors quantises per-expert ``nn.Linear`` modules (its targets match modules
of that class): the transformers 5 model's stacked experts are swapped for the hub's per-expert
modules first (:func:`ct_helpers.linearize_experts`, what llm-compressor does to calibrate MoE
models), then :func:`ct_helpers.compress` runs the package's own quantisation, compression and save
and its ``decompress_model`` (the producer's dequantised model). The router is left in float through
the ignore list, as the released FP8 MoE checkpoints do (compressed-tensors adds routers it sees to
the list itself); Qwen2-MoE's ``shared_expert_gate`` too (a one-row gate no runtime quantises).
Fine-grained FP8 checkpoints: transformers' ``FineGrainedFP8HfQuantizer`` op on every projection,
experts included, the router left in float (as the Qwen3 FP8 releases).

Reference. transformers runs the dequantised float model (the producer's dequantisation; for
quantisation on load, the fp64 oracle ``reference.fp8_quantize`` of the float weights, per output
channel) with the eager experts, every quantised input fake-quantised by the same oracle as the
runner quantises it: the dense linears' inputs by forward pre-hooks, and inside transformers' own
experts forward each expert's two GEMM inputs (the routed rows of x, and the activation between the
GEMMs), per row, or per row and 128-group with 128 x 128 blocks. An input within float32 noise of
an e4m3 rounding boundary takes the runner's rounding (counted, at most 1e-4 of the codes; measured
0 to 5 of ~130,000): the runner's activation between the GEMMs is read out of ``fused_moe_fp8``
itself (a ``w2`` that copies its input). FlashAttention's rule: the runner's max logit error
against the float64 reference at most twice the float32 reference's (plus 1e-5), and a relative
norm error below 1e-5 (measured 2.4e-7 to 3.3e-7); without the fake quantisation the same
reference measures what the dynamic fp8 activations cost (2.4e-2 to 4.8e-2), which must be 100x
that. ``test_each_fp8_detail_is_visible``: scales ignored, gate / up halves swapped, block scales
reordered each move the logits 3.7e-2 to 1.2 away.

Also: tensor parallelism (two shards of one layer against an oracle that quantises the activation
per rank slice; two ranks through the engine: blockwise equal to one rank within 1e-5, per channel
within the rounding of the slices), expert parallelism (bit for bit), a router the producer
quantised anyway (dequantised, routing in float), ``fastinfer quantize`` (the logits of quantising
on load), refusals, and the emulated CUDA kernels in bf16.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import fastinfer  # noqa: E402,F401
from fastinfer import reference as ref  # noqa: E402
from fastinfer.engine.llm import LLM  # noqa: E402
from fastinfer.layers import (  # noqa: E402
    ExpertProjections,
    FusedMoE,
    RouterMethod,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
)
from fastinfer.quant import Fp8BlockLinearMethod, Fp8FusedMoEMethod, Fp8LinearMethod  # noqa: E402
from model_helpers import plan_logits as _plan_logits  # noqa: E402
from model_helpers import make_hf_model, prefill_logits, random_prompt, rel_err, unfused_norm_quant  # noqa: E402
from test_quant_formats import _fp8_codes, _snap_ties  # noqa: E402

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme  # noqa: E402
from ct_helpers import compress, linearize_experts  # noqa: E402

VOCAB = 300
PROMPT = random_prompt(25, VOCAB, 7)
FP8_FLOOR = 1e-5
BLOCK = 128

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# hidden 128 (4 / 2 heads of 64), vocab 300, 2 layers; expert widths multiples of 128 where blocks are
# used (256: 128 per rank at tensor_parallel_size=2)
CASES = {
    # 4 experts of width 256, 2 per token (renormalised)
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # layer 0 dense (an fp8 MLP), layer 1 routed: 8 experts of width 256, 3 per token, norm_topk_prob;
    # 4 KV heads (k and v 256 rows: whole 128 x 128 blocks on each of 2 tensor-parallel ranks)
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                                    moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[0])),
    # 8 experts of width 64, 3 per token, a shared expert of width 128, q/k/v biases
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=128, norm_topk_prob=True)),
    # one KV head, 8 experts of width 256, 3 per token (not renormalised), q / k / v clipped at 1.5
    "olmoe": ("olmoe", dict(num_attention_heads=2, num_key_value_heads=1, num_experts=8, num_experts_per_tok=3,
                            clip_qkv=1.5, eos_token_id=2)),
}
ARCHS = list(CASES)
# what the released checkpoints leave in float besides lm_head: the routers (Mixtral's module is
# "mlp" in transformers 5's modules, "block_sparse_moe" in the files) and Qwen2-MoE's shared gate
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$", r"re:.*shared_expert_gate$"]


def _hf(name: str):
    kind, over = CASES[name]
    return make_hf_model(kind, seed=3, **over)


_CACHE: dict = {}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``get(key, build)``: ``build(directory)`` once per module for ``key``."""
    def get(key, build):
        if key not in _CACHE:
            _CACHE[key] = build(str(tmp_path_factory.mktemp("-".join(map(str, key)))))
        return _CACHE[key]

    return get


def float_checkpoint(store, name: str) -> str:
    def build(d):
        _hf(name).save_pretrained(d)
        return d

    return store(("float", name), build)


# ------------------------------------------------------------------------------------------------
# the reference: transformers with every quantised input fake-quantised by the fp64 oracle
# ------------------------------------------------------------------------------------------------
def _unit_down(moe: FusedMoE, first: int, n: int):
    """``w2`` (and ones for its scales) whose every expert copies activation columns
    ``first .. first + n - 1`` to outputs ``0 .. n - 1`` (a 1.0 per row: each output IS that input)."""
    E, H, I = moe.num_local_experts, moe.hidden_size, moe.local_intermediate_size
    w2 = torch.zeros(E, H, I)
    w2[:, torch.arange(n), first + torch.arange(n)] = 1.0
    return w2.to(torch.float8_e4m3fn), torch.ones_like(moe.w2_scale)


def _activations_of_each_slot(moe: FusedMoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, k, I]``: the activation ``fused_moe_fp8`` multiplies by ``w2`` for each token and slot,
    dequantised (``aq * sa``), read out of the op itself: with ``w2`` copying its input columns to
    its outputs and weight 1 per slot, the output is that activation exactly (one product of 1.0 per
    output, fp32)."""
    T, k = ids.shape
    H, I = moe.hidden_size, moe.local_intermediate_size
    out = torch.empty(T, k, I)
    for first in range(0, I, H):
        n = min(H, I - first)
        w2, w2_scale = _unit_down(moe, first, n)
        for j in range(k):
            y = moe.ops.fused_moe_fp8(x, moe.w13, w2, moe.w13_scale, w2_scale, torch.ones(T, 1),
                                      ids[:, j:j + 1].contiguous(), "silu")
            out[:, j, first:first + n] = y[:, :n]
    return out


def runner_trace(llm: LLM):
    """The runner's logits of PROMPT and what it quantised: each decoder linear's input (by checkpoint
    module name) and each MoE layer's input rows and per-slot activations (by layer index)."""
    trace = {"linear": {}, "moe": {}}
    hooks = []
    for m in llm.model.linear_layers():
        def linear_hook(mod, args, m=m):
            for p in m.parts:
                trace["linear"][p.prefix] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()
        hooks.append(m.register_forward_pre_hook(linear_hook))
    for i, layer in enumerate(llm.model.layers):
        if layer.moe is None:
            continue

        def moe_hook(mod, args, out, i=i):
            x = args[0].detach().clone()
            _, ids = mod.ops.moe_topk(mod.router(x), mod.top_k, mod.renormalize, "softmax")
            trace["moe"][i] = (x, _activations_of_each_slot(mod, x, ids) if isinstance(mod.method, Fp8FusedMoEMethod)
                               else None)
        hooks.append(layer.moe.register_forward_hook(moe_hook))
    try:
        with unfused_norm_quant(llm.model):
            return prefill_logits(llm.model, PROMPT), trace
    finally:
        for h in hooks:
            h.remove()


def fake_quantize(x: torch.Tensor, mode: str, runner: torch.Tensor, stats: dict) -> torch.Tensor:
    """``x`` quantised to e4m3 and back by ``reference.fp8_quantize`` (per row, "token", or per row and
    128-group, "group", or 64-group, "act"), in x's dtype; a code at a rounding tie within float32
    noise takes the runner's rounding of the same value (``runner``: its input, same rows), counted
    in ``stats``."""
    x2 = x.reshape(-1, x.shape[-1])
    assert mode != "group" or x2.shape[1] % BLOCK == 0
    q, s = _fp8_codes(x2, mode, None)
    q = _snap_ties(q, s, x2, _fp8_codes(runner.reshape(x2.shape), mode, None)[0], stats)
    stats["codes"] = stats.get("codes", 0) + q.numel()
    return (q.double() * s.double()).to(x.dtype).reshape(x.shape)


def _fake_quantise_experts(layer_idx: int, experts, mode: str, trace: dict, stats: dict) -> None:
    """Run transformers' own experts forward with both GEMM inputs fake-quantised: its input rows
    before it (every expert's gate/up GEMM gathers them; ``mode``), and, while it runs,
    ``torch.nn.functional.linear``'s input when it multiplies by a ``down_proj`` (expert ``e``'s
    rows: its tokens in transformers' order, ``torch.where`` over ``[slot, token]``; per 64-group,
    as fused_moe_fp8 quantises the activation with either weight format)."""
    original = torch.nn.functional.linear
    down = experts.down_proj
    x_run, a_run = trace["moe"][layer_idx]
    state = {}

    def linear(x, w, b=None):
        if w.shape != down.shape[1:]:  # gate/up: rows of the already fake-quantised input
            return original(x, w, b)
        e = (w.data_ptr() - down.data_ptr()) // (down.stride(0) * down.element_size())
        slot, token = torch.where((state["ids"] == e).t())
        return original(fake_quantize(x, "act", a_run[token, slot], stats), w, b)

    def pre(mod, args):
        hidden, ids, weights = args
        state["ids"] = ids
        torch.nn.functional.linear = linear
        return fake_quantize(hidden, mode, x_run, stats), ids, weights

    def post(mod, args, out):
        torch.nn.functional.linear = original

    experts.register_forward_pre_hook(pre)
    experts.register_forward_hook(post)


def reference_logits(model, dense: list, mode, trace: dict, stats: dict, weights=None) -> torch.Tensor:
    """The transformers ``model``'s logits of PROMPT (float64); ``weights``: parameter name -> float
    value to run with instead; ``mode`` ("token" / "group", None: float activations): the inputs of
    the linears named in ``dense`` and of every expert fake-quantised, ties resolved as the runner
    (``trace``, :func:`runner_trace`) did."""
    with torch.no_grad():
        for name, value in (weights or {}).items():
            model.get_parameter(name).copy_(value)
    if mode is not None:
        for name in dense:
            model.get_submodule(name).register_forward_pre_hook(
                lambda mod, args, name=name: (fake_quantize(args[0], mode, trace["linear"][name], stats),))
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "experts"):
                _fake_quantise_experts(i, layer.mlp.experts, mode, trace, stats)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].double()


def load_reference(path: str, dtype):
    """transformers' model of checkpoint ``path`` in ``dtype``, its experts run by their eager loop
    (one ``nn.functional.linear`` per expert and GEMM, which the fake quantisation hooks into)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()


def check_fp8(llm: LLM, reference, what: str) -> dict:
    """FlashAttention's rule against ``reference(dtype, mode, trace, stats)`` (fake-quantised), and
    the cost of the fp8 activations (``mode`` None); returns the figures and the runner's logits."""
    out, trace = runner_trace(llm)
    stats: dict = {}
    ref64, ref32 = reference(torch.float64, True, trace, stats), reference(torch.float32, True, trace, stats)
    float_acts = reference(torch.float64, False, trace, {})
    err = float((out.double() - ref64).abs().max())
    naive = float((ref32 - ref64).abs().max())
    figures = dict(rel=rel_err(out, ref64), max=err, max_fp32=naive, activations=rel_err(out, float_acts),
                   ties=stats.get("snapped", 0), codes=stats["codes"], logits=out)
    print(f"{what}: rel err {figures['rel']:.2e}, max {err:.2e} (torch fp32: {naive:.2e}); vs float activations "
          f"{figures['activations']:.2e}; {figures['ties']} of {figures['codes']} reference codes at a tie")
    assert figures["ties"] <= 1e-4 * figures["codes"], (what, figures)
    assert err <= 2 * naive + FP8_FLOOR, (what, figures)
    assert figures["rel"] < 1e-5, (what, figures)
    assert figures["activations"] > 100 * figures["rel"], (what, figures)  # the activations are quantised
    return figures


def _moe_layers(model):
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def _dense_fp8_names(hf) -> list:
    """The decoder linears the runner quantises (not the routers, not Qwen2-MoE's shared gate)."""
    return [name for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in name
            and not name.endswith("shared_expert_gate")]


# ------------------------------------------------------------------------------------------------
# quantisation on load
# ------------------------------------------------------------------------------------------------
def _per_channel(w: torch.Tensor):
    """The fp64 oracle's per-output-channel e4m3 codes and scales of ``w [N, K]``, and its dequantisation."""
    q, s = ref.fp8_quantize(w.float(), "token")
    return q, s, q.double() * s.double()[:, None]


@pytest.mark.parametrize("name", ARCHS)
def test_fp8_on_load_matches_fake_quantised_transformers(store, name):
    """``quantization="fp8"``: the experts' codes and scales are the oracle's per-channel ones
    (amax / 448 per weight row, bit for bit), the router, lm_head (and Qwen2-MoE's shared gate) stay
    float, the dense linears are fp8 as in a dense model; the logits are transformers' on the
    dequantised weights with fake-quantised inputs (FlashAttention's rule)."""
    path = float_checkpoint(store, name)
    llm = LLM(path, num_kv_blocks=8, quantization="fp8")
    hf = load_reference(path, torch.float64)
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Fp8FusedMoEMethod and not m.method.blockwise for m in moes)
    for m in moes:
        assert type(m.router.method) is RouterMethod and m.router.weight.dtype == torch.float32
        assert m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn
    assert type(llm.model.lm_head.method) is UnquantizedLinearMethod
    linears = [m for m in llm.model.linear_layers() if m is not llm.model.lm_head and not m.prefix.endswith(".gate")]
    assert linears and all(type(m.method) is Fp8LinearMethod for m in linears)
    # the experts as the oracle quantises them, and the dequantised weights of the reference
    weights = {}
    for i, (layer, ours) in enumerate(zip(hf.model.layers, llm.model.layers)):
        if ours.moe is None:
            continue
        m, experts = ours.moe, layer.mlp.experts
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        deq13 = weights[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.empty_like(gate_up, dtype=torch.float64)
        deq2 = weights[f"model.layers.{i}.mlp.experts.down_proj"] = torch.empty_like(down, dtype=torch.float64)
        for e in range(gate_up.shape[0]):
            q13, s13, deq13[e] = _per_channel(gate_up[e])
            q2, s2, deq2[e] = _per_channel(down[e])
            assert torch.equal(m.w13[e].view(torch.uint8), q13.view(torch.uint8)) and torch.equal(m.w13_scale[e], s13)
            assert torch.equal(m.w2[e].view(torch.uint8), q2.view(torch.uint8)) and torch.equal(m.w2_scale[e], s2)
    dense = _dense_fp8_names(hf)
    for n in dense:
        weights[n + ".weight"] = _per_channel(hf.get_submodule(n).weight.detach())[2]

    def reference(dtype, quantised, trace, stats):
        return reference_logits(load_reference(path, dtype), dense, "token" if quantised else None, trace, stats,
                                {k: v.to(dtype) for k, v in weights.items()})

    check_fp8(llm, reference, f"{name} fp8 on load")


# ------------------------------------------------------------------------------------------------
# compressed-tensors
# ------------------------------------------------------------------------------------------------
CT_VARIANTS = {  # name -> (config groups, blockwise)
    "FP8_DYNAMIC": (lambda: {"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}, False),
    "FP8-tensor-weights": (lambda: {"group_0": QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="tensor"),
        input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True))}, False),
    "FP8_BLOCK": (lambda: {"group_0": preset_name_to_scheme("FP8_BLOCK", ["Linear"])}, True),
}


def ct_checkpoint(store, name: str, variant: str):
    """``(ct_path, deq_path, schemes)`` of CASES[name] quantised by compressed-tensors."""
    def build(d):
        groups, _ = CT_VARIANTS[variant]
        return compress(linearize_experts(_hf(name)), groups(), IGNORE, d + "/m", None)

    return store(("ct", name, variant), build)


CT_CASES = [(a, "FP8_DYNAMIC") for a in ARCHS] + [("mixtral", "FP8-tensor-weights"), ("qwen3_moe", "FP8_BLOCK"),
                                                  ("olmoe", "FP8_BLOCK")]


@pytest.mark.parametrize("name,variant", CT_CASES)
def test_compressed_tensors_moe_matches_dequantised_float(store, name, variant):
    ct_path, deq_path, schemes = ct_checkpoint(store, name, variant)
    blockwise = CT_VARIANTS[variant][1]
    qc = json.load(open(os.path.join(ct_path, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    from safetensors import safe_open

    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        expert = next(n for n in sorted(names) if ".experts.1." in n and n.endswith(".weight"))
        assert f.get_tensor(expert).dtype == torch.float8_e4m3fn, expert  # the experts are quantised
        router = next(n for n in names if n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")))
        assert f.get_tensor(router).dtype == torch.float32, router  # the router is not
        scale = f.get_tensor(expert + "_scale")
    llm = LLM(ct_path, num_kv_blocks=8)
    moes = _moe_layers(llm.model)
    assert moes and all(type(m.method) is Fp8FusedMoEMethod and m.method.blockwise == blockwise for m in moes)
    assert all(type(m.router.method) is RouterMethod for m in moes)
    dense_cls = Fp8BlockLinearMethod if blockwise else Fp8LinearMethod
    linears = [m for m in llm.model.linear_layers() if m is not llm.model.lm_head and not m.prefix.endswith(".gate")]
    assert all(type(m.method) is dense_cls for m in linears)
    if variant == "FP8-tensor-weights":  # one scale per projection, repeated over its rows: exact
        assert expert == "model.layers.0.block_sparse_moe.experts.1.w1.weight" and scale.numel() == 1
        got = moes[0].w13_scale[1, :moes[0].intermediate_size]
        assert torch.equal(got, scale.float().reshape(1).expand_as(got))
    dense = [n for n in schemes if ".experts." not in n]
    mode = "group" if blockwise else "token"

    def reference(dtype, quantised, trace, stats):
        return reference_logits(load_reference(deq_path, dtype), dense, mode if quantised else None, trace, stats)

    figures = check_fp8(llm, reference, f"{name} {variant}")
    out = figures["logits"]
    # transformers loading the directory itself: it dequantises the experts (no activation
    # quantisation there) and runs the dense linears through compressed-tensors' forward; it
    # multiplies each expert's codes by its weight_scale as is, which 128 x 128 blocks do not fit
    # (transformers 5.24 fails to load them)
    if blockwise:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(ct_path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0]
    err = rel_err(out, theirs)
    print(f"{name} {variant}: rel err vs transformers + compressed-tensors {err:.2e}")
    assert err < 2 * figures["activations"] + 1e-4, err


# ------------------------------------------------------------------------------------------------
# Hugging Face fine-grained FP8 (128 x 128 blocks, weight_scale_inv)
# ------------------------------------------------------------------------------------------------
def hf_fp8_checkpoint(store, name: str, not_convert=()):
    """``(fp8_path, deq_path)``: CASES[name] quantised by transformers' fine-grained FP8 quantiser op
    (every decoder projection, experts included, but those whose module name starts with one of
    ``not_convert``; routers, norms, embedding and lm_head stay float), and the float checkpoint of
    transformers' own dequantisation of it (loading it on a CPU dequantises)."""
    def build(d):
        from safetensors.torch import load_file, save_file
        from transformers import FineGrainedFP8Config
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        _hf(name).save_pretrained(d + "/float")
        qcfg = FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK), modules_to_not_convert=list(not_convert) or None)
        op = FineGrainedFP8HfQuantizer(qcfg).get_quantize_ops()
        out = {}
        for key, w in load_file(os.path.join(d, "float", "model.safetensors")).items():
            convert = ".layers." in key and key.endswith("proj.weight") and not key.startswith(tuple(not_convert))
            out.update(op.convert({key: w}) if convert else {key: w})
        os.makedirs(d + "/fp8")
        save_file(out, os.path.join(d, "fp8", "model.safetensors"), metadata={"format": "pt"})
        cfg = json.load(open(os.path.join(d, "float", "config.json")))
        json.dump(dict(cfg, quantization_config=qcfg.to_dict()), open(os.path.join(d, "fp8", "config.json"), "w"))
        hf = transformers.AutoModelForCausalLM.from_pretrained(d + "/fp8", dtype=torch.float32).eval()
        os.makedirs(d + "/deq")
        save_file({k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()},
                  os.path.join(d, "deq", "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(os.path.join(d, "float", "config.json"), os.path.join(d, "deq", "config.json"))
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT])).logits[0]
        return d + "/fp8", d + "/deq", logits

    return store(("hf-fp8", name) + tuple(not_convert), build)


def test_hf_fine_grained_fp8_moe(store):
    """Qwen3-MoE with every projection in 128 x 128 fp8 blocks (the Qwen3-*-FP8 layout): blockwise
    experts and dense linears, the router float; against transformers' dequantisation of the same
    directory with fake-quantised inputs (per 1 x 128 group)."""
    fp8_path, deq_path, theirs = hf_fp8_checkpoint(store, "qwen3_moe")
    from safetensors import safe_open

    with safe_open(os.path.join(fp8_path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
        assert list(f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight_scale_inv").shape) == [1, 2]
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32
    llm = LLM(fp8_path, num_kv_blocks=8)
    moe = llm.model.layers[1].moe
    assert type(moe.method) is Fp8FusedMoEMethod and moe.method.blockwise
    assert moe.w13_scale.shape == (8, 4, 1) and moe.w2_scale.shape == (8, 1, 2)
    assert type(moe.router.method) is RouterMethod
    linears = [m for m in llm.model.linear_layers() if m is not llm.model.lm_head and m is not moe.router]
    assert all(type(m.method) is Fp8BlockLinearMethod for m in linears)
    # the float checkpoint holds the weights transformers ran
    assert rel_err(prefill_logits(LLM(deq_path, num_kv_blocks=8).model, PROMPT), theirs) < 1e-5
    hf = load_reference(deq_path, torch.float64)
    dense = _dense_fp8_names(hf)

    def reference(dtype, quantised, trace, stats):
        return reference_logits(load_reference(deq_path, dtype), dense, "group" if quantised else None, trace, stats)

    figures = check_fp8(llm, reference, "qwen3_moe fine-grained fp8")
    assert torch.equal(prefill_logits(LLM(fp8_path, num_kv_blocks=8, quantization="fp8").model, PROMPT),
                       figures["logits"])  # as stored


def test_experts_stored_in_float_load_in_float(store):
    """Experts a quantised checkpoint leaves in float (``modules_to_not_convert``) run as float
    experts; the rest of the model as stored."""
    fp8_path, deq_path, _ = hf_fp8_checkpoint(store, "qwen3_moe", ["model.layers.1.mlp.experts"])
    llm = LLM(fp8_path, num_kv_blocks=8)
    moe = llm.model.layers[1].moe
    assert type(moe.method) is UnquantizedFusedMoEMethod and moe.w13.dtype == torch.float32
    assert not hasattr(moe, "w13_scale")
    assert type(llm.model.layers[1].qkv_proj.method) is Fp8BlockLinearMethod
    float_moe = LLM(deq_path, num_kv_blocks=8).model.layers[1].moe
    assert torch.equal(moe.w13, float_moe.w13) and torch.equal(moe.w2, float_moe.w2)


# ------------------------------------------------------------------------------------------------
# each detail matters
# ------------------------------------------------------------------------------------------------
def _undo(moe: FusedMoE, detail: str) -> None:
    I = moe.local_intermediate_size
    if detail == "w13 scales":
        moe.w13_scale.fill_(1.0 / 448)
    elif detail == "w2 scales":
        moe.w2_scale.copy_(moe.w2_scale.mean())
    elif detail == "gate / up halves":
        s_gate, s_up = moe.w13_scale.split(moe.w13_scale.shape[1] // 2, dim=1)
        moe.w13.copy_(torch.cat([moe.w13[:, I:], moe.w13[:, :I]], dim=1))
        moe.w13_scale.copy_(torch.cat([s_up, s_gate], dim=1))
    elif detail == "block scale order":  # each block row's scales in reverse order
        moe.w13_scale.copy_(moe.w13_scale.flip(1))
        moe.w2_scale.copy_(moe.w2_scale.flip(2))
    else:
        raise AssertionError(detail)


@pytest.mark.parametrize("name,variant,detail", [
    ("mixtral", "FP8_DYNAMIC", "w13 scales"), ("mixtral", "FP8_DYNAMIC", "w2 scales"),
    ("mixtral", "FP8_DYNAMIC", "gate / up halves"), ("qwen3_moe", "FP8_BLOCK", "gate / up halves"),
    ("qwen3_moe", "FP8_BLOCK", "block scale order"),
])
def test_each_fp8_detail_is_visible(store, name, variant, detail):
    """Undoing one detail of the loaded experts (their scales, which half of w13 is gate, the
    order of the block scales) moves the logits 1000 x the parity tolerance away from the
    producer's dequantised model with the fake-quantised inputs."""
    ct_path, deq_path, schemes = ct_checkpoint(store, name, variant)
    mode = "group" if CT_VARIANTS[variant][1] else "token"
    llm = LLM(ct_path, num_kv_blocks=8)
    _, trace = runner_trace(llm)
    ref64 = reference_logits(load_reference(deq_path, torch.float64), [n for n in schemes if ".experts." not in n],
                             mode, trace, {})
    with torch.no_grad():
        for moe in _moe_layers(llm.model):
            _undo(moe, detail)
    err = rel_err(prefill_logits(llm.model, PROMPT), ref64)
    print(f"{name} {variant} without {detail}: rel err {err:.2e}")
    assert err > 1000 * 1e-5, (detail, err)


# ------------------------------------------------------------------------------------------------
# tensor and expert parallelism
# ------------------------------------------------------------------------------------------------
H_LAYER, I_LAYER, E_LAYER, K_LAYER = 128, 256, 4, 2
PROJ = ExpertProjections("w1", "w3", "w2")


def _layer_tensors(blockwise: bool):
    """One MoE layer's checkpoint tensors (``moe.gate``, ``moe.experts.{e}.w1 / w3 / w2``): float, or
    with ``blockwise`` each projection in transformers' fine-grained fp8 (``weight`` e4m3 +
    ``weight_scale_inv``, its quantiser op); and the dequantised float weights ``[E, 2I, H]``,
    ``[E, H, I]`` (fp64) the layer must compute with."""
    g = torch.Generator().manual_seed(4)
    t = {"moe.gate.weight": torch.randn(E_LAYER, H_LAYER, generator=g) * 0.5}
    for e in range(E_LAYER):
        for p, shape in (("w1", (I_LAYER, H_LAYER)), ("w3", (I_LAYER, H_LAYER)), ("w2", (H_LAYER, I_LAYER))):
            t[f"moe.experts.{e}.{p}.weight"] = torch.randn(shape, generator=g) * 0.2
    if blockwise:
        from transformers import FineGrainedFP8Config
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        op = FineGrainedFP8HfQuantizer(FineGrainedFP8Config()).get_quantize_ops()
        for key in [k for k in t if ".experts." in k]:
            t.update(op.convert({key: t.pop(key)}))

    def deq(key):
        if not blockwise:
            return _per_channel(t[key])[2]
        s = t[key + "_scale_inv"].double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return t[key].double() * s

    w13 = torch.stack([torch.cat([deq(f"moe.experts.{e}.w1.weight"), deq(f"moe.experts.{e}.w3.weight")])
                       for e in range(E_LAYER)])
    w2 = torch.stack([deq(f"moe.experts.{e}.w2.weight") for e in range(E_LAYER)])
    return t, w13, w2


def _fp8_layer(tensors, blockwise: bool, tp=None) -> FusedMoE:
    from fastinfer.layers import TensorDictReader
    from fastinfer.ops import backend
    from fastinfer.quant import CheckpointQuantization, OnLoadQuantization, QuantOptions, StoredQuantization

    if blockwise:
        qc = CheckpointQuantization(StoredQuantization("fp8", "fp8", {"quant_method": "fp8"}))
    else:
        qc = OnLoadQuantization(QuantOptions("fp8"))
    kw = dict(tp=tp, reduce_results=False) if tp is not None else {}
    m = FusedMoE(H_LAYER, I_LAYER, E_LAYER, K_LAYER, True, "moe", PROJ, dtype=torch.float32, device="cpu",
                 ops=backend(), quant_config=qc, **kw)
    reader = TensorDictReader(tensors)
    m.router.load_from(reader)
    m.load_from(reader)
    return m


@pytest.mark.parametrize("blockwise", [False, True], ids=["per-channel", "blockwise"])
def test_tensor_parallel_shards_of_fp8_experts(blockwise):
    """Two tensor-parallel shards of one fp8 MoE layer (built in this process, their partial sums
    added as the all-reduce does): each holds its rows of gate and up with their scales (blocks) and
    its columns of down with every row's scale, and together they compute the unsharded experts'
    MLPs with the activation between the GEMMs quantised per 64-group (a rank's slice holds whole
    groups: the codes of one rank). Oracle: the dequantised checkpoint weights (fp64), inputs
    fake-quantised by ``reference.fp8_quantize``."""
    from fastinfer.distributed import ParallelInfo

    tensors, w13, w2 = _layer_tensors(blockwise)
    whole = _fp8_layer(tensors, blockwise)
    shards = [_fp8_layer(tensors, blockwise, ParallelInfo(r, 2)) for r in range(2)]
    local = I_LAYER // 2
    assert shards[1].w13.shape == (E_LAYER, 2 * local, H_LAYER) and shards[1].w2.shape == (E_LAYER, H_LAYER, local)
    assert torch.equal(shards[1].w13[:, :local].view(torch.uint8), whole.w13[:, local:I_LAYER].view(torch.uint8))
    x = torch.randn(37, H_LAYER, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        weights, ids = whole.ops.moe_topk(whole.router(x), K_LAYER, True, "softmax")
        out = shards[0](x) + shards[1](x)
        one = whole(x)
    mode, group = "group", ref.moe.ACT_GROUP

    def fq(v, size):
        q, s = ref.fp8_quantize(v.float().contiguous(), mode, size)
        return (q.double().view(v.shape[0], -1, size) * s.double()[..., None]).view(v.shape)

    want = torch.zeros(37, H_LAYER, dtype=torch.float64)
    xq = fq(x, BLOCK) if blockwise else _per_channel(x)[2]
    for t in range(37):
        for j in range(K_LAYER):
            e = int(ids[t, j])
            h = xq[t:t + 1] @ w13[e].t()
            a = (torch.nn.functional.silu(h[:, :I_LAYER]) * h[:, I_LAYER:]).float()
            want[t] += float(weights[t, j]) * (fq(a, group)[0] @ w2[e].t())
    err, err_one = rel_err(out, want), rel_err(one, want)
    print(f"{'blockwise' if blockwise else 'per channel'}: two shards rel err {err:.2e} against the "
          f"per-slice oracle; one rank {err_one:.2e} against it")
    assert err < 1e-5 and err_one < 1e-5  # the same codes


def test_blockwise_experts_refuse_a_tensor_parallel_cut_inside_a_block():
    from fastinfer.distributed import ParallelInfo

    tensors, _, _ = _layer_tensors(True)
    with pytest.raises(ValueError, match=r"^moe: fp8 experts in 128 x 128 blocks need the hidden size \(128\) and "
                                         r"each rank's expert intermediate size \(64 of 256 on each of "
                                         r"tensor_parallel_size=4 ranks\) to be multiples of 128 \(fused_moe_fp8\)$"):
        _fp8_layer(tensors, True, ParallelInfo(0, 4))


def _parallel_cases(store):
    """(label, checkpoint, quantization, blockwise): per-channel experts quantised on load, and
    compressed-tensors FP8_BLOCK (expert width 256: 128 per rank)."""
    return [("qwen2_moe fp8 on load", float_checkpoint(store, "qwen2_moe"), "fp8", False),
            ("qwen3_moe FP8_BLOCK", ct_checkpoint(store, "qwen3_moe", "FP8_BLOCK")[0], None, True)]


ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=16, block_size=16)
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_tp2_equals_one_rank(store, engines, monkeypatch):
    """``tensor_parallel_size=2`` (rank 0 here, one spawned worker; each expert's intermediate
    dimension split, with its scales): blockwise experts (128 of a's columns per rank: whole
    groups) give one rank's greedy tokens and its logits within 1e-4 -- not bitwise: the layer
    before the experts already differs by the all-reduce's fp32 order (1.3e-6 in the MoE input
    here), and a code at a rounding tie may go the other way (here one such flip moves the logits
    by 3.9e-5; with a's groups of 32 or 128 none flips, 3e-7); per-channel experts here hold 32 of
    a's columns per rank, so their groups differ from one rank's 64 and they differ by that
    rounding (test_tensor_parallel_shards_of_fp8_experts: exact against that oracle), less than the
    whole fp8 model differs from the float one."""
    from fastinfer import SamplingParams

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    for label, path, quantization, blockwise in _parallel_cases(store):
        one = engines(path, quantization=quantization, **ENGINE)
        tp = engines(path, quantization=quantization, tensor_parallel_size=2, **ENGINE)
        moe = next(layer.moe for layer in tp.model.layers if layer.moe is not None)  # rank 0's shard
        assert type(moe.method) is Fp8FusedMoEMethod and moe.w2.shape[2] == moe.intermediate_size // 2
        a, b = _plan_logits(one, PROMPT), _plan_logits(tp, PROMPT)
        err = rel_err(b, a)
        print(f"{label}: tensor_parallel_size=2 against one rank: rel err {err:.2e}")
        if blockwise:
            assert err < 1e-4
            params = SamplingParams(**GREEDY)
            assert [o.outputs[0].token_ids for o in tp.generate([PROMPT], params)] == \
                [o.outputs[0].token_ids for o in one.generate([PROMPT], params)]
        else:  # the per-slice rounding is a rounding of the same size as the one-rank one, no more
            err_fp8 = rel_err(a, _plan_logits(engines(path, **ENGINE), PROMPT))
            print(f"{label}: one rank against the float model: rel err {err_fp8:.2e}")
            assert 0 < err < err_fp8


def test_ep2_equals_one_process_bit_for_bit(store, engines, monkeypatch):
    """``expert_parallel_size=2``: half the fp8 experts on each rank, whole; the logits of every
    prefill row and a decode row equal one process's bit for bit (float32: a row's quantisation is
    its own, and each slot's output returns unweighted), and so do the greedy tokens."""
    from fastinfer import SamplingParams

    monkeypatch.setenv("FASTINFER_TP_THREADS", "1")
    for label, path, quantization, blockwise in _parallel_cases(store):
        one = engines(path, quantization=quantization, **ENGINE)
        ep = engines(path, quantization=quantization, expert_parallel_size=2, **ENGINE)
        moe = next(layer.moe for layer in ep.model.layers if layer.moe is not None)
        assert type(moe.method) is Fp8FusedMoEMethod and moe.method.blockwise == blockwise
        assert moe.w13.shape[0] == moe.num_experts // 2 and moe.w13_scale.shape[0] == moe.num_experts // 2
        a, b = _plan_logits(one, PROMPT), _plan_logits(ep, PROMPT)
        assert torch.equal(a, b), f"{label}: max |diff| {(a - b).abs().max():.3e}"
        params = SamplingParams(**GREEDY)
        assert [o.outputs[0].token_ids for o in ep.generate([PROMPT], params)] == \
            [o.outputs[0].token_ids for o in one.generate([PROMPT], params)]
        assert min(ep.stats()["expert_parallel_routed_slots"]) > 0


# ------------------------------------------------------------------------------------------------
# the router, fastinfer quantize, refusals
# ------------------------------------------------------------------------------------------------
def test_a_router_the_checkpoint_quantised_runs_dequantised(store):
    """Routers as ``nn.Linear`` (transformers 4's modules) and only lm_head ignored: compressed-tensors
    quantises them too. The runner still routes in float: the router's weight is the producer's
    dequantisation exactly, and the model matches transformers on the dequantised model (the
    router's input not quantised)."""
    from safetensors import safe_open

    ct_path, deq_path, schemes = store(("ct-router",), lambda d: compress(
        linearize_experts(_hf("qwen3_moe"), router_linear=True), CT_VARIANTS["FP8_DYNAMIC"][0](), ["lm_head"],
        d + "/m", None))
    assert "model.layers.1.mlp.gate" in schemes
    with safe_open(os.path.join(ct_path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float8_e4m3fn
    with safe_open(os.path.join(deq_path, "model.safetensors"), "pt") as f:
        deq_router = f.get_tensor("model.layers.1.mlp.gate.weight")
    llm = LLM(ct_path, num_kv_blocks=8)
    router = llm.model.layers[1].moe.router
    assert type(router.method) is RouterMethod and torch.equal(router.weight, deq_router)
    dense = [n for n in schemes if ".experts." not in n and not n.endswith("mlp.gate")]

    def reference(dtype, quantised, trace, stats):
        return reference_logits(load_reference(deq_path, dtype), dense, "token" if quantised else None, trace, stats)

    check_fp8(llm, reference, "qwen3_moe FP8_DYNAMIC, router quantised by the producer")


def test_router_named_by_the_config_stays_float(store, tmp_path):
    """The config's ignore list without the routers (its ``Linear`` target then names them): the
    router loads in float as stored, the model unchanged."""
    ct_path, _, _ = ct_checkpoint(store, "qwen3_moe", "FP8_DYNAMIC")
    edited = str(tmp_path / "m")
    shutil.copytree(ct_path, edited)
    cfg = json.load(open(os.path.join(edited, "config.json")))
    cfg["quantization_config"]["ignore"] = ["lm_head"]
    json.dump(cfg, open(os.path.join(edited, "config.json"), "w"))
    out = prefill_logits(LLM(edited, num_kv_blocks=8).model, PROMPT)
    assert torch.equal(out, prefill_logits(LLM(ct_path, num_kv_blocks=8).model, PROMPT))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_quantize_cli_writes_what_loading_quantises(store, tmp_path, name):
    """``fastinfer quantize --method fp8`` quantises the experts as loading with quantization="fp8"
    does (e4m3 + per-row ``weight_scale`` per expert projection; routers, lm_head and the shared
    gate float): the two models give the same logits, bit for bit."""
    from safetensors import safe_open

    from fastinfer.quant import QuantOptions, quantize_checkpoint

    path = float_checkpoint(store, name)
    out = str(tmp_path / "fp8")
    quantize_checkpoint(path, out, QuantOptions("fp8"))
    moe, down = ("block_sparse_moe", "w2") if name == "mixtral" else ("mlp", "down_proj")
    prefix = f"model.layers.1.{moe}.experts.2.{down}"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.get_tensor(prefix + ".weight").dtype == torch.float8_e4m3fn
        assert list(f.get_tensor(prefix + ".weight_scale").shape) == [128]
        assert f.get_tensor(f"model.layers.1.{moe}.gate.weight").dtype == torch.float32
    stored = LLM(out, num_kv_blocks=8)
    assert type(stored.model.layers[1].moe.method) is Fp8FusedMoEMethod
    on_load = LLM(path, num_kv_blocks=8, quantization="fp8")
    assert torch.equal(prefill_logits(stored.model, PROMPT), prefill_logits(on_load.model, PROMPT))
    with pytest.raises(ValueError, match=r"quantization='int8' does not quantise mixture-of-experts experts"):
        quantize_checkpoint(path, str(tmp_path / "int8"), QuantOptions("int8"))


def _ct_config(weights: dict, activations, fmt: str, ignore=("lm_head",), targets=("Linear",)) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": list(targets), "weights": weights,
                                          "input_activations": activations}}}


_FP8_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}


@pytest.mark.parametrize("qc,match", [
    (_ct_config(_FP8_CHANNEL, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
                "float-quantized"),
     r"^moe\.experts\.0\.w1: compressed-tensors scheme float-quantized FP8 \(per-channel weights, static "
     r"activations\) of config group 'group_0' is not supported for experts"),
    (_ct_config(_FP8_CHANNEL, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True},
                "float-quantized"),
     r"^moe\.experts\.0\.w1: .*\(per-channel weights, tensor activations\) .* is not supported for experts"),
    (_ct_config({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
                {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True},
                "int-quantized"),
     r"^moe\.experts\.0\.w1: compressed-tensors scheme int-quantized .* not supported for experts"),
    (_ct_config(_FP8_CHANNEL, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
                "float-quantized", targets=[r"re:.*experts\.[01]\..*"]),
     r"^moe: the experts have different compressed-tensors schemes \(moe\.experts\.0\.w1: group_0, "
     r"moe\.experts\.2\.w1: ignored \(float\)\); every expert projection of a layer must share one$"),
    ({"quant_method": "fastinfer", "format_version": 1, "method": "int8"},
     r"^moe: fastinfer int8 experts are not supported \(mixture-of-experts checkpoints load with fp8 or int4 "
     r"experts"),
])
def test_unsupported_expert_quantisations_are_refused(qc, match):
    """Each a ``ValueError`` line naming the layer (or the expert projection) and the scheme, when the
    model is built."""
    from fastinfer.ops import backend
    from fastinfer.quant import resolve_quantization

    quant = resolve_quantization({"quantization_config": qc})
    with pytest.raises(ValueError, match=match) as e:
        FusedMoE(H_LAYER, I_LAYER, E_LAYER, K_LAYER, True, "moe", PROJ, dtype=torch.float32, device="meta",
                 ops=backend(), quant_config=quant)
    assert "\n" not in str(e.value)


def test_static_fp8_experts_refused_through_the_engine(store, tmp_path):
    """The FP8 preset (static per-tensor activation scales) in a MoE checkpoint's config: refused
    naming the first expert projection, before any weight is read."""
    ct_path, _, _ = ct_checkpoint(store, "mixtral", "FP8_DYNAMIC")
    edited = str(tmp_path / "m")
    shutil.copytree(ct_path, edited)
    cfg = json.load(open(os.path.join(edited, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(strategy="tensor",
                                                                                     dynamic=False)
    json.dump(cfg, open(os.path.join(edited, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.block_sparse_moe\.experts\.0\.w1: compressed-tensors "
                                         r"scheme .*static activations.* not supported for experts"):
        LLM(edited, num_kv_blocks=8)


# ------------------------------------------------------------------------------------------------
# the CUDA kernel sources (simt emulator)
# ------------------------------------------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("name,variant", [("qwen2_moe", "FP8_DYNAMIC"), ("qwen3_moe", "FP8_BLOCK")])
def test_sim_fp8_moe(store, name, variant):
    """bf16 prefill of an fp8 MoE model on ``torch.ops.fastinfer_sim`` (fused_moe_fp8 per channel /
    blockwise, moe_topk, the fp8 GEMMs, attention on the kernel sources), bit-identical across
    schedule seeds, at most 2x as far from the fp32 CPU result as the CPU ops in bf16."""
    from conftest import SIM_SEEDS, raw_bits, require_sim, sim_seed

    from fastinfer.engine.checkpoints import load_checkpoint
    from fastinfer.ops import backend

    require_sim()
    ct_path, _, _ = ct_checkpoint(store, name, variant)
    ids = PROMPT[:17]
    ref32 = prefill_logits(LLM(ct_path, num_kv_blocks=8).model, ids)
    naive = prefill_logits(LLM(ct_path, num_kv_blocks=8, dtype="bfloat16").model, ids)
    model = load_checkpoint(ct_path, torch.bfloat16, "cpu", None, backend("fastinfer_sim"))
    results = []
    for seed in SIM_SEEDS:
        with sim_seed(seed):
            results.append(prefill_logits(model, ids))
    err, err_naive = rel_err(results[0], ref32), rel_err(naive, ref32)
    print(f"sim {name} {variant}: rel err {err:.4f} (cpu bf16: {err_naive:.4f})")
    assert 0 < err_naive < 0.1 and err <= 2 * err_naive, (err, err_naive)
    for other in results[1:]:
        assert torch.equal(raw_bits(results[0]), raw_bits(other)), "sim result depends on the schedule seed"
