"""The Redis bus's keys and KV event fields: workers write them, routers and the controller read them.

With ``P`` = ``tandem:<model key>``:

- ``P:worker:<worker_id>``: one worker's registry entry, a lease its worker refreshes (worker/redis_bus.py).
- ``P:kv``: one Redis Stream holding every worker's KV event batches, so that every router replica reads them in
  one global order. Each entry's fields are ``w`` (worker id), ``s`` (the batch's sequence number), ``h`` (block
  hashes, packed little-endian u64) and ``k`` (one event-kind byte per hash).

Routers of one model read only that model's keys; the controller, which checks a replica's registration before it
calls it READY, matches every model's (:func:`worker_pattern` with no model).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

NAMESPACE = "tandem"
_HASH = struct.Struct("<Q")


def key_prefix(model_key: str) -> str:
    return f"{NAMESPACE}:{model_key}"


def worker_key(model_key: str, worker_id: str) -> str:
    """The registry entry of one worker."""
    return f"{key_prefix(model_key)}:worker:{worker_id}"


def worker_pattern(model_key: str = "*") -> str:
    """A ``SCAN MATCH`` pattern for the registry entries of one model (of every model by default)."""
    return f"{key_prefix(model_key)}:worker:*"


def kv_stream_key(model_key: str) -> str:
    """The stream of every worker's KV event batches."""
    return f"{key_prefix(model_key)}:kv"


def pack_hashes(hashes: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(data: bytes) -> list[int]:
    if len(data) % _HASH.size:
        raise ValueError(f"packed hashes must be a multiple of {_HASH.size} bytes, got {len(data)}")
    return [h for (h,) in _HASH.iter_unpack(data)]


def kv_event_fields(worker_id: str, seq: int, hashes: Sequence[int], kinds: bytes) -> dict[str, str | int | bytes]:
    """One batch as the fields of its stream entry (``XADD``)."""
    return {"w": worker_id, "s": seq, "h": pack_hashes(hashes), "k": kinds}


@dataclass(slots=True, frozen=True)
class KVEventEntry:
    """One batch read back from the stream: ``kinds[i]`` is the event kind of ``hashes[i]``."""

    worker_id: str
    seq: int
    hashes: list[int]
    kinds: bytes

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> KVEventEntry:
        """From an undecoded ``XREAD`` entry; ValueError or KeyError on a malformed one."""
        return cls(fields[b"w"].decode(), int(fields[b"s"]), unpack_hashes(fields[b"h"]), fields[b"k"])
