"""Iteration-level scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step gets a budget of ``max_num_batched_tokens`` new tokens:

1. running sequences that decode (one new token each), in FCFS order;
2. running sequences in the middle of a chunked prefill, FCFS;
3. waiting sequences, FCFS, admitted while the budget, ``max_num_seqs``, the free blocks (and a
   hybrid model's free state slots) allow
   (their prefix-cache hits are taken first, except by a sequence that still needs the logits of
   its prompt positions for prompt logprobs; a prompt longer than the remaining budget is chunked).

When a running sequence needs a block and none is free, the running sequence that arrived last is
preempted: its blocks (and a hybrid model's state slot, :class:`~.block_manager.StateSlots`) are freed, it goes back to the waiting queue, and when readmitted it is
recomputed from its prompt + the tokens generated so far (its full blocks often come back from the
prefix cache). A sequence may preempt itself if it is the latest arrival.

A hybrid model with prefix caching (``state_slots`` given and the block manager caching): a
cached prefix is only usable up to its deepest block that has a state snapshot
(:class:`~.block_manager.StateSlots`); the admitted sequence takes those blocks and the snapshot is
copied into its slot. Snapshots are taken at block-aligned prefix ends, where a prefill chunk is
cut so that the slot holds exactly that state: the end of the last full block of the prompt, and
the end of the cached blocks when they reach past the deepest snapshot (the point where this
sequence leaves a prefix another one computed, so the next sequence sharing it finds its state).

Static batching (``static_batching=True``, for comparisons): waiting sequences are admitted only
into a batch that is still forming: a batch opens when nothing is running and closes as soon as
admission stops for a reason other than this step's token budget (the queue is empty, or
``max_num_seqs`` / the free blocks are reached); then nothing joins until every sequence of the
batch has finished. The same engine otherwise (chunked prefill, preemption, prefix cache).

Speculative decoding: with a ``lookahead`` rule (given at construction by the engine when it has a
proposer), a decoding sequence for which ``lookahead(seq)`` returns a plan with ``span`` S > 1 is
scheduled as a speculative step instead of a plain decode: it reserves KV slots for ``S`` tokens
past its computed ones (the draft tree's nodes and the draft model's scratch nodes) and costs ``S``
tokens of the budget. If the budget left is smaller than ``S``, or the free blocks do not cover the
extra slots, it decodes normally this step (a speculative step never preempts anything). The plan
travels in the output (``spec``), so it is made once per step.

Batches in flight (pipeline parallelism, :class:`~.core.EngineCore`): ``schedule(busy, max_seqs)``
leaves out the running sequences in ``busy`` (those of batches still in the pipeline: neither
scheduled nor preempted, their blocks kept) and schedules at most ``max_seqs`` sequences, so the
running ones split over the batches in flight.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Tuple

from .block_manager import BlockManager, StateSlots
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SpecPlan:
    """One speculative step of a sequence: ``size`` (chain length, or tree depth) and ``span`` (KV
    slots reserved past its computed tokens)."""

    size: int
    span: int


@dataclass
class SchedulerOutput:
    # (sequence, number of new tokens computed this step), prefill chunks first then decodes
    prefills: List[Tuple[Sequence, int]] = field(default_factory=list)
    decodes: List[Sequence] = field(default_factory=list)
    preempted: List[Sequence] = field(default_factory=list)
    # speculative steps and their plans
    spec: List[Tuple[Sequence, SpecPlan]] = field(default_factory=list)
    # waiting -> running this step (their prefix-cache hits are their computed tokens)
    admitted: List[Sequence] = field(default_factory=list)
    # hybrid models: (source, destination) state-slot copies to apply, in order, before the forward
    state_copies: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.spec

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes) + sum(p.span for _, p in self.spec)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, lookahead: Optional[Callable[[Sequence], Optional[SpecPlan]]] = None,
                 static_batching: bool = False, state_slots: Optional[StateSlots] = None):
        self.bm = block_manager
        self.state_slots = state_slots  # hybrid models: one slot per running sequence
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: List[Sequence] = []  # sorted by arrival
        self.running: List[Sequence] = []
        self.num_preemptions = 0
        self.lookahead = lookahead  # see the module docstring
        self.static_batching = static_batching
        self._batch_open = True  # static batching: the current batch still admits
        # hybrid models with prefix caching: state snapshots at block-aligned prefix ends
        self.snapshots = state_slots is not None and block_manager.enable_prefix_caching
        if self.snapshots:
            block_manager.on_evict = state_slots.drop

    # ------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.sort_key), seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence joins the running set directly (it already shares blocks)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, scheduled: Dict[int, int]) -> None:
        self.running.remove(seq)
        n = scheduled.pop(seq.seq_id, None)
        if n is not None:  # un-schedule it from this step
            out.prefills = [(s, k) for s, k in out.prefills if s is not seq]
            out.decodes = [s for s in out.decodes if s is not seq]
            out.spec = [(s, p) for s, p in out.spec if s is not seq]
            out.admitted = [s for s in out.admitted if s is not seq]
        self.bm.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)

    def _reserve(self, seq: Sequence, num_tokens: int, out: SchedulerOutput,
                 scheduled: Dict[int, int], busy: Collection[int] = ()) -> bool:
        """Make room for ``seq`` to hold ``num_tokens`` tokens, preempting the latest arrivals (not
        ``busy`` ones). Returns False when ``seq`` itself had to be preempted."""
        while not self.bm.can_allocate(seq, num_tokens):
            victim = max((s for s in self.running if s.seq_id not in busy), key=lambda s: s.sort_key)
            self._preempt(victim, out, scheduled)
            if victim is seq:
                return False
        self.bm.allocate(seq, num_tokens)
        return True

    # ------------------------------------------------------------------------------------------
    def schedule(self, busy: Collection[int] = (), max_seqs: Optional[int] = None) -> SchedulerOutput:
        """The next batch; ``busy``: seq ids of batches in flight, ``max_seqs``: at most this many
        sequences in it (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: Dict[int, int] = {}  # seq_id -> new tokens
        cap = self.max_num_seqs if max_seqs is None else max_seqs

        # 1. decodes, 2. ongoing prefill chunks (both FCFS among running)
        running = sorted((s for s in self.running if s.seq_id not in busy), key=lambda s: s.sort_key)
        decoding = [s for s in running if s.num_uncomputed_tokens == 1]
        prefilling = [s for s in running if s.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if budget <= 0 or len(scheduled) >= cap:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted meanwhile
                continue
            plan = self.lookahead(seq) if self.lookahead is not None and seq.num_uncomputed_tokens == 1 else None
            # speculate only with room to spare: never preempt another sequence for draft slots
            if (plan is not None and 1 < plan.span <= budget
                    and self.bm.can_allocate(seq, seq.num_computed_tokens + plan.span)):
                self.bm.allocate(seq, seq.num_computed_tokens + plan.span)
                scheduled[seq.seq_id] = plan.span
                budget -= plan.span
                out.spec.append((seq, plan))
                continue
            n = self._cut(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            if not self._reserve(seq, seq.num_computed_tokens + n, out, scheduled, busy):
                continue
            scheduled[seq.seq_id] = n
            budget -= n
            if n == 1 and seq.num_uncomputed_tokens == 1:
                out.decodes.append(seq)
            else:
                out.prefills.append((seq, n))

        # 3. admit waiting sequences (no preemption on their behalf)
        if self.static_batching and not self.running:
            self._batch_open = True
        if not out.preempted and self._batch_open:
            while self.waiting and budget > 0 and len(scheduled) < cap:
                seq = self.waiting[0]
                need_seqs = 1 + max(seq.pending_forks, 0)
                if len(self.running) + need_seqs > self.max_num_seqs:
                    self._batch_open = not self.static_batching
                    break
                # a prefix-cache hit has no logits: prompt logprobs recompute the whole prompt
                hits = self.bm.match_prefix(seq) if not seq.block_table and not seq.needs_prompt_logits else []
                restore = None
                if self.snapshots:
                    hits, restore = self._snapshot_plan(seq, hits)
                computed = len(hits) * self.bm.block_size if hits else seq.num_computed_tokens
                n = self._cut(seq, computed, min(seq.num_tokens - computed, budget))
                if not self.bm.can_allocate(seq, computed + n, hits) or (
                        self.state_slots is not None and not self.state_slots.can_take(need_seqs)):
                    self._batch_open = not self.static_batching
                    break
                self.waiting.pop(0)
                if self.state_slots is not None:
                    self.state_slots.take(seq)
                    if restore is not None:
                        self.state_slots.restore(seq, restore)
                if hits or not seq.block_table:
                    self.bm.allocate_prefix(seq, hits)
                    if seq.num_preemptions == 0:
                        seq.num_cached_tokens = seq.num_computed_tokens
                self.bm.allocate(seq, seq.num_computed_tokens + n)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.admitted.append(seq)
                scheduled[seq.seq_id] = n
                budget -= n
                if n == 1 and seq.num_uncomputed_tokens == 1:
                    out.decodes.append(seq)
                else:
                    out.prefills.append((seq, n))
            if not self.waiting and self.static_batching:
                self._batch_open = False
        if self.state_slots is not None and not out.is_empty:
            out.state_copies = self.state_slots.take_copies()
        return out

    def _snapshot_plan(self, seq: Sequence, hits: List[int]) -> Tuple[List[int], Optional[int]]:
        """A hybrid model's usable prefix-cache hits (those up to the deepest snapshot), the hash of
        that snapshot (None: none) and, in ``seq.snapshot_points``, the prefix ends (tokens) to
        snapshot as it computes (see the module docstring)."""
        bs = self.bm.block_size
        hashes = [self.bm.blocks[b].hash for b in hits]
        k = self.state_slots.cached_prefix(hits, hashes)
        points = []
        if len(hits) > k:
            points.append(len(hits) * bs)  # where it leaves a prefix computed before
        last_full = (seq.num_prompt_tokens - 1) // bs * bs
        if last_full > max(k * bs, points[-1] if points else 0):
            points.append(last_full)
        seq.snapshot_points = points
        return hits[:k], (hashes[k - 1] if k else None)

    def _cut(self, seq: Sequence, computed: int, n: int) -> int:
        """``n`` new tokens from ``computed`` on, cut at the first snapshot point inside them."""
        for p in seq.snapshot_points:
            if computed < p < computed + n:
                return p - computed
        return n

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are now in the cache."""
        for seq, n in out.prefills:
            seq.num_computed_tokens += n
            self.bm.register_full_blocks(seq)
            if self.snapshots and seq.num_computed_tokens in seq.snapshot_points and seq.state_slot is not None:
                self.state_slots.save(seq, seq.block_hashes[seq.num_computed_tokens // self.bm.block_size - 1])
        for seq in out.decodes:
            seq.num_computed_tokens += 1
            self.bm.register_full_blocks(seq)
