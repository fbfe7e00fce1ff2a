"""Tensor parallelism, rank 0's side: start the workers, drive them, notice when they fail, stop them.

:class:`TensorParallelRunner` is rank 0's :class:`~.model_runner.ModelRunner` (its own shard) that
also broadcasts every :class:`~.model_runner.ForwardPlan` to the N-1 workers (:mod:`.worker`)
before running it, so all ranks run the same forward on their shards; the logits come back
gathered on rank 0. Expert parallelism runs on the same processes; pipeline parallelism on
``pipeline_parallel_size`` groups of them (N = ``config.world_size``: the stages times the larger
of ``tensor_parallel_size`` and ``expert_parallel_size``; rank 0 runs stage 0, see
:mod:`fastinfer.distributed.pipeline`). The KV slot moves of a
verification are applied on rank 0 at once and travel with the next plan (nothing reads those
slots in between).

Workers are processes started with the ``spawn`` start method (rank r on ``cuda:r`` on a GPU
machine), meeting rank 0 at a ``TCPStore`` on 127.0.0.1 at a port the OS chose (so two engines on
one host never collide), or, under ``torchrun``, the launcher's other processes.

Faults: before each step rank 0 checks its workers' process sentinels; a collective that fails (a
dead peer resets its connection at once; a hung one misses the deadline, ``FASTINFER_TP_TIMEOUT``
seconds, 30 by default) raises :class:`TensorParallelError` naming the rank, its pid and what
happened. The engine is then unusable: the workers are killed and every later step raises the same
error. :meth:`TensorParallelRunner.shutdown` (``LLM.shutdown()``, also run when the LLM is garbage
collected and at interpreter exit) sends the stop message, joins the workers (killing any that do
not exit within 5 s), and releases the process groups and the store's port. No shared memory is
used.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from ..distributed import (CollectiveError, build_groups, master_store, release_torchrun_groups, torchrun_env,
                           torchrun_groups)
from ..models import load_config
from .config import EngineConfig
from .kv_sizing import KVSizing, MemoryPool
from .model_runner import ForwardPlan, ModelRunner, check_split
from .worker import STAGE_BUSY, PlanEncoder, spawned_worker_main, tp_timeout_s, worker_config, worker_threads

__all__ = ["TensorParallelRunner", "TensorParallelError"]

STARTUP_TIMEOUT_S = float(os.environ.get("FASTINFER_TP_STARTUP_TIMEOUT", 600.0))
JOIN_TIMEOUT_S = 5.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or hung; the engine cannot continue."""


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is alive but did not answer (hung, or much slower than rank 0)"
    if code < 0:
        try:
            return f"died (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"died (signal {-code})"
    return f"exited with code {code}"


def world_size_text(config: EngineConfig) -> str:
    """The sizes that make the engine's processes, as an error message names them."""
    tp, ep, pp = config.tensor_parallel_size, config.expert_parallel_size, config.pipeline_parallel_size
    return (f"tensor_parallel_size={tp}" + (f", expert_parallel_size={ep}" if ep > 1 else "")
            + (f", pipeline_parallel_size={pp}" if pp > 1 else ""))


def rank_text(config: EngineConfig, rank: int, pid: Optional[int] = None) -> str:
    """A worker as errors name it: ``tensor-parallel worker rank 1 (pid 123)``; under pipeline
    parallelism ``pipeline-parallel worker rank 2 (stage 1 of 2, pid 123)``."""
    pid_text = "" if pid is None else f"pid {pid}"
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel worker rank {rank}" + (f" ({pid_text})" if pid_text else "")
    stage = rank // config.stage_size
    where = f"stage {stage} of {config.pipeline_parallel_size}" + (f", {pid_text}" if pid_text else "")
    return f"pipeline-parallel worker rank {rank} ({where})"


class _Workers:
    """The spawned worker processes of one engine (and their pipes)."""

    def __init__(self, config: EngineConfig, world_size: int, port: int, timeout_s: float, threads: int):
        ctx = multiprocessing.get_context("spawn")
        self.config = config
        self.procs: List = []
        self.conns: List = []
        wconfig = worker_config(config)
        for rank in range(1, world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=spawned_worker_main, name=f"fastinfer-tp-worker-{rank}", daemon=True,
                            args=(wconfig, rank, world_size, port, timeout_s, threads, os.getpid(), send))
            p.start()
            send.close()
            self.procs.append(p)
            self.conns.append(recv)

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs]

    def wait_for(self, what: str, deadline: float) -> None:
        """Wait until every worker has reported ``what`` (an error it reports, or its death, raises)."""
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(f"workers {sorted(i + 1 for i in pending)} did not "
                                          f"report '{what}' within {STARTUP_TIMEOUT_S:.0f} s")
            sentinels = {self.procs[i].sentinel: i for i in pending}
            ready = multiprocessing.connection.wait(list(pending.values()) + list(sentinels), timeout=left)
            for r in ready:
                i = sentinels.get(r)
                if i is None:
                    i = next(j for j, c in pending.items() if c is r)
                    try:
                        kind, info = r.recv()
                    except EOFError:
                        kind, info = "died", None
                    if kind == "error":
                        raise TensorParallelError(f"{rank_text(self.config, i + 1)} failed: {info}")
                    if kind == what:
                        pending.pop(i)
                    continue
                self.procs[i].join(0.1)
                raise TensorParallelError(f"{rank_text(self.config, i + 1, self.procs[i].pid)} "
                                          f"{_describe_exit(self.procs[i].exitcode)} while starting")

    def dead(self) -> Optional[str]:
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive():
                return f"{rank_text(self.config, rank, p.pid)} {_describe_exit(p.exitcode)}"
        return None

    def describe_failure(self) -> str:
        return self.dead() or "; ".join(f"{rank_text(self.config, r, p.pid)} {_describe_exit(None)}"
                                        for r, p in enumerate(self.procs, 1))

    def stop(self, graceful: bool) -> None:
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if graceful else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(JOIN_TIMEOUT_S)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def _shutdown(state: dict) -> None:
    """Stop an engine's workers and release its groups (a finalizer: holds no reference to the runner)."""
    workers, tp, ctrl = state.pop("workers", None), state.pop("tp", None), state.pop("ctrl", None)
    graceful = not state.get("failed")
    if ctrl is not None and graceful:
        try:
            ctrl.send(None)
        except CollectiveError:
            graceful = False
    if workers is not None:
        workers.stop(graceful)
    for comm in (tp.comm if tp is not None else None, tp.pipeline if tp is not None else None,
                 ctrl.comm if ctrl is not None else None):
        if comm is not None:
            comm.close()
    if state.pop("torchrun", False):
        release_torchrun_groups()
    state.pop("store", None)


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel group (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        n = config.world_size
        if isinstance(config.model, str):  # refuse a bad split before starting anything
            check_split(load_config(config.model), config)
        env = torchrun_env()
        timeout = tp_timeout_s()
        self._state: dict = {}
        self._error: Optional[str] = None
        self._kind = "pipeline-parallel" if config.pipeline_parallel_size > 1 else "tensor-parallel"
        self._pending_moves: Tuple[List[int], List[int]] = ([], [])
        self.encoder = PlanEncoder()
        self.workers: Optional[_Workers] = None
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        try:
            if env is not None and env["world_size"] > 1:
                if env["world_size"] != n or env["rank"] != 0:
                    raise ValueError(f"launched by torchrun as rank {env['rank']} of {env['world_size']}, but "
                                     f"the engine has {n} processes ({world_size_text(config)}): they must be "
                                     "equal, and ranks > 0 serve through fastinfer.engine.worker.serve_torchrun_worker")
                torch.set_num_threads(min(torch.get_num_threads(), worker_threads(
                    int(os.environ.get("LOCAL_WORLD_SIZE", n)))))
                if config.device.type == "cuda":
                    torch.cuda.set_device(env["local_rank"])
                tp, ctrl = torchrun_groups(config.device, timeout, config.pipeline_parallel_size)
                self._state["torchrun"] = True
            else:
                threads = min(torch.get_num_threads(), worker_threads(n))
                torch.set_num_threads(threads)
                if config.device.type == "cuda":
                    if torch.cuda.device_count() < n:
                        raise ValueError(f"{world_size_text(config)} needs {n} GPUs, {torch.cuda.device_count()} "
                                         "visible")
                    torch.cuda.set_device(0)
                store = self._state["store"] = master_store()
                self.workers = self._state["workers"] = _Workers(config, n, store.port, timeout, threads)
                deadline = time.monotonic() + STARTUP_TIMEOUT_S
                self.workers.wait_for("started", deadline)
                tp, ctrl = build_groups(store, 0, n, config.device, timeout, num_stages=config.pipeline_parallel_size)
            self._state["tp"], self._state["ctrl"] = tp, ctrl
            self.ctrl = ctrl
            super().__init__(config, tp)
            if self.workers is not None:
                self.workers.wait_for("loaded", deadline)
        except BaseException:
            self._state["failed"] = True
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> List[int]:
        return self.workers.pids if self.workers is not None else []

    # ---- start-up -----------------------------------------------------------------------------
    def agreed_kv_sizing(self, extra_pools: Sequence[MemoryPool] = ()) -> KVSizing:
        """This rank's sizing with the smallest block count and state-slot count (a hybrid model's)
        of all ranks (every rank allocates them)."""
        local = self.local_kv_sizing(extra_pools)
        n, slots = self._guard(lambda: self.ctrl.comm.all_reduce_min([local.num_blocks, local.num_seq_slots],
                                                                     STARTUP_TIMEOUT_S))
        return dataclasses.replace(local, num_blocks=n, num_seq_slots=slots)

    def init_kv(self, num_blocks: int, num_state_slots: Optional[int] = None) -> None:
        self._initialising = True
        try:
            self._guard(lambda: ModelRunner.init_kv(self, num_blocks, num_state_slots))
        finally:
            self._initialising = False

    def enable_decode_graphs(self, max_batch: int, max_blocks: int, use_graphs: bool):
        if not getattr(self, "_initialising", False):  # the workers would not follow: shapes would differ
            raise RuntimeError("under tensor parallelism decode graphs are set up at start-up, on every rank "
                               "(CUDA, enforce_eager=False)")
        return super().enable_decode_graphs(max_batch, max_blocks, use_graphs)

    # ---- steps --------------------------------------------------------------------------------
    def move_slots(self, src: List[int], dst: List[int]) -> None:
        super().move_slots(src, dst)
        self._pending_moves[0].extend(src)
        self._pending_moves[1].extend(dst)

    def submit(self, plan: ForwardPlan):
        moves, self._pending_moves = self._pending_moves, ([], [])

        def run():  # under PP the next stage may still run the last batch: the message is not waited for
            self.ctrl.send(self.encoder.encode(plan, moves), wait=self.stage.num_stages == 1)
            return ModelRunner.submit(self, plan)

        return self._guard(run)

    def collect(self, pending):
        return self._guard(lambda: ModelRunner.collect(self, pending))

    def stage_busy_seconds(self) -> List[float]:
        """Per rank, the seconds its pipeline stage has computed so far (its layers, not the waits
        for the stage before it): bench/pp.py's busy fractions."""
        def run():
            self.ctrl.send(STAGE_BUSY)
            mine = torch.tensor([self.stage_busy_s], dtype=torch.float64)
            return self.ctrl.comm.gather_to_first(mine, dim=0, timeout_s=self.ctrl.send_timeout_s).tolist()

        return self._guard(run)

    def _guard(self, fn):
        """Run ``fn`` (which meets the workers in collectives); a failure kills the group."""
        if self._error is None and self.workers is not None:
            dead = self.workers.dead()
            if dead:
                self._fail(dead)
        if self._error is not None:
            raise TensorParallelError(self._error)
        try:
            return fn()
        except CollectiveError as e:
            if self.workers is not None:
                time.sleep(0.2)  # a killed peer's sentinel may lag its reset connection
                what = self.workers.describe_failure()
            else:
                what = "a torchrun peer failed or hung"
            self._fail(f"{what} ({e})")
            raise TensorParallelError(self._error) from None
        except Exception as e:  # the ranks may be out of step now: stop them, keep rank 0's error
            self._fail(f"rank 0 raised {type(e).__name__} during a {self._kind} step ({e})")
            raise

    def _fail(self, what: str) -> None:
        self._error = f"{what}; the {self._kind} engine has stopped (create a new LLM)"
        self._state["failed"] = True
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the workers and release the groups and the port (idempotent)."""
        self._finalizer()
        if self._error is None:
            self._error = f"the {self._kind} engine was shut down"
