"""The executor's drafter for each ``spec_method``, and the KV slots of a forward plan's rows."""

from __future__ import annotations

from typing import List

import torch

from ...layers import slot_of
from .drafter import Drafter, DraftModelDrafter

__all__ = ["build_drafter", "load_eagle_head", "plan_slots"]


def load_eagle_head(spec, target):
    """The EAGLE / EAGLE-3 head of ``spec`` (a directory, or an already built ``EagleDraftModel`` /
    ``Eagle3DraftModel``, as ``spec.method`` says)."""
    from .eagle import EagleDraftModel, load_eagle
    from .eagle3 import Eagle3DraftModel, load_eagle3

    cls, load = (Eagle3DraftModel, load_eagle3) if spec.method == "eagle3" else (EagleDraftModel, load_eagle)
    head = spec.draft_model
    if isinstance(head, str):
        return load(head, target)
    if type(head) is not cls:
        raise ValueError(f"spec_model for spec_method={spec.method!r} must be a head directory or {cls.__name__}, "
                         f"got {type(head).__name__}")
    return head


def build_drafter(spec, target, draft_model, num_kv_blocks: int, block_size: int, device: torch.device,
                  max_num_batched_tokens: int, deterministic: bool = False) -> Drafter:
    """``draft_model``: the loaded draft model / EAGLE head (None for Medusa); its KV pool is
    allocated here, with the target's block count. ``deterministic``: see :attr:`Drafter.deterministic`."""
    drafter = _build(spec, target, draft_model, num_kv_blocks, block_size, device, max_num_batched_tokens)
    drafter.deterministic = deterministic
    return drafter


def _build(spec, target, draft_model, num_kv_blocks, block_size, device, max_num_batched_tokens) -> Drafter:
    if spec.method == "medusa":
        from .medusa import build_medusa_drafter

        return build_medusa_drafter(spec, target, device)
    kv = draft_model.allocate_kv_cache(num_kv_blocks, block_size)
    args = (draft_model, kv, block_size, device, spec.mode, spec.num_tokens, spec.tree_topk, max_num_batched_tokens)
    if spec.method == "eagle":
        from .eagle import EagleDrafter

        return EagleDrafter(*args, num_kv_blocks)
    if spec.method == "eagle3":
        from .eagle3 import Eagle3Drafter

        return Eagle3Drafter(*args, num_kv_blocks)
    return DraftModelDrafter(*args)


def plan_slots(plan, block_size: int) -> List[int]:
    """The KV slot of every row of a :class:`~..model_runner.ForwardPlan`'s batch, in batch order
    (chunks, decodes, trees)."""
    out: List[int] = []
    for c in plan.chunks:
        t = plan.tables[c.seq_id]
        out += [slot_of(t, c.start + i, block_size) for i in range(len(c.tokens))]
    for sid, _, p in plan.decodes:
        out.append(slot_of(plan.tables[sid], p, block_size))
    for c in plan.trees:
        t = plan.tables[c.seq_id]
        out += [slot_of(t, c.start + i, block_size) for i in range(len(c.tokens))]
    return out
