"""``spec.autoscaling`` of a TandemDeployment: where the planner reads its observations, how often it decides, and
the planner's own configuration (``operators.planner.config.PlannerConfig``) built from the tiers and the SLOs.

Absent, or ``enabled: false``: nobody but a person, an HPA or KEDA scales the TandemTiers. Enabled, the operator's
planner loop (``operators.autoscale``) decides every ``intervalSeconds`` from Prometheus (``prometheusUrl``) and writes
each TandemTier's scale. The tiers' bounds are the tiers' own ``scaling.min``/``scaling.max`` (a tier with fixed
``replicas`` is pinned: min = max); a replica's GPUs are its ranks times its rank's ``nvidia.com/gpu`` limit (one
device per rank when none is given); the SLO targets are ``spec.slo``'s (the planner compares its p90 against them).

Every bad value raises ``SpecError`` naming the field, so the reconcile reports ``Degraded=True`` as for any other
spec mistake; ``PlannerConfig``'s own checks (thresholds in order, the budget above the tiers' minimums) are
reported under ``spec.autoscaling``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from operators.planner.config import Mode, PlannerConfig, Role, TierConfig

DEFAULT_INTERVAL_S = 30.0
DEFAULT_WINDOW_S = 60.0
DEFAULT_TTFT_SLO_S = 2.0
DEFAULT_ITL_SLO_S = 0.1
# PromQL label matchers only (name op "value", comma separated): what scopes the queries to one deployment's series.
_MATCHER = r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=|!=|=~|!~)\s*"(?:[^"\\]|\\.)*"\s*'
SELECTOR = re.compile(rf"^(?:{_MATCHER}(?:,{_MATCHER})*)?$")
# spec.autoscaling key -> PlannerConfig field, for the planner's knobs passed through as they are.
KNOBS = {
    "targetUtilisation": "target_utilisation", "leadTimeSeconds": "lead_time_s", "queueHigh": "queue_high",
    "queueLow": "queue_low", "kvHigh": "kv_high", "kvLow": "kv_low", "reactiveMaxStep": "reactive_max_step",
    "hysteresis": "hysteresis", "scaleUpCooldownSeconds": "scale_up_cooldown_s",
    "scaleDownCooldownSeconds": "scale_down_cooldown_s", "scaleDownWindows": "scale_down_windows",
}


class AutoscalingError(ValueError):
    """A bad ``spec.autoscaling`` (spec.py turns it into its SpecError)."""


@dataclass(slots=True, frozen=True)
class AutoscalingSpec:
    planner: PlannerConfig
    prometheus_url: str
    interval_s: float = DEFAULT_INTERVAL_S  # one decision per interval (the forecaster's step)
    window_s: float = DEFAULT_WINDOW_S  # PromQL range of rates and percentiles; at least the interval
    selector: str | None = None  # None: namespace="<ns>",service="<td>-router-metrics" (the ServiceMonitor's labels)

    def __post_init__(self) -> None:
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise AutoscalingError(f"spec.autoscaling.prometheusUrl {self.prometheus_url!r} must start with http:// "
                                   "or https://")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise AutoscalingError(f"spec.autoscaling.intervalSeconds must be > 0, got {self.interval_s!r}")
        if not (math.isfinite(self.window_s) and self.window_s >= self.interval_s):
            raise AutoscalingError(f"spec.autoscaling.windowSeconds={self.window_s!r} must be >= intervalSeconds="
                                   f"{self.interval_s!r}: each decision reads at least the window since the last")
        if self.selector is not None and SELECTOR.match(self.selector) is None:
            raise AutoscalingError(f"spec.autoscaling.selector {self.selector!r} is not a list of PromQL label "
                                   'matchers such as namespace="serving",service="llama-router-metrics"')

    def matchers(self, name: str, namespace: str) -> str:
        if self.selector is not None:
            return self.selector
        return f'namespace="{namespace}",service="{name}-router-metrics"'


@dataclass(slots=True, frozen=True)
class TierBounds:
    """What the planner needs of one validated tier (``spec.TierSpec``)."""

    name: str
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int


def _slo_s(slo: dict[str, Any], key: str, default: float) -> float:
    target = (slo.get(key) or {}).get("targetMs")
    if target is None:
        return default
    if not isinstance(target, int | float) or target <= 0:
        raise AutoscalingError(f"spec.slo.{key}.targetMs must be a number > 0, got {target!r}")
    return float(target) / 1000.0


def _number(a: dict[str, Any], key: str, default: float | None = None) -> float | None:
    value = a.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AutoscalingError(f"spec.autoscaling.{key} must be a finite number, got {value!r}")
    return float(value)


def parse_autoscaling(a: Any, tiers: tuple[TierBounds, ...], slo: dict[str, Any]) -> AutoscalingSpec | None:
    """``spec.autoscaling`` (None when absent or disabled) against the already validated tiers and SLOs."""
    if a is None:
        return None
    if not isinstance(a, dict):
        raise AutoscalingError("spec.autoscaling must be an object")
    if not a.get("enabled", False):
        return None
    for key in ("prometheusUrl", "gpuBudget"):
        if a.get(key) is None:
            raise AutoscalingError(f"spec.autoscaling.{key} is required when autoscaling is enabled")
    budget = a["gpuBudget"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise AutoscalingError(f"spec.autoscaling.gpuBudget must be a whole number >= 1, got {budget!r}")
    mode = a.get("mode", Mode.PREDICTIVE.value)
    if mode not in {m.value for m in Mode}:
        raise AutoscalingError(f"spec.autoscaling.mode {mode!r} is not one of {', '.join(m.value for m in Mode)}")
    capacity = {name: _number(a, f"{name}TokensPerSecond", 0.0) or 0.0 for name in ("prefill", "decode")}
    disaggregated = any(t.name == "prefill" for t in tiers)
    knobs = {field: value for key, field in KNOBS.items() if (value := _number(a, key)) is not None}
    if "scale_down_windows" in knobs:
        knobs["scale_down_windows"] = int(knobs["scale_down_windows"])
    try:
        planner = PlannerConfig(
            tiers=tuple(TierConfig(
                name=t.name, role=Role(t.name) if disaggregated else Role.BOTH, gpus_per_replica=t.gpus_per_replica,
                min_replicas=t.min_replicas, max_replicas=t.max_replicas,
                prefill_tokens_per_s=capacity["prefill"], decode_tokens_per_s=capacity["decode"]) for t in tiers),
            gpu_budget=budget, ttft_slo_s=_slo_s(slo, "ttft", DEFAULT_TTFT_SLO_S),
            itl_slo_s=_slo_s(slo, "itl", DEFAULT_ITL_SLO_S), mode=Mode(mode), **knobs)  # type: ignore[arg-type]
    except ValueError as e:
        raise AutoscalingError(f"spec.autoscaling: {e}") from None
    interval = _number(a, "intervalSeconds", DEFAULT_INTERVAL_S)
    window = _number(a, "windowSeconds", max(DEFAULT_WINDOW_S, interval or 0.0))
    selector = a.get("selector")
    if selector is not None and not isinstance(selector, str):
        raise AutoscalingError("spec.autoscaling.selector must be a string")
    assert interval is not None and window is not None
    return AutoscalingSpec(planner, str(a["prometheusUrl"]), interval, window, selector)
