"""The fields of a DFlash drafter's ``config.json`` (:mod:`.dflash`), read without torch: the engine
core's proposer needs the block size (the KV slots a drafting step writes) and imports no tensor code.

Fields as z-lab's published drafters carry them (z-lab/dflash ``dflash/model.py``,
``DFlashDraftModel.__init__``; SGLang ``python/sglang/srt/speculative/dflash_utils.py``,
``parse_dflash_draft_config``, accepts the same keys at the top level too):

* ``block_size`` (top level, or in ``dflash_config``): tokens per drafted block, the anchor (the
  last committed token) included; required.
* ``dflash_config.mask_token_id``: the token id the block's other positions carry; required.
* ``dflash_config.target_layer_ids``: the target layers whose outputs are concatenated as context
  features (0-based, the OUTPUT of layer i, as transformers' ``hidden_states[i + 1]``); default
  :func:`default_target_layer_ids` of ``num_target_layers`` and the drafter's
  ``num_hidden_layers``.
* ``num_target_layers``: the target's layer count the drafter was trained on (checked against the
  target when present).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["DFlashConfig", "default_target_layer_ids", "parse_dflash_config", "read_dflash_config",
           "dflash_block_size"]


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> Tuple[int, ...]:
    """z-lab's rule (``build_target_layer_ids``): one drafter layer reads the middle target layer;
    otherwise ``num_draft_layers`` ids spread evenly (rounded) from 1 to ``num_target_layers - 3``."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """The DFlash fields of a drafter's config (module docstring)."""

    block_size: int
    mask_token_id: int
    num_draft_layers: int
    #: None: :func:`default_target_layer_ids` of the target's layer count
    target_layer_ids: Optional[Tuple[int, ...]]
    num_target_layers: Optional[int]

    def layer_ids(self, num_target_layers: int, where: str) -> Tuple[int, ...]:
        """The target layer ids for a target of ``num_target_layers`` layers; a ValueError when the
        config was written for another layer count or names a layer the target cannot hand over."""
        if self.num_target_layers is not None and self.num_target_layers != num_target_layers:
            raise ValueError(f"{where}: the DFlash drafter was trained on a target of num_target_layers="
                             f"{self.num_target_layers}, this target has {num_target_layers} layers")
        ids = self.target_layer_ids
        if ids is None:
            if num_target_layers < 4 and self.num_draft_layers > 1:
                raise ValueError(f"{where}: the default target_layer_ids need a target of at least 4 layers "
                                 f"(got {num_target_layers}); give dflash_config.target_layer_ids")
            ids = default_target_layer_ids(num_target_layers, self.num_draft_layers)
        # the runner hands over the residual stream entering a layer: the output of the last layer is
        # not among them (it leaves through the final norm)
        bad = [i for i in ids if not 0 <= i < num_target_layers - 1]
        if bad:
            raise ValueError(f"{where}: dflash_config.target_layer_ids {bad} must be in [0, {num_target_layers - 1}) "
                             f"for a target of {num_target_layers} layers (the last layer's output is not "
                             "available as a context feature)")
        return tuple(ids)


def _int(value: Any, name: str, where: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    return value


def parse_dflash_config(d: Dict[str, Any], where: str) -> DFlashConfig:
    """The DFlash fields of the ``config.json`` dict ``d`` (``where`` names it in errors)."""
    dc = d.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ValueError(f"{where}: dflash_config must be an object, got {dc!r}")

    def field(name: str) -> Any:
        return dc.get(name, d.get(name))

    if field("block_size") is None:
        raise ValueError(f"{where}: a DFlash config needs block_size (tokens per drafted block)")
    block_size = _int(field("block_size"), "block_size", where, 2)
    if field("mask_token_id") is None:
        raise ValueError(f"{where}: a DFlash config needs dflash_config.mask_token_id (the id of the mask token "
                         "the drafted positions carry)")
    mask_token_id = _int(field("mask_token_id"), "mask_token_id", where, 0)
    num_draft_layers = _int(d.get("num_hidden_layers"), "num_hidden_layers", where, 1)
    ids = field("target_layer_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"{where}: dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
        ids = tuple(ids)
    ntl = field("num_target_layers")
    ntl = None if ntl is None else _int(ntl, "num_target_layers", where, 1)
    return DFlashConfig(block_size, mask_token_id, num_draft_layers, ids, ntl)


def read_dflash_config(path: str) -> Tuple[Dict[str, Any], DFlashConfig]:
    """``(the config.json dict, its DFlash fields)`` of the drafter directory ``path``."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"DFlash directory {path!r} has no config.json")
    with open(cfg_file, "r", encoding="utf-8") as f:
        d = json.load(f)
    return d, parse_dflash_config(d, cfg_file)


def dflash_block_size(spec_model: Any) -> int:
    """The block size of ``spec_model``: a drafter directory, or a built drafter (its ``block_size``)."""
    if isinstance(spec_model, str):
        return read_dflash_config(spec_model)[1].block_size
    return int(spec_model.block_size)
