"""The planner's state as ``.status.autoscaling.state`` of a TandemDeployment, and back.

The guards need memory across decisions (each tier's last change and how many windows a scale-down has been wanted;
the forecaster's level and trend). Kept in the custom resource's status, it survives an operator restart or a
leader change: the next operator resumes the cool-downs and the sustained-scale-down count where the last one left
them, instead of starting fresh (which would let a restart skip a cool-down). Times are seconds since the epoch, the
planner's clock in the operator; a tier that never changed has ``lastChangeTime: null``.
"""

from __future__ import annotations

import math
from typing import Any

from operators.planner.forecast import HoltState
from operators.planner.planner import PlannerState, TierState


def dump(state: PlannerState, time_s: float) -> dict[str, Any]:
    return {
        "time": time_s,
        "forecast": {"level": state.forecast.level, "trend": state.forecast.trend},
        "tiers": {name: {"lastChangeTime": t.last_change_s if math.isfinite(t.last_change_s) else None,
                         "downWindows": t.down_windows} for name, t in sorted(state.tiers.items())},
    }


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def load(saved: Any) -> tuple[PlannerState, float] | None:
    """The state and the time of the decision that left it; None when nothing usable was saved (a fresh start)."""
    if not isinstance(saved, dict) or _finite(saved.get("time")) is None:
        return None
    forecast: dict[str, Any] = saved["forecast"] if isinstance(saved.get("forecast"), dict) else {}
    tiers: dict[str, TierState] = {}
    for name, t in (saved.get("tiers") or {}).items():
        if not isinstance(t, dict):
            continue
        changed = _finite(t.get("lastChangeTime"))
        windows = t.get("downWindows")
        tiers[str(name)] = TierState(-math.inf if changed is None else changed,
                                     windows if isinstance(windows, int) and windows >= 0 else 0)
    holt = HoltState(_finite(forecast.get("level")), _finite(forecast.get("trend")) or 0.0)
    time_s = _finite(saved.get("time"))
    assert time_s is not None
    return PlannerState(holt, tiers), time_s
