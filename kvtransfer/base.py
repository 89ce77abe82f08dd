"""The two interfaces every transport implements, and the typed hand-off from decode to prefill.

    decode:  reserve → PENDING → (first bytes) IN_FLIGHT → (every layer landed) DONE | FAILED → release
             → (release returned True: a one-sided WRITE may still land) held → listed by ``quiet()`` → free
    prefill: start → IN_FLIGHT → send_layer × L → finish → (receiver acknowledged) DONE | FAILED → release

Failures are never silent (peer death, mismatch and lease expiry each give FAILED with a message, and tell the
peer); kvtransfer never frees engine blocks, its owner does. :class:`DestinationInfo` crosses processes, so it is
JSON with strict type checks, never pickle, and its ``compat_hash`` is recomputed from the embedded layout.
"""

from __future__ import annotations

import abc
import base64
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvtransfer.book import Entry, OnDone, OnFailed, TransferBook, TransferState, TransferStatus
from kvtransfer.config import TransferConfig
from kvtransfer.layout import KVLayout

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
DESTINATION_VERSION = 1
# DestinationInfo's fields as JSON types: from_bytes checks each before anything is built from it.
_WIRE_TYPES: dict[str, type | tuple[type, ...]] = {
    "backend": str, "request_id": str, "transfer_id": int, "endpoint": str, "layout": dict, "dst_block_ids": list,
    "num_tokens": int, "deadline_s": (int, float), "compat_hash": str, "agent_name": str, "agent_metadata": str,
    "regions": list, "mem_type": str, "device_id": int,
}

__all__ = ["DestinationInfo", "KVCaches", "KVReceiver", "KVSender", "OnDone", "OnFailed", "TransferState",
           "TransferStatus"]


@dataclass(slots=True, frozen=True)
class DestinationInfo:
    """Everything a sender needs to push one request's KV into one decode rank's reserved blocks. ``deadline_s`` is
    wall-clock (``time.time()``); ``regions`` (per-layer K and V base addresses) and ``agent_metadata`` serve NIXL."""

    backend: str
    request_id: str
    transfer_id: int
    endpoint: str
    layout: KVLayout
    dst_block_ids: tuple[int, ...]
    num_tokens: int
    deadline_s: float
    compat_hash: str
    agent_name: str = ""
    agent_metadata: bytes = b""
    regions: tuple[tuple[int, int], ...] = ()
    mem_type: str = "DRAM"
    device_id: int = 0
    version: int = field(default=DESTINATION_VERSION)

    def __post_init__(self) -> None:
        if self.version != DESTINATION_VERSION:
            raise ValueError(f"DestinationInfo version {self.version} is not {DESTINATION_VERSION}")
        if not self.backend or not self.request_id:
            raise ValueError("DestinationInfo needs a backend and a request_id")
        if not 0 <= self.transfer_id < 2**63:
            raise ValueError(f"transfer_id {self.transfer_id} out of range")
        if self.num_tokens < 1 or not self.dst_block_ids:
            raise ValueError("DestinationInfo needs at least one token and one block")
        need = -(-self.num_tokens // self.layout.block_size)
        if need != len(self.dst_block_ids):
            raise ValueError(f"{self.num_tokens} tokens need {need} blocks, got {len(self.dst_block_ids)}")
        if self.compat_hash != self.layout.compat_hash():
            raise ValueError("DestinationInfo compat_hash does not match its layout (corrupted or tampered)")
        if self.regions and len(self.regions) != self.layout.num_layers:
            raise ValueError(f"{len(self.regions)} regions for {self.layout.num_layers} layers")
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type {self.mem_type!r} is not DRAM or VRAM")

    def to_bytes(self) -> bytes:
        doc = {"version": self.version} | {name: getattr(self, name) for name in _WIRE_TYPES} | {
            "layout": self.layout.to_dict(), "dst_block_ids": list(self.dst_block_ids),
            "regions": [list(r) for r in self.regions],
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> DestinationInfo:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"DestinationInfo is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ValueError("DestinationInfo must be a JSON object")
        if doc.get("version") != DESTINATION_VERSION:
            raise ValueError(f"DestinationInfo version {doc.get('version')!r} is not {DESTINATION_VERSION}")
        for key, typ in _WIRE_TYPES.items():
            if not isinstance(doc.get(key), typ) or isinstance(doc.get(key), bool):
                raise ValueError(f"DestinationInfo field {key!r} missing or not {typ}")
        if not all(isinstance(b, int) and b >= 0 for b in doc["dst_block_ids"]):
            raise ValueError("DestinationInfo dst_block_ids must be non-negative ints")
        regions = doc["regions"]
        if not all(isinstance(r, list) and len(r) == 2 and all(isinstance(a, int) for a in r) for r in regions):
            raise ValueError("DestinationInfo regions must be [k_addr, v_addr] int pairs")
        return cls(**{key: doc[key] for key in _WIRE_TYPES} | {
            "layout": KVLayout.from_dict(doc["layout"]), "dst_block_ids": tuple(doc["dst_block_ids"]),
            "deadline_s": float(doc["deadline_s"]), "regions": tuple((int(k), int(v)) for k, v in regions),
            "agent_metadata": base64.b64decode(doc["agent_metadata"], validate=True),
        })


class _Side(abc.ABC):
    """What both ends share: the config, the request ledger (created here, started by the backend once its threads
    run) and the two calls that only read it."""

    backend_name: ClassVar[str]
    side: ClassVar[str]

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        self.config = config or TransferConfig()
        self.book = TransferBook(self.side, on_failed, self._notify_peer)

    @abc.abstractmethod
    def _notify_peer(self, entry: Entry, message: str) -> None:
        """Tell the other end that ``entry`` failed here (best effort; its own lease is the backstop)."""

    def set_on_done(self, on_done: OnDone | None) -> None:
        """Call ``on_done(request_id)`` the moment a transfer turns DONE, on that thread and possibly under the
        ledger's lock: it must only signal, never block or call back. ``poll`` stays the source of truth."""
        self.book.on_done = on_done

    def poll(self, request_id: str) -> TransferStatus:
        return self.book.status(request_id)

    @abc.abstractmethod
    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        """Hand over this rank's per-layer (K, V) tensors once, at start-up."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background threads (joined within ``config.close_timeout_s``) and drop connections."""


class KVSender(_Side):
    """Prefill side: pushes a request's layers into a decode rank's reserved blocks."""

    side: ClassVar[str] = "sender"

    @abc.abstractmethod
    def start(self, request_id: str, dest: DestinationInfo | Sequence[DestinationInfo], src_block_ids: Sequence[int],
              deadline_s: float) -> None:
        """Handshake with the destination rank(s), one per head slice when src TP < dst TP. Raises
        ``CompatibilityError`` (and tells the peer) on mismatch."""

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int) -> None:
        """Non-blocking: queue or post ``layer``; called right after that layer's forward."""

    @abc.abstractmethod
    def finish(self, request_id: str) -> None:
        """All layers were given to ``send_layer``; the request completes once the receiver confirms."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the request (cancelling it, and telling the peer, if it is still in flight)."""


class KVReceiver(_Side):
    """Decode side: reserves destinations and reports when every layer has landed."""

    side: ClassVar[str] = "receiver"

    @abc.abstractmethod
    def reserve(self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                deadline_s: float) -> DestinationInfo:
        """Open a lease on already-allocated blocks and describe them for the sender."""

    @abc.abstractmethod
    def release(self, request_id: str) -> bool:
        """Forget the request; bytes that still arrive for it are discarded, never written. Returns whether its
        blocks must stay held: True when a sender may still write into them on its own (NIXL WRITEs posted before
        it learnt of the failure); the owner frees them once :meth:`quiet` lists the request. False: free now."""

    def quiet(self) -> list[str]:
        """Requests whose ``release`` returned True and into whose blocks nothing can be written any more, each
        listed once (then their blocks may be reused). Backends whose own threads land every byte hold nothing."""
        return []
