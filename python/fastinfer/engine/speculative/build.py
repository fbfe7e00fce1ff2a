"""The executor's builders of each speculative method (``spec_method``, the names of
:mod:`.registry`): the loader of a draft with its own KV pool (a draft model, an EAGLE / EAGLE-3
head; :data:`DRAFT_LOADERS`, none for Medusa's heads, which read the target's hidden states) and
the drafter (:data:`DRAFTER_BUILDERS`); and the KV slots of a forward plan's rows. The engine
core's half (the proposers) is :mod:`.proposer`'s. Only the executor imports this module.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from ...layers import slot_of
from .dflash import DFlashDraftModel, build_dflash_drafter, load_dflash
from .drafter import Drafter, DraftModelDrafter
from .eagle import EagleDraftModel, EagleDrafter, load_eagle
from .eagle3 import Eagle3DraftModel, Eagle3Drafter, load_eagle3
from .medusa import build_medusa_drafter

__all__ = ["DRAFT_LOADERS", "DRAFTER_BUILDERS", "load_draft", "build_drafter", "load_draft_model",
           "load_eagle_head", "plan_slots"]


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
    """The EAGLE / EAGLE-3 head (or DFlash drafter) of ``spec``: ``load(directory, target)``, or an
    already built ``cls`` (``EagleDraftModel`` / ``Eagle3DraftModel`` / ``DFlashDraftModel``). It
    calls the target's op backend."""
    head = spec.draft_model
    if isinstance(head, str):
        return load(head, target)
    if type(head) is not cls:
        raise ValueError(f"spec_model for spec_method={spec.method!r} must be a head directory or {cls.__name__}, "
                         f"got {type(head).__name__}")
    return head


def _load_eagle(spec, target, max_model_len, ops):
    return load_eagle_head(spec, target, EagleDraftModel, load_eagle)


def _load_eagle3(spec, target, max_model_len, ops):
    return load_eagle_head(spec, target, Eagle3DraftModel, load_eagle3)


def _load_dflash(spec, target, max_model_len, ops):
    return load_eagle_head(spec, target, DFlashDraftModel, load_dflash)


#: method -> ``(spec, target, max_model_len, ops) -> draft`` with its own KV pool (indexed by the
#: target's block ids); a method not listed has none
DRAFT_LOADERS: Dict[str, Callable] = {"draft": load_draft_model, "eagle": _load_eagle, "eagle3": _load_eagle3,
                                      "dflash": _load_dflash}


def load_draft(spec, target, max_model_len: int, ops):
    """The draft of ``spec`` with its own KV pool (:data:`DRAFT_LOADERS`), or None."""
    load = DRAFT_LOADERS.get(spec.method)
    return load(spec, target, max_model_len, ops) if load is not None else None


def _drafter_args(spec, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
                  kv_cache_dtype) -> tuple:
    kv = draft.allocate_kv_cache(num_kv_blocks, block_size, kv_cache_dtype)  # the target's block count and ids
    return draft, kv, block_size, device, spec.mode, spec.num_tokens, spec.tree_topk, max_num_batched_tokens, ops


def _draft_model_drafter(spec, target, draft, num_kv_blocks, *args):
    return DraftModelDrafter(*_drafter_args(spec, draft, num_kv_blocks, *args))


def _eagle_drafter(spec, target, draft, num_kv_blocks, *args):
    return EagleDrafter(*_drafter_args(spec, draft, num_kv_blocks, *args), num_kv_blocks)


def _eagle3_drafter(spec, target, draft, num_kv_blocks, *args):
    return Eagle3Drafter(*_drafter_args(spec, draft, num_kv_blocks, *args), num_kv_blocks)


def _dflash_drafter(spec, target, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
                    kv_cache_dtype):
    return build_dflash_drafter(spec, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, kv_cache_dtype)


def _medusa_drafter(spec, target, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
                    kv_cache_dtype):  # the heads read the target's hidden states: no KV pool of their own
    return build_medusa_drafter(spec, target, device)


#: method -> ``(spec, target, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
#: kv_cache_dtype) -> Drafter`` (``draft``: what :data:`DRAFT_LOADERS` loaded, or None;
#: ``kv_cache_dtype``: the torch dtype of the draft's KV pool, the target's)
DRAFTER_BUILDERS: Dict[str, Callable] = {"draft": _draft_model_drafter, "medusa": _medusa_drafter,
                                         "eagle": _eagle_drafter, "eagle3": _eagle3_drafter,
                                         "dflash": _dflash_drafter}


def build_drafter(spec, target, draft: Optional[torch.nn.Module], num_kv_blocks: int, block_size: int,
                  device: torch.device, max_num_batched_tokens: int, ops, kv_cache_dtype: torch.dtype) -> Drafter:
    """The executor's drafter of ``spec.method`` (:data:`DRAFTER_BUILDERS`)."""
    return DRAFTER_BUILDERS[spec.method](spec, target, draft, num_kv_blocks, block_size, device,
                                         max_num_batched_tokens, ops, kv_cache_dtype)


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
