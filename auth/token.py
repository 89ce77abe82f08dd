"""The cluster token: one shared secret that every part of one Tandem cluster holds, and that admin calls carry.

Why a token beside TLS (see ``auth.credentials``): loopback ``tandem up`` runs without TLS, and even there a local
process must not be able to ``Drain`` a worker or read its cache (``Snapshot``). So the token is always on: the
process that starts a cluster creates one (``ensure_cluster_token``) and its router, controller and workers inherit
it through the ``TANDEM_CLUSTER_TOKEN`` environment variable, as a Kubernetes pod gets a Secret; or each process reads
it from a file (``--auth-token-file``, a mounted Secret in the chart). An environment variable and a 0600 file are
readable by the same principals (the process's own user and root); a command-line flag would be world-readable.

The token travels as gRPC metadata ``authorization: Bearer <token>`` and is compared in constant time.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_ENV = "TANDEM_CLUSTER_TOKEN"
METADATA_KEY = "authorization"
_SCHEME = "Bearer "
MIN_TOKEN_CHARS = 16


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    """``token`` stripped of surrounding whitespace (a file's trailing newline); ValueError if it is too short."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"a cluster token needs at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    return token


def read_token_file(path: str | Path) -> str:
    return check_token(Path(path).read_text())


def write_token_file(path: str | Path, token: str) -> Path:
    """Write ``token`` to ``path``, readable by its owner only."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return p


def env_token() -> str | None:
    raw = os.environ.get(TOKEN_ENV)
    return check_token(raw) if raw else None


def ensure_cluster_token() -> str:
    """The token in this process's environment, creating one there if there is none: every process started from
    here on (workers, Ray's processes) inherits it, so the parts of one cluster share it without passing it on a
    command line."""
    token = env_token()
    if token is None:
        token = os.environ[TOKEN_ENV] = new_token()
    return token


def bearer(token: str) -> str:
    return _SCHEME + token


def token_matches(presented: str | None, expected: str) -> bool:
    """Whether ``presented`` (an ``authorization`` value) carries ``expected``, in constant time."""
    if not presented or not presented.startswith(_SCHEME):
        return False
    return hmac.compare_digest(presented[len(_SCHEME):].encode(), expected.encode())
