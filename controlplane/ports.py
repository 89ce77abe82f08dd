"""Fail fast on a busy port: ``tandem up`` checks the ports it must serve on before Ray and the workers start.

The check binds the address the way the servers will (``SO_REUSEADDR``, so a port left in TIME_WAIT by a previous
run counts as free) and closes it at once. A port taken between this check and the server's bind still fails at
that bind; this only turns the common case (another ``tandem up``, another server) into an immediate one-line error
instead of one after the cluster started.
"""

from __future__ import annotations

import socket


class PortInUseError(OSError):
    """The address is taken (or cannot be bound here at all)."""


def check_bindable(host: str, port: int, what: str) -> None:
    """Raise :class:`PortInUseError` unless ``host:port`` can be bound now. Port 0 (any free port) always can."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUseError(f"cannot serve {what} on {host}:{port}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise PortInUseError(f"cannot serve {what} on {host}:{port}: {e.strerror or e} (another `tandem up`? "
                                 "`tandem down` stops it; or choose another port)") from None
