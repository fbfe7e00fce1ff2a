"""Medusa draft heads: extra decoding heads on the target's last hidden state (Cai et al. 2024,
https://arxiv.org/abs/2401.10774), their checkpoint layouts and the drafter that runs them.

Head ``i`` (0-based) maps the final-normed hidden state ``h`` of the token before the root to
logits of the token ``i + 1`` places after the root: ``num_layers`` residual blocks
``x <- x + SiLU(W x + b)`` then a vocabulary projection. The candidates of a step are the static
tree of :mod:`.trees` (a path's last rank picks among its head's top-k), deterministic given ``h``,
so :func:`fastinfer.ops.tree_verify` runs without draft probabilities (exact sampling).

Layouts (a directory with ``config.json`` and safetensors weights; see the README):

* Medusa repository (``FasterDecoding/Medusa``): config ``medusa_num_heads``, ``medusa_num_layers``;
  file ``medusa_lm_head.safetensors`` (or ``model.safetensors``); tensors
  ``medusa_head.{i}.{j}.linear.weight [H, H]`` / ``.bias [H]`` for ``j < num_layers`` and
  ``medusa_head.{i}.{num_layers}.weight [V, H]``.
* vLLM (``model_type: "medusa"``): config ``num_heads``, ``num_hidden_layers``, ``hidden_size``,
  ``vocab_size``, optional ``medusa_fc_bias`` (block biases, default false) and ``original_lm_head``
  (one projection shared by all heads); tensors ``blocks.{i}.layers.{j}.weight`` (``.bias``),
  ``lm_heads.{i}.weight`` (only ``lm_heads.0`` with ``original_lm_head``), optionally prefixed
  ``medusa_heads.``. A reduced vocabulary (``truncated_vocab_size`` / ``token_map``) is refused.
  With ``original_lm_head`` (the heads use the base model's LM head) a file without ``lm_heads.0``
  is read as what the flag says: the target's own LM head is used (fastinfer's reading; vLLM
  needs the copy written out, ``tools/train_draft_heads.py --medusa-lm-head-copy`` does).
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import torch
import torch.nn.functional as F

from ...layers import TensorDictReader, WeightReader
from ..sequence import Sequence
from .drafter import Draft, Drafter, read_head_weights
from .trees import Path, tree_for_heads, tree_mask, tree_structure

Tensor = torch.Tensor

__all__ = ["MedusaHeads", "MedusaDrafter", "load_medusa_heads", "MEDUSA_LAYOUTS"]

MEDUSA_LAYOUTS = ("medusa", "vllm")


class MedusaHeads(torch.nn.Module):
    """``num_heads`` heads of ``num_layers`` residual blocks and a ``[V, H]`` projection each."""

    def __init__(self, blocks: List[List[Tuple[Tensor, Optional[Tensor]]]], lm_heads: List[object]):
        super().__init__()
        self.blocks = blocks  # per head: [(W [H, H], b [H] or None)] * num_layers
        # per head: W [V, H], or the target's LM head module (float32 logits); possibly shared by all heads
        self.lm_heads = lm_heads

    @property
    def num_heads(self) -> int:
        return len(self.lm_heads)

    def forward(self, hidden: Tensor) -> Tensor:
        """float32 logits ``[num_heads, B, V]`` of hidden states ``[B, H]``."""
        out = []
        for blocks, lm in zip(self.blocks, self.lm_heads):
            x = hidden
            for w, b in blocks:
                x = x + F.silu(F.linear(x, w, b))
            out.append(F.linear(x, lm).float() if isinstance(lm, Tensor) else lm(x))
        return torch.stack(out)


def _read_dir(path: str) -> Tuple[dict, WeightReader]:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"Medusa heads directory {path!r} has no config.json")
    with open(cfg_file, "r", encoding="utf-8") as f:
        cfg = json.load(f)
    wfile, raw = read_head_weights(path, ("medusa_lm_head.safetensors", "model.safetensors"))
    return cfg, TensorDictReader(raw, repr(wfile))


def _int_field(cfg: dict, key: str, where: str) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key.endswith("layers") else 1):
        raise ValueError(f"{where}: config.json field {key!r} must be a positive int, got {v!r}")
    return v


def medusa_layout(cfg: dict) -> str:
    if "medusa_num_heads" in cfg:
        return "medusa"
    if cfg.get("model_type") == "medusa" or "num_heads" in cfg:
        return "vllm"
    raise ValueError("config.json names no Medusa layout: expected medusa_num_heads / medusa_num_layers "
                     "(Medusa repository) or model_type 'medusa' with num_heads / num_hidden_layers (vLLM)")


def load_medusa_heads(path: str, hidden_size: int, vocab_size: int, dtype: torch.dtype, device,
                      target_lm_head=None) -> MedusaHeads:
    """Heads of directory ``path`` for a target of ``hidden_size`` / ``vocab_size`` (layout detected
    from config.json; a missing or wrong-shape tensor is an error naming it, extra tensors too).
    ``target_lm_head``: the target's LM head module, used by ``original_lm_head`` heads whose file
    has no ``lm_heads.0``."""
    cfg, reader = _read_dir(path)
    layout = medusa_layout(cfg)
    H, V = int(hidden_size), int(vocab_size)
    if layout == "medusa":
        nh, nl = _int_field(cfg, "medusa_num_heads", path), _int_field(cfg, "medusa_num_layers", path)
        names = [[(f"medusa_head.{i}.{j}.linear.weight", f"medusa_head.{i}.{j}.linear.bias") for j in range(nl)]
                 for i in range(nh)]
        lm = [f"medusa_head.{i}.{nl}.weight" for i in range(nh)]
    else:
        nh, nl = _int_field(cfg, "num_heads", path), _int_field(cfg, "num_hidden_layers", path)
        tv = cfg.get("truncated_vocab_size")
        if tv is not None and tv != cfg.get("vocab_size", V):
            raise ValueError(f"{path}: truncated_vocab_size={tv} (a token_map draft vocabulary) is not supported")
        pre = "medusa_heads." if any(n.startswith("medusa_heads.") for n in reader.names()) else ""
        bias = bool(cfg.get("medusa_fc_bias", False))
        names = [[(f"{pre}blocks.{i}.layers.{j}.weight", f"{pre}blocks.{i}.layers.{j}.bias" if bias else None)
                  for j in range(nl)] for i in range(nh)]
        lm = [f"{pre}lm_heads.{0 if cfg.get('original_lm_head', False) else i}.weight" for i in range(nh)]
    for key, want in (("hidden_size", H), ("vocab_size", V)):
        if key in cfg and cfg[key] != want:
            raise ValueError(f"{path}: the heads have {key}={cfg[key]}, the target {want}")

    def get(name: str, shape) -> Tensor:
        return reader.get_float(name, shape).to(device=device, dtype=dtype).contiguous()

    blocks = [[(get(w, (H, H)), get(b, (H,)) if b is not None else None) for w, b in head] for head in names]
    lms: Dict[str, object] = {}
    shared = layout == "vllm" and cfg.get("original_lm_head", False)
    for n in lm:
        if n in lms:
            continue
        if shared and not reader.has(n):
            if target_lm_head is None:
                raise ValueError(f"{path}: original_lm_head heads without {n} use the target's LM head: load "
                                 "them for a target (LLM(spec_method='medusa')), or write the tensor out")
            lms[n] = target_lm_head
        else:
            lms[n] = get(n, (V, H))
    unused = reader.unused()
    if unused:
        raise ValueError(f"unexpected tensors in {reader.description} for the {layout} layout with {nh} heads of "
                         f"{nl} layers: {', '.join(sorted(unused)[:5])}")
    return MedusaHeads(blocks, [lms[n] for n in lm])


class MedusaDrafter(Drafter):
    """Drafts the static tree from the heads on the hidden state of each sequence's last logits row.

    The hidden state that produced a sequence's root is kept from the step that sampled the root
    (a decode or prompt row, or the last accepted node of a verification). A sequence without one
    (a fork, right after it was created) drafts the root alone this step.
    """

    wants_hidden_states = True

    def __init__(self, heads: MedusaHeads, paths: Seq[Path], device: torch.device):
        self.heads = heads
        self.paths = list(paths)
        self.device = device
        self.num_draft_forwards = 0
        self._hidden: Dict[int, Tuple[int, Tensor]] = {}  # seq_id -> (num_tokens it is for, [rows, H])

    def observe_hidden_states(self, seqs: List[Sequence], hidden: Tensor) -> None:
        i = 0
        while i < len(seqs):
            s = seqs[i]
            j = i
            while j < len(seqs) and seqs[j] is s:
                j += 1
            # one row (sampled: valid once the sampled token is appended) or a draft's nodes (see on_verified)
            self._hidden[s.seq_id] = (s.num_tokens + 1, hidden[i:j])
            i = j

    def on_verified(self, drafts: List[Draft]) -> None:
        for d in drafts:
            n, rows = self._hidden[d.seq.seq_id]
            self._hidden[d.seq.seq_id] = (n - 1 + len(d.path), rows[d.path[-1]: d.path[-1] + 1])

    def forget(self, seq_ids: Seq[int]) -> None:
        for sid in seq_ids:
            self._hidden.pop(sid, None)

    def propose(self, items: Seq[Tuple[Sequence, int, int]], gens: Seq[torch.Generator]) -> List[Draft]:
        have = [(s, size) for s, size, _ in items
                if self._hidden.get(s.seq_id, (-1,))[0] == s.num_tokens]
        top: Optional[List[List[List[int]]]] = None
        if have:
            k = 1 + max(max(p) for p in self.paths)
            with torch.inference_mode():
                h = torch.cat([self._hidden[s.seq_id][1][-1:] for s, _ in have])
                logits = self.heads(h)  # [heads, B, V]
                top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices.tolist()
            self.num_draft_forwards += 1
        out = []
        rank = {s.seq_id: r for r, (s, _) in enumerate(have)}
        for s, size, _ in items:
            r = rank.get(s.seq_id)
            paths = [p for p in self.paths if len(p) <= size] if r is not None else []
            parents, depths = tree_structure(paths)
            tokens = [s.token_ids[-1]] + [top[len(p) - 1][r][p[-1]] for p in paths]
            out.append(Draft(s, tokens, parents, depths, torch.tensor(tree_mask(parents)), None, [-1] * len(tokens),
                             s.num_tokens))
        return out


def build_medusa_drafter(spec, target, device: torch.device) -> MedusaDrafter:
    """The drafter of a ``spec_method="medusa"`` config for ``target`` (heads in its dtype)."""
    c = target.config
    heads = spec.draft_model
    if isinstance(heads, str):
        heads = load_medusa_heads(heads, int(c.hidden_size), int(c.vocab_size), target.dtype, device, target.lm_head)
    elif not isinstance(heads, MedusaHeads):
        raise ValueError(f"spec_model for spec_method='medusa' must be a heads directory or MedusaHeads, "
                         f"got {type(heads).__name__}")
    paths = tree_for_heads(spec.tree, spec.mode, spec.num_tokens, heads.num_heads)
    return MedusaDrafter(heads, paths, device)
