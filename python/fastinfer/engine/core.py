"""The engine core: requests as token ids, one scheduling step at a time.

``EngineCore`` owns the scheduler, the block manager and (with speculation) the proposer, and
drives an executor (any :class:`~.messages.StepExecutor`; its caller builds it): ``add_request``
(prompt token ids + params), ``abort_request``, ``step() ->`` one
:class:`~.messages.SeqOutput` per sequence the step touched (its new token ids, and a finish
reason when it finished), ``has_unfinished_requests``. It never touches a device tensor and knows
no text: detokenisation and stop strings belong to the output processor, which stops sequences
through :meth:`EngineCore.stop_sequence`. Finished requests leave the core at once.

Batches in flight (pipeline parallelism: ``executor.max_batches_in_flight`` K > 1): a step submits
batches (``executor.submit``) while fewer than K are in flight and the scheduler finds work among
the sequences not already in one, each batch holding about 1 / K of the unfinished sequences, then
collects the oldest (``executor.collect``) and applies its results. A sequence is in at most one
batch in flight; one finished meanwhile (aborted, stopped) has its results dropped.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, Iterable, List, Optional, Set, Tuple

from .block_manager import BlockManager, StateSlots
from .messages import SeqOutput, SpecWork, StepExecutor, StepInput
from .params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, Sequence
from .speculative.proposer import DraftModelProposer, make_proposer

if TYPE_CHECKING:  # the config module imports torch and the model loader; the core reads fields only
    from .config import EngineConfig

__all__ = ["EngineCore"]


class EngineCore:
    def __init__(self, config: EngineConfig, executor: StepExecutor, eos_token_ids: Iterable[int]):
        self.executor = executor
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = executor.max_model_len
        self.vocab_size = executor.vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.block_manager = BlockManager(executor.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.proposer: Optional[DraftModelProposer] = None
        if config.speculative is not None:
            self.proposer = make_proposer(config.speculative, self.block_manager, self.max_model_len,
                                          executor.draft_tree)
        self.num_state_slots = int(getattr(executor, "num_state_slots", 0))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, lookahead=self.proposer.plan if self.proposer else None,
                                   static_batching=config.static_batching,
                                   state_slots=StateSlots(self.num_state_slots, 2 if self.proposer else 1)
                                   if self.num_state_slots else None)
        self.requests: Dict[str, Request] = {}
        self.max_batches_in_flight = int(getattr(executor, "max_batches_in_flight", 1))
        self._in_flight: Deque[Tuple[SchedulerOutput, list, object]] = deque()  # (batch, forks, pending)
        self._finished_seq_ids: List[int] = []  # for the executor, at the next step
        self._next_seq_id = 0
        self.num_steps = 0
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: List[int], params: SamplingParams) -> Optional[str]:
        """Why this request cannot run (None: it can)."""
        try:
            params.verify()
        except ValueError as e:
            return str(e)
        if not prompt_ids:
            return "empty prompt"
        bad = [t for t in prompt_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            return f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
        if params.structured is not None:
            error = self.executor.structured_output_error(params.structured)
            if error is not None:
                return error
        if len(prompt_ids) >= self.max_model_len:
            return (f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                    f"(prompt + at least one generated token must fit)")
        if self.block_manager.blocks_needed(len(prompt_ids) + 1) > self.block_manager.num_blocks:
            return "prompt does not fit in the KV cache"
        if params.n > self.max_num_seqs:
            return f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}"
        if params.n > 1 and self.num_state_slots:
            return (f"n={params.n} is not supported for a hybrid model (a fork would need a copy of the "
                    "linear-attention state)")
        return None

    def add_request(self, request_id: str, prompt_ids: List[int], params: SamplingParams) -> Optional[str]:
        """Queue a request; returns the reason it was refused (then nothing is queued), else None."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        error = self.validate(prompt_ids, params)
        if error is not None:
            return error
        req = Request(request_id, prompt_ids, params)
        seq = self._new_seq(req)
        seq.pending_forks = params.n - 1
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return None

    def _new_seq(self, req: Request) -> Sequence:
        seq = Sequence(self._next_seq_id, req, len(req.seqs), req.prompt_token_ids, req.params)
        self._next_seq_id += 1
        req.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request (blocks freed now); no output follows."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        self.requests.pop(request_id, None)

    def stop_sequence(self, request_id: str, index: int) -> None:
        """The output processor found a stop string in completion ``index``: finish it here too."""
        req = self.requests.get(request_id)
        if req is not None and index < len(req.seqs) and not req.seqs[index].is_finished:
            self._finish(req.seqs[index], "stop")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.on_finish(seq)
        self._finished_seq_ids.append(seq.seq_id)
        req = seq.request
        if req.finished:
            self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------------------------------
    # one step
    # ------------------------------------------------------------------------------------------
    def step(self) -> List[SeqOutput]:
        """Schedule, run the executor once, apply its results (with batches in flight: submit
        batches, then apply the oldest's results; see the module docstring)."""
        if self.max_batches_in_flight > 1:
            return self._step_in_flight()
        out = self.scheduler.schedule()
        if out.is_empty:
            return self._refuse_stuck(out)
        step, forks = self._step_input(out)
        return self._apply(out, forks, self.executor.execute(step))

    def _step_input(self, out: SchedulerOutput):
        self.num_steps += 1
        if self.proposer is not None:
            self.proposer.on_schedule(out)
        forks = self._create_forks(out)
        spec = [SpecWork(s, p, self.proposer.draft_computed(s)) for s, p in out.spec]
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return StepInput(out, spec, {p.seq_id: c for p, c in forks}, finished), forks

    def _step_in_flight(self) -> List[SeqOutput]:
        out = None
        while len(self._in_flight) < self.max_batches_in_flight:
            busy: Set[int] = {s.seq_id for b, _, _ in self._in_flight
                              for s in [s for s, _ in b.prefills] + b.decodes}
            unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
            share = -(-min(unfinished, self.max_num_seqs) // self.max_batches_in_flight)
            out = self.scheduler.schedule(busy, max_seqs=max(1, share))
            if out.is_empty:
                break
            step, forks = self._step_input(out)
            self._in_flight.append((out, forks, self.executor.submit(step)))
        if not self._in_flight:
            return self._refuse_stuck(out)
        out, forks, pending = self._in_flight.popleft()
        result = self.executor.collect(pending)
        # the sequences finished while in flight (aborted, stopped): their results are dropped
        result.sampled = [s for s in result.sampled if not s.seq.is_finished]
        result.prompt_logprobs = [p for p in result.prompt_logprobs if not p.seq.is_finished]
        out.prefills = [(s, n) for s, n in out.prefills if not s.is_finished]
        out.decodes = [s for s in out.decodes if not s.is_finished]
        return self._apply(out, [(p, c) for p, c in forks if not p.is_finished], result)

    def _apply(self, out: SchedulerOutput, forks, result) -> List[SeqOutput]:
        """The results of batch ``out``: computed tokens, new tokens, finished sequences."""
        self.scheduler.postprocess(out)
        outs: Dict[int, SeqOutput] = {}

        def news(seq: Sequence) -> SeqOutput:
            o = outs.get(seq.seq_id)
            if o is None:
                o = outs[seq.seq_id] = SeqOutput(seq.request.request_id, seq.index,
                                                 num_cached_tokens=seq.num_cached_tokens)
            return o

        for seq in [s for s, _ in out.prefills] + out.decodes + [s for s, _ in out.spec]:
            news(seq).num_forwards = 1
        for p in result.prompt_logprobs:
            p.seq.request.num_prompt_logprobs = p.first - 1 + len(p.logprobs)
            news(p.seq).new_prompt_logprobs = p.logprobs
        for v in result.verified:
            seq, o = v.seq, news(v.seq)
            n = seq.num_tokens
            accepted = v.tokens[:-1]
            seq.num_computed_tokens = n + len(accepted)  # the root and the accepted nodes
            self.block_manager.trim(seq, n + len(v.tokens))
            self.proposer.commit(seq, v.draft_computed, v.num_draft, v.num_accepted, v.max_depth)
            seq.token_ids.extend(accepted)  # register the now complete blocks (prefix cache) ...
            self.block_manager.register_full_blocks(seq)
            del seq.token_ids[n:]  # ... then append one token at a time (stop conditions)
            o.spec_verified, o.spec_num_draft, o.spec_num_accepted = 1, v.num_draft, v.num_accepted
            for i, tok in enumerate(v.tokens):
                if self._append(seq, tok, v.logprobs[i] if v.logprobs is not None else None, o):
                    break
        # new forks share the parent's full prompt blocks (before the parent may finish and free
        # them) and recompute the partial tail block themselves
        for parent, children in forks:
            n_full = min(parent.num_prompt_tokens // self.block_size, len(parent.block_table))
            for child in children:
                self.block_manager.share(parent, child, n_full)
                child.num_cached_tokens = parent.num_cached_tokens
                self.scheduler.add_running(child)
                if self.proposer is not None:
                    self.proposer.on_fork(parent, child)
        for s in result.sampled:
            self._append(s.seq, s.token, s.logprobs, news(s.seq))
        return list(outs.values())

    def _create_forks(self, out: SchedulerOutput):
        """n > 1: the sequences that sample their first token this step get their forks now."""
        forks = []
        sampled = [s for s, n in out.prefills if s.num_computed_tokens + n == s.num_tokens] + out.decodes
        for seq in sampled:
            if seq.pending_forks > 0:
                req = seq.request
                forks.append((seq, [self._new_seq(req) for _ in range(seq.pending_forks)]))
                seq.pending_forks = 0
        return forks

    def _refuse_stuck(self, out: SchedulerOutput) -> List[SeqOutput]:
        """An empty step with waiting sequences and none running: the oldest can never be admitted
        (the KV pool is too small for it)."""
        if out.preempted or not self.scheduler.waiting or self.scheduler.running:
            return []
        seq = self.scheduler.waiting[0]
        o = SeqOutput(seq.request.request_id, seq.index, num_cached_tokens=seq.num_cached_tokens)
        if seq.num_output_tokens:
            o.finish_reason = "length"
            self._finish(seq, "length")
        else:
            o.finish_reason, o.error = "error", "the KV cache is too small for this request"
            self.abort_request(seq.request.request_id)
        return [o]

    def _append(self, seq: Sequence, tok: int, lp: Optional[dict], o: SeqOutput) -> bool:
        """Append one generated token; finish on EOS, a stop token, max_tokens or max_model_len."""
        seq.token_ids.append(tok)
        self.num_generated_tokens += 1
        o.new_token_ids.append(tok)
        if lp is not None:
            if o.new_logprobs is None:
                o.new_logprobs = []
            o.new_logprobs.append(lp)
        p = seq.params
        reason, stop_reason = None, None
        if not p.ignore_eos and tok in self.eos_token_ids:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return False
        o.finish_reason, o.stop_reason = reason, stop_reason
        self._finish(seq, reason, stop_reason)
        return True

    # ------------------------------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """Engine counters; with speculation also the proposer's (``spec_*``); the executor's
        (:meth:`~.messages.StepExecutor.stats`)."""
        bm = self.block_manager
        st: Dict[str, object] = {
            "num_kv_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "target_forwards_per_generated_token": self.num_steps / max(self.num_generated_tokens, 1),
            "num_unfinished_requests": len(self.requests),
        }
        if self.proposer is not None:
            st.update(self.proposer.stats())
        st.update(self.executor.stats())
        return st
