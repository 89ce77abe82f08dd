"""What the controller knows of one replica: its tier, lifecycle state, Ray handles, address and last load.

Lifecycle (ordered, as ``tandem.v1.ReplicaState`` numbers it):

    STARTING ──healthy and registered──► READY ──scale-down / Drain──► DRAINING ──in-flight 0 or timeout──► gone
        │                                  │
        └──── worker or actor died ────────┴──► FAILED ──► removed; the reconcile loop starts a replacement
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from proto.tandem.v1 import worker_pb2 as wpb

TIERS = ("prefill", "decode")


class ReplicaState(enum.IntEnum):
    STARTING = 1
    READY = 2
    DRAINING = 3
    FAILED = 4


def in_flight(load: wpb.LoadResponse) -> int:
    """Requests still on a worker: queued, running, waiting for KV, and KV transfers not yet finished."""
    return int(load.waiting + load.running + load.waiting_for_kv + load.transfers_in_flight)


def holds_nothing(load: wpb.LoadResponse) -> bool:
    """No request, no pending transfer and no KV block in use (prefix-cached free blocks do not count)."""
    return in_flight(load) == 0 and load.held_blocks == 0 and load.used_blocks == 0


@dataclass(slots=True)
class Replica:
    replica_id: str
    tier: str
    ranks: int
    state: ReplicaState = ReplicaState.STARTING
    address: str = ""
    metrics_address: str = ""  # its worker's own /metrics (host:port) for a Prometheus; "": not served
    worker_id: str = ""  # what its worker calls itself (Health), as the router labels its gauges; "": not yet known
    pid: int = -1
    placement_group: Any = None
    actor: Any = None
    load: wpb.LoadResponse | None = None
    created: float = field(default_factory=time.monotonic)
    draining_since: float | None = None  # time.monotonic() when it was marked draining
    drain_acked: bool = False  # its worker accepted Drain (marked draining in the registry, refusing new work)
    drain_seconds: float | None = None  # how long its drain took, once done
    removed_at: float | None = None  # time.monotonic() when its actor was stopped and its group removed
    final_load: wpb.LoadResponse | None = None  # its last Load before it was stopped
    restarts: int = 0  # replicas of this slot replaced before it

    @property
    def in_flight(self) -> int:
        return in_flight(self.load) if self.load is not None else 0

    @property
    def active(self) -> bool:
        """Counts toward the tier's desired replicas (starting or ready)."""
        return self.state in (ReplicaState.STARTING, ReplicaState.READY)
