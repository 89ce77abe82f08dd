"""What the planner is told: per-tier bounds and measured capacity, the SLOs, the GPU budget and the guards' knobs.

Capacity is "measured capacity at the SLO": the prefill tokens per second one replica sustains while its TTFT stays
within target, and the decode tokens per second one replica sustains while its ITL stays within target (Dynamo's
throughput planner takes the same two figures from a profiling run; the simulator computes them from its roofline).
A capacity of 0 means unknown: that tier is sized by the reactive thresholds alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: one replica prefills and decodes


class Mode(StrEnum):
    PREDICTIVE = "predictive"  # forecast the next window and size from capacity, floored by the reactive mode
    REACTIVE = "reactive"  # thresholds on queue depth, KV utilisation and latency only


@dataclass(slots=True, frozen=True)
class TierConfig:
    name: str
    role: Role
    gpus_per_replica: int
    min_replicas: int
    max_replicas: int
    prefill_tokens_per_s: float = 0.0  # one replica, at the TTFT target
    decode_tokens_per_s: float = 0.0  # one replica, at the ITL target

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tier name must not be empty")
        if self.gpus_per_replica < 1:
            raise ValueError(f"{self.name}: gpus_per_replica must be >= 1, got {self.gpus_per_replica}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"{self.name}: need 0 <= min_replicas <= max_replicas, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        for field in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, field)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{self.name}: {field} must be a finite number >= 0, got {value!r}")


@dataclass(slots=True, frozen=True)
class PlannerConfig:
    tiers: tuple[TierConfig, ...]
    gpu_budget: int  # all tiers together, draining replicas included; never exceeded
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    mode: Mode = Mode.PREDICTIVE
    target_utilisation: float = 0.8  # plan each tier to run at this fraction of its capacity at the SLO
    # A new replica's start-up (pod scheduled, weights loaded, warm-up): predictive sizing also covers the rate
    # forecast this far past the next window, so a replica asked for now is there when the load it is for arrives.
    lead_time_s: float = 0.0
    # Reactive thresholds: queued requests per ready replica, KV utilisation (0..1).
    queue_high: float = 4.0
    queue_low: float = 0.5
    kv_high: float = 0.85
    kv_low: float = 0.5
    # A reactive scale-up asks for at most this multiple of the ready replicas per decision (as Kubernetes' HPA's
    # default scale-up policy, which doubles): its signals are per ready replica and lag by a start-up, so a bigger
    # jump overshoots and takes the GPU budget from the other tier.
    reactive_max_step: float = 2.0
    # Guards.
    hysteresis: float = 0.2  # scale down only to at most (1 - hysteresis) of the current replicas
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    scale_down_windows: int = 3  # consecutive decisions that must all want fewer replicas
    # Holt's linear forecaster over the per-window request rate.
    forecast_alpha: float = 0.5
    forecast_beta: float = 0.3

    def __post_init__(self) -> None:
        names = [t.name for t in self.tiers]
        if not names:
            raise ValueError("at least one tier is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be distinct, got {names}")
        floor = sum(t.min_replicas * t.gpus_per_replica for t in self.tiers)
        if self.gpu_budget < floor:
            raise ValueError(f"gpu_budget={self.gpu_budget} is below the tiers' minimums ({floor} GPUs)")
        for name in ("ttft_slo_s", "itl_slo_s", "queue_high", "kv_high"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.queue_low < self.queue_high:
            raise ValueError(f"need 0 <= queue_low < queue_high, got {self.queue_low}, {self.queue_high}")
        if not (math.isfinite(self.reactive_max_step) and self.reactive_max_step > 1):
            raise ValueError(f"reactive_max_step must be a finite number > 1, got {self.reactive_max_step!r}")
        if not 0 <= self.kv_low < self.kv_high <= 1:
            raise ValueError(f"need 0 <= kv_low < kv_high <= 1, got {self.kv_low}, {self.kv_high}")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError(f"target_utilisation must be in (0, 1], got {self.target_utilisation}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if not (math.isfinite(self.lead_time_s) and self.lead_time_s >= 0):
            raise ValueError(f"lead_time_s must be a finite number >= 0, got {self.lead_time_s!r}")
        if self.scale_up_cooldown_s < 0 or self.scale_down_cooldown_s < 0:
            raise ValueError("cool-downs must be >= 0")
        if self.scale_down_windows < 1:
            raise ValueError(f"scale_down_windows must be >= 1, got {self.scale_down_windows}")
        for name in ("forecast_alpha", "forecast_beta"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)
