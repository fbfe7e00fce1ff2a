"""``AsyncLLM``: the engine behind an asyncio server.

    engine = AsyncLLM(model_path)                   # the same keyword arguments as LLM
    async for out in engine.generate(prompt, SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)                  # cumulative, only stable text
    engine.abort("r1")                              # from anywhere on the event loop

One background thread owns the engine (the :class:`~fastinfer.LLM` driver over the engine core and
the output processor) and steps it while work exists, sleeping otherwise. The event loop never
touches the engine: ``generate`` and ``abort`` post commands that the thread applies between steps,
and the thread hands each step's outputs back with ``loop.call_soon_threadsafe`` to per-request
queues. Outputs are cumulative, so a consumer slower than the engine just gets the latest one
(nothing is lost). A generator that is closed, cancelled or garbage-collected before its request
finished aborts the request: its KV blocks return to the pool at the next step.

Errors: a request the engine refuses (bad prompt) ends with a finished output whose ``error`` is
set; if the engine itself fails, or :meth:`shutdown` is called, every open stream raises
:class:`EngineDeadError` and new requests are refused with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, Optional, Tuple

from .llm import LLM, PromptType
from .params import RequestOutput, SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError"]


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can run any more."""


_ABORTED = object()  # queue marker: the request was aborted, its stream ends


class AsyncLLM:
    """See the module docstring. ``llm_kwargs`` are :class:`~fastinfer.LLM`'s."""

    def __init__(self, model: Any = None, **llm_kwargs: Any):
        self.llm = LLM(model, **llm_kwargs)
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.llm.max_model_len
        self._commands: Deque[Tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._queues: Dict[str, asyncio.Queue] = {}  # event loop side only
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.dead: Optional[BaseException] = None  # why the loop stopped
        self._stats: Dict[str, Any] = self.llm.stats()
        self._num_pending_adds = 0

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread on the running event loop (``generate`` does it when needed)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fastinfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, reason: str = "the server is shutting down", timeout: float = 5.0) -> None:
        """Stop the loop: open streams raise :class:`EngineDeadError` (call on the event loop)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self.dead is None:
            self.dead = EngineDeadError(reason)
        self._fail_all(self.dead)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.llm.shutdown()  # tensor-parallel workers (a no-op at TP 1)

    @property
    def is_running(self) -> bool:
        return self.dead is None and (self._thread is None or self._thread.is_alive())

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Run one request; yields its :class:`RequestOutput` after the steps that changed it, the
        last one with ``finished=True``. Ends without a finished output when :meth:`abort` ed."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.start()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._post("add", (prompt, params, request_id))
        finished = False
        try:
            while True:
                item = await q.get()
                while not q.empty() and isinstance(item, RequestOutput) and not item.finished:
                    item = q.get_nowait()  # outputs are cumulative: the latest is enough
                if item is _ABORTED:
                    finished = True  # the engine already dropped it
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._post("abort", request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now (call on the event loop); its stream ends."""
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(_ABORTED)
            self._post("abort", request_id)

    # ---- what the engine is doing (read on the event loop) -----------------------------------
    def stats(self) -> Dict[str, Any]:
        """The engine's counters after its last step (:meth:`fastinfer.LLM.stats`), plus
        ``num_running`` / ``num_waiting`` sequences (waiting: queued, not yet admitted)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet admitted by the scheduler (preempted sequences included)."""
        return self._num_pending_adds + len(self.llm.engine_core.scheduler.waiting)

    @property
    def num_requests(self) -> int:
        """Requests with an open stream."""
        return len(self._queues)

    # ---- the engine thread -------------------------------------------------------------------
    def _post(self, kind: str, arg: Any) -> None:
        with self._wake:
            if kind == "add":
                self._num_pending_adds += 1
            self._commands.append((kind, arg))
            self._wake.notify()

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                with self._wake:
                    while not self._commands and not self._stopping and not llm.has_unfinished_requests():
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands, self._commands = self._commands, deque()
                for kind, arg in commands:
                    if kind == "add":
                        prompt, params, rid = arg
                        try:
                            llm.add_request(prompt, params, rid)
                        except ValueError as e:  # a duplicate id: that stream fails, the engine goes on
                            self._loop.call_soon_threadsafe(self._fail_one, rid, e)
                        with self._wake:
                            self._num_pending_adds -= 1
                    elif arg in llm.output_processor:
                        llm.abort_request(arg)
                outputs = llm.step()
                stats = llm.stats()
                stats["num_running"] = len(llm.engine_core.scheduler.running)
                stats["num_waiting"] = len(llm.engine_core.scheduler.waiting)
                self._stats = stats
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # noqa: BLE001 - the engine failed: every stream must learn it
            self.dead = EngineDeadError(f"the engine failed: {e!r}")
            self.dead.__cause__ = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, self.dead)

    def _deliver(self, outputs) -> None:
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for q in list(self._queues.values()):
            q.put_nowait(error)
