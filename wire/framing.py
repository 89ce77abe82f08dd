"""Length-prefixed protobuf frames: the wire format of the plain-TCP ``Session`` transport.

A frame is a 4-byte big-endian length followed by that many bytes of one serialized message (``SessionRequest``
from router to worker, ``SessionReply`` back). A frame longer than ``MAX_FRAME`` is a protocol error: the reader
drops the connection, which both sides treat as the session breaking (every request on it fails, the worker aborts
them all).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

MAX_FRAME = 64 << 20  # the same bound as the gRPC channels' receive limit
# A peer that vanishes without closing (host crash, partition) is noticed by the kernel: keepalive probes after
# KEEPALIVE_IDLE_S of silence, every KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT of them; unacknowledged data gives up
# after USER_TIMEOUT_S. Either way the connection errors out and the session ends as if the peer had closed it.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_S = 30
_LEN = struct.Struct(">I")


class FrameError(ValueError):
    """A frame that breaks the protocol (too long)."""


def tune_session_socket(sock: socket.socket) -> None:
    """No Nagle delay (a frame goes out at once), and the dead-peer detection above (where the OS has it)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_S * 1000)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


class FrameBuffer:
    """Bytes in, whole frames out (the asyncio side: fed from ``data_received``)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise FrameError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
            if n - pos - 4 < size:
                break
            out.append(bytes(buf[pos + 4:pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out


def read_frames(sock: socket.socket) -> Iterator[bytes]:
    """Frames off a blocking socket until the peer closes it (the thread side); raises OSError or FrameError."""
    buf = FrameBuffer()
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return
        yield from buf.feed(data)
