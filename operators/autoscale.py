"""The planner loop: one decision per ``spec.autoscaling.intervalSeconds`` for each TandemDeployment that enables it.

A kopf timer (``handlers.build_registry``, every ``OperatorConfig.autoscale_tick_s``) calls :func:`tick`, which is
level-triggered: it reads everything it needs each time and converges the TandemTiers to the decision.

    due?  (the last decision's time, from memory or from .status.autoscaling.state after a restart)
      └─► replicas: the controller's Status (ready, starting, draining per tier)
      └─► traffic: Prometheus (operators.prometheus: rate, lengths, prefix hits, TTFT/ITL, queues, KV use)
      └─► plan(PlannerConfig, Observations, PlannerState)                 (operators.planner: pure)
      └─► each TandemTier's scale  ◄─ desired; a lower count is a drain: the TandemTier change is forwarded to the
          controller's SetReplicas (handlers.forward_tier), which drains the surplus first (the least loaded
          replicas stop taking work, finish what they hold, and only then give their GPUs back)
      └─► .status.autoscaling (each tier's current, desired, drain and reason; what was observed; the state) and a
          Normal Event per change, on the TandemDeployment and the TandemTier

Budget and bounds are the planner's guards (``operators.planner.planner``); ``forward_tier`` clamps into
``[scaling.min, scaling.max]`` once more. While autoscaling is on the planner owns the tiers' scale: a hand
``kubectl scale`` is set back at the next decision. Nothing is decided without both sources: a controller or a
Prometheus that cannot be read, or a selector that matches no series, is reported in ``.status.autoscaling.message``
with one Warning Event per distinct message, and the tiers are left as they are.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from kubernetes_asyncio.client import ApiException

from operators.control import ControlClients, ControlError
from operators.kube import KINDS, Kube
from operators.planner.planner import Plan, PlannerState, TierDecision, plan
from operators.planner_store import dump, load
from operators.prometheus import PrometheusError, TierCounts, observe
from operators.secrets import control_auth
from operators.spec import DeploymentSpec, SpecError, parse

Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(slots=True)
class PlannerMemory:
    """What the loop keeps between ticks in the operator's memory (the status holds the same for a restart)."""

    last: dict[tuple[str, str], tuple[PlannerState, float]] = field(default_factory=dict)  # (ns, td) -> state, time
    reported: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, td) -> the problem last reported

    def forget(self, key: tuple[str, str]) -> None:
        self.last.pop(key, None)
        self.reported.pop(key, None)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _resume(memory: PlannerMemory, key: tuple[str, str], body: kopf.Body) -> tuple[PlannerState, float] | None:
    """The newer of the state in memory and the one in the status (a restarted operator has only the status)."""
    saved = load(((body.get("status") or {}).get("autoscaling") or {}).get("state"))
    mine = memory.last.get(key)
    if saved is None or (mine is not None and mine[1] >= saved[1]):
        return mine
    return saved


def _problem(memory: PlannerMemory, key: tuple[str, str], body: kopf.Body, patch: kopf.Patch, logger: Logger,
             reason: str, message: str) -> None:
    if memory.reported.get(key) != message:
        memory.reported[key] = message
        kopf.warn(body, reason=reason, message=message)
        logger.warning("autoscaling: %s: %s", reason, message)
    patch.status["autoscaling"] = {"enabled": True, "message": f"{reason}: {message}"}


async def _scale(kube: Kube, spec: DeploymentSpec, namespace: str, d: TierDecision, body: kopf.Body,
                 logger: Logger) -> None:
    name = f"{spec.name}-{d.name}"
    tier = await kube.get(KINDS["TandemTier"], namespace, name)
    if tier is None:
        logger.warning("autoscaling: TandemTier %s/%s does not exist yet; the reconcile creates it", namespace, name)
        return
    if (tier.get("spec") or {}).get("replicas") != d.desired:
        await kube.scale(KINDS["TandemTier"], namespace, name, d.desired)
    if d.desired != d.current:
        what = (f"scale {d.name} up {d.current} -> {d.desired}" if d.desired > d.current
                else f"drain {d.drain} of {d.current} {d.name} replicas -> {d.desired}")
        reason = "ScaledUp" if d.desired > d.current else "Draining"
        kopf.event([body, kopf.Body(cast(kopf.RawBody, tier))], type="Normal", reason=reason,
                   message=f"{what}: {d.reason}")
        logger.info("autoscaling: %s: %s", what, d.reason)


def _status(p: Plan, obs_summary: dict[str, Any], now: float) -> dict[str, Any]:
    return {
        "enabled": True, "message": "", "lastDecisionTime": _iso(now), "forecastRate": round(p.forecast_rate, 6),
        "observed": obs_summary,
        "tiers": {d.name: {"current": d.current, "desired": d.desired, "drain": d.drain, "sized": d.sized,
                           "reason": d.reason} for d in p.tiers},
        "state": dump(p.state, now),
    }


async def tick(control: ControlClients, control_address: str, kube: Kube, memory: PlannerMemory, body: kopf.Body,
               namespace: str, patch: kopf.Patch, logger: Logger, now: float | None = None) -> Plan | None:
    """Decide once if a decision is due; the plan applied (None when nothing was decided)."""
    try:
        spec = parse(dict(body))
    except SpecError:
        return None  # the reconcile reports it
    a = spec.autoscaling
    key = (namespace, spec.name)
    if a is None:
        if ((body.get("status") or {}).get("autoscaling") or {}).get("enabled"):
            patch.status["autoscaling"] = {"enabled": False, "message": "autoscaling is off"}
        memory.forget(key)
        return None
    now = time.time() if now is None else now
    resumed = _resume(memory, key, body)
    if resumed is not None and now - resumed[1] < a.interval_s:
        return None
    try:
        auth = await control_auth(kube, spec, namespace)
        status = await control.status(control_address, auth)
    except ControlError as e:
        _problem(memory, key, body, patch, logger, "ControllerUnreachable", str(e))
        return None
    counts = {t.name: TierCounts(int(s.ready), int(s.starting), int(s.draining)) if (s := status.get(t.name))
              else TierCounts(0) for t in spec.tiers}
    try:
        obs = await observe(a.prometheus_url, a.matchers(spec.name, namespace), a.window_s, a.interval_s, now, counts)
    except PrometheusError as e:
        _problem(memory, key, body, patch, logger, "MetricsUnavailable", str(e))
        return None
    memory.reported.pop(key, None)
    p = plan(a.planner, obs, resumed[0] if resumed else None)
    memory.last[key] = (p.state, now)
    summary = {"requestRate": round(obs.request_rate, 6), "inputTokensMean": round(obs.input_len.mean, 3),
               "outputTokensMean": round(obs.output_len.mean, 3), "prefixHitRate": round(obs.prefix_hit_rate, 6),
               "ttftP90Seconds": obs.ttft.p90, "itlP90Seconds": obs.itl.p90,
               "queueDepth": {t.name: t.queue_depth for t in obs.tiers},
               "kvUtilisation": {t.name: round(t.kv_utilisation, 6) for t in obs.tiers}}
    patch.status["autoscaling"] = _status(p, summary, now)
    try:  # the decision is recorded first: a failed write is set right by the next decision, not repeated now
        for d in p.tiers:
            await _scale(kube, spec, namespace, d, body, logger)
    except ApiException as e:
        patch.status["autoscaling"]["message"] = f"scaling a TandemTier: {e.status} {e.reason}"
        logger.warning("autoscaling: scaling a TandemTier: %s %s; the next decision retries", e.status, e.reason)
    return p
