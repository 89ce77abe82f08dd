"""What the planner sees each window: the traffic, its latencies, and each tier's replicas, queues and KV use.

The operator fills this from Prometheus, ``tandem up --autoscale`` from the router's and workers' metrics, the
simulator from its own books; the planner cannot tell them apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LengthStats:
    """A token-length distribution over the window: its mean and 90th percentile."""

    mean: float = 0.0
    p90: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and math.isfinite(self.p90)) or self.mean < 0 or self.p90 < 0:
            raise ValueError(f"lengths must be finite and >= 0, got mean={self.mean} p90={self.p90}")


@dataclass(slots=True, frozen=True)
class Percentiles:
    """Seconds; None where nothing was measured in the window."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None


@dataclass(slots=True, frozen=True)
class TierObservation:
    name: str
    ready: int  # serving
    starting: int = 0  # asked for, not yet serving (pending pods, loading weights)
    draining: int = 0  # finishing in-flight work; takes nothing new, still holds its GPUs
    queue_depth: float = 0.0  # requests waiting, summed over the tier's ready replicas
    kv_utilisation: float = 0.0  # used / total KV blocks over the tier's ready replicas, 0..1

    def __post_init__(self) -> None:
        if min(self.ready, self.starting, self.draining) < 0:
            raise ValueError(f"{self.name}: replica counts must be >= 0")
        if self.queue_depth < 0 or not 0 <= self.kv_utilisation <= 1:
            raise ValueError(f"{self.name}: need queue_depth >= 0 and kv_utilisation in [0, 1]")

    @property
    def current(self) -> int:
        """Replicas that are, or will be, serving: ready plus starting. Draining ones are already on their way out."""
        return self.ready + self.starting


@dataclass(slots=True, frozen=True)
class Observations:
    time_s: float  # the end of the window, on the caller's clock
    window_s: float
    request_rate: float  # requests per second arriving over the window
    input_len: LengthStats
    output_len: LengthStats
    prefix_hit_rate: float  # fraction of prompt tokens served from cache, 0..1
    ttft: Percentiles
    itl: Percentiles
    tiers: tuple[TierObservation, ...]

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.request_rate < 0 or not math.isfinite(self.request_rate):
            raise ValueError(f"need window_s > 0 and a finite request_rate >= 0, got {self.window_s}, "
                             f"{self.request_rate}")
        if not 0 <= self.prefix_hit_rate <= 1:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")

    def tier(self, name: str) -> TierObservation | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None
