"""Fixed binary frames shared by the tcp, torch and NIXL-notification paths: a 40-byte big-endian header, then
``payload_len`` bytes (DATA: raw KV of one piece, K or V; HELLO: the sender's layout as JSON; FAIL: a reason).
Nothing is pickled. READY and QUIET are NIXL's only (its WRITEs land without the receiver's threads, see
:mod:`kvtransfer.nixl_backend`): READY admits a leg's WRITEs, QUIET promises that no WRITE of it can still land.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from enum import IntEnum

from kvtransfer.layout import KVLayout

MAGIC = 0x544B5631  # "TKV1"
WIRE_VERSION = 1
_HEADER = struct.Struct("!IBBBxQIIIHHQ")
HEADER_SIZE = _HEADER.size
MAX_CONTROL_PAYLOAD = 1 << 20  # HELLO/FAIL payloads larger than this are refused


class Kind(IntEnum):
    HELLO = 1  # sender → receiver: layout of the sending rank; opens the leg
    DATA = 2  # sender → receiver: one piece of one layer, K or V
    FINISH = 3  # sender → receiver: the leg has sent every layer
    ACK = 4  # receiver → sender: every layer landed
    FAIL = 5  # either way: the request failed, payload is the reason
    READY = 6  # receiver → sender (NIXL): HELLO accepted, the leg may WRITE from now on (never before)
    QUIET = 7  # sender → receiver (NIXL): every WRITE of this leg reached a final state; it never writes again


@dataclass(slots=True, frozen=True)
class Frame:
    kind: Kind
    transfer_id: int
    layer: int = 0
    kv: int = 0
    dst_start: int = 0
    num_blocks: int = 0
    head_lo: int = 0
    head_hi: int = 0
    payload_len: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, WIRE_VERSION, int(self.kind), self.kv, self.transfer_id, self.layer, self.dst_start,
                            self.num_blocks, self.head_lo, self.head_hi, self.payload_len)


def unpack(buf: bytes | bytearray | memoryview) -> Frame:
    if len(buf) < HEADER_SIZE:
        raise ValueError(f"short frame header ({len(buf)} bytes)")
    magic, version, kind, kv, tid, layer, start, nblocks, lo, hi, plen = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"bad frame magic {magic:#x}")
    if version != WIRE_VERSION:
        raise ValueError(f"wire version {version} is not {WIRE_VERSION}")
    try:
        k = Kind(kind)
    except ValueError:
        raise ValueError(f"unknown frame kind {kind}") from None
    if k != Kind.DATA and plen > MAX_CONTROL_PAYLOAD:
        raise ValueError(f"control payload of {plen} bytes is too large")
    return Frame(k, tid, layer, kv, start, nblocks, lo, hi, plen)


def control(kind: Kind, transfer_id: int, payload: bytes = b"") -> bytes:
    """A control frame with its payload, ready to send."""
    return Frame(kind, transfer_id, payload_len=len(payload)).pack() + payload


def hello_payload(layout: KVLayout, agent: str = "", metadata: bytes = b"") -> bytes:
    """HELLO's payload: the sender's layout and, for NIXL, its agent's name and metadata (to answer on)."""
    doc: dict[str, object] = {"layout": layout.to_dict()}
    if agent:
        doc |= {"agent": agent, "metadata": base64.b64encode(metadata).decode()}
    return json.dumps(doc).encode()


def parse_hello(payload: bytes) -> tuple[KVLayout, str, bytes]:
    """``(layout, agent, metadata)`` of a HELLO payload (``""``, ``b""`` where the sender sent none)."""
    try:
        doc = json.loads(payload)
        metadata = base64.b64decode(doc["metadata"], validate=True) if "agent" in doc else b""
        return KVLayout.from_dict(doc["layout"]), str(doc.get("agent", "")), metadata
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed HELLO: {e}") from None
