"""The speculative methods (``spec_method``): one :class:`SpecMethod` entry each, holding what the
configuration needs to know of a method, so the config looks a method up instead of comparing its
name.

Pure data (it imports nothing of the engine and builds nothing): the config (:mod:`..config`)
imports it. An entry gives the method's config defaults (mode, draft size per mode), what
``spec_model`` names (a checkpoint or a heads directory), whether a static tree applies and whether
tensor parallelism is supported. What builds a method's parts is keyed by the same names, on each
side of the engine: the executor's head loaders and drafters in :mod:`.build`, the core's proposers
in :mod:`.proposer` (tests/test_engine_config.py checks that both cover every method).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

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

    @property
    def option(self) -> str:
        """The LLM option naming this method's model in messages."""
        return "draft_model" if self.name == "draft" else "spec_model"


_DRAFT_SIZES = {"chain": 4, "tree": 8}

SPEC_REGISTRY: Dict[str, SpecMethod] = {m.name: m for m in (
    SpecMethod("draft", "a draft model (checkpoint directory or .gguf file, or a model object)", "chain",
               _DRAFT_SIZES, True, False, True),
    SpecMethod("medusa", "Medusa heads (a directory, Medusa or vLLM layout, or MedusaHeads)", "tree",
               {"chain": None, "tree": None}, False, True, False),
    SpecMethod("eagle", "an EAGLE-1/2 head (a directory, EAGLE repository layout, or EagleDraftModel)", "chain",
               _DRAFT_SIZES, False, False, False),
    SpecMethod("eagle3", "an EAGLE-3 head (a directory, EAGLE repository or vLLM layout, or Eagle3DraftModel)",
               "chain", _DRAFT_SIZES, False, False, False),
    SpecMethod("dflash", "a DFlash block drafter (a directory, z-lab layout, or DFlashDraftModel)", "chain",
               {"chain": None, "tree": None}, False, True, False),
)}

SPEC_METHODS: Tuple[str, ...] = tuple(SPEC_REGISTRY)


def spec_method(name: str) -> SpecMethod:
    """The registry entry of ``name``; a ValueError listing the methods otherwise."""
    entry = SPEC_REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"spec_method must be one of {SPEC_METHODS}, got {name!r}")
    return entry
