"""One simulation's settings: the fleet, the engine limits, the routing policy, the SLOs and the planner."""

from __future__ import annotations

from dataclasses import dataclass

from operators.planner.config import PlannerConfig, Role
from router.dispatch import DisaggConfig
from sim.roofline import StepModel


@dataclass(slots=True, frozen=True)
class TierSpec:
    name: str
    role: Role
    replicas: int  # at the start (the planner moves it within its TierConfig bounds)

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"{self.name}: replicas must be >= 0")


@dataclass(slots=True, frozen=True)
class SimConfig:
    step: StepModel
    tiers: tuple[TierSpec, ...]
    model_name: str = "model"
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131072
    routing: str = "kv"  # or "round_robin"
    router_temperature: float = 0.0
    min_uncached_tokens: int = DisaggConfig().min_uncached_tokens
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1  # per request, its mean inter-token latency (TPOT)
    planner: PlannerConfig | None = None  # None: static fleet
    planner_window_s: float = 30.0
    sample_every_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        roles = {t.role for t in self.tiers}
        if not self.tiers or (Role.PREFILL in roles and Role.DECODE not in roles):
            raise ValueError("a fleet needs a decode (or colocated) tier; a prefill tier needs a decode tier")
        if Role.BOTH in roles and len(self.tiers) != 1:
            raise ValueError("a colocated fleet has one tier")
        if len({t.name for t in self.tiers}) != len(self.tiers):
            raise ValueError("tier names must be distinct")
        if self.block_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size, max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.routing not in ("kv", "round_robin"):
            raise ValueError(f"routing must be 'kv' or 'round_robin', got {self.routing!r}")
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0 or self.planner_window_s <= 0 or self.sample_every_s <= 0:
            raise ValueError("SLOs, planner_window_s and sample_every_s must be > 0")
        if self.planner is not None and {t.name for t in self.planner.tiers} != {t.name for t in self.tiers}:
            raise ValueError("the planner's tiers must be the fleet's tiers")

    @property
    def disaggregated(self) -> bool:
        return any(t.role is Role.PREFILL for t in self.tiers)
