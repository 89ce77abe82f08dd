"""The routing cost: explicit, configurable, and returned term by term with every decision.

For a request of ``R`` blocks (its prompt, rounded up) and a candidate worker ``w`` that already caches the
request's first ``overlap`` blocks, all in KV-block units::

    uncached       = max(R - overlap, 0)                                 blocks w must prefill for this request
    prefill_term   = prefill_weight · (w.prefill_tokens / block_size + uncached)   w's prefill backlog, incl. this
    decode_term    = decode_weight  · (w.decode_blocks + uncached)       KV blocks w holds, plus the new ones this needs
    queue_term     = queue_weight   · w.queue_depth                      requests already waiting on w
    total          = prefill_term + decode_term + queue_term

This is Dynamo's documented ``prefill_load_scale · max(prefill_blocks − overlap, 0) + decode_blocks`` with the
worker's backlog made explicit and a queue term added (set ``queue_weight=0`` to drop it). Overlap saves prefill
compute and decode memory alike: cached blocks are shared (ref-counted) with the new request, so only the uncached
blocks are new KV on that worker. Counting the whole prompt there would charge the worker that holds a prefix for
holding it, and a load report taken while that prefix was in use would push the next hit elsewhere.

Picking: ``temperature == 0`` takes the cheapest worker; exact ties are broken by the rng, never by list order, so
router replicas with the same view do not all land on the first worker. ``temperature > 0`` samples
``softmax(-(total - best) / (R · temperature))``: cost differences are measured in units of the request's own length,
so the temperature is unit-free and unaffected by load that every worker carries alike (a min-max normalisation
would blow any difference up to 1; a ratio to the best total would shrink with the shared baseline). A worker whose
cost exceeds the best by ``temperature · R`` blocks is ``e`` times less likely. At ``temperature=0.1`` a worker
missing a cached prefix of half the request is ``e^5`` less likely, so a long cached prefix still wins, while
near-ties are spread, which is what keeps replicas that share load reports from herding.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from router.load import LoadTracker, WorkerId

_HEADER_KEYS = ("w", "ov", "un", "p", "d", "q", "t")


@dataclass(slots=True, frozen=True)
class CostConfig:
    prefill_weight: float = 1.0
    decode_weight: float = 1.0
    queue_weight: float = 1.0
    temperature: float = 0.0
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("prefill_weight", "decode_weight", "queue_weight", "temperature"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(slots=True, frozen=True)
class CostBreakdown:
    worker_id: WorkerId
    overlap_blocks: int
    uncached_prefill_blocks: int
    prefill_term: float
    decode_term: float
    queue_term: float
    total: float

    def as_header(self) -> str:
        """Compact ``x-tandem-route`` value, e.g. ``w=d-3;ov=12;un=52;p=60.0;d=80.0;q=1.0;t=141.0``."""
        return (f"w={quote(self.worker_id, safe='')};ov={self.overlap_blocks};un={self.uncached_prefill_blocks};"
                f"p={self.prefill_term!r};d={self.decode_term!r};q={self.queue_term!r};t={self.total!r}")

    @classmethod
    def from_header(cls, header: str) -> CostBreakdown:
        """Inverse of ``as_header`` (floats are written with ``repr``, so they round-trip exactly)."""
        parts = dict(item.split("=", 1) for item in header.split(";"))
        if tuple(parts) != _HEADER_KEYS:
            raise ValueError(f"not an x-tandem-route value: {header!r}")
        values = [unquote(parts["w"]), int(parts["ov"]), int(parts["un"])]
        values += [float(parts[key]) for key in _HEADER_KEYS[3:]]
        return cls(*values)


# One candidate's terms, in CostBreakdown field order; the hot path builds these and CostBreakdowns only on demand.
CostRow = tuple[WorkerId, int, int, float, float, float, float]


class CostModel:
    __slots__ = ("config",)

    def __init__(self, config: CostConfig) -> None:
        self.config = config

    def score(self, candidates: Sequence[WorkerId], overlap_blocks: Mapping[WorkerId, int], request_blocks: int,
              load: LoadTracker) -> list[CostBreakdown]:
        """One breakdown per candidate, in candidate order."""
        return [CostBreakdown(*row) for row in self.rows(candidates, overlap_blocks, request_blocks, load)]

    def rows(self, candidates: Sequence[WorkerId], overlap_blocks: Mapping[WorkerId, int], request_blocks: int,
             load: LoadTracker) -> list[CostRow]:
        """``score`` as plain tuples: the formula lives here only, so what is explained is what was scored."""
        cfg = self.config
        pw, dw, qw = cfg.prefill_weight, cfg.decode_weight, cfg.queue_weight
        per_token = 1.0 / cfg.block_size
        r = request_blocks
        overlap_of = overlap_blocks.get
        record_of = load.records.get
        out: list[CostRow] = []
        append = out.append
        for worker in candidates:
            overlap = overlap_of(worker, 0)
            if overlap > r:
                overlap = r
            record = record_of(worker)
            if record is None:
                prefill = pw * (r - overlap)
                decode = dw * (r - overlap)
                queue = 0.0
            else:
                tokens, blocks, queued = record.prefill_tokens, record.decode_blocks, record.queue_depth
                prefill = pw * ((tokens if tokens > 0 else 0) * per_token + r - overlap)
                decode = dw * ((blocks if blocks > 0 else 0) + r - overlap)
                queue = qw * (queued if queued > 0 else 0)
            append((worker, overlap, r - overlap, prefill, decode, queue, prefill + decode + queue))
        return out

    def pick(self, breakdowns: Sequence[CostBreakdown], rng: random.Random) -> tuple[CostBreakdown,
                                                                                   Sequence[CostBreakdown]]:
        """Choose one breakdown (see the module docstring for the rule). Returns it and the input."""
        if not breakdowns:
            raise ValueError("no candidates to pick from")
        first = breakdowns[0]
        i = self.choose([b.total for b in breakdowns], first.overlap_blocks + first.uncached_prefill_blocks, rng)
        return breakdowns[i], breakdowns

    def choose(self, totals: Sequence[float], request_blocks: int, rng: random.Random) -> int:
        """Index of the chosen total: argmin with rng tie-break, or the softmax of the module docstring."""
        best = min(totals)
        temperature = self.config.temperature
        if temperature == 0.0:
            tied = [i for i, t in enumerate(totals) if t <= best]
            return tied[0] if len(tied) == 1 else rng.choice(tied)
        inv = 1.0 / (max(request_blocks, 1) * temperature)
        exp = math.exp
        weights = [exp((best - t) * inv) for t in totals]
        return rng.choices(range(len(totals)), weights=weights)[0]
