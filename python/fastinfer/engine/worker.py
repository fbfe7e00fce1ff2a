"""A tensor-parallel worker (ranks 1 .. N-1) and the step messages rank 0 sends it.

A worker builds its shard (:class:`~.model_runner.ModelRunner` with its rank), agrees on the KV
pool size (and a hybrid model's number of state slots) with the other ranks (the minimum of what
each has room for), then loops: receive one message from rank 0's control channel, run it
(:meth:`ModelRunner.forward`: the slot moves of the last verification, then the forward, whose
all-reduces and logits gather meet rank 0's), until the stop message (None). It samples nothing and
keeps no scheduler state.

Messages (:class:`PlanEncoder` on rank 0, :class:`PlanDecoder` here) carry a
:class:`~.model_runner.ForwardPlan` with its block tables as deltas: the worker mirrors each live
sequence's table, and a message says only how many leading entries are still valid and the new tail
(a hybrid model's state slot of each sequence and the slot copies travel whole), so a decode step
that crosses no block boundary sends ``(seq id, token, position)`` per sequence and nothing else.
Tree masks travel as bytes.

Two ways in: :func:`spawned_worker_main` (rank 0 started it with the ``spawn`` start method; it
reports "started" / "loaded" / an error through a pipe, and exits when rank 0 goes away) and
:func:`serve_torchrun_worker` (every rank launched by ``torchrun``; ranks > 0 become workers here).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from ..distributed import build_groups, client_store, release_torchrun_groups, torchrun_env, torchrun_groups
from .config import EngineConfig
from .model_runner import Chunk, ForwardPlan, ModelRunner

__all__ = ["PlanEncoder", "PlanDecoder", "spawned_worker_main", "serve_torchrun_worker", "worker_config",
           "serve", "tp_timeout_s", "worker_threads", "STAGE_BUSY"]

DEFAULT_TIMEOUT_S = 30.0


def tp_timeout_s() -> float:
    """Deadline of one collective of the tensor group (``FASTINFER_TP_TIMEOUT``, seconds; default 30):
    how long a rank waits for a peer that died silently or hangs before the engine fails."""
    return float(os.environ.get("FASTINFER_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def worker_threads(world_size: int) -> int:
    """Intra-op threads per rank on a CPU: the cores this process may use, divided among the ranks
    (``FASTINFER_TP_THREADS`` overrides), so N ranks' OpenMP pools do not oversubscribe the cores."""
    if "FASTINFER_TP_THREADS" in os.environ:
        return max(1, int(os.environ["FASTINFER_TP_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, world_size))


def worker_config(config: EngineConfig) -> EngineConfig:
    """What a worker builds: the target only (the draft runs on rank 0), no progress bar, in the
    dtype rank 0 resolved (a worker resolving ``dtype="auto"`` itself could pick another one)."""
    return dataclasses.replace(config, dtype=config.model_dtype, load_progress=False).without_speculation()


# ------------------------------------------------------------------------------------------------
# step messages
# ------------------------------------------------------------------------------------------------

def _pack_mask(m: Optional[torch.Tensor]):
    return None if m is None else (int(m.shape[0]), bytes(m.to(torch.bool).to(torch.uint8).reshape(-1).numpy()))


def _unpack_mask(m) -> Optional[torch.Tensor]:
    if m is None:
        return None
    q, data = m
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.bool).reshape(q, q)


def _pack_chunks(chunks: List[Chunk]):
    return [(c.seq_id, c.tokens, c.start, c.logits, c.positions, _pack_mask(c.mask)) for c in chunks]


def _unpack_chunks(packed) -> List[Chunk]:
    return [Chunk(sid, toks, start, logits, pos, _unpack_mask(m)) for sid, toks, start, logits, pos, m in packed]


class PlanEncoder:
    """Rank 0: a plan as a message, block tables as deltas against what the workers hold."""

    def __init__(self):
        self.sent: Dict[int, List[int]] = {}

    def encode(self, plan: ForwardPlan, moves) -> tuple:
        tables = []
        for sid, table in plan.tables.items():
            old = self.sent.get(sid, ())
            keep = 0
            for a, b in zip(old, table):
                if a != b:
                    break
                keep += 1
            if keep != len(old) or keep != len(table):
                tables.append((sid, keep, table[keep:]))
                self.sent[sid] = list(table)
        for sid in plan.finished:
            self.sent.pop(sid, None)
        return (_pack_chunks(plan.chunks), plan.decodes, _pack_chunks(plan.trees), tables, plan.want_hidden,
                tuple(plan.hidden_layers), (list(moves[0]), list(moves[1])), list(plan.finished),
                dict(plan.state_slots), list(plan.state_copies))


class PlanDecoder:
    """A worker: messages back into plans (its mirror of the block tables)."""

    def __init__(self):
        self.tables: Dict[int, List[int]] = {}

    def decode(self, msg: tuple) -> ForwardPlan:
        chunks, decodes, trees, tables, want_hidden, hidden_layers, moves, finished, state_slots, state_copies = msg
        for sid, keep, tail in tables:
            self.tables[sid] = self.tables.get(sid, [])[:keep] + list(tail)
        plan = ForwardPlan(_unpack_chunks(chunks), list(decodes), _unpack_chunks(trees), {}, want_hidden,
                           hidden_layers, moves, finished, state_slots, state_copies)
        for sid in [c.seq_id for c in plan.chunks + plan.trees] + [d[0] for d in plan.decodes]:
            plan.tables[sid] = self.tables[sid]
        for sid in finished:
            self.tables.pop(sid, None)
        return plan


# ------------------------------------------------------------------------------------------------
# the worker loop
# ------------------------------------------------------------------------------------------------

#: the message asking every rank for its pipeline stage's busy seconds (gathered on rank 0)
STAGE_BUSY = "stage_busy"


def serve(runner: ModelRunner, ctrl) -> None:
    """Agree on the KV pool, then run rank 0's messages until the stop message."""
    local = runner.local_kv_sizing()
    runner.init_kv(*ctrl.comm.all_reduce_min([local.num_blocks, local.num_seq_slots]))
    decoder = PlanDecoder()
    while True:
        msg = ctrl.recv()
        if msg is None:
            return
        if msg == STAGE_BUSY:
            ctrl.comm.gather_to_first(torch.tensor([runner.stage_busy_s], dtype=torch.float64), dim=0)
            continue
        runner.forward(decoder.decode(msg))


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that spawned this worker is gone (it cannot stop us any more)."""
    def watch():
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(3)

    threading.Thread(target=watch, name="fastinfer-parent-watch", daemon=True).start()


def _set_device(config: EngineConfig, local_rank: int) -> None:
    if config.device.type == "cuda":
        torch.cuda.set_device(local_rank)


def spawned_worker_main(config: EngineConfig, rank: int, world_size: int, port: int, timeout_s: float,
                        threads: int, parent_pid: int, conn) -> None:
    """Entry point of a worker process rank 0 spawned (see the module docstring)."""
    _watch_parent(parent_pid)
    try:
        torch.set_num_threads(threads)
        conn.send(("started", os.getpid()))
        _set_device(config, rank)
        store = client_store(port)
        tp, ctrl = build_groups(store, rank, world_size, config.device, timeout_s,
                                num_stages=config.pipeline_parallel_size)
        runner = ModelRunner(worker_config(config), tp)
        conn.send(("loaded", None))
    except BaseException as e:  # report, then exit: rank 0 raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()
        sys.exit(1)
    try:
        serve(runner, ctrl)
    except Exception:  # rank 0 went away or a collective failed: nothing left to serve
        traceback.print_exc(limit=2)
        sys.exit(1)
    finally:
        close_groups(tp, ctrl)


def close_groups(tp, ctrl) -> None:
    """Release a rank's groups (tensor, pipeline, control)."""
    for comm in (tp.comm, tp.pipeline, ctrl.comm):
        if comm is not None:
            comm.close()


def serve_torchrun_worker(llm_kwargs: Dict[str, Any]) -> bool:
    """Under torchrun, ranks > 0 build their shard of ``LLM(**llm_kwargs)``'s target and serve rank 0
    until it stops; returns True then. Returns False at once in rank 0 or outside torchrun."""
    env = torchrun_env()
    if env is None or env["world_size"] == 1 or env["rank"] == 0:
        return False
    config = worker_config(EngineConfig.from_options(**llm_kwargs))
    if config.world_size != env["world_size"]:
        raise ValueError(f"torchrun started {env['world_size']} processes but the engine has {config.world_size} "
                         f"(tensor_parallel_size={config.tensor_parallel_size}, expert_parallel_size="
                         f"{config.expert_parallel_size}, pipeline_parallel_size={config.pipeline_parallel_size}): "
                         "they must be equal")
    torch.set_num_threads(worker_threads(int(os.environ.get("LOCAL_WORLD_SIZE", env["world_size"]))))
    _set_device(config, env["local_rank"])
    tp, ctrl = torchrun_groups(config.device, tp_timeout_s(), config.pipeline_parallel_size)
    try:
        serve(ModelRunner(config, tp), ctrl)
    finally:
        close_groups(tp, ctrl)
        release_torchrun_groups()
    return True
