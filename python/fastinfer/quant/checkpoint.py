"""``fastinfer quantize``: a float checkpoint -> a quantised one, in the format of :mod:`fastinfer.quant`.

The layers quantised are exactly those :class:`~fastinfer.quant.OnLoadQuantization` quantises when
loading (the model's linear layers and, with fp8 or int4, a mixture-of-experts model's experts,
each expert projection like a linear; read from the model itself; ``lm_head`` and the routers stay
float), so a written checkpoint and quantisation on load give the same model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import torch

from ..layers import FusedMoE, SafetensorsReader, UnquantizedFusedMoEMethod, UnquantizedLinearMethod
from ..models import GEMMA_ARCHITECTURES, ModelConfig, load_model, model_class
from .config import ON_LOAD_ONLY, QuantOptions
from .resolve import OnLoadQuantization
from .math import pack_nibbles, quantize_fp8_weight, quantize_int4_weight, quantize_int8_weight
from .smoothquant import apply_smoothing, calibrate, smoothing_plan

Tensor = torch.Tensor

__all__ = ["quantize_checkpoint"]

_WEIGHT_FILES = re.compile(r"(\.safetensors|\.safetensors\.index\.json|\.bin|\.pt|\.pth|\.ckpt|\.msgpack|\.h5)$")


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="layer")


class _ShardWriter:
    def __init__(self, out_dir: str, max_shard_bytes: int):
        self.out_dir, self.max = out_dir, int(max_shard_bytes)
        self.cur: Dict[str, Tensor] = {}
        self.cur_bytes = 0
        self.files: List[str] = []
        self.names: List[List[str]] = []

    def add(self, name: str, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + nbytes > self.max:
            self._flush()
        self.cur[name] = t.contiguous()
        self.cur_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.cur:
            return
        fname = f".tmp-shard-{len(self.files):05d}.safetensors"
        save_file(self.cur, os.path.join(self.out_dir, fname), metadata={"format": "pt"})
        self.files.append(fname)
        self.names.append(list(self.cur))
        self.cur, self.cur_bytes = {}, 0

    def close(self) -> List[str]:
        self._flush()
        n = len(self.files)
        final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        umask = os.umask(0)
        os.umask(umask)
        for tmp, fin in zip(self.files, final):
            os.replace(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, fin))
            os.chmod(os.path.join(self.out_dir, fin), 0o666 & ~umask)  # safetensors writes 0600
        if n > 1:
            total = sum(os.path.getsize(os.path.join(self.out_dir, f)) for f in final)
            index = {"metadata": {"total_size": total},
                     "weight_map": {name: fin for names, fin in zip(self.names, final) for name in names}}
            with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return final


@torch.no_grad()
def quantize_checkpoint(in_dir: str, out_dir: str, opts: QuantOptions, progress: bool = False,
                        max_shard_bytes: int = 4 << 30, smoothquant: Optional[float] = None,
                        calibration: Optional[torch.Tensor] = None) -> Dict[str, object]:
    """Quantise the float safetensors checkpoint ``in_dir`` into ``out_dir`` (format: :mod:`fastinfer.quant`).

    Reads one tensor at a time (memory-mapped); writes shards of at most ``max_shard_bytes``.
    int8 only: ``smoothquant`` = alpha smooths the weights first (:mod:`fastinfer.quant.smoothquant`)
    with activation statistics of the float model (loaded in float32 on the CPU) over the token ids
    ``calibration``. Returns a summary dict (files written, number of quantised linears).
    """
    if not isinstance(opts, QuantOptions):
        raise TypeError("opts must be a QuantOptions")
    if opts.method in ON_LOAD_ONLY:
        raise ValueError(f"method {opts.method!r} quantises on load only (LLM(..., quantization={opts.method!r})); "
                         "fastinfer quantize writes fp8, int4 or int8 checkpoints")
    if smoothquant is not None and (opts.method != "int8" or calibration is None or len(calibration) < 2):
        raise ValueError("smoothquant needs method 'int8' and calibration token ids")
    if smoothquant is not None and not 0.0 <= float(smoothquant) <= 1.0:
        raise ValueError(f"smoothquant alpha must be in [0, 1], got {smoothquant}")
    cfg_path = os.path.join(in_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"no config.json in {in_dir!r}")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    model_config = ModelConfig.from_dict(cfg)  # refuse unsupported models before writing anything
    if model_config.text_weights_prefixes:
        raise ValueError(f"{in_dir!r} is a multimodal checkpoint ({cfg.get('architectures')}): quantize needs a "
                         "text-only one (its tensors under model.layers.*)")
    if model_config.is_hybrid:
        raise ValueError(f"quantize does not write {model_config.architecture} checkpoints (a hybrid model's "
                         "linears run in float): quantise the experts of a MoE variant on load, quantization='fp8'")
    if smoothquant is not None and model_config.architecture in GEMMA_ARCHITECTURES:
        # its folds assume Llama's layer: gate/up read post_attention_layernorm, a norm scales by weight
        raise ValueError(f"smoothquant is not supported for {model_config.architecture} (Gemma's gate/up input "
                         "is pre_feedforward_layernorm's, and its norms scale by 1 + weight)")
    if cfg.get("quantization_config"):
        qc = cfg["quantization_config"]
        raise ValueError(f"{in_dir!r} is already quantised (quantization_config {qc.get('quant_method')!r}"
                         f"{' ' + repr(qc.get('method')) if qc.get('method') else ''}); quantise a float checkpoint")
    reader = SafetensorsReader(in_dir)
    if os.path.abspath(out_dir) == os.path.abspath(in_dir):
        raise ValueError("OUT_DIR must differ from IN_DIR")
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if _WEIGHT_FILES.search(old):
            raise ValueError(f"{out_dir!r} already holds weights ({old}); use an empty directory")

    # which weights are quantised: the linears whose method is not float when loading with opts
    shell = model_class(model_config)(model_config, device="meta", quant_config=OnLoadQuantization(opts))
    quantized = {part.prefix + ".weight" for layer in shell.linear_layers()
                 if not isinstance(layer.method, UnquantizedLinearMethod) for part in layer.parts}
    quantized |= {part.prefix + ".weight" for moe in shell.modules() if isinstance(moe, FusedMoE)
                  and not isinstance(moe.method, UnquantizedFusedMoEMethod)
                  for e in range(moe.num_experts) for part in moe.expert_projections(e)}
    missing = sorted(name for name in quantized if not reader.has(name))
    if missing:  # e.g. experts stacked as transformers 5's modules hold them, which would pass through float
        raise ValueError(f"{in_dir!r} has no tensor {missing[0]!r} ({len(missing)} quantised tensors missing; "
                         "quantize reads linears and experts under the hub checkpoints' names)")
    layers: Dict[int, List[str]] = {}
    other: List[str] = []
    for name in reader.names():
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        (layers.setdefault(int(m.group(1)), []) if m else other).append(name)

    edits: Dict[str, list] = {}
    explicit: Dict[str, torch.Tensor] = {}
    sq_entry = None
    if smoothquant is not None:
        stats = calibrate(load_model(in_dir, dtype=torch.float32), calibration)
        edits, explicit = smoothing_plan(reader, model_config.num_hidden_layers, stats, float(smoothquant))
        sq_entry = {"alpha": float(smoothquant), "calibration_tokens": int(len(calibration)),
                    "folded": "q/k/v, gate/up: RMSNorm weights (float32); down_proj: up_proj rows",
                    "explicit": "o_proj: smooth_scale (activations divided by it)"}

    writer = _ShardWriter(out_dir, max_shard_bytes)
    n_quant = 0

    def emit(name: str) -> None:
        nonlocal n_quant
        t = reader.get(name)
        if name in edits:
            t = apply_smoothing(t, edits[name])
        if name not in quantized:
            writer.add(name, t)
            return
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}: the input must be a float checkpoint")
        prefix = name[: -len(".weight")]
        if opts.method == "fp8":
            q, s = quantize_fp8_weight(t)
            writer.add(prefix + ".weight", q)
            writer.add(prefix + ".weight_scale", s)
        elif opts.method == "int8":
            q, s = quantize_int8_weight(t)
            writer.add(prefix + ".weight", q)
            writer.add(prefix + ".weight_scale", s)
            if prefix in explicit:
                writer.add(prefix + ".smooth_scale", explicit[prefix])
        else:
            q, s, z = quantize_int4_weight(t, opts.group_size, opts.symmetric, opts.pad_groups, name)
            writer.add(prefix + ".weight_packed", pack_nibbles(q))
            writer.add(prefix + ".weight_scale", s)
            if z is not None:
                writer.add(prefix + ".weight_zero_point", z)
        n_quant += 1

    for name in sorted(other):
        emit(name)
    for li in _progress(sorted(layers), progress, f"quantize {opts.method}"):
        for name in sorted(layers[li]):
            emit(name)
    written = writer.close()

    cfg["quantization_config"] = opts.config_entry(sq_entry) if opts.method == "int8" else opts.config_entry()
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    copied = []
    for fname in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, fname)
        if fname == "config.json" or _WEIGHT_FILES.search(fname) or not os.path.isfile(src):
            continue
        shutil.copyfile(src, os.path.join(out_dir, fname))  # tokenizer files, generation_config, ...
        copied.append(fname)
    return {"out_dir": out_dir, "method": opts.method, "weights": written, "copied": copied,
            "quantized_linears": n_quant}
