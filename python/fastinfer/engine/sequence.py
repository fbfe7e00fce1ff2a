"""A sequence: one completion being generated (a prompt with n > 1 completions has n sequences).

A sequence owns its token ids (prompt + generated), its block table (physical KV block ids) and
``num_computed_tokens``: how many leading tokens have their K/V in the cache. The scheduler moves it
between WAITING -> RUNNING -> FINISHED (and RUNNING -> WAITING on preemption, which frees the blocks
and resets ``num_computed_tokens``: the tokens are recomputed later, prompt and generated alike).

These are the engine core's records: token ids only. Text, logprobs and timings live in the output
processor; sampling generators in the executor; draft-model state in the proposer.
"""

from __future__ import annotations

import enum
import itertools
from typing import List, Optional

from .params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_counter = itertools.count()


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request: "Request",
        index: int,
        prompt_token_ids: List[int],
        params: SamplingParams,
    ):
        self.seq_id = seq_id
        self.request = request
        self.index = index  # completion index within the request
        self.params = params
        self.token_ids: List[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: List[int] = []
        self.block_hashes: List[int] = []  # hash chain of the leading full blocks (prefix cache)
        self.status = SequenceStatus.WAITING
        self.arrival = request.arrival  # FCFS key (ties broken by index)
        self.finish_reason: Optional[str] = None
        self.stop_reason = None
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache (first admission)
        self.num_preemptions = 0
        self.state_slot: Optional[int] = None  # hybrid models: its linear-attention state slot while running
        self.snapshot_points: List[int] = []  # hybrid models with prefix caching: where to snapshot its state
        self.scratch_slot: Optional[int] = None  # hybrid models with speculation: its state before a verification
        # n > 1: the first completion prefills the prompt, then the others fork from it
        self.pending_forks: int = 0

    # ------------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether this sequence's prefill must produce the logits of its prompt positions: it is
        the request's first completion (the one that prefills the prompt), the request asked for
        prompt logprobs and some are still missing."""
        req = self.request
        return (self.index == 0 and self.params.prompt_logprobs is not None
                and req.num_prompt_logprobs < self.num_prompt_tokens - 1)

    @property
    def sort_key(self):
        return (self.arrival, self.index)

    def __repr__(self) -> str:  # pragma: no cover
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, idx={self.index}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")


class Request:
    """A prompt (token ids) with its sampling params; holds its n sequences (the forks of n > 1
    are created when the first one has prefilled the prompt)."""

    def __init__(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = next(_arrival_counter)
        self.seqs: List[Sequence] = []
        # prompt tokens after the first whose logprobs have been computed (prompt_logprobs)
        self.num_prompt_logprobs = 0

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)
