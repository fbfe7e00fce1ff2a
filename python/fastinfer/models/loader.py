"""Load a Hugging Face Llama-family checkpoint (safetensors only) into :class:`LlamaForCausalLM`.

* Formats: ``model.safetensors`` or sharded ``model.safetensors.index.json`` + shards. Pickle
  checkpoints (``*.bin``, ``*.pt``) are refused: loading them can execute arbitrary code.
* Files are memory-mapped (``safetensors.safe_open``); each tensor is converted to the model's
  dtype/device and copied into its slot, so peak host memory stays around one tensor.
* Name mapping: ``model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}`` -> rows of
  ``layers.{i}.qkv_proj`` (q, then k, then v); ``model.layers.{i}.mlp.{gate,up}_proj`` -> rows of
  ``layers.{i}.gate_up_proj`` (gate, then up); the rest one to one (``model.`` prefix dropped).
* Tied embeddings (``tie_word_embeddings``): ``lm_head`` IS ``embed_tokens`` (an ``lm_head.weight``
  in the file is then ignored, as in transformers). Untied: ``lm_head.weight`` is required.
* Errors (``ValueError`` naming the tensor): a missing tensor, an unexpected tensor (rotary
  ``inv_freq`` buffers are ignored), a shape mismatch, a tensor listed in the index but absent from
  its shard.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM

__all__ = ["load_model", "load_weights", "checkpoint_files"]

Tensor = torch.Tensor

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def checkpoint_files(path: str) -> Tuple[List[str], Optional[Dict[str, str]]]:
    """The safetensors files of the checkpoint directory ``path`` and, when sharded, the index's
    ``weight_map`` (tensor name -> file name)."""
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path!r} does not exist")
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index, "r", encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = []
        for fname in weight_map.values():
            if fname not in files:
                files.append(fname)
        for fname in files:
            if not os.path.isfile(os.path.join(path, fname)):
                raise ValueError(f"shard {fname!r} listed in model.safetensors.index.json is missing")
        return [os.path.join(path, f) for f in files], weight_map
    if os.path.isfile(single):
        return [single], None
    pickles = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        raise ValueError(
            f"{path!r} has only pickle checkpoints ({', '.join(sorted(pickles))}); fastinfer loads "
            "safetensors only (convert with `safetensors` / save_pretrained(safe_serialization=True))"
        )
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _targets(model: LlamaForCausalLM) -> Dict[str, Tuple[Tensor, int, int]]:
    """HF tensor name -> (destination parameter, row offset, rows)."""
    c = model.config
    sd = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    out: Dict[str, Tuple[Tensor, int, int]] = {}

    def whole(hf: str, ours: str):
        p = sd[ours]
        out[hf] = (p, 0, p.shape[0])

    whole("model.embed_tokens.weight", "embed_tokens.weight")
    whole("model.norm.weight", "norm.weight")
    if not c.tie_word_embeddings:
        whole("lm_head.weight", "lm_head.weight")
    q, kv, F = c.q_size, c.kv_size, c.intermediate_size
    for i in range(c.num_hidden_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        whole(hf + "input_layernorm.weight", us + "input_layernorm.weight")
        whole(hf + "post_attention_layernorm.weight", us + "post_attention_layernorm.weight")
        kinds = ["weight"] + (["bias"] if c.qkv_bias else [])
        for kind in kinds:
            p = sd[us + "qkv_proj." + kind]
            out[hf + "self_attn.q_proj." + kind] = (p, 0, q)
            out[hf + "self_attn.k_proj." + kind] = (p, q, kv)
            out[hf + "self_attn.v_proj." + kind] = (p, q + kv, kv)
        whole(hf + "self_attn.o_proj.weight", us + "o_proj.weight")
        if c.o_bias:
            whole(hf + "self_attn.o_proj.bias", us + "o_proj.bias")
        for kind in ["weight"] + (["bias"] if c.mlp_bias else []):
            p = sd[us + "gate_up_proj." + kind]
            out[hf + "mlp.gate_proj." + kind] = (p, 0, F)
            out[hf + "mlp.up_proj." + kind] = (p, F, F)
            whole(hf + "mlp.down_proj." + kind, us + "down_proj." + kind)
    return out


def _progress(items: List[str], enabled: bool) -> Iterable[str]:
    if not enabled or len(items) == 0:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional
        return items
    return tqdm(items, desc="loading safetensors shards", unit="shard")


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: str, progress: bool = False) -> LlamaForCausalLM:
    """Fill ``model``'s parameters from the safetensors checkpoint in directory ``path``."""
    from safetensors import safe_open

    files, weight_map = checkpoint_files(path)
    targets = _targets(model)
    tied_lm_head = model.config.tie_word_embeddings
    seen: Dict[str, str] = {}
    for file in _progress(files, progress):
        fname = os.path.basename(file)
        with safe_open(file, framework="pt", device="cpu") as f:
            names = list(f.keys())
            if weight_map is not None:
                present = set(names)
                for name, wf in weight_map.items():
                    if wf == fname and name not in present:
                        raise ValueError(f"tensor {name!r} is listed in the index for {fname!r} but absent from it")
            for name in names:
                if _IGNORED.search(name):
                    continue
                if tied_lm_head and name == "lm_head.weight":
                    continue  # tied: lm_head is embed_tokens (transformers ignores this copy too)
                if name not in targets:
                    raise ValueError(f"unexpected tensor {name!r} in {fname!r} (not part of {model.config.architecture})")
                if name in seen:
                    raise ValueError(f"tensor {name!r} appears in both {seen[name]!r} and {fname!r}")
                dst, off, rows = targets[name]
                want = (rows,) + tuple(dst.shape[1:])
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != want:
                    raise ValueError(f"tensor {name!r} has shape {list(shape)}, expected {list(want)}")
                t = f.get_tensor(name)
                if not t.is_floating_point():
                    raise ValueError(f"tensor {name!r} has non-float dtype {t.dtype} (a quantised checkpoint needs a quantization_config in config.json, see fastinfer.quant)")
                dst.narrow(0, off, rows).copy_(t.to(device=dst.device, dtype=dst.dtype))
                seen[name] = fname
    missing = [n for n in targets if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]!r}{more} in checkpoint {path!r}")
    return model


def load_model(
    path: str,
    dtype: Optional[torch.dtype] = None,
    device=None,
    progress: bool = False,
    max_positions: Optional[int] = None,
    config: Optional[ModelConfig] = None,
    quantization: Optional[str] = None,
    quantization_config: Optional[dict] = None,
) -> LlamaForCausalLM:
    """Build the model of checkpoint directory ``path`` and load its weights.

    Defaults: ``device`` "cpu"; ``dtype`` float32 on CPU, else the checkpoint's dtype when it is
    float16/bfloat16, else bfloat16.

    Quantisation (:mod:`fastinfer.quant`): ``quantization`` "fp8" / "int4" quantises a float
    checkpoint's decoder linears on load (``quantization_config``: optional ``group_size``,
    ``symmetric``, ``pad_groups`` for int4); a checkpoint whose config.json has a
    ``quantization_config`` (fastinfer, AutoAWQ, AutoGPTQ) is loaded as stored.
    """
    config = ModelConfig.from_pretrained(path) if config is None else config
    device = torch.device("cpu" if device is None else device)
    if dtype is None:
        if device.type == "cpu":
            dtype = torch.float32
        elif config.torch_dtype in (torch.float16, torch.bfloat16):
            dtype = config.torch_dtype
        else:
            dtype = torch.bfloat16
    from ..quant.quantize import QuantOptions

    opts = QuantOptions.from_any(quantization, quantization_config)
    if opts is not None or config.raw.get("quantization_config"):
        from ..quant.loader import build_model_shell, load_quantized_weights

        # no float copy of the decoder linears is ever allocated
        model = build_model_shell(config, dtype=dtype, device=device, max_positions=max_positions)
        load_quantized_weights(model, path, opts, progress=progress)
    else:
        model = LlamaForCausalLM(config, dtype=dtype, device=device, max_positions=max_positions)
        load_weights(model, path, progress=progress)
    model.eval()
    return model
