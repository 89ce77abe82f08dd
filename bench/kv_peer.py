"""Run one end of a transfer in a child process, driven over a pipe: used by the tests and by the bench.

The parent holds a :class:`Peer` per child. Commands are plain tuples of str/int/float/bytes over a
``multiprocessing`` pipe between this process and its own child (a control channel, not a peer transport: KV and
hand-offs still go through the backend under test, and a ``DestinationInfo`` crosses as its JSON bytes). Every
call has a timeout; a child exits when its parent goes away; ``kill()`` is SIGKILL by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer.base import DestinationInfo
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout

_CTX = mp.get_context("spawn")
FAILURE_CHECK_S = 0.005  # how often _wait_finished checks the status for a failure while it waits for DONE


def make_caches(layout: KVLayout, num_blocks: int, seed: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V); random from ``seed`` (bit patterns, so every byte is checked) or zeros when None."""
    shape = (num_blocks, layout.block_size, layout.local_heads, layout.head_dim)
    out = []
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for _ in range(layout.num_layers):
        pair = []
        for _ in range(2):
            if gen is None:
                pair.append(torch.zeros(shape, dtype=layout.torch_dtype))
            else:
                raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * layout.element_size), dtype=torch.uint8,
                                    generator=gen)
                pair.append(raw.view(layout.torch_dtype).contiguous())
        out.append((pair[0], pair[1]))
    return out


def digest(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_ids: Sequence[int]) -> list[str]:
    """sha256 of each layer's K and V bytes over ``block_ids`` (in order)."""
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    out = []
    for k, v in kv_caches:
        h = hashlib.sha256()
        for t in (k, v):
            h.update(t.index_select(0, idx).contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def _serve(conn: Any, backend: str, role: str, layout: dict[str, Any], num_blocks: int, seed: int | None,
           config: dict[str, Any]) -> None:
    from kvtransfer import get_backend

    lay = KVLayout.from_dict(layout)
    caches = make_caches(lay, num_blocks, seed)
    sender_cls, receiver_cls = get_backend(backend)
    cfg = TransferConfig(**config)
    side: Any = sender_cls(cfg) if role == "sender" else receiver_cls(cfg)
    side.register(caches, lay)
    done: dict[str, threading.Event] = {}  # request id -> set the moment its transfer turns DONE

    def on_done(rid: str) -> None:
        ev = done.get(rid)
        if ev is not None:
            ev.set()

    side.set_on_done(on_done)
    parent = os.getppid()
    conn.send(("ready", os.getpid()))
    while True:
        if not conn.poll(0.5):
            if os.getppid() != parent:
                break
            continue
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            result = _run(side, caches, cmd, args, done)
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            continue
        conn.send(("ok", result))
        if cmd == "close":
            break


def _wait_finished(side: Any, done: dict[str, threading.Event], rid: str, timeout_s: float) -> None:
    """Return once ``rid`` is DONE or FAILED, or after ``timeout_s``. Woken by the side's ``on_done`` the moment
    it turns DONE (polling every 200 us added ~0.1 ms to a ~1 ms timed request); a failure has no such signal, so
    the status is also checked every ``FAILURE_CHECK_S``. The event is in place before the first status check, so
    a DONE between the check and the wait still ends the wait at once."""
    finished = done[rid] = threading.Event()
    try:
        end = time.monotonic() + timeout_s
        while not side.poll(rid).finished and time.monotonic() < end:
            finished.wait(FAILURE_CHECK_S)
    finally:
        del done[rid]


def _run(side: Any, caches: Any, cmd: str, args: tuple[Any, ...], done: dict[str, threading.Event]) -> Any:
    if cmd == "reserve":
        return side.reserve(*args).to_bytes()
    if cmd == "start":
        rid, dests, ids, deadline = args
        side.start(rid, [DestinationInfo.from_bytes(d) for d in dests], ids, deadline)
        return None
    if cmd in ("send_layer", "finish", "release"):
        getattr(side, cmd)(*args)
        return None
    if cmd == "poll":
        s = side.poll(*args)
        return int(s.state), s.error, s.bytes_sent, s.layers_done
    if cmd == "wait":
        rid, timeout_s = args
        _wait_finished(side, done, rid, timeout_s)
        s = side.poll(rid)
        return int(s.state), s.error, s.bytes_sent, s.layers_done
    if cmd == "transfer":  # whole request, timed on the sender: start → every layer → finish → ACK
        rid, dests, ids, deadline, timeout_s = args
        t0 = time.perf_counter()
        side.start(rid, [DestinationInfo.from_bytes(d) for d in dests], ids, deadline)
        for layer in range(len(caches)):
            side.send_layer(rid, layer)
        side.finish(rid)
        _wait_finished(side, done, rid, timeout_s)
        elapsed = time.perf_counter() - t0
        s = side.poll(rid)
        side.release(rid)
        return int(s.state), s.error, elapsed
    if cmd == "digest":
        return digest(caches, args[0])
    if cmd == "close":
        side.close()
        return None
    raise ValueError(f"unknown command {cmd!r}")


class Peer:
    """A child process running one sender or receiver."""

    def __init__(self, backend: str, role: str, layout: KVLayout, num_blocks: int, seed: int | None = None,
                 config: dict[str, Any] | None = None, wait: bool = True) -> None:
        self.role = role
        self._conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_serve, args=(child, backend, role, layout.to_dict(), num_blocks, seed,
                                                      config or {}), daemon=True)
        self.proc.start()
        child.close()
        self.pid: int = self.proc.pid or -1
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float = 60.0) -> Peer:
        """Block until the child has registered its caches (start several children, then wait on each)."""
        status, value = self._recv(timeout_s)
        if status != "ready":
            raise RuntimeError(f"{self.role} failed to start: {value}")
        self.pid = value
        return self

    def _recv(self, timeout_s: float) -> tuple[str, Any]:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.role} did not answer within {timeout_s}s")
        return self._conn.recv()

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send((cmd, args))
        status, value = self._recv(timeout_s)
        if status == "error":
            raise RuntimeError(f"{self.role} {cmd}: {value}")
        return value

    def kill(self) -> None:
        """SIGKILL the child by PID (no cleanup runs in it: this is the "peer died" case)."""
        if self.proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid or self.pid, signal.SIGKILL)
        self.proc.join(5)

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.call("close", timeout_s=5)
        self.proc.join(2)
        self.kill()
        self._conn.close()
