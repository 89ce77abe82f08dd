"""The two interfaces every transport implements, and the status they report.

Lifecycle of one request (queues as states; ``TransferState`` is ordered so "finished" is ``state >= DONE``)::

    decode:  reserve → PENDING → (first bytes) IN_FLIGHT → (every layer landed) DONE | FAILED → release
    prefill: start → IN_FLIGHT → send_layer × L → finish → (receiver acknowledged) DONE | FAILED → release

Failures are never silent: peer death, compatibility mismatch and lease expiry each produce FAILED with a message,
visible through ``poll`` and, if given, the ``on_failed(request_id, message)`` callback (called from a background
thread, outside any lock). kvtransfer never frees engine blocks itself; the owner frees them when it sees FAILED or
DONE and then calls ``release``.

Deadlines (``deadline_s``) are absolute wall-clock times. A lease that has not reached DONE by its deadline turns
FAILED on that side ("lease expired") and, best effort, the peer is told so it fails too instead of waiting.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar

import torch

from kvtransfer.config import TransferConfig
from kvtransfer.destination import DestinationInfo
from kvtransfer.layout import KVLayout

if TYPE_CHECKING:
    from kvtransfer.book import TransferBook

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
OnFailed = Callable[[str, str], None]
OnDone = Callable[[str], None]

__all__ = ["DestinationInfo", "KVCaches", "KVReceiver", "KVSender", "OnDone", "OnFailed", "TransferState",
           "TransferStatus"]


class TransferState(IntEnum):
    PENDING = 0
    IN_FLIGHT = 1
    DONE = 2
    FAILED = 3


@dataclass(slots=True, frozen=True)
class TransferStatus:
    state: TransferState
    error: str | None = None
    bytes_sent: int = 0  # sender: bytes handed to the transport; receiver: bytes landed in reserved blocks
    layers_done: int = 0  # sender: layers fully sent; receiver: layers fully landed

    @property
    def finished(self) -> bool:
        return self.state >= TransferState.DONE


class KVSender(abc.ABC):
    """Prefill side: pushes a request's layers into a decode rank's reserved blocks."""

    backend_name: ClassVar[str]
    book: TransferBook  # every implementation keeps its requests in one

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        self.config = config or TransferConfig()
        self.on_failed = on_failed

    def set_on_done(self, on_done: OnDone | None) -> None:
        """Call ``on_done(request_id)`` the moment a transfer turns DONE, so its owner need not wait for a poll tick.

        It runs on whichever thread saw the transfer finish, possibly under the request ledger's lock: it must only
        signal (set an event, queue a call on the engine loop), never block or call back into this object. ``poll``
        stays the source of truth.
        """
        self.book.on_done = on_done

    @abc.abstractmethod
    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None:
        """Hand over this rank's per-layer (K, V) tensors once, at start-up."""

    @abc.abstractmethod
    def start(
        self,
        request_id: str,
        dest: DestinationInfo | Sequence[DestinationInfo],
        src_block_ids: Sequence[int],
        deadline_s: float,
    ) -> None:
        """Handshake with the destination rank(s). Raises ``CompatibilityError`` (and tells the peer) on mismatch.

        Several destinations are given when this rank's heads are spread over several decode ranks (src TP <
        dst TP); each gets the head slice it owns.
        """

    @abc.abstractmethod
    def send_layer(self, request_id: str, layer: int) -> None:
        """Non-blocking: queue or post ``layer``; called right after that layer's forward."""

    @abc.abstractmethod
    def finish(self, request_id: str) -> None:
        """All layers were given to ``send_layer``; the request completes once the receiver confirms."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus: ...

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the request (cancelling it, and telling the peer, if it is still in flight)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background threads (joined within ``config.close_timeout_s``) and drop connections."""


class KVReceiver(abc.ABC):
    """Decode side: reserves destinations and reports when every layer has landed."""

    backend_name: ClassVar[str]
    book: TransferBook  # every implementation keeps its requests in one

    def __init__(self, config: TransferConfig | None = None, on_failed: OnFailed | None = None) -> None:
        self.config = config or TransferConfig()
        self.on_failed = on_failed

    def set_on_done(self, on_done: OnDone | None) -> None:
        """Call ``on_done(request_id)`` the moment a transfer turns DONE, so its owner need not wait for a poll tick.

        It runs on whichever thread saw the transfer finish, possibly under the request ledger's lock: it must only
        signal (set an event, queue a call on the engine loop), never block or call back into this object. ``poll``
        stays the source of truth.
        """
        self.book.on_done = on_done

    @abc.abstractmethod
    def register(self, kv_caches: KVCaches, layout: KVLayout) -> None: ...

    @abc.abstractmethod
    def reserve(
        self, request_id: str, dst_block_ids: Sequence[int], num_tokens: int, deadline_s: float
    ) -> DestinationInfo:
        """Open a lease on already-allocated blocks and describe them for the sender."""

    @abc.abstractmethod
    def poll(self, request_id: str) -> TransferStatus: ...

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Forget the request; bytes that still arrive for it are discarded, never written."""

    @abc.abstractmethod
    def close(self) -> None: ...
