"""Writing compressed-tensors checkpoints with the compressed-tensors package itself (the producer
library as the oracle of the format): what llm-compressor's save path runs, without llm-compressor
(it pins an older torch and transformers than this project's). Used by tests/test_quant_formats.py
(random models), tests/test_gguf.py (a real trained model), tests/test_kv_cache_fp8.py (a
``kv_cache_scheme``: fp8 KV-cache scales) and tests/test_models_moe_fp8.py (mixture-of-experts models,
experts in the hub's per-expert layout: :func:`linearize_experts`)."""

from __future__ import annotations

import copy

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam


def _observe(w: torch.Tensor, args):
    """The min / max a memoryless min-max observer sees for ``args.strategy`` (padding partial groups
    and blocks with zeros, which compressed-tensors' qparams include anyway)."""
    s = args.strategy
    if s == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if s == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if s in ("group", "tensor_group"):  # tensor_group: NVFP4's groups under a global scale
        g = args.group_size
        k = -(-w.shape[1] // g) * g
        wv = torch.nn.functional.pad(w, (0, k - w.shape[1])).unflatten(-1, (k // g, g))
        return wv.amin(-1), wv.amax(-1)
    if s == "block":
        bn, bk = args.block_structure
        n, k = -(-w.shape[0] // bn) * bn, -(-w.shape[1] // bk) * bk
        wv = torch.nn.functional.pad(w, (0, k - w.shape[1], 0, n - w.shape[0])).reshape(n // bn, bn, k // bk, bk)
        return wv.amin((1, 3)), wv.amax((1, 3))
    raise AssertionError(s)


class _ExpertMLP(torch.nn.Module):
    """One expert as hub checkpoints (and transformers 4's modules) hold it: three ``nn.Linear``."""

    def __init__(self, names, weights):
        super().__init__()
        for name, w in zip(names, weights):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            setattr(self, name, lin)


def linearize_experts(model, router_linear: bool = False):
    """A copy of the transformers 5 mixture-of-experts ``model`` whose stacked experts
    (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) are per-expert ``nn.Linear``
    modules under the hub's names (``experts.{e}.gate_proj / up_proj / down_proj``, Mixtral's
    ``w1 / w3 / w2``), the layout compressed-tensors quantises (its targets match ``Linear``
    modules) and ``save_pretrained`` writes (llm-compressor swaps such modules in to calibrate
    MoE models). ``router_linear``: the routers become ``nn.Linear`` too (``mlp.gate``, as transformers
    4 had them), which compressed-tensors' ``Linear`` target then quantises unless ignored. Not
    runnable: for quantising and saving only."""
    names = ("w1", "w3", "w2") if model.config.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = copy.deepcopy(model)
    for layer in out.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:  # a dense layer
            continue
        if router_linear:
            w = layer.mlp.gate.weight
            layer.mlp.gate = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                layer.mlp.gate.weight.copy_(w)
        I = experts.gate_up_proj.shape[1] // 2
        layer.mlp.experts = torch.nn.ModuleList(
            _ExpertMLP(names, (experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:], experts.down_proj[e]))
            for e in range(experts.gate_up_proj.shape[0]))
    return out


def _input_ranges(model, ids):
    """min / max of every linear's input over the calibration prompt (static activation scales)."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.__setitem__(name, (args[0].amin(), args[0].amax()))))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


def compress(model, groups: dict, ignore, dst: str, calib, dequantised: bool = True):
    """Quantise the transformers ``model`` (in place) with compressed-tensors' ``groups`` (config
    groups of schemes) and ``ignore`` list and save it to ``dst + '-ct'``; with ``dequantised``, the
    producer's own dequantisation of it (float weights, no quantisation config) goes to
    ``dst + '-deq'`` (else None). ``calib``: token ids whose linear inputs set static activation
    scales. Returns both paths and the quantised modules' schemes by name."""
    clean = copy.deepcopy(model) if dequantised else None
    ranges = _input_ranges(model, calib) if calib is not None else {}
    apply_quantization_config(model, QuantizationConfig(config_groups=groups, ignore=list(ignore)))
    schemes = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            sch = getattr(m, "quantization_scheme", None)
            if sch is None:
                continue
            schemes[name] = sch
            gs = None
            if sch.weights.strategy == "tensor_group":  # NVFP4: the global scale from the tensor's range
                gs = generate_gparam(m.weight.data.amin(), m.weight.data.amax())
                m.weight_global_scale.copy_(gs.to(m.weight_global_scale.dtype))
            s, z = calculate_qparams(*_observe(m.weight.data, sch.weights), sch.weights, global_scale=gs)
            m.weight_scale.copy_(s.to(m.weight_scale.dtype))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.copy_(z.to(m.weight_zero_point.dtype))
            ia = sch.input_activations
            if ia is not None and not ia.dynamic:
                if name not in ranges:
                    raise ValueError(f"{name}: a static activation scale needs calibration ids (calib)")
                lo, hi = ranges[name]
                s, _ = calculate_qparams(lo.reshape(1), hi.reshape(1), ia)
                m.input_scale.copy_(s.to(m.input_scale.dtype))
            m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst + "-ct")
    compressor.update_config(dst + "-ct")
    if clean is None:
        return dst + "-ct", None, schemes
    compressor.decompress_model(model)
    with torch.no_grad():
        for name in schemes:
            clean.get_submodule(name).weight.copy_(model.get_submodule(name).weight)
    clean.save_pretrained(dst + "-deq")
    return dst + "-ct", dst + "-deq", schemes


def _accept_transformers5_attention(monkeypatch) -> None:
    """compressed-tensors 0.20.1 gives an attention module a KV-cache scheme only when its forward
    has a ``past_key_value(s)`` parameter; transformers 5 renamed it ``cache``. Recognise that name
    too (for the duration of the test), so the package's own apply and config code run unchanged."""
    import inspect

    import compressed_tensors.quantization.lifecycle.apply as ct_apply
    import compressed_tensors.quantization.lifecycle.initialize as ct_initialize

    original = ct_initialize.is_cached_attention_module

    def is_cached_attention_module(module) -> bool:
        if original(module):
            return True
        return ("attention" in type(module).__name__.lower() and hasattr(module, "k_proj")
                and "cache" in inspect.signature(module.forward).parameters)

    monkeypatch.setattr(ct_initialize, "is_cached_attention_module", is_cached_attention_module)
    monkeypatch.setattr(ct_apply, "is_cached_attention_module", is_cached_attention_module)


def compress_kv_cache(model, kv_args, dst: str, calib, monkeypatch) -> str:
    """The transformers ``model`` saved to ``dst`` as compressed-tensors saves a ``kv_cache_scheme``
    ``kv_args`` (QuantizationArgs; weights left in float): the package attaches ``k_scale`` /
    ``v_scale`` to every attention module (:func:`apply_quantization_config`), they are set from the
    min / max of the keys and values the model caches over the token ids ``calib`` (post-RoPE, per
    tensor or per KV head as ``kv_args.strategy`` says, the package's ``calculate_qparams``), and its
    :class:`ModelCompressor` writes the checkpoint and the config. Returns ``dst``."""
    _accept_transformers5_attention(monkeypatch)
    with torch.no_grad():
        cache = model(torch.tensor([calib]), use_cache=True).past_key_values
    apply_quantization_config(model, QuantizationConfig(config_groups={}, kv_cache_scheme=kv_args))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for name, states in (("k", cache.layers[i].keys), ("v", cache.layers[i].values)):  # [B, Hkv, S, D]
                if kv_args.strategy == "tensor":
                    lo, hi = states.amin().reshape(1), states.amax().reshape(1)
                else:  # attn_head: [Hkv, 1, 1]
                    lo, hi = (states.amin((0, 2, 3)).reshape(-1, 1, 1), states.amax((0, 2, 3)).reshape(-1, 1, 1))
                s, _ = calculate_qparams(lo, hi, kv_args)
                getattr(attn, f"{name}_scale").copy_(s.to(getattr(attn, f"{name}_scale").dtype))
            attn.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    return dst
