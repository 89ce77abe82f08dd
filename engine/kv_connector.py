"""The KV connector: the one seam between the engine and KV that lives in another engine.

A disaggregated role is a connector, not a reach into the engine. The engine calls it at fixed points, on its own
thread, and owns every block throughout; the connector sees block ids, never the pool, the block tables or the
scheduler's queues.

Scheduler side (called by :class:`~engine.scheduler.Scheduler`):

- :meth:`KVConnector.num_remote_tokens`: how many of a new request's prompt tokens another engine will write. A
  request with any is not scheduled: its blocks are reserved at once and it waits in ``WAITING_FOR_REMOTE_KV``
  (decode).
- :meth:`KVConnector.request_finished`: a request ended (any status). True keeps its blocks held, so a send still
  reading them reads intact KV (prefill); they are freed when :meth:`KVConnector.get_finished` reports the send.

Worker side (called by :class:`~engine.llm_engine.LLMEngine`):

- :meth:`KVConnector.register_kv_caches`: once, with the cache tensors and the block-id lookup.
- :meth:`KVConnector.start_load_kv`: blocks were reserved for a request's remote KV; open the receive on them.
- :meth:`KVConnector.bind_step`: before a step's forward, the requests it computes and how many tokens each;
  then :meth:`KVConnector.save_kv_layer` after each layer's forward, so a send of that layer overlaps the layers
  still to compute.
- :meth:`KVConnector.get_finished`: at the start of every step, what ended since the last: sends (their held blocks
  are freed), loads that landed (the request joins the running batch with the first token the remote engine
  sampled) and loads that failed (the request ends in error, its blocks freed).

Colocated mode is an engine without a connector: none of these calls is made.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.request import Request, TokenLogprobs


@dataclass(slots=True, frozen=True)
class EngineKV:
    """What a connector may read of the engine's KV: the cache tensors (one (K, V) pair per local layer), their
    geometry, and each live request's block ids."""

    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    num_layers: int
    block_size: int
    block_ids: Callable[[str], list[int]]

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.block_size < 1:
            raise ValueError(f"num_layers={self.num_layers} and block_size={self.block_size} must be >= 1")


@dataclass(slots=True, frozen=True)
class LoadDone:
    """A request's remote KV landed and its first token (sampled by the remote engine) is here."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprobs | None = None


@dataclass(slots=True, frozen=True)
class LoadFailed:
    """A request's remote KV will not arrive (peer gone, lease expired, refused); ``message`` says why."""

    request_id: str
    message: str


@dataclass(slots=True)
class FinishedTransfers:
    """What a connector reports at the start of a step."""

    sent: list[str] = field(default_factory=list)  # sends ended, DONE or FAILED: free their held blocks
    loaded: list[LoadDone] = field(default_factory=list)
    failed: list[LoadFailed] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sent or self.loaded or self.failed)


class KVConnector(ABC):
    """Both sides of one role's KV hand-off; every method runs on the engine's thread."""

    # How long an engine loop may sleep while the only requests wait for remote KV (a finished transfer wakes it
    # sooner); None: the loop's own idle interval.
    remote_wait_s: float | None = None

    # ---- scheduler side ------------------------------------------------------------------------------------

    def num_remote_tokens(self, request: Request) -> int:
        """Prompt tokens of a new ``request`` whose KV another engine writes (0: compute them here)."""
        return 0

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """``request`` ended with these blocks. True: keep them until :meth:`get_finished` reports its send."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Transfers still in flight (sends from held blocks, loads): the engine is not idle while any are."""

    # ---- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv: EngineKV) -> None:
        """Called once, when the connector is attached to an engine."""
        return None

    def start_load_kv(self, request: Request, block_ids: list[int]) -> None:
        """Blocks were reserved for ``request``'s remote KV: start receiving. Raising refuses the request (its
        blocks are freed)."""
        return None

    def bind_step(self, requests: Sequence[Request], num_new_tokens: Sequence[int]) -> None:
        """A step's forward is about to compute ``num_new_tokens[i]`` tokens of ``requests[i]``."""
        return None

    def save_kv_layer(self, layer: int) -> None:
        """Layer ``layer`` of the bound step's forward wrote its KV."""
        return None

    @abstractmethod
    def get_finished(self) -> FinishedTransfers:
        """Transfers that ended since the last call."""
