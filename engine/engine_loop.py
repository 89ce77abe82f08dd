"""Drives an :class:`LLMEngine` from one background thread, for servers.

The engine is single-threaded by design. Server threads never touch it directly: they hand it closures with
:meth:`EngineLoop.call` (run between two steps, result through a ``Future``) and read each request's outputs from
its own queue. The loop steps whenever there is work, runs ``hooks`` after every step (KV event publishing,
parking) and otherwise sleeps on a condition until a command arrives or the idle interval passes (longer while
the only requests wait for remote KV: the engine's KV connector says how long, and a finished transfer wakes it).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")

END = None  # sentinel put on a request's queue after its final output


class OutputSink(Protocol):
    """Where a request's outputs go (``queue.SimpleQueue`` is one): ``put`` is called on the loop thread."""

    def put(self, item: RequestOutput | None) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, idle_interval_s: float = 0.005) -> None:
        self.engine = engine
        self.idle_interval_s = idle_interval_s
        self._cmds: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, OutputSink] = {}
        self._hooks: list[Callable[[], None]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    def add_hook(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs on the loop thread after every step and every idle tick."""
        self._hooks.append(hook)

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._wake:
            if self._stop:
                fut.set_exception(RuntimeError("engine loop stopped"))
                return fut
            self._cmds.append((fn, fut))
            self._wake.notify()
        return fut

    def call_sync(self, fn: Callable[[LLMEngine], T], timeout: float | None = 30.0) -> T:
        return self.call(fn).result(timeout)

    def open_stream(self, request_id: str) -> queue.SimpleQueue[RequestOutput | None]:
        """Outputs of ``request_id`` go to the returned queue, ``END`` after the last. Loop thread only."""
        q: queue.SimpleQueue[RequestOutput | None] = queue.SimpleQueue()
        self._streams[request_id] = q
        return q

    def attach(self, request_id: str, sink: OutputSink) -> None:
        """Like :meth:`open_stream`, into a caller's sink (a session relays many requests through one queue)."""
        self._streams[request_id] = sink

    def detach(self, request_id: str) -> None:
        """Forget ``request_id``'s sink without an ``END`` (its owner already knows it will get nothing)."""
        self._streams.pop(request_id, None)

    def stream(self, request_id: str) -> OutputSink | None:
        return self._streams.get(request_id)

    def publish(self, out: RequestOutput) -> None:
        """Route an output to its stream (loop thread only); closes the stream when the request finished."""
        q = self._streams.get(out.request_id)
        if q is None:
            return
        q.put(out)
        if out.finished:
            q.put(END)
            del self._streams[out.request_id]

    def close_stream(self, request_id: str) -> None:
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put(END)

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._wake:
                    if not self._cmds and not eng.has_runnable() and not self._stop:
                        self._wake.wait(eng.idle_wait_s(self.idle_interval_s))
                    if self._stop:
                        break
                    cmds = list(self._cmds)
                    self._cmds.clear()
                for fn, fut in cmds:
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn(eng))
                        except BaseException as e:  # handed to the caller
                            fut.set_exception(e)
                if eng.has_unfinished():
                    for out in eng.step():
                        self.publish(out)
                for hook in self._hooks:
                    hook()
        except BaseException as e:
            log.exception("engine loop died")
            self.error = e
        finally:
            for rid in list(self._streams):
                self.close_stream(rid)
            with self._wake:
                pending = list(self._cmds)
                self._cmds.clear()
                self._stop = True
            for _, fut in pending:
                fut.set_exception(RuntimeError("engine loop stopped"))
