"""Cost-aware speculation: how many proposals each request verifies this step (0..K), from measured step costs.

Verifying K proposals adds K rows to the step. Whether that pays depends on two things the engine can measure:

- **what a step costs** with ``e`` extra rows beside the batch's ``B`` decoding requests, ``c(B, e)``. On a CPU whose
  decode step is bound by reading the weights, five rows cost what one does; on a tiny model the step is mostly
  Python and the kernels' per-row work, and on a loaded host a multi-row matmul split over threads can stall on a
  descheduled one. :class:`StepCosts` keeps, per batch-size bucket, a log-space moving average of the step's wall
  time without speculation and of the ratio ``c(B, e) / c(B, 0)`` per extra-row bucket (a ratio, so that load which
  drifts between the rare speculated steps and the common plain ones cancels out).
- **how much of a proposal is accepted**: per request, a decayed count of proposals accepted against those tried
  (each position up to and including the first rejection), with the engine-wide rate as prior. A proposal that is
  not verified still teaches: the tokens the request emits over the next steps show how much of it would have
  been accepted (exactly so for greedy decoding), so a request's rate keeps up while it is not speculated.

With per-token acceptance ``a``, ``k`` proposals emit ``E(a, k) = 1 + a + .. + a^k`` tokens in expectation. The
policy picks, request by request (the most accepting first), the ``k`` that maximises the batch's expected tokens
per second of step, ``(B + gains) / c(B, e)``, and ``k = 0`` where no ``k`` beats not speculating: a request
whose proposals are not accepted, or a host where extra rows cost more than they return, stops being speculated.

Unknown costs: with no step measured at a batch size the policy speculates every proposal (so the first steps
measure ``c(B, e)``); with ``c(B, 0)`` unknown it speculates nothing (so the next step measures it); an extra-row
count not yet measured is interpolated from its neighbours (extrapolated beyond the largest). Estimates that say
"never" are re-tested: every ``PROBE_EVERY`` decoding steps at a batch size, the policy plans as if extra rows were
free, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PROBE_EVERY = 64  # decoding steps at one batch size between two plans that assume extra rows are free
EWMA_WEIGHT = 0.1  # weight of a new step time (log space) once a bucket has 10 samples; 1/n before
REQUEST_DECAY = 0.7  # a request's acceptance counts are multiplied by this before each new observation
GLOBAL_DECAY = 0.98
PRIOR_TRIED = 2.0  # the engine-wide rate's weight in a request's estimate, in tried proposals


def bucket(n: int) -> int:
    """Exact up to 8, then the next power of two: the cost table stays small for large batches."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


def expected_tokens(a: float, k: int) -> float:
    """Tokens a step emits in expectation with ``k`` proposals each accepted with probability ``a`` in turn."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class _Mean:
    """A moving average in log space: the mean of the first 1/EWMA_WEIGHT samples, then exponential."""

    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.value += (x - self.value) * max(EWMA_WEIGHT, 1.0 / self.n)


@dataclass(slots=True)
class _Shape:
    base: _Mean = field(default_factory=_Mean)  # log c(B, 0)
    ratio: dict[int, _Mean] = field(default_factory=dict)  # extra-row bucket -> log(c(B, e) / c(B, 0))
    steps: int = 0  # decoding steps seen at this batch size
    last_probe: int = 0


class StepCosts:
    """Measured wall time of decoding steps per batch-size bucket and extra rows (see the module's docstring)."""

    def __init__(self) -> None:
        self.shapes: dict[int, _Shape] = {}

    def observe(self, batch: int, extra: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        s = self.shapes.setdefault(bucket(batch), _Shape())
        s.steps += 1
        x = math.log(seconds)
        if extra == 0:
            s.base.add(x)
        elif s.base.n:  # a ratio needs the plain step's cost beside it
            s.ratio.setdefault(bucket(extra), _Mean()).add(x - s.base.value)

    def known(self, batch: int) -> bool:
        return bucket(batch) in self.shapes

    def base(self, batch: int) -> float | None:
        s = self.shapes.get(bucket(batch))
        return math.exp(s.base.value) if s is not None and s.base.n else None

    def ratio(self, batch: int, extra: int) -> float:
        """``c(B, e) / c(B, 0)``: measured, or interpolated in log space between measured neighbours (1 at e = 0),
        extrapolated from the last two beyond them; 1 when none is measured (optimistic, so it gets measured)."""
        if extra <= 0:
            return 1.0
        s = self.shapes.get(bucket(batch))
        if s is None or not s.ratio:
            return 1.0
        e = bucket(extra)
        m = s.ratio.get(e)
        if m is not None:
            return math.exp(m.value)
        points = [(0, 0.0), *sorted((k, m.value) for k, m in s.ratio.items())]
        i = next((j for j, (k, _) in enumerate(points) if k > e), len(points) - 1)  # beyond the last: extrapolate
        (lo, lo_v), (hi, hi_v) = points[i - 1], points[i]
        return math.exp(lo_v + (hi_v - lo_v) * (e - lo) / (hi - lo))

    def probe_due(self, batch: int) -> bool:
        s = self.shapes.get(bucket(batch))
        return s is not None and s.steps - s.last_probe >= PROBE_EVERY

    def probed(self, batch: int) -> None:
        s = self.shapes.get(bucket(batch))
        if s is not None:
            s.last_probe = s.steps


@dataclass(slots=True)
class Acceptance:
    """Decayed counts of proposals accepted and tried (a position is tried up to and including the first reject)."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, accepted: int, proposed: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + accepted + (1 if accepted < proposed else 0)

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.tried + prior_weight)


def choose(costs: StepCosts, batch: int, candidates: list[tuple[float, int]]) -> list[int]:
    """Proposals to verify per candidate ``(acceptance rate, proposals available)`` in a decoding step of ``batch``
    requests, maximising expected tokens per second of step (see the module's docstring)."""
    if not costs.known(batch):
        return [k for _, k in candidates]
    if costs.base(batch) is None:
        return [0] * len(candidates)
    ks = _best(costs, batch, candidates, free=False)
    if not any(ks) and costs.probe_due(batch):
        ks = _best(costs, batch, candidates, free=True)
        if any(ks):
            costs.probed(batch)
    return ks


def _best(costs: StepCosts, batch: int, candidates: list[tuple[float, int]], free: bool) -> list[int]:
    ks = [0] * len(candidates)
    gain, extra = 0.0, 0
    best = float(batch)  # expected tokens per unit of c(B, 0)
    for i in sorted(range(len(candidates)), key=lambda j: -candidates[j][0]):
        a, avail = candidates[i]
        pick = 0
        for k in range(1, avail + 1):
            r = 1.0 if free else costs.ratio(batch, extra + k)
            t = (batch + gain + expected_tokens(a, k) - 1.0) / r
            if t > best:
                best, pick = t, k
        if pick == 0:
            continue
        ks[i] = pick
        gain += expected_tokens(a, pick) - 1.0
        extra += pick
    return ks
