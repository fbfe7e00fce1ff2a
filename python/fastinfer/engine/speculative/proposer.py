"""The engine core's half of speculation: what to propose, and what the draft's KV cache holds.

A :class:`Proposer` never touches a tensor. It gives the scheduler its lookahead rule
(:meth:`Proposer.plan`: the draft size and the KV slots a speculative step reserves), tells the
executor's drafter how far each sequence's draft K/V reaches (:meth:`Proposer.draft_computed`),
and takes the verdicts back (:meth:`Proposer.commit`) to keep that state and the statistics.

Draft-KV state. The draft's pool uses the target's block ids (the sequence's block table), so
preemption, forks and prefix caching need no second allocator. The proposer keeps, per sequence,
how many leading tokens have draft K/V, and per block the block manager's ``version`` it filled
completely: a prefix-cache hit on such a block (same version: same contents since) spares the
draft's recomputation too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence as Seq

from ..block_manager import BlockManager
from ..scheduler import SchedulerOutput, SpecPlan
from ..sequence import Sequence
from .dflash_config import dflash_block_size
from .trees import Path

if TYPE_CHECKING:  # the config module imports torch and the model loader; this reads fields only
    from ..config import SpeculativeConfig

__all__ = ["Proposer", "DraftModelProposer", "StaticTreeProposer", "BlockDraftProposer", "EagleProposer",
           "PROPOSER_BUILDERS", "make_proposer", "speculation_supported"]


def speculation_supported(params) -> bool:
    """The verifier reproduces the plain temperature distribution only: no top-k / top-p / min-p /
    penalties / logit bias."""
    return (params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.logit_bias)


class Proposer:
    """Interface of the core-side proposer (the draft model today; draft heads next)."""

    def plan(self, seq: Sequence):
        """The scheduler's lookahead rule: a :class:`SpecPlan`, or None to decode normally."""
        raise NotImplementedError

    def draft_computed(self, seq: Sequence) -> int:
        raise NotImplementedError

    def on_schedule(self, out: SchedulerOutput) -> None:
        raise NotImplementedError

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        raise NotImplementedError

    def on_finish(self, seq: Sequence) -> None:
        raise NotImplementedError

    def commit(self, seq: Sequence, draft_computed: int, num_draft: int, num_accepted: int, max_depth: int) -> None:
        raise NotImplementedError

    def stats(self) -> Dict[str, object]:
        raise NotImplementedError


class DraftModelProposer(Proposer):
    """Plans for a draft model (chain or tree) and tracks its KV coverage (module docstring)."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int):
        self.mode = config.mode
        self.k = int(config.num_tokens or 0)
        self.topk = int(config.tree_topk)
        self.depth = int(config.tree_depth or 0)
        self.bm = block_manager
        self.max_model_len = max_model_len
        self._computed: Dict[int, int] = {}  # seq_id -> leading tokens with draft K/V
        self._filled: Dict[int, int] = {}  # block id -> block version whose draft K/V is complete
        # statistics over the engine's lifetime
        self.num_verify = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.depth_reached: List[int] = []  # [d-1]: verifications whose path reached depth d
        self.depth_offered: List[int] = []  # [d-1]: verifications whose tree had a node at depth d

    # ---- planning ---------------------------------------------------------------------------------
    def plan(self, seq: Sequence):
        p = seq.params
        if p.speculative is False or not speculation_supported(p):
            return None
        left = self.max_model_len - seq.num_tokens  # tokens that may still be generated
        if p.max_tokens is not None:
            left = min(left, p.max_tokens - seq.num_output_tokens)
        size = min(self.k if self.mode == "chain" else self.depth, left - 1)
        if size < 1:
            return None
        span = self._span(size)
        if seq.num_computed_tokens + span > self.max_model_len:
            return None
        return SpecPlan(size, span)

    def _span(self, size: int) -> int:
        """KV slots of a draft of ``size`` (chain length / tree depth), its root included."""
        return size + 1 if self.mode == "chain" else max(self.k + 1, self.topk * (size - 1) + 1)

    # ---- draft-KV state ---------------------------------------------------------------------------
    def draft_computed(self, seq: Sequence) -> int:
        return self._computed.get(seq.seq_id, 0)

    def _valid_prefix_blocks(self, seq: Sequence, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and self._filled.get(seq.block_table[n]) == self.bm.version[seq.block_table[n]]:
            n += 1
        return n

    def on_schedule(self, out: SchedulerOutput) -> None:
        """Preempted sequences lost their blocks; admitted ones may have draft K/V in their hits."""
        for seq in out.preempted:
            self._computed.pop(seq.seq_id, None)
        bs = self.bm.block_size
        for seq in out.admitted:
            hits = seq.num_computed_tokens // bs  # admission: the computed tokens are the hits
            self._computed[seq.seq_id] = self._valid_prefix_blocks(seq, hits) * bs

    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        self._computed[child.seq_id] = min(self.draft_computed(parent), child.num_computed_tokens)

    def on_finish(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)

    def commit(self, seq: Sequence, draft_computed: int, num_draft: int, num_accepted: int, max_depth: int) -> None:
        """A verified step: the draft now holds K/V of ``draft_computed`` leading tokens."""
        self._computed[seq.seq_id] = draft_computed
        bs = self.bm.block_size
        for i in range(min(draft_computed // bs, len(seq.block_table))):
            bid = seq.block_table[i]
            self._filled[bid] = self.bm.version[bid]
        while len(self.depth_offered) < max_depth:
            self.depth_offered.append(0)
            self.depth_reached.append(0)
        for d in range(max_depth):
            self.depth_offered[d] += 1
            if num_accepted > d:
                self.depth_reached[d] += 1
        self.num_verify += 1
        self.num_draft_tokens += num_draft
        self.num_accepted += num_accepted

    def stats(self) -> Dict[str, object]:
        """Lifetime counters. ``spec_mean_accepted_length``: accepted draft tokens per verification
        (each verification also emits one more token: ``spec_mean_tokens_per_verify``);
        ``spec_acceptance_rate_per_depth[d - 1]``: among verifications whose tree had a node at
        depth d, the fraction whose accepted path reached depth d."""
        nv = max(self.num_verify, 1)
        return {
            "spec_num_verify": self.num_verify,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_mean_accepted_length": self.num_accepted / nv,
            "spec_mean_tokens_per_verify": (self.num_accepted + self.num_verify) / nv,
            "spec_draft_acceptance_rate": self.num_accepted / max(self.num_draft_tokens, 1),
            "spec_acceptance_rate_per_depth": [r / o if o else 0.0 for r, o in zip(self.depth_reached, self.depth_offered)],
            "spec_depth_reached": list(self.depth_reached),
            "spec_depth_offered": list(self.depth_offered),
        }


class StaticTreeProposer(DraftModelProposer):
    """Plans for draft heads with a static tree of ``paths`` (Medusa): the tree cut at the depth
    the sequence may still generate; the drafter keeps no KV of its own."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 paths: Seq[Path]):
        super().__init__(config, block_manager, max_model_len)
        self.paths = list(paths)
        self.depth = max(len(p) for p in self.paths)
        self.mode = "tree"  # plan() cuts the tree at the depth the sequence may still generate

    def _span(self, size: int) -> int:
        return 1 + sum(len(q) <= size for q in self.paths)


class BlockDraftProposer(StaticTreeProposer):
    """Plans for a DFlash drafter (:mod:`.dflash`): a static tree as Medusa's, and a drafting step
    that writes the whole block's K/V (``block_size`` slots from the root) whatever the tree's size,
    so a speculative step reserves at least ``block_size`` slots."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                 paths: Seq[Path], block_size: int):
        super().__init__(config, block_manager, max_model_len, paths)
        self.block_size = int(block_size)

    def _span(self, size: int) -> int:
        return max(super()._span(size), self.block_size)


def _block_draft_proposer(spec, bm, max_model_len, draft_tree) -> BlockDraftProposer:
    return BlockDraftProposer(spec, bm, max_model_len, draft_tree, dflash_block_size(spec.draft_model))


class EagleProposer(DraftModelProposer):
    """An EAGLE head's rows pair each token's feature with the NEXT token, so the last row of a
    prefix-cache hit's blocks is recomputed (the token after the hit may differ)."""

    def on_schedule(self, out: SchedulerOutput) -> None:
        super().on_schedule(out)
        for seq in out.admitted:
            self._computed[seq.seq_id] = max(0, self._computed[seq.seq_id] - 1)


#: method (``spec_method``, the names of :mod:`.registry`) -> ``(spec, block_manager, max_model_len,
#: draft_tree) -> Proposer`` (``draft_tree``: the executor's static tree of draft heads, or None)
PROPOSER_BUILDERS: Dict[str, Callable[..., DraftModelProposer]] = {
    "draft": lambda spec, bm, max_model_len, draft_tree: DraftModelProposer(spec, bm, max_model_len),
    "medusa": StaticTreeProposer,
    "eagle": lambda spec, bm, max_model_len, draft_tree: EagleProposer(spec, bm, max_model_len),
    "eagle3": lambda spec, bm, max_model_len, draft_tree: EagleProposer(spec, bm, max_model_len),
    "dflash": _block_draft_proposer,
}


def make_proposer(config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int,
                  draft_tree: Optional[Seq[Path]]) -> DraftModelProposer:
    """The core-side proposer of ``config.method`` (:data:`PROPOSER_BUILDERS`; ``draft_tree``: the
    executor's static tree of draft heads, for ``medusa`` and ``dflash``)."""
    return PROPOSER_BUILDERS[config.method](config, block_manager, max_model_len, draft_tree)
