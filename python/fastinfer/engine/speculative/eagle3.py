"""EAGLE-3 draft heads (Li et al. 2025, https://arxiv.org/abs/2503.01840): EAGLE's drafting on a
feature fused from three target layers, with its own final norm and a reduced vocabulary.

Row ``p`` pairs token ``t_{p+1}`` with a feature ``f``: for a committed token, ``fc(a_p)`` where
``a_p = [s_lo; s_mid; s_hi]`` are the target's residual streams entering the aux layers (ids
``eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)`` for a target of L layers, as the
EAGLE repository and vLLM pick them; id i is the output of layer i - 1); for a drafted token, its
parent row's output ``g`` as it is (no ``fc``). The layer ("midlayer")::

    x = [input_layernorm(embed(t_{p+1})); hidden_norm(f)]        # 2H: q/k/v_proj take 2H inputs
    r = f   (hidden_norm(f) with norm_before_residual, vLLM's option)
    g = decoder layer on x with residual r (attention at position p, then the MLP)
    logits = lm_head(norm(g))   [draft_vocab]  ->  target ids  draft_id + d2t[draft_id]

Draft logits are scattered into the target vocabulary (``-inf`` outside it), so chain sampling's
draft probabilities are zero outside ``t2d`` and verification stays exact; greedy and tree drafting
see the same ranking. Everything else (rows one position early, the feature pool by KV slot, the
catch-up from true features, chain / EAGLE-2 tree drafting) is :class:`.eagle.EagleDrafter`'s; the
pool keeps ``fc(a_p)`` (computed when the target's aux states come in).

Layouts (a directory with ``config.json``: a one-layer Llama config with ``draft_vocab_size`` (default
``vocab_size``), optionally ``eagle_aux_hidden_state_layer_ids`` (or in ``eagle_config``) and
``norm_before_residual``; weights in ``model.safetensors``):

* EAGLE repository (SafeAILab/EAGLE ``eagle/model/cnets.py``): ``fc.weight [H, 3H]``,
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]``,
  ``midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]``, ``midlayer.self_attn.o_proj.weight``,
  ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight [H]``, ``lm_head.weight [Vd, H]``,
  ``d2t [Vd]`` (int64 offsets), ``t2d [V]`` (bool), optionally ``embed_tokens.weight [V, H]``
  (else the target's embedding).
* vLLM (``llama_eagle3.py``, speculators): the same with ``layers.0.`` for ``midlayer.``, optionally
  ``model.``-prefixed (not ``lm_head``, ``d2t``, ``t2d``).

``d2t`` / ``t2d`` may be absent when ``draft_vocab_size == vocab_size``. Anything missing, mis-shaped
or left over is an error naming the checkpoint's tensor.
"""

from __future__ import annotations

import json
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ...layers import ColumnParallelLinear, RMSNorm, TensorDictReader, VocabEmbedding, WeightPart
from ...layers.weights import CheckpointModule
from ...models.config import ModelConfig
from ...models.llama import LlamaDecoderLayer
from .drafter import read_head_weights
from .eagle import EagleDraftModel, EagleDrafter

Tensor = torch.Tensor

__all__ = ["Eagle3DraftModel", "Eagle3Drafter", "load_eagle3", "default_aux_layers"]


def default_aux_layers(num_layers: int) -> Tuple[int, int, int]:
    """The aux layer ids of the EAGLE repository / vLLM for a target of ``num_layers`` layers."""
    return (2, num_layers // 2, num_layers - 3)


class Eagle3DraftModel(EagleDraftModel):
    """``fc`` (kH -> H) + the 2H-input midlayer + own norm + reduced-vocabulary head."""

    def __init__(self, target, layer: LlamaDecoderLayer, fc: ColumnParallelLinear, hidden_norm: RMSNorm,
                 norm: RMSNorm, lm_head: ColumnParallelLinear, embed: Optional[VocabEmbedding],
                 draft_to_target: Tensor, aux_layers: Sequence[int], norm_before_residual: bool):
        super().__init__(target, layer, fc.weight, None)
        self.fc, self.hidden_norm, self.norm, self.lm_head, self.embed = fc, hidden_norm, norm, lm_head, embed
        self.draft_to_target = draft_to_target  # [Vd] int64 target id of each draft id
        self.vocab_size = int(target.config.vocab_size)
        self.aux_layers = tuple(int(i) for i in aux_layers)
        self.norm_before_residual = bool(norm_before_residual)

    def fuse(self, aux: Tensor) -> Tensor:
        """The feature ``fc(a)`` of the target's concatenated aux states ``a [T, kH]``."""
        return self.fc(aux.to(self.dtype))

    def compute_logits(self, g: Tensor) -> Tensor:
        """float32 logits in the target vocabulary (``-inf`` outside the draft vocabulary)."""
        d = self.lm_head(self.norm(g)).float()
        out = torch.full((d.shape[0], self.vocab_size), float("-inf"), dtype=torch.float32, device=d.device)
        out[:, self.draft_to_target] = d
        return out

    def forward(self, batch, kv_caches, features: Tensor) -> Tuple[Tensor, Tensor]:
        """float32 logits and output features ``g`` of the batch's logits rows; ``features [T, H]``."""
        e = (self.embed or self.target.embed_tokens)(batch.input_ids)
        f = features.to(e.dtype)
        h = self.hidden_norm(f)
        residual = h.clone() if self.norm_before_residual else f.clone()  # updated in place by the layer
        x = torch.cat([self.layer.input_layernorm(e), h], dim=-1)
        y, res = self.layer.attention_mlp(x, residual, batch, kv_caches[0], self.target.cos_sin_cache)
        g = (y + res).index_select(0, batch.logits_indices)
        return self.compute_logits(g), g


class Eagle3Drafter(EagleDrafter):
    """:class:`.eagle.EagleDrafter` on the target's aux layers (the pool keeps ``fc`` of them)."""

    def __init__(self, model: Eagle3DraftModel, *args, **kw):
        super().__init__(model, *args, **kw)
        self.hidden_layers = model.aux_layers

    def observe_slot_hidden_states(self, slots: List[int], hidden: Tensor) -> None:
        super().observe_slot_hidden_states(slots, self.model.fuse(hidden))


# ------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------
class _LayoutReader(TensorDictReader):
    """The file's tensors read under the names our layers ask for (``model.layers.0.*``,
    ``model.fc.weight``, ...); ``to_file`` maps those to the file's names (and leaves file names as
    they are), so errors and :meth:`unused` name the checkpoint's own tensors."""

    def __init__(self, tensors, description: str, to_file: Callable[[str], str]):
        super().__init__(tensors, description)
        self.to_file = to_file

    def has(self, name: str) -> bool:
        return super().has(self.to_file(name))

    def shape(self, name: str) -> Tuple[int, ...]:
        return super().shape(self.to_file(name))

    def _read(self, name: str) -> Tensor:
        return super()._read(self.to_file(name))

    def get(self, name: str, *args, **kw) -> Tensor:
        return super().get(self.to_file(name), *args, **kw)


def _name_map(names: Sequence[str]) -> Tuple[str, Callable[[str], str]]:
    """``(layout, our name -> the file's name)`` of a checkpoint's tensor names."""
    if any(n.startswith("midlayer.") for n in names):
        layout, layer, pre = "eagle", "midlayer.", ""
    else:
        layout, layer = "vllm", "layers.0."
        pre = "model." if any(n.startswith("model.") for n in names) else ""

    def to_file(name: str) -> str:
        if name.startswith("model.layers.0."):
            return pre + layer + name[len("model.layers.0."):]
        if name.startswith("model."):
            return pre + name[len("model."):]
        return name

    return layout, to_file


def _aux_layer_ids(d: dict, num_target_layers: int, where: str) -> Tuple[int, ...]:
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layers(num_target_layers)
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of ints, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"{where}: eagle_aux_hidden_state_layer_ids {bad} out of range for a target of "
                         f"{num_target_layers} layers")
    return tuple(ids)


def _vocab_map(reader: _LayoutReader, V: int, Vd: int, device) -> Tensor:
    """The target id of each draft id (``arange + d2t``), checked against ``t2d``."""
    if Vd == V and not reader.has("d2t"):
        if reader.has("t2d"):
            reader.get("t2d", (V,), dtypes=(torch.bool,))
        return torch.arange(V, device=device)
    d2t = reader.get("d2t", (Vd,), dtypes=(torch.int64, torch.int32)).to(torch.int64)
    ids = torch.arange(Vd, dtype=torch.int64) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd:
        raise ValueError(f"tensor 'd2t' of {reader.description} must map the {Vd} draft ids to distinct target "
                         f"ids in [0, {V}) (target_id = draft_id + d2t[draft_id])")
    if reader.has("t2d") or Vd < V:
        t2d = reader.get("t2d", (V,), dtypes=(torch.bool,))
        if not torch.equal(t2d.nonzero().flatten(), ids.sort().values):
            raise ValueError(f"tensors 't2d' and 'd2t' of {reader.description} disagree: t2d must be True "
                             "exactly at the target ids draft_id + d2t[draft_id]")
    return ids.to(device)


def load_eagle3(path: str, target) -> Eagle3DraftModel:
    """The EAGLE-3 head in directory ``path`` for ``target`` (see the module docstring); weights of
    any float dtype, computed in the target's."""
    if target.config.is_mla:  # the head's layer rotates with the target's table: 64 rotary dims there
        raise ValueError(f"EAGLE-3 heads are not supported for {target.config.architecture}: the head rotates q and k "
                         "with the target's RoPE table, which covers a multi-head latent attention target's "
                         "rotary dims only (use spec_method='draft')")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"EAGLE-3 directory {path!r} has no config.json")
    with open(cfg_file, "r", encoding="utf-8") as f:
        d = json.load(f)
    cfg = ModelConfig.from_dict(dict(d, num_hidden_layers=1, architectures=["LlamaForCausalLM"]))
    tc = target.config
    H, V = int(tc.hidden_size), int(tc.vocab_size)
    for key, want in (("hidden_size", H), ("vocab_size", V), ("target_hidden_size", H)):
        got = d.get(key, want) if key == "target_hidden_size" else getattr(cfg, key)
        if got is not None and got != want:
            raise ValueError(f"{path}: the EAGLE-3 head has {key}={got}, the target's hidden_size / vocab_size is "
                             f"{want}")
    Vd = d.get("draft_vocab_size") or V
    if not isinstance(Vd, int) or not 1 <= Vd <= V:
        raise ValueError(f"{path}: draft_vocab_size must be an int in [1, vocab_size={V}], got {Vd!r}")
    aux = _aux_layer_ids(d, int(tc.num_hidden_layers), path)
    wfile, raw = read_head_weights(path)
    layout, to_file = _name_map(list(raw))
    reader = _LayoutReader(raw, f"{wfile!r} ({layout} layout)", to_file)
    kw = dict(dtype=target.dtype, device=target.device, ops=target.ops)
    layer = LlamaDecoderLayer(cfg, 0, quant_config=None, **kw)
    layer.qkv_proj = ColumnParallelLinear(2 * H, layer.qkv_proj.parts, cfg.qkv_bias, **kw)  # [embed; feature]
    hidden_norm = RMSNorm(H, cfg.rms_norm_eps, "model.layers.0.hidden_norm", **kw)
    norm = RMSNorm(H, cfg.rms_norm_eps, "model.norm", **kw)
    fc = ColumnParallelLinear(len(aux) * H, [WeightPart("model.fc", H)], reader.has("model.fc.bias"), **kw)
    lm_head = ColumnParallelLinear(H, [WeightPart("lm_head", Vd)], False, **kw)
    embed = None
    if reader.has("model.embed_tokens.weight"):  # its own embedding (else the target's)
        embed = VocabEmbedding(V, H, "model.embed_tokens", dtype=target.dtype, device=target.device)
    for mod in [layer, hidden_norm, norm, fc, lm_head] + ([embed] if embed is not None else []):
        for m in mod.modules():
            if isinstance(m, CheckpointModule):
                m.load_from(reader)
    d2t = _vocab_map(reader, V, Vd, target.device)
    unused = reader.unused()
    if unused:
        raise ValueError(f"unexpected tensors in EAGLE-3 checkpoint {reader.description}: "
                         f"{', '.join(sorted(unused)[:5])}")
    return Eagle3DraftModel(target, layer, fc, hidden_norm, norm, lm_head, embed, d2t, aux,
                            bool(d.get("norm_before_residual", False)))
