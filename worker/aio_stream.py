"""A request's outputs, from the engine loop thread to a ``grpc.aio`` handler, with a bound on what piles up.

:class:`AioSink` is an ``OutputSink`` (``engine/engine_loop.py``): the loop thread appends to a deque and wakes
the asyncio side; the handler drains every output queued since. A handler parked on ``get`` holds no thread, so a
worker carries as many concurrent streams as its memory allows, where a thread-per-call server stops at its pool's
size. The sinks of one event loop share a :class:`LoopWaker`: an engine step that feeds 32 streams crosses to the
event loop with one ``call_soon_threadsafe`` (one self-pipe write and one callback), not 32.

Backpressure: a stream whose client is slower than the engine cannot send, so its outputs pile up here. When the
tokens produced but not yet taken pass ``high_water`` the sink asks for its request to be parked
(``worker/parking.py``: it stops generating, keeps its blocks); once the handler has caught up to ``high_water / 2``
it is resumed. HTTP/2 flow control makes a handler's send wait for a client that does not read, which is what
lets the backlog form.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from engine.engine_loop import END
from engine.llm_engine import RequestOutput


class LoopWaker:
    """Wakes sinks' handlers on one event loop from other threads: the sinks woken before the loop gets to run
    are woken together by one callback."""

    __slots__ = ("_lock", "_pending", "_scheduled", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[AioSink] = []
        self._scheduled = False

    def wake(self, sink: AioSink) -> None:
        """Any thread: ``sink``'s waiter runs soon."""
        with self._lock:
            self._pending.append(sink)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the server's loop is closed: nobody is waiting any more
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for sink in pending:
            sink._wake()


class AioSink:
    __slots__ = ("_event", "_items", "_scheduled", "_waker", "high_water", "on_backlog", "on_caught_up",
                 "parked", "produced", "taken")

    def __init__(self, loop: asyncio.AbstractEventLoop | LoopWaker, high_water: int = 0,
                 on_backlog: Callable[[], None] | None = None, on_caught_up: Callable[[], None] | None = None) -> None:
        """``loop``: the handler's event loop, or the :class:`LoopWaker` its sinks share. ``high_water`` > 0 with
        ``on_backlog`` (called on the loop thread) and ``on_caught_up`` (called on the asyncio thread) bounds the
        backlog."""
        self._waker = loop if isinstance(loop, LoopWaker) else LoopWaker(loop)
        self._items: deque[RequestOutput | None] = deque()
        self._event = asyncio.Event()
        self._scheduled = False
        self.high_water = high_water
        self.on_backlog = on_backlog
        self.on_caught_up = on_caught_up
        self.produced = 0  # tokens put (written by the loop thread only)
        self.taken = 0  # tokens taken (written by the asyncio thread only)
        self.parked = False

    def put(self, item: RequestOutput | None) -> None:
        """Engine loop thread."""
        self._items.append(item)
        if item is not END:
            self.produced += len(item.new_token_ids)
            if (self.high_water and not self.parked and self.on_backlog is not None
                    and self.produced - self.taken > self.high_water and not item.finished):
                self.parked = True
                self.on_backlog()
        if not self._scheduled:  # one wake-up per batch of this request's outputs, not one per output
            self._scheduled = True
            self._waker.wake(self)

    def _wake(self) -> None:
        self._scheduled = False
        self._event.set()

    async def get(self, timeout_s: float) -> RequestOutput | None:
        """The next output (``END`` after the last); TimeoutError after ``timeout_s`` of nothing."""
        if not self._items:
            async with asyncio.timeout(timeout_s):
                while not self._items:
                    self._event.clear()
                    await self._event.wait()
        return self._take(self._items.popleft())

    def get_nowait(self) -> RequestOutput | None:
        """The next output if one is queued; raises IndexError if none."""
        return self._take(self._items.popleft())

    def _take(self, item: RequestOutput | None) -> RequestOutput | None:
        if item is not END:
            self.taken += len(item.new_token_ids)
            if self.parked and self.produced - self.taken <= self.high_water // 2:
                self.parked = False
                if self.on_caught_up is not None:
                    self.on_caught_up()
        return item
