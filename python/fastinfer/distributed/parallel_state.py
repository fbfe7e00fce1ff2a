"""Where this process sits in the tensor-parallel group, and how the group is built.

* :class:`ParallelInfo`: ``rank``, ``world_size`` and the group's :class:`Communicator` (None at
  world size 1). Layers shard by it (:mod:`fastinfer.layers`); its ``ep`` is the group the
  mixture-of-experts layers split their experts over (expert parallelism).
* :func:`model_parallel`: what the model is built with, from the engine's group of processes and
  its ``tensor_parallel_size`` / ``expert_parallel_size``.
* :func:`build_groups`: the two groups of one engine over a ``torch.distributed`` store: the tensor
  group (gloo on CPU, NCCL on CUDA; all-reduces and the logits gather, deadline
  ``timeout_s``) and the control group (always gloo; rank 0's per-step message, which an idle
  worker waits for without a deadline worth the name). The groups belong to the engine, not to the
  process: no ``init_process_group``, so several engines can live in one process.
* Spawned workers on one host (:func:`master_store` / :func:`client_store`): a ``TCPStore`` on
  127.0.0.1 at a port the OS picks (port 0), gloo bound to the loopback device.
* torchrun (:func:`torchrun_env`, :func:`torchrun_groups`): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from the launcher; the default group is
  initialised from them (``env://``) and the engine's groups are made with ``new_group``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from .communication import Communicator, ControlChannel

__all__ = ["ParallelInfo", "SINGLE", "model_parallel", "build_groups", "master_store", "client_store",
           "torchrun_env", "torchrun_groups", "release_torchrun_groups", "CONTROL_TIMEOUT_S", "LOOPBACK"]

LOOPBACK = "127.0.0.1"
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits for the next step as long as its engine lives


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the tensor-parallel group (``comm`` is None at world size 1).

    ``ep``: the group the mixture-of-experts layers split their experts over (rank r holds a
    contiguous ``1 / ep.world_size`` of them, :class:`~fastinfer.layers.FusedMoE`); None: no expert
    parallelism (each expert's intermediate dimension is split over this group instead). The
    layers other than the experts never read it.

    ``pipeline``: under pipeline parallelism, the group of this rank's tensor-parallel rank in every
    stage (its rank there is this process's stage, :mod:`.pipeline`); None otherwise. The runner
    sends the hidden state over it; the layers never read it."""

    rank: int = 0
    world_size: int = 1
    comm: Optional[Communicator] = field(default=None, compare=False, repr=False)
    ep: Optional["ParallelInfo"] = field(default=None, compare=False, repr=False)
    pipeline: Optional[Communicator] = field(default=None, compare=False, repr=False)


SINGLE = ParallelInfo()


def model_parallel(group: ParallelInfo, tensor_parallel_size: int, expert_parallel_size: int) -> ParallelInfo:
    """How one rank's model splits over the engine's processes ``group`` (``world_size`` = the larger
    of the two sizes; each size is 1 or that): tensor-parallel over all of them, or over none
    (``tensor_parallel_size=1``: every rank builds attention and the dense layers whole and runs
    them on every token), and with ``expert_parallel_size > 1`` the experts split over all of them."""
    sizes = {tensor_parallel_size, expert_parallel_size} - {1}
    if sizes and sizes != {group.world_size}:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} and expert_parallel_size="
                         f"{expert_parallel_size} do not describe a group of {group.world_size} processes")
    tp = group if tensor_parallel_size > 1 else SINGLE
    return dataclasses.replace(tp, ep=group) if expert_parallel_size > 1 else tp


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def master_store(timeout_s: float = 300.0):
    """Rank 0's store for spawned workers: 127.0.0.1, a free port chosen by the OS (``.port``)."""
    return torch.distributed.TCPStore(LOOPBACK, 0, None, True, timeout=_td(timeout_s), wait_for_workers=False)


def client_store(port: int, timeout_s: float = 300.0, host: str = LOOPBACK):
    return torch.distributed.TCPStore(host, int(port), None, False, timeout=_td(timeout_s))


def _gloo(store, rank: int, size: int, timeout_s: float, loopback: bool):
    pg_cls = torch.distributed.ProcessGroupGloo
    opts = pg_cls._Options()
    opts._timeout = _td(timeout_s)
    opts._devices = [pg_cls.create_device(hostname=LOOPBACK) if loopback else pg_cls.create_default_device()]
    return pg_cls(store, rank, size, opts)


def _nccl(store, rank: int, size: int, timeout_s: float, device: torch.device):
    pg_cls = torch.distributed.ProcessGroupNCCL
    opts = pg_cls.Options()
    opts._timeout = _td(timeout_s)
    pg = pg_cls(store, rank, size, opts)
    if hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(device)
    return pg


def build_groups(store, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 loopback: bool = True, num_stages: int = 1) -> Tuple[ParallelInfo, ControlChannel]:
    """The engine's tensor group (as :class:`ParallelInfo`) and control channel over ``store``.
    ``num_stages > 1`` (pipeline parallelism): ``world_size`` is ``num_stages x T`` ranks, the tensor
    group is this rank's stage's (``rank // T``; its rank there ``rank % T``) and
    ``ParallelInfo.pipeline`` its pipeline group."""
    prefix = torch.distributed.PrefixStore
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ctrl = Communicator(_gloo(prefix("ctrl/", store), rank, world_size, CONTROL_TIMEOUT_S, loopback),
                        rank, world_size, CONTROL_TIMEOUT_S, "control group")

    def group(name: str, member: int, size: int):
        if device.type == "cuda":
            return _nccl(prefix(name, store), member, size, timeout_s, device)
        return _gloo(prefix(name, store), member, size, timeout_s, loopback)

    if num_stages == 1:
        tp = ParallelInfo(rank, world_size, Communicator(group("tp/", rank, world_size), rank, world_size, timeout_s))
        return tp, ControlChannel(ctrl, timeout_s)
    per_stage = world_size // num_stages
    stage, local = divmod(rank, per_stage)
    tp_comm = Communicator(group(f"tp{stage}/", local, per_stage), local, per_stage, timeout_s)
    pp_comm = Communicator(group(f"pp{local}/", stage, num_stages), stage, num_stages, timeout_s, "pipeline group")
    return ParallelInfo(local, per_stage, tp_comm, pipeline=pp_comm), ControlChannel(ctrl, timeout_s)


def torchrun_env(environ: Optional[Dict[str, str]] = None) -> Optional[Dict[str, object]]:
    """``{rank, world_size, local_rank, master_addr, master_port}`` when launched by torchrun (or any
    launcher setting the same variables), else None."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)), "master_addr": env.get("MASTER_ADDR", LOOPBACK),
            "master_port": int(env.get("MASTER_PORT", 29500))}


def torchrun_groups(device: torch.device, timeout_s: float, num_stages: int = 1) -> Tuple[ParallelInfo, ControlChannel]:
    """The engine's groups in a torchrun job: the default group from ``env://`` (gloo; NCCL on
    CUDA), then one new group per role (``num_stages > 1``: as :func:`build_groups`, every rank
    making every stage's tensor group and every pipeline group, in one order)."""
    dist = torch.distributed
    env = torchrun_env()
    if env is None:
        raise RuntimeError("not launched by torchrun: RANK / WORLD_SIZE are not set")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                timeout=_td(max(timeout_s, 300.0)))
    rank, ws = dist.get_rank(), dist.get_world_size()
    ctrl_pg = dist.new_group(backend="gloo", timeout=_td(CONTROL_TIMEOUT_S))
    ctrl = Communicator(ctrl_pg, rank, ws, CONTROL_TIMEOUT_S, "control group")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if num_stages == 1:
        tp_pg = dist.new_group(backend=backend, timeout=_td(timeout_s))
        return ParallelInfo(rank, ws, Communicator(tp_pg, rank, ws, timeout_s)), ControlChannel(ctrl, timeout_s)
    per_stage = ws // num_stages
    stage, local = divmod(rank, per_stage)
    tp_pgs = [dist.new_group([s * per_stage + r for r in range(per_stage)], backend=backend, timeout=_td(timeout_s))
              for s in range(num_stages)]
    pp_pgs = [dist.new_group([s * per_stage + r for s in range(num_stages)], backend=backend, timeout=_td(timeout_s))
              for r in range(per_stage)]
    tp_comm = Communicator(tp_pgs[stage], local, per_stage, timeout_s)
    pp_comm = Communicator(pp_pgs[local], stage, num_stages, timeout_s, "pipeline group")
    return ParallelInfo(local, per_stage, tp_comm, pipeline=pp_comm), ControlChannel(ctrl, timeout_s)


def release_torchrun_groups() -> None:
    """Destroy the default process group of a torchrun job (and every group made from it) once the
    engine is done with them: left to interpreter exit, gloo's threads can outlive their group and
    abort the process ("terminate called without an active exception") after its output is written."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # a group already shut down or broken: nothing left to release
            pass
