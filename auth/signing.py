"""Signed registry entries: HMAC-SHA256 under a key derived from the cluster token.

Anyone who can write to Redis could otherwise advertise a worker address, and every router would send it prompts.
A worker signs its entry (``sign``); a router keeps only entries whose signature checks (``verify``), and ignores
and logs the rest. The signature covers the entry's canonical JSON (keys sorted, no spaces), so field order and
formatting do not matter. The key is ``HMAC(token, "tandem registry v1")`` rather than the token itself, so that a
signature is no use anywhere else the token is.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIG_FIELD = "sig"
_CONTEXT = b"tandem registry v1"


class BadSignature(ValueError):
    """An entry that is unsigned, malformed, or signed with another key."""


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), _CONTEXT, hashlib.sha256).digest()


def canonical(entry: dict[str, Any]) -> bytes:
    """The bytes a signature covers: ``entry`` without its signature, as sorted, compact JSON."""
    body = {k: v for k, v in entry.items() if k != SIG_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(entry: dict[str, Any], token: str) -> str:
    """``entry`` as JSON with its signature in ``sig``."""
    sig = hmac.new(_key(token), canonical(entry), hashlib.sha256).hexdigest()
    return json.dumps({**{k: v for k, v in entry.items() if k != SIG_FIELD}, SIG_FIELD: sig})


def verify(raw: str | bytes, token: str) -> dict[str, Any]:
    """The entry that ``raw`` holds, without its signature; BadSignature if it is unsigned, malformed or forged."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadSignature(f"not JSON: {e}") from None
    if not isinstance(entry, dict):
        raise BadSignature("not a JSON object")
    sig = entry.pop(SIG_FIELD, None)
    if not isinstance(sig, str):
        raise BadSignature("unsigned")
    want = hmac.new(_key(token), canonical(entry), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(sig.encode(), want.encode()):
        raise BadSignature("signature does not match")
    return entry
