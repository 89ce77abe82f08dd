"""The two sizing rules, before any guard: predictive (capacity at the SLO) and reactive (thresholds).

Predictive, for a forecast rate ``r`` (requests/s), mean prompt ``I`` and output ``O`` tokens, prefix hit rate ``h``::

    prefill replicas = ceil(r · I · (1 - h) / (prefill_tokens_per_s · target_utilisation))
    decode replicas  = ceil(r · O / (decode_tokens_per_s · target_utilisation))
    colocated        = ceil(both loads added, each over its own capacity)

Reactive, per tier, from what the tier reports now: the pressure is the largest of queue per ready replica over
``queue_high``, KV utilisation over ``kv_high`` and the tier's latency p90 over its SLO (TTFT for prefill while its
own queue holds prompts, ITL for decode, the larger for colocated). Pressure above 1 asks for
``max(ceil(ready · min(pressure, reactive_max_step)), ready + 1, current)`` replicas: the signals are measured on the
ready replicas, so replicas still starting count toward the answer (a tier waiting out a start-up does not ask again
for what is on its way, and is never shrunk under pressure), and one decision at most doubles the tier (by default).
Every signal below its low mark (queue under ``queue_low``, KV under ``kv_low``, latency under half its SLO) lets the
tier shrink by one hysteresis step, ``min(current - 1, floor(current · (1 - hysteresis)))`` (one replica fewer
would never pass the hysteresis guard on a tier of more than ``1 / hysteresis`` replicas); anything between holds.

In predictive mode the reactive answer is a lower bound: the tier is sized ``max(predictive, reactive)``, so a
forecast never sizes a tier below what its queues and latencies demand now, never shrinks a tier whose signals are
not low, and never shrinks one faster than the reactive mode would (``tests/test_planner.py`` checks the bound on
random observations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from operators.planner.config import PlannerConfig, Role, TierConfig
from operators.planner.observations import Observations, TierObservation


@dataclass(slots=True, frozen=True)
class Sizing:
    replicas: int
    reason: str


def predictive(cfg: PlannerConfig, tier: TierConfig, obs: Observations, rate: float) -> Sizing | None:
    """Replicas to carry ``rate`` at the SLO; None when the tier's capacity is unknown."""
    u = cfg.target_utilisation
    prefill_load = rate * obs.input_len.mean * (1 - obs.prefix_hit_rate)
    decode_load = rate * obs.output_len.mean
    need = 0.0
    if tier.role in (Role.PREFILL, Role.BOTH):
        if tier.prefill_tokens_per_s <= 0:
            return None
        need += prefill_load / (tier.prefill_tokens_per_s * u)
    if tier.role in (Role.DECODE, Role.BOTH):
        if tier.decode_tokens_per_s <= 0:
            return None
        need += decode_load / (tier.decode_tokens_per_s * u)
    replicas = math.ceil(need - 1e-9)
    return Sizing(replicas, f"predictive: {rate:.3g} req/s forecast needs {need:.2f} replicas")


def _latency_p90(cfg: PlannerConfig, tier: TierConfig, obs: Observations, t: TierObservation) -> float:
    """The tier's latency p90 over its SLO (0 when nothing was measured).

    A prefill tier answers for TTFT only while prompts wait in its own queue: in a disaggregated fleet TTFT also holds
    the wait for decode to reserve KV blocks, and blaming prefill for that would grow the wrong tier (and, under the
    budget, starve the one that needs the GPUs)."""
    ratios = []
    own_queue = t.queue_depth / max(t.ready, 1) > cfg.queue_low
    if obs.ttft.p90 is not None and (tier.role is Role.BOTH or (tier.role is Role.PREFILL and own_queue)):
        ratios.append(obs.ttft.p90 / cfg.ttft_slo_s)
    if tier.role in (Role.DECODE, Role.BOTH) and obs.itl.p90 is not None:
        ratios.append(obs.itl.p90 / cfg.itl_slo_s)
    return max(ratios, default=0.0)


def reactive(cfg: PlannerConfig, tier: TierConfig, obs: Observations, t: TierObservation) -> tuple[Sizing, bool]:
    """The thresholds' answer, and whether every signal is low (the only state in which it lets the tier shrink)."""
    current = t.current
    queue = t.queue_depth / max(t.ready, 1)
    latency = _latency_p90(cfg, tier, obs, t)
    signals = {"queue": queue / cfg.queue_high, "kv": t.kv_utilisation / cfg.kv_high, "latency": latency}
    worst = max(signals, key=lambda k: signals[k])
    pressure = signals[worst]
    if pressure > 1:
        replicas = max(math.ceil(max(t.ready, 1) * min(pressure, cfg.reactive_max_step) - 1e-9), t.ready + 1, current)
        return Sizing(replicas, f"reactive: {worst} at {pressure:.2f}x its high mark"), False
    low = queue <= cfg.queue_low and t.kv_utilisation <= cfg.kv_low and latency <= 0.5
    if low:
        step_down = min(current - 1, math.floor(current * (1 - cfg.hysteresis) + 1e-9))
        return Sizing(max(step_down, 0), "reactive: queue, KV and latency all low"), True
    return Sizing(current, "reactive: within thresholds"), False
