"""The speculative methods (``spec_method``): one :class:`SpecMethod` entry each, holding everything
that differs between them, so the config, the executor and the engine core look a method up instead
of comparing its name.

An entry gives the method's config defaults (mode, draft size per mode), what ``spec_model`` names
(a checkpoint or a heads directory), whether a static tree applies, whether tensor parallelism is
supported, and the three builders: the head loader (a draft with its own KV pool, or None when the
drafter reads the target's hidden states), the executor's drafter and the core's proposer. The
builders import their modules when called, so this module stays importable from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

__all__ = ["SpecMethod", "SPEC_REGISTRY", "SPEC_METHODS", "SPEC_MODES", "spec_method"]

#: the drafting modes: draft tokens in a row, or a tree of them
SPEC_MODES: Tuple[str, ...] = ("chain", "tree")


@dataclass(frozen=True)
class SpecMethod:
    """What one ``spec_method`` is (see the module docstring)."""

    name: str
    #: what ``spec_model`` is for this method (shown in errors and the option help)
    description: str
    #: ``spec_mode`` when none is given
    default_mode: str
    #: ``num_spec_tokens`` when none is given, by mode (None: the method's own size, e.g. every head)
    default_num_tokens: Dict[str, Optional[int]]
    #: ``spec_model`` is a checkpoint (a directory or a .gguf file) rather than a heads directory
    spec_model_is_checkpoint: bool
    #: ``spec_tree`` (a static tree of top-k rank paths) applies, in tree mode
    static_tree: bool
    #: runs with ``tensor_parallel_size > 1`` (the heads need the target's hidden states, which
    #: the sharded target does not return yet)
    tensor_parallel: bool
    #: ``(spec, target, max_model_len, ops) -> draft`` with its own KV pool; None: no own pool
    load_draft: Optional[Callable]
    #: ``(spec, target, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops, kv_cache_dtype)
    #: -> Drafter`` (``kv_cache_dtype``: the torch dtype of the draft's KV pool, the target's)
    build_drafter: Callable
    #: ``(spec, block_manager, max_model_len, draft_tree) -> Proposer`` (``draft_tree``: the executor's
    #: static tree of draft heads, or None)
    make_proposer: Callable

    @property
    def option(self) -> str:
        """The LLM option naming this method's model in messages."""
        return "draft_model" if self.name == "draft" else "spec_model"


# ---- builders (lazy imports: the engine modules import the config, which imports this) ----------

def _load_draft_model(spec, target, max_model_len, ops):
    from .build import load_draft_model

    return load_draft_model(spec, target, max_model_len, ops)


def _load_eagle(spec, target, max_model_len, ops):
    from .build import load_eagle_head
    from .eagle import EagleDraftModel, load_eagle

    return load_eagle_head(spec, target, EagleDraftModel, load_eagle)


def _load_eagle3(spec, target, max_model_len, ops):
    from .build import load_eagle_head
    from .eagle3 import Eagle3DraftModel, load_eagle3

    return load_eagle_head(spec, target, Eagle3DraftModel, load_eagle3)


def _drafter_args(spec, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
                  kv_cache_dtype) -> tuple:
    kv = draft.allocate_kv_cache(num_kv_blocks, block_size, kv_cache_dtype)  # the target's block count and ids
    return draft, kv, block_size, device, spec.mode, spec.num_tokens, spec.tree_topk, max_num_batched_tokens, ops


def _draft_model_drafter(spec, target, draft, num_kv_blocks, *args):
    from .drafter import DraftModelDrafter

    return DraftModelDrafter(*_drafter_args(spec, draft, num_kv_blocks, *args))


def _eagle_drafter(spec, target, draft, num_kv_blocks, *args):
    from .eagle import EagleDrafter

    return EagleDrafter(*_drafter_args(spec, draft, num_kv_blocks, *args), num_kv_blocks)


def _eagle3_drafter(spec, target, draft, num_kv_blocks, *args):
    from .eagle3 import Eagle3Drafter

    return Eagle3Drafter(*_drafter_args(spec, draft, num_kv_blocks, *args), num_kv_blocks)


def _medusa_drafter(spec, target, draft, num_kv_blocks, block_size, device, max_num_batched_tokens, ops,
                    kv_cache_dtype):  # the heads read the target's hidden states: no KV pool of their own
    from .medusa import build_medusa_drafter

    return build_medusa_drafter(spec, target, device)


def _chain_proposer(eagle: bool) -> Callable:
    def make(spec, block_manager, max_model_len, draft_tree):
        from .proposer import DraftModelProposer, EagleProposer

        return (EagleProposer if eagle else DraftModelProposer)(spec, block_manager, max_model_len)
    return make


def _static_tree_proposer(spec, block_manager, max_model_len, draft_tree):
    from .proposer import StaticTreeProposer

    return StaticTreeProposer(spec, block_manager, max_model_len, draft_tree)


_DRAFT_SIZES = {"chain": 4, "tree": 8}

SPEC_REGISTRY: Dict[str, SpecMethod] = {m.name: m for m in (
    SpecMethod("draft", "a draft model (checkpoint directory or .gguf file, or a model object)", "chain",
               _DRAFT_SIZES, True, False, True, _load_draft_model, _draft_model_drafter,
               _chain_proposer(eagle=False)),
    SpecMethod("medusa", "Medusa heads (a directory, Medusa or vLLM layout, or MedusaHeads)", "tree",
               {"chain": None, "tree": None}, False, True, False, None, _medusa_drafter, _static_tree_proposer),
    SpecMethod("eagle", "an EAGLE-1/2 head (a directory, EAGLE repository layout, or EagleDraftModel)", "chain",
               _DRAFT_SIZES, False, False, False, _load_eagle, _eagle_drafter,
               _chain_proposer(eagle=True)),
    SpecMethod("eagle3", "an EAGLE-3 head (a directory, EAGLE repository or vLLM layout, or Eagle3DraftModel)",
               "chain", _DRAFT_SIZES, False, False, False, _load_eagle3, _eagle3_drafter,
               _chain_proposer(eagle=True)),
)}

SPEC_METHODS: Tuple[str, ...] = tuple(SPEC_REGISTRY)


def spec_method(name: str) -> SpecMethod:
    """The registry entry of ``name``; a ValueError listing the methods otherwise."""
    entry = SPEC_REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"spec_method must be one of {SPEC_METHODS}, got {name!r}")
    return entry
