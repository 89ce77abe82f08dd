"""A ``grpc.aio`` server on a thread of its own, with its own event loop, driven from plain threaded code.

``tandem worker``'s main thread waits for a signal and then drains; the engine runs on its own thread. The gRPC
server gets a third: its event loop runs nothing but the handlers (``worker/aio_service.py``), so whatever the
main thread or the engine do, probes and streams are served. Every call here blocks until the loop has done it.

Starting the server also names the process's Python threads in the OS (:func:`name_threads_in_os`), so that
``top -H``, ``ps -L`` and ``tandem bench serve``'s CPU accounting (bench/serve_cpu.py) tell the engine loop's CPU
from the serving threads'.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from proto.tandem.v1 import worker_pb2_grpc as pb_grpc

T = TypeVar("T")
_CALL_TIMEOUT_S = 30.0


class AioServerThread:
    def __init__(self, servicer: pb_grpc.WorkerServicer, options: Sequence[tuple[str, Any]] = (),
                 interceptors: Sequence[Any] = ()) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()

        async def make() -> grpc.aio.Server:
            server = grpc.aio.server(options=list(options), interceptors=list(interceptors))
            pb_grpc.add_WorkerServicer_to_server(servicer, server)
            return server

        self.server = self._run(make())

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float = _CALL_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def bind(self, add_port: Callable[[grpc.aio.Server], int]) -> int:
        """``add_port(server)`` on the loop (e.g. ``server.add_insecure_port(address)``); returns its port."""
        async def bind() -> int:
            return add_port(self.server)

        return self._run(bind())

    def start(self) -> None:
        self._run(self.server.start())
        name_threads_in_os()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (calls still running get ``grace_s``), then end the loop and its thread."""
        try:
            self._run(self.server.stop(grace_s), grace_s + 5.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)


def name_threads_in_os() -> None:
    """Give each live Python thread but the main one its name in the OS too (``/proc/self/task/TID/comm``, first
    15 bytes). Best effort: where there is no ``/proc`` (not Linux) nothing changes."""
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is main or t.native_id is None:
            continue
        with contextlib.suppress(OSError), open(f"/proc/self/task/{t.native_id}/comm", "w") as f:
            f.write(t.name[:15])
