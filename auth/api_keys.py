"""The gateway's API keys: which bearer tokens may call it, and which of them are admin keys.

Keys come from ``--api-key`` (repeatable) and ``--api-key-file``: one key per line, blank lines and ``#`` comments
ignored, and a key written ``admin:KEY`` is an admin key (the same prefix works on ``--api-key``). An admin key
unlocks what must not leak between clients, such as routing explanations (``x-tandem-explain``), whose per-worker
prefix overlaps tell whether another client's prompt is cached.

A presented key is compared with every configured key with ``hmac.compare_digest`` over SHA-256 digests, so the
time taken depends neither on where the first differing byte is nor on the key's length, nor on which key (if any)
matched. No keys configured means the gateway is open (the loopback ``tandem up`` default).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ADMIN_PREFIX = "admin:"


@dataclass(slots=True, frozen=True)
class ApiKey:
    digest: bytes
    admin: bool


@dataclass(slots=True, frozen=True)
class Caller:
    """Who a request is from: ``admin`` if its key is an admin key (or no keys are configured)."""

    admin: bool


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key(text: str) -> ApiKey:
    """One key as written on the command line or in a key file (``KEY`` or ``admin:KEY``)."""
    admin = text.startswith(ADMIN_PREFIX)
    key = text[len(ADMIN_PREFIX):] if admin else text
    if not key or key != key.strip() or any(c.isspace() for c in key):
        raise ValueError("an API key must be non-empty and contain no whitespace")
    return ApiKey(_digest(key), admin)


def read_key_file(path: str | Path) -> list[ApiKey]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            out.append(parse_key(line))
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no API keys in the file")
    return out


class ApiKeys:
    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)

    @classmethod
    def load(cls, keys: Iterable[str] = (), key_file: str | None = None) -> ApiKeys:
        parsed = [parse_key(k) for k in keys]
        if key_file:
            parsed += read_key_file(key_file)
        return cls(parsed)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> Caller | None:
        """The caller of a request with this ``Authorization`` header, or None when it must get 401. With no keys
        configured every caller is let in, as admin."""
        if not self.keys:
            return Caller(admin=True)
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(token.strip())
        found: ApiKey | None = None
        for k in self.keys:  # every key is compared: the time does not tell which one matched
            if hmac.compare_digest(presented, k.digest):
                found = k
        return None if found is None else Caller(admin=found.admin)
