"""Collectives of one tensor-parallel group, each with a deadline, and the control channel rank 0
drives the workers with.

Expert parallelism exchanges rows with :meth:`Communicator.all_to_all` (``all_to_all_single``
with uneven splits: gloo implements it on CPU tensors, as NCCL on CUDA ones) and
:meth:`Communicator.all_gather`.

:class:`Communicator` wraps a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) that
was built for this group alone (not the default group: two engines can live in one process). Every
collective waits at most ``timeout_s``; a dead peer (connection reset) or one that does not arrive
in time raises :class:`CollectiveError`, never hangs.

:class:`ControlChannel` broadcasts one picklable message per engine step from rank 0 over a gloo
group: a fixed 4 KiB frame (8-byte length + payload) carries a decode step in one collective; a
longer message (a prompt's tokens) sends the rest in a second one.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any, Callable, List, Optional

import torch

Tensor = torch.Tensor

__all__ = ["Communicator", "ControlChannel", "CollectiveError", "FRAME_BYTES"]

FRAME_BYTES = 4096
MAX_UNWAITED = 16  # posted sends / broadcasts a communicator lets run before it waits for the oldest


class CollectiveError(RuntimeError):
    """A collective of a tensor-parallel group failed: a peer died, hung, or left the group."""


def _opts(cls_name: str, root: int):
    opts = getattr(torch.distributed, cls_name)()
    opts.rootRank = root
    if hasattr(opts, "rootTensor"):
        opts.rootTensor = 0
    return opts


class Communicator:
    """Collectives of ``pg`` (this process is ``rank`` of ``world_size``); ``name`` appears in errors."""

    def __init__(self, pg, rank: int, world_size: int, timeout_s: float, name: str = "tensor-parallel group"):
        self.pg = pg
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.timeout_s = float(timeout_s)
        self.name = name
        self.num_collectives = 0  # counters for bench/tp.py
        self.bytes_all_reduced = 0
        self.bytes_gathered = 0  # this rank's contribution (gather_to_first and all_gather)
        self.bytes_all_to_all = 0  # what this rank sent
        self.bytes_sent = 0  # point to point: sent, received
        self.bytes_received = 0
        self._unwaited: List = []  # (what, work, tensor) of posted sends and broadcasts, oldest first

    def _wait(self, what: str, work, timeout_s: Optional[float] = None) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s))
        except RuntimeError as e:
            raise CollectiveError(f"{what} on the {self.name} (rank {self.rank} of {self.world_size}) failed: "
                                  f"{str(e).splitlines()[0][:300]}") from None
        self.num_collectives += 1

    def _pg(self):  # (closed: the layers of a shut-down engine still hold this communicator)
        if self.pg is None:
            raise CollectiveError(f"{self.name} is closed (the engine was shut down)")
        return self.pg

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """Sum (``op="max"``: maximum) ``t`` over the ranks, in place (also returned)."""
        self.bytes_all_reduced += t.numel() * t.element_size()
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
        self._wait("all_reduce", self._pg().allreduce([t], opts))
        return t

    def all_reduce_min(self, values: List[int], timeout_s: Optional[float] = None) -> List[int]:
        """Element-wise minimum of integer lists over the ranks."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp.MIN
        self._wait("all_reduce(min)", self._pg().allreduce([t], opts), timeout_s)
        return t.tolist()

    def gather_to_first(self, t: Tensor, dim: int, timeout_s: Optional[float] = None) -> Tensor:
        """Rank 0: the ranks' ``t`` concatenated along ``dim`` (rank order); other ranks: ``t``."""
        t = t.contiguous()
        self.bytes_gathered += t.numel() * t.element_size()
        outs = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == 0 else []
        self._wait("gather", self._pg().gather(outs, [t], _opts("GatherOptions", 0)), timeout_s)
        return torch.cat(outs[0], dim=dim) if self.rank == 0 else t

    def all_gather(self, t: Tensor) -> Tensor:
        """Every rank: the ranks' ``t`` (the same shape on each) concatenated along dim 0, in rank order."""
        t = t.contiguous()
        self.bytes_gathered += t.numel() * t.element_size()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait("all_gather", self._pg().allgather([outs], [t]))
        return torch.cat(outs)

    def all_to_all(self, t: Tensor, send_rows: List[int], recv_rows: List[int]) -> Tensor:
        """Rows ``t[sum(send_rows[:j]) :][: send_rows[j]]`` go to rank ``j``; returns the rows
        received, rank ``i``'s ``recv_rows[i]`` rows at offset ``sum(recv_rows[:i])`` (every rank
        passes the sizes its peers pass it: ``recv_rows[i]`` is rank ``i``'s ``send_rows[rank]``)."""
        t = t.contiguous()
        if len(send_rows) != self.world_size or len(recv_rows) != self.world_size or sum(send_rows) != t.shape[0]:
            raise ValueError(f"all_to_all: {t.shape[0]} rows split as {send_rows}, receiving {recv_rows}, over "
                             f"{self.world_size} ranks")
        self.bytes_all_to_all += t.numel() * t.element_size()
        out = t.new_empty((sum(recv_rows),) + tuple(t.shape[1:]))
        self._wait("all_to_all", self._pg().alltoall_base(out, t, list(recv_rows), list(send_rows),
                                                          torch.distributed.AllToAllOptions()))
        return out

    def send(self, t: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``t`` to rank ``dst`` of this group (point to point; it receives a tensor of the same
        shape and dtype with the same ``tag``)."""
        t = t.contiguous()
        self.bytes_sent += t.numel() * t.element_size()
        self._wait(f"send to rank {dst}", self._pg().send([t], int(dst), int(tag)))

    def post_send(self, t: Tensor, dst: int, tag: int = 0) -> None:
        """:meth:`send` without waiting for the receiver to take it (a busy next stage): the send
        completes in the background; its failure is raised by a later post or :meth:`wait_posted`."""
        t = t.contiguous()
        self.bytes_sent += t.numel() * t.element_size()
        self._post(f"send to rank {dst}", self._pg().send([t], int(dst), int(tag)), t)

    def _post(self, what: str, work, t: Tensor) -> None:
        self._unwaited.append((what, work, t))
        while self._unwaited and (self._unwaited[0][1].is_completed() or len(self._unwaited) > MAX_UNWAITED):
            what, work, _ = self._unwaited.pop(0)
            self._wait(what, work)

    def wait_posted(self, timeout_s: Optional[float] = None) -> None:
        """Wait for every posted send and broadcast."""
        while self._unwaited:
            what, work, _ = self._unwaited.pop(0)
            self._wait(what, work, timeout_s)

    def recv(self, t: Tensor, src: int, tag: int = 0) -> Tensor:
        """Receive into ``t`` (contiguous) what rank ``src`` of this group sends; returns ``t``."""
        return self.post_recv(t, src, tag)()

    def post_recv(self, t: Tensor, src: int, tag: int = 0) -> Callable[[], Tensor]:
        """Post the receive of :meth:`recv` now; the function returned waits for it (the deadline
        counts from that call) and returns ``t``."""
        self.bytes_received += t.numel() * t.element_size()
        work = self._pg().recv([t], int(src), int(tag))

        def wait() -> Tensor:
            self._wait(f"recv from rank {src}", work)
            return t

        return wait

    def broadcast(self, t: Tensor, root: int = 0, timeout_s: Optional[float] = None, wait: bool = True) -> Tensor:
        """``wait=False`` (the root): post it, as :meth:`post_send`."""
        work = self._pg().broadcast([t], _opts("BroadcastOptions", root))
        if wait:
            self._wait("broadcast", work, timeout_s)
        else:
            self._post("broadcast", work, t)
        return t

    def close(self) -> None:
        """Release the process group (its sockets); later collectives raise."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):  # already broken, or a backend without shutdown
                pass


class ControlChannel:
    """Rank 0 :meth:`send` s one message per step; the other ranks :meth:`recv` it (a gloo group
    with a long deadline: an idle engine keeps its workers waiting here). A send waits at most
    ``send_timeout_s``: a broadcast blocks once a receiver stops reading (a hung worker).
    ``send(obj, wait=False)`` does not wait for the receivers (pipeline parallelism: the next
    stage may still be busy with the last batch); a failure is raised by a later send."""

    def __init__(self, comm: Communicator, send_timeout_s: float):
        self.comm = comm
        self.send_timeout_s = float(send_timeout_s)
        self.bytes_sent = 0
        self.num_messages = 0

    def send(self, obj: Any, wait: bool = True) -> int:
        """Broadcast ``obj`` (rank 0 only); returns the payload size in bytes."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[: FRAME_BYTES - 8]
        if head:
            frame[8: 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.comm.broadcast(frame, timeout_s=self.send_timeout_s, wait=wait)
        if len(data) > len(head):
            self.comm.broadcast(torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8),
                                timeout_s=self.send_timeout_s, wait=wait)
        self.bytes_sent += len(data)
        self.num_messages += 1
        return len(data)

    def recv(self) -> Any:
        frame = self.comm.broadcast(torch.empty(FRAME_BYTES, dtype=torch.uint8))
        n = int(frame[:8].view(torch.int64)[0])
        data = bytes(frame[8: 8 + min(n, FRAME_BYTES - 8)].numpy())
        if n > FRAME_BYTES - 8:
            rest = self.comm.broadcast(torch.empty(n - (FRAME_BYTES - 8), dtype=torch.uint8))
            data += bytes(rest.numpy())
        return pickle.loads(data)
