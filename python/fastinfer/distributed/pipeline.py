"""Pipeline parallelism: which layers each stage holds, and where a process sits in the pipeline.

The engine's processes form ``P x T`` ranks: stage ``s`` is ranks ``[s T, (s + 1) T)``, a
tensor-parallel group of ``T`` (``T`` = the larger of ``tensor_parallel_size`` and
``expert_parallel_size``). Stage ``s`` holds layers ``[start, end)`` of :func:`partition_layers`
(the embedding on the first stage, the final norm and the LM head on the last) and the KV cache of
those layers only. Between stages the hidden state and the residual stream travel with
point-to-point ``send`` / ``recv`` over a *pipeline group*: the ranks of the same tensor-parallel
rank in every stage (``T`` groups of ``P``); under TP each rank of a stage holds the whole hidden
state (the row-parallel layers all-reduce it), so rank ``t`` of stage ``s`` sends to rank ``t`` of
stage ``s + 1``. The last stage's tensor-parallel rank 0 sends the logits back to rank 0 (stage 0,
where the scheduler and the sampler run) over pipeline group 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from .communication import Communicator

__all__ = ["PipelineStage", "WHOLE_MODEL", "partition_layers", "parse_partition", "pipeline_stage"]


def parse_partition(partition: Union[None, str, Sequence[int]]) -> Optional[Tuple[int, ...]]:
    """``"10,10,12"`` (or a sequence of ints) as a tuple of layer counts; None stays None."""
    if partition is None:
        return None
    if isinstance(partition, str):
        try:
            counts = tuple(int(p) for p in partition.replace(" ", "").split(","))
        except ValueError:
            raise ValueError(f"pipeline_partition must be layer counts separated by commas, e.g. '10,10,12'; "
                             f"got {partition!r}") from None
    else:
        counts = tuple(partition)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            raise ValueError(f"pipeline_partition must hold ints (layers per stage), got {partition!r}")
    if not counts or any(n < 1 for n in counts):
        raise ValueError(f"pipeline_partition needs at least one layer per stage, got {partition!r}")
    return counts


def partition_layers(num_layers: int, num_stages: int,
                     partition: Union[None, str, Sequence[int]] = None) -> List[Tuple[int, int]]:
    """The ``[start, end)`` layer range of each stage: ``partition`` (layers per stage, summing to
    ``num_layers``) or, by default, ``num_layers // num_stages`` each with the remainder given one
    layer at a time to the stages before the last, from the second-to-last down (vLLM's
    ``get_pp_indices``: the last stage also runs the final norm and the LM head)."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} is larger than the model's {num_layers} layers "
                         "(each stage needs at least one)")
    counts = parse_partition(partition)
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        more = list(range(num_stages - 1))[::-1][:extra]  # a remainder is < num_stages: fits before the last
        counts = tuple(base + (1 if s in more else 0) for s in range(num_stages))
    if len(counts) != num_stages:
        raise ValueError(f"pipeline_partition {','.join(map(str, counts))} has {len(counts)} stages, "
                         f"pipeline_parallel_size is {num_stages}")
    if sum(counts) != num_layers:
        raise ValueError(f"pipeline_partition {','.join(map(str, counts))} holds {sum(counts)} layers, the model "
                         f"has {num_layers}")
    ranges, start = [], 0
    for n in counts:
        ranges.append((start, start + n))
        start += n
    return ranges


@dataclass(frozen=True)
class PipelineStage:
    """One stage: ``index`` of ``num_stages``, layers ``[start, end)``; ``comm``: the pipeline group of
    this process (its rank there is ``index``; None with one stage)."""

    index: int = 0
    num_stages: int = 1
    start: int = 0
    end: Optional[int] = None  # None: to the last layer (the whole model)
    comm: Optional[Communicator] = field(default=None, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def layer_range(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)

    def owns_layer(self, layer_idx: int) -> bool:
        return self.start <= layer_idx and (self.end is None or layer_idx < self.end)

    def describe(self) -> str:
        return f"pipeline stage {self.index} of {self.num_stages} (layers {self.start}..{self.end - 1})"


WHOLE_MODEL = PipelineStage()


def pipeline_stage(num_layers: int, num_stages: int, partition, comm: Optional[Communicator]) -> PipelineStage:
    """The stage of the process whose pipeline group is ``comm`` (its rank there is its stage)."""
    if comm is None or comm.world_size != num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} needs the engine's pipeline groups "
                         "(build_groups(..., num_stages=...))")
    return PipelineStage(comm.rank, num_stages, *partition_layers(num_layers, num_stages, partition)[comm.rank],
                         comm=comm)
