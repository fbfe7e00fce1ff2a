"""Tensor, expert and pipeline parallelism on ``torch.distributed``: the groups of one engine (gloo
on CPU, NCCL on CUDA), collectives and point-to-point sends with deadlines, the control channel
rank 0 drives its workers with, and the layer split of pipeline stages (:mod:`.pipeline`).
The worker processes themselves are the engine's (:mod:`fastinfer.engine.workers`)."""

from .communication import FRAME_BYTES, CollectiveError, Communicator, ControlChannel  # noqa: F401
from .parallel_state import (  # noqa: F401
    CONTROL_TIMEOUT_S,
    SINGLE,
    ParallelInfo,
    build_groups,
    client_store,
    master_store,
    model_parallel,
    torchrun_env,
    torchrun_groups,
    release_torchrun_groups,
)

__all__ = ["Communicator", "ControlChannel", "CollectiveError", "FRAME_BYTES", "ParallelInfo", "SINGLE",
           "model_parallel", "build_groups", "master_store", "client_store", "torchrun_env", "torchrun_groups",
           "release_torchrun_groups", "CONTROL_TIMEOUT_S"]
