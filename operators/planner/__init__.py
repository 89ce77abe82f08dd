"""The SLO planner: a pure function from observations to desired replicas per tier, each with its reason.

One decision (:func:`operators.planner.planner.plan`)::

    Observations ──forecast (Holt)──► next window's request rate
                 ──sizing: predictive (rate × lengths ÷ capacity at the SLO), floored by reactive (queue, KV, latency)
                 ──guards: min/max, cool-down, hysteresis, sustained scale-down through drain, GPU budget──► Plan

The state that makes guards possible (last change per tier, how many windows a scale-down has been wanted, the
forecaster's level and trend) goes in and comes out as a value, so the operator, ``tandem up --autoscale`` and the
simulator run the same code and a test can replay any sequence of observations. Nothing here imports torch, ray or
kopf.
"""
