"""The decision: observations and the previous state in, desired replicas per tier (with reasons) and the next state
out. Pure: no clock, no I/O; the caller stamps ``Observations.time_s``.

Sizing (``sizing.py``): in predictive mode each tier is sized ``max(predictive, reactive)``, so the predictive mode
is bounded below by the reactive one, before the guards and, the guards being monotone in the sized count, after
them (the budget's rebalance below aside: when the budget binds, one tier's GPUs are the other's).

Guards, applied per tier after sizing (``sizing.py``), in this order:

1. **min/max**: the desired count is clamped into ``[min_replicas, max_replicas]``; a tier outside its bounds is
   brought back at once (no cool-down, no hysteresis: the bounds are the operator's contract, Dynamo #6637/#14575).
2. **scale up** waits out ``scale_up_cooldown_s`` since the tier's last change.
3. **scale down** needs all of: a drop of at least ``hysteresis`` of the current count; ``scale_down_windows``
   consecutive decisions wanting it; ``scale_down_cooldown_s`` since the last change. It is returned as a number of
   replicas to *drain* (``TierDecision.drain``): the actuator marks them draining, they finish their work, and only
   then go; draining replicas are not counted as capacity but still count against the budget.
4. **GPU budget** across tiers: ``Σ (desired + draining) · gpus_per_replica <= gpu_budget`` for every scale-up (the
   GPUs a draining replica holds are not free until it is gone, Dynamo #12428). Over budget, scale-ups are trimmed one
   replica at a time from the tier that grows most relative to its size; a scale-up to a tier's minimum is trimmed
   last and only ever waits for drains, never below the minimums (which the config proves fit). A tier starved by the
   budget takes GPUs from a tier that holds more than its predictive need: that tier drains down to its need (a
   budget-driven drain, not subject to its own scale-down guards), and the starved tier grows once the GPUs are free.

Each tier's guards read only that tier's replicas: a tier whose replicas are starting (pods pending) neither blocks
nor delays another tier's scale-down (Dynamo #14251 froze every scale-down while any pod pended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from operators.planner.config import Mode, PlannerConfig
from operators.planner.forecast import HoltState, ahead, holt_update
from operators.planner.observations import Observations, TierObservation
from operators.planner.sizing import predictive, reactive


@dataclass(slots=True, frozen=True)
class TierState:
    last_change_s: float = -math.inf
    down_windows: int = 0  # consecutive decisions that wanted fewer replicas


@dataclass(slots=True, frozen=True)
class PlannerState:
    forecast: HoltState = field(default_factory=HoltState)
    tiers: dict[str, TierState] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class TierDecision:
    name: str
    current: int  # ready + starting when observed
    desired: int  # what the tier's scale should be set to
    drain: int  # replicas to drain (a scale-down happens only this way); 0 unless desired < current
    reason: str
    sized: int  # the sizing rules' answer before the guards


@dataclass(slots=True, frozen=True)
class Plan:
    time_s: float
    forecast_rate: float
    tiers: tuple[TierDecision, ...]
    state: PlannerState

    def desired(self, name: str) -> int:
        return self.decision(name).desired

    def decision(self, name: str) -> TierDecision:
        for d in self.tiers:
            if d.name == name:
                return d
        raise KeyError(name)

    def gpus(self, cfg: PlannerConfig, obs: Observations) -> int:
        """GPUs held once this plan is applied and before drains finish: desired plus draining, all tiers."""
        total = 0
        for d in self.tiers:
            t = obs.tier(d.name)
            total += (d.desired + (t.draining if t else 0)) * cfg.tier(d.name).gpus_per_replica
        return total


@dataclass(slots=True)
class _Work:
    name: str
    obs: TierObservation
    gpus: int
    min_replicas: int
    desired: int
    sized: int
    reason: str
    state: TierState
    need: int | None  # the predictive answer clamped to the bounds (None: capacity unknown or reactive mode)
    wanted: int  # desired before the budget


def plan(cfg: PlannerConfig, obs: Observations, state: PlannerState | None = None) -> Plan:
    state = state or PlannerState()
    holt, rate = holt_update(state.forecast, obs.request_rate, cfg.forecast_alpha, cfg.forecast_beta)
    # Size for the next window and for the window a replica asked for now would start serving in, whichever needs
    # more: a rise is met by the time it arrives, and a tier is not drained of what it needs again within a start-up.
    sizing_rate = max(rate, ahead(holt, 1 + cfg.lead_time_s / obs.window_s))
    now = obs.time_s
    work: list[_Work] = []
    for tier in cfg.tiers:
        t = obs.tier(tier.name) or TierObservation(tier.name, ready=0)
        current = t.current
        ts = state.tiers.get(tier.name, TierState())
        floor, _ = reactive(cfg, tier, obs, t)
        pred = predictive(cfg, tier, obs, sizing_rate) if cfg.mode is Mode.PREDICTIVE else None
        if pred is None:
            sized, reason = floor.replicas, floor.reason
        elif floor.replicas > pred.replicas:  # the reactive answer bounds the predictive one from below
            sized, reason = floor.replicas, f"{floor.reason} (floor over {pred.reason})"
        else:
            sized, reason = pred.replicas, pred.reason
        desired = min(max(sized, tier.min_replicas), tier.max_replicas)
        out_of_bounds = not tier.min_replicas <= current <= tier.max_replicas
        if out_of_bounds:
            bound = "min" if current < tier.min_replicas else "max"
            desired = tier.min_replicas if bound == "min" else tier.max_replicas
            ts = TierState(now, 0)
            reason = f"{bound}: {current} replicas outside [{tier.min_replicas}, {tier.max_replicas}]"
        elif desired != sized:
            reason += f"; clamped to {'min' if desired > sized else 'max'} {desired}"
        if out_of_bounds:
            pass  # brought back at once, above
        elif desired > current:
            if now - ts.last_change_s < cfg.scale_up_cooldown_s:
                desired, reason = current, f"cool-down after a change {now - ts.last_change_s:.0f}s ago; {reason}"
                ts = replace(ts, down_windows=0)
            else:
                ts = TierState(now, 0)
        elif desired < current:
            if desired > current * (1 - cfg.hysteresis) + 1e-9:
                desired, reason = current, f"hysteresis: {desired} is within {cfg.hysteresis:.0%} of {current}"
                ts = replace(ts, down_windows=0)
            elif ts.down_windows + 1 < cfg.scale_down_windows:
                ts = replace(ts, down_windows=ts.down_windows + 1)
                reason = f"sustaining {ts.down_windows}/{cfg.scale_down_windows} before draining to {desired}"
                desired = current
            elif now - ts.last_change_s < cfg.scale_down_cooldown_s:
                ts = replace(ts, down_windows=ts.down_windows + 1)
                desired, reason = current, f"cool-down after a change {now - ts.last_change_s:.0f}s ago; {reason}"
            else:
                ts = TierState(now, 0)
        else:
            ts = replace(ts, down_windows=0)
        need = None if pred is None else min(max(pred.replicas, tier.min_replicas), tier.max_replicas)
        work.append(_Work(tier.name, t, tier.gpus_per_replica, tier.min_replicas, desired, sized, reason, ts, need,
                          desired))
    _enforce_budget(cfg, work, state)
    decisions = tuple(TierDecision(w.name, w.obs.current, w.desired, max(w.obs.current - w.desired, 0), w.reason,
                                   w.sized) for w in work)
    return Plan(now, rate, decisions, PlannerState(holt, {w.name: w.state for w in work}))


def _enforce_budget(cfg: PlannerConfig, work: list[_Work], state: PlannerState) -> None:
    """Trim scale-ups until desired plus draining GPUs fit the budget (see the module docstring, guard 4)."""

    def held(with_draining: bool) -> int:
        return sum((w.desired + (w.obs.draining if with_draining else 0)) * w.gpus for w in work)

    trimmed: set[str] = set()
    while held(True) > cfg.gpu_budget:
        growing = [w for w in work if w.desired > w.obs.current and w.desired > w.min_replicas]
        if not growing:
            growing = [w for w in work if w.desired > w.obs.current]
            if not growing or held(False) <= cfg.gpu_budget:
                break  # only scale-ups to a minimum remain: they fit once the drains finish
        w = max(growing, key=lambda w: ((w.desired - w.obs.current) / max(w.obs.current, 1), w.name))
        w.desired -= 1
        trimmed.add(w.name)
    while held(False) > cfg.gpu_budget:  # the budget shrank below the fleet: shrink, through drain
        w = max((w for w in work if w.desired > w.min_replicas), key=lambda w: (w.desired * w.gpus, w.name))
        w.desired -= 1
        trimmed.add(w.name)
    # Rebalance: a tier starved by the budget gets GPUs from a tier (not itself asking for more) holding more than its
    # predictive need, which drains down to that need (bypassing its own scale-down guards: the signal is the other
    # tier's shortage). The starved tier grows in a later window, once the drains have given the GPUs back.
    for w in work:
        short = (w.wanted - w.desired) * w.gpus
        for o in work:
            if short <= 0 or o is w or o.need is None or o.desired != o.obs.current or o.wanted > o.obs.current:
                continue
            surplus = o.desired - max(o.need, o.min_replicas)
            k = min(surplus, -(-short // o.gpus))
            if k > 0:
                o.desired -= k
                short -= k * o.gpus
                o.reason = f"budget: drain {k} (need {o.need}) for {w.name}; {o.reason}"
                o.state = TierState(state.tiers.get(o.name, TierState()).last_change_s, 0)
    for w in work:
        if w.name in trimmed:
            w.reason = f"budget: {cfg.gpu_budget} GPUs allow {w.desired}; {w.reason}"
            if w.desired == w.obs.current:
                w.state = state.tiers.get(w.name, TierState())
            elif w.desired < w.obs.current:
                w.state = TierState(w.state.last_change_s, 0)
