"""What crosses the seam between the engine core and the executor, one step at a time.

The core sends a :class:`StepInput` (what the scheduler chose, the speculative work, new forks,
finished sequences) to a :class:`StepExecutor` and gets a :class:`ModelOutput` back: token ids and
numbers, never a tensor. The core then reports one :class:`SeqOutput` per sequence the step touched
to the output processor. Everything here is plain data over token ids: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence as Seq, Union

from .scheduler import SchedulerOutput, SpecPlan
from .sequence import Sequence
from .speculative.trees import Path

__all__ = ["StepInput", "SpecWork", "ModelOutput", "PromptLogprobs", "SampledToken", "VerifiedDraft", "SeqOutput",
           "StepExecutor"]


@dataclass
class SpecWork:
    """One sequence's speculative step: the scheduler's plan and the draft's KV coverage."""

    seq: Sequence
    plan: SpecPlan
    draft_computed: int  # leading tokens the draft has K/V for (the proposer's state)


@dataclass
class StepInput:
    scheduled: SchedulerOutput
    spec: List[SpecWork] = field(default_factory=list)
    # parent seq_id -> the new sequences (n > 1) whose first token is sampled from the parent's row
    forks: Dict[int, List[Sequence]] = field(default_factory=dict)
    finished_seq_ids: List[int] = field(default_factory=list)  # since the last step


@dataclass
class SampledToken:
    seq: Sequence
    token: int
    logprobs: Optional[Dict[int, float]]


@dataclass
class VerifiedDraft:
    seq: Sequence
    tokens: List[int]  # the accepted draft tokens, then the bonus / residual sample
    logprobs: Optional[List[Dict[int, float]]]
    num_draft: int
    num_accepted: int
    max_depth: int
    draft_computed: int  # leading tokens with draft K/V after the commit


@dataclass
class PromptLogprobs:
    """The logprobs of prompt tokens ``first ..`` of ``seq`` (one dict per token, in order)."""

    seq: Sequence
    first: int
    logprobs: List[Dict[int, float]]


@dataclass
class ModelOutput:
    sampled: List[SampledToken] = field(default_factory=list)
    verified: List[VerifiedDraft] = field(default_factory=list)
    prompt_logprobs: List[PromptLogprobs] = field(default_factory=list)


@dataclass
class SeqOutput:
    """What one engine step did to one sequence (completion ``index`` of request ``request_id``)."""

    request_id: str
    index: int
    new_token_ids: List[int] = field(default_factory=list)
    new_logprobs: Optional[List[dict]] = None
    new_prompt_logprobs: Optional[List[dict]] = None  # of the next prompt tokens (prompt_logprobs)
    finish_reason: Optional[str] = None  # of the last new token: "stop" (EOS / stop token), "length", ...
    stop_reason: Union[int, str, None] = None
    error: Optional[str] = None
    num_cached_tokens: int = 0
    num_forwards: int = 0  # target forward passes that computed its tokens (0 or 1)
    spec_num_draft: int = 0  # speculative step: draft tokens verified, and accepted
    spec_num_accepted: int = 0
    spec_verified: int = 0


class StepExecutor(Protocol):
    """What the engine core needs from an executor (:class:`~.executor.Executor` is the one that
    runs models): the sizes it derived from the model and the device, and one step at a time."""

    @property
    def max_model_len(self) -> int:
        """Tokens a sequence may reach (capped by the model's positions and the KV pool)."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the paged KV pool, for the block manager."""

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size: prompt token ids must be below it."""

    @property
    def num_state_slots(self) -> int:
        """State slots of a hybrid model's linear-attention layers (one per running sequence, the
        others hold prefix-cache state snapshots); 0: the model keeps no per-sequence state."""

    @property
    def draft_tree(self) -> Optional[Seq[Path]]:
        """The static tree of a draft-heads drafter (Medusa), for the core's proposer; else None."""

    def structured_output_error(self, spec) -> Optional[str]:
        """Why a request's structured-output constraint cannot run (None: it can; it is compiled
        now, once per distinct constraint)."""

    def execute(self, step: StepInput) -> ModelOutput: ...

    def stats(self) -> Dict[str, object]: ...
