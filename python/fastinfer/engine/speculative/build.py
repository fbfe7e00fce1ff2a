"""The loaders of the heads with their own KV pool (a draft model, an EAGLE / EAGLE-3 head), which
the method registry (:mod:`.registry`) names, and the KV slots of a forward plan's rows."""

from __future__ import annotations

from typing import List

import torch

from ...layers import slot_of

__all__ = ["load_draft_model", "load_eagle_head", "plan_slots"]


def load_draft_model(spec, target, max_model_len: int, ops):
    """Load / check the draft model of ``spec``: same vocabulary, the target's dtype and device,
    built on the op backend ``ops`` (the config's mode). It runs on rank 0 only, unsharded (its
    proposals are token ids that travel in the step's plan)."""
    from ..checkpoints import load_checkpoint
    from ...models import load_config

    device = target.device
    if isinstance(spec.draft_model, str):
        dcfg = load_config(spec.draft_model)
        _check_draft_vocab(int(dcfg.vocab_size), int(target.config.vocab_size))
        draft = load_checkpoint(spec.draft_model, target.dtype, device, int(target.max_positions), ops)
    else:
        draft = spec.draft_model
        _check_draft_vocab(int(draft.config.vocab_size), int(target.config.vocab_size))
        if torch.device(getattr(draft, "device", device)) != device:
            raise ValueError(f"draft_model is on {draft.device}, the target on {device}")
        if int(getattr(draft, "max_positions", max_model_len)) < max_model_len:
            raise ValueError(f"draft_model accepts {draft.max_positions} positions, fewer than "
                             f"max_model_len={max_model_len}")
    draft.pack_linears_for_cpu()
    return draft


def _check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"draft_model has vocab_size {draft_vocab}, the target {target_vocab}: speculative "
                         "decoding needs a draft with the target's tokenizer and vocabulary")


def load_eagle_head(spec, target, cls, load):
    """The EAGLE / EAGLE-3 head of ``spec``: ``load(directory, target)``, or an already built
    ``cls`` (``EagleDraftModel`` / ``Eagle3DraftModel``). It calls the target's op backend."""
    head = spec.draft_model
    if isinstance(head, str):
        return load(head, target)
    if type(head) is not cls:
        raise ValueError(f"spec_model for spec_method={spec.method!r} must be a head directory or {cls.__name__}, "
                         f"got {type(head).__name__}")
    return head


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
