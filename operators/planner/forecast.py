"""Next window's request rate: Holt's linear exponential smoothing (a level and a trend) over per-window rates.

Dynamo's throughput planner also forecasts the next window before sizing; Holt's method is the smallest forecaster
that follows a ramp (a plain moving average lags a rising load by half its span, which is when the SLO breaks).
A replica asked for now serves only after its start-up, so the planner also reads the forecast that many windows
ahead (``ahead``): the trend carried forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class HoltState:
    level: float | None = None
    trend: float = 0.0


def holt_update(state: HoltState, rate: float, alpha: float, beta: float) -> tuple[HoltState, float]:
    """Fold one window's observed rate in; return the new state and the forecast for the next window (>= 0)."""
    if state.level is None:
        return HoltState(rate, 0.0), rate
    level = alpha * rate + (1 - alpha) * (state.level + state.trend)
    trend = beta * (level - state.level) + (1 - beta) * state.trend
    return HoltState(level, trend), max(level + trend, 0.0)


def ahead(state: HoltState, windows: float) -> float:
    """The forecast ``windows`` windows past the last one folded in (>= 0): ``level + windows · trend``."""
    if state.level is None:
        return 0.0
    return max(state.level + windows * state.trend, 0.0)
