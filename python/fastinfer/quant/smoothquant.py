"""SmoothQuant (Xiao et al. 2023, arXiv:2211.10438) for int8 W8A8: migrate activation outliers into
the weights before quantising them.

For a linear ``y = x W^T`` with input channel j, ``x_j / s_j`` and ``W[:, j] * s_j`` give the same
product; with ``s_j = max|X_j|^a / max|W[:, j]|^(1 - a)`` (``a`` = ``alpha``, default 0.5;
``max|X_j|`` over calibration text run through the float model, ``max|W[:, j]|`` over the fused
projections that share the input) the per-token int8 activations lose less to a few large
channels. The ``1 / s`` goes where it is exact:

* q/k/v (input: ``input_layernorm``'s output) and gate/up (``post_attention_layernorm``): into
  the RMSNorm weight, ``g_j / s_j`` (stored in float32, so nothing is rounded);
* down_proj (input: ``silu(gate) * up``): into up_proj's output rows, ``W_up[j, :] / s_j`` (and its
  bias), before up_proj is quantised;
* o_proj (input: the attention output, no per-channel op before it): kept as an explicit activation
  scale, ``P.smooth_scale [K]`` in the checkpoint; the int8 linear divides its input by it.

Channels whose activation or weight maximum is 0 keep ``s = 1``; ``s`` is clamped to
``[1e-5, 1e5]``. Used by :func:`fastinfer.quant.quantize_checkpoint` (``fastinfer quantize --method
int8 --smoothquant ALPHA``).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..layers import BatchBuilder, WeightReader
from ..layers.batch import DEFAULT_BLOCK_SIZE
from ..models import PACKED_MODULES

Tensor = torch.Tensor

__all__ = ["calibrate", "smoothing_plan", "apply_smoothing"]

# fused linear -> where its 1/s goes: ("norm", relative name) | ("rows", relative name) | ("explicit", None)
_FOLD = {
    "qkv_proj": ("norm", "input_layernorm"),
    "gate_up_proj": ("norm", "post_attention_layernorm"),
    "down_proj": ("rows", "mlp.up_proj"),
    "o_proj": ("explicit", None),
}


@torch.inference_mode()
def calibrate(model, ids: Tensor, context: int = 256, windows_per_batch: int = 8,
              block_size: int = DEFAULT_BLOCK_SIZE) -> Dict[str, Tensor]:
    """``max|X_j|`` (float32 ``[K]``) of every decoder linear's input over the token ids ``ids``, run
    through ``model`` (a float :class:`~fastinfer.models.LlamaForCausalLM`) in windows of ``context``
    tokens; keyed by the linear's prefix (its first part's checkpoint name)."""
    stats: Dict[str, Tensor] = {}
    hooks = []
    for layer in model.linear_layers():
        if layer.prefix.startswith("model.layers."):
            def hook(mod, args):
                m = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float().cpu()
                stats[mod.prefix] = torch.maximum(stats[mod.prefix], m) if mod.prefix in stats else m
            hooks.append(layer.register_forward_pre_hook(hook))
    try:
        n = max(1, len(ids) // context)
        per = -(-context // block_size)
        caches = model.allocate_kv_cache(windows_per_batch * per, block_size)
        for w0 in range(0, n, windows_per_batch):
            b = BatchBuilder(block_size, model.device)
            for j, i in enumerate(range(w0, min(n, w0 + windows_per_batch))):
                b.prefill(ids[i * context:(i + 1) * context].tolist(), 0, list(range(j * per, (j + 1) * per)),
                          logits="last")
            model(b.build(), caches)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _factors(x_max: Tensor, w_max: Tensor, alpha: float) -> Tensor:
    x, w = x_max.double(), w_max.double()
    s = torch.where((x > 0) & (w > 0), x.pow(alpha) / w.pow(1.0 - alpha), torch.ones_like(x))
    return s.clamp(1e-5, 1e5).float()


def smoothing_plan(reader: WeightReader, num_layers: int, stats: Dict[str, Tensor], alpha: float
                   ) -> Tuple[Dict[str, List[Tuple[str, Tensor]]], Dict[str, Tensor]]:
    """``(edits, explicit)``: ``edits[name]`` lists what the smoothing does to checkpoint tensor
    ``name`` (``("cols", s)``: multiply a weight's columns by s; ``("div", s)``: divide a norm
    weight or a bias; ``("rows", s)``: divide a weight's rows); ``explicit[prefix] = s``: the o_proj
    activation scales, stored as ``prefix.smooth_scale``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothquant alpha must be in [0, 1], got {alpha}")
    edits: Dict[str, List[Tuple[str, Tensor]]] = {}
    explicit: Dict[str, Tensor] = {}
    for i in range(num_layers):
        base = f"model.layers.{i}."
        for slot, parts in PACKED_MODULES.items():
            prefixes = [base + p for p in parts]
            x_max = stats.get(prefixes[0])
            if x_max is None:
                raise ValueError(f"no calibration statistics for {prefixes[0]} (calibrate the float model first)")
            w_max = torch.stack([reader.get_float(p + ".weight").float().abs().amax(0) for p in prefixes]).amax(0)
            s = _factors(x_max, w_max, alpha)
            for p in prefixes:
                edits.setdefault(p + ".weight", []).append(("cols", s))
            how, where = _FOLD[slot]
            if how == "norm":
                edits.setdefault(base + where + ".weight", []).append(("div", s))
            elif how == "rows":
                edits.setdefault(base + where + ".weight", []).append(("rows", s))
                if reader.has(base + where + ".bias"):
                    edits.setdefault(base + where + ".bias", []).append(("div", s))
            else:
                explicit[prefixes[0]] = s
    return edits, explicit


def apply_smoothing(t: Tensor, ops: List[Tuple[str, Tensor]]) -> Tensor:
    """The smoothed float32 version of a checkpoint tensor (``ops``: its entry in the plan)."""
    out = t.float()
    for how, s in ops:
        if how == "cols":
            out = out * s[None, :]
        elif how == "rows":
            out = out / s[:, None]
        else:
            out = out / s
    return out.contiguous()
