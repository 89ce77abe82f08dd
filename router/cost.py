"""The routing cost: explicit, configurable, and returned term by term with every decision.

For a request of ``R`` blocks (its prompt, rounded up) and a candidate worker ``w`` that already caches the
request's first ``overlap`` blocks, all in KV-block units::

    uncached       = max(R - overlap, 0)                                 blocks w must prefill for this request
    prefill_term   = prefill_weight · (w.prefill_tokens / block_size + uncached)   w's prefill backlog, incl. this
    decode_term    = decode_weight  · (w.decode_blocks + uncached)       KV blocks w holds, plus the new ones this needs
    queue_term     = queue_weight   · w.queue_depth                      requests already waiting on w
    adapter_term   = adapter_load_cost  if the request names a LoRA adapter w serves but has not loaded, else 0
    total          = prefill_term + decode_term + queue_term + adapter_term

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

The adapter term prefers workers that hold a request's LoRA adapter in memory: another worker that serves it must
read it from disk first (engine/lora/manager.py), charged as ``adapter_load_cost`` blocks of work, so a holder wins
unless it is busier by more than that. Workers that do not serve the adapter at all are never candidates. A request
of the base model has no adapter term (its breakdown carries 0 and its header leaves it out).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import numpy as np

from router.load import LoadTracker, WorkerId

VECTOR_MIN = 24  # from this many candidates on, score them as arrays (numpy's fixed cost beats a Python loop)
_Num = TypeVar("_Num", float, np.ndarray)

_HEADER_KEYS = ("w", "ov", "un", "p", "d", "q", "t")
_ADAPTER_HEADER_KEYS = ("w", "ov", "un", "p", "d", "q", "a", "t")  # a request of a LoRA adapter


@functools.cache
def _kernel() -> Any:
    """``router/cost_kernel.c`` built for this interpreter, or None: then the numpy path below runs."""
    from native.extension import load_python_extension

    return load_python_extension("router._cost_kernel", Path(__file__).with_name("cost_kernel.c"),
                                 ("-ffp-contract=off",))


@dataclass(slots=True, frozen=True)
class CostConfig:
    prefill_weight: float = 1.0
    decode_weight: float = 1.0
    queue_weight: float = 1.0
    temperature: float = 0.0
    block_size: int = 16
    # Blocks of work charged to a worker that must load the request's LoRA adapter from disk (it serves it, but the
    # adapter is not resident): reading and checking an adapter costs about as much as prefilling a few blocks.
    adapter_load_cost: float = 16.0

    def __post_init__(self) -> None:
        for name in ("prefill_weight", "decode_weight", "queue_weight", "temperature", "adapter_load_cost"):
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
    adapter_term: float = 0.0  # the LoRA adapter's load cost on this worker (included in ``total``)

    def as_header(self) -> str:
        """Compact ``x-tandem-route`` value, e.g. ``w=d-3;ov=12;un=52;p=60.0;d=80.0;q=1.0;t=141.0`` (with
        ``a=16.0`` before ``t`` when the adapter term is not 0)."""
        adapter = f"a={self.adapter_term!r};" if self.adapter_term else ""
        return (f"w={quote(self.worker_id, safe='')};ov={self.overlap_blocks};un={self.uncached_prefill_blocks};"
                f"p={self.prefill_term!r};d={self.decode_term!r};q={self.queue_term!r};{adapter}t={self.total!r}")

    @classmethod
    def from_header(cls, header: str) -> CostBreakdown:
        """Inverse of ``as_header`` (floats are written with ``repr``, so they round-trip exactly)."""
        parts = dict(item.split("=", 1) for item in header.split(";"))
        if tuple(parts) not in (_HEADER_KEYS, _ADAPTER_HEADER_KEYS):
            raise ValueError(f"not an x-tandem-route value: {header!r}")
        prefill, decode, queue, total = (float(parts[key]) for key in ("p", "d", "q", "t"))
        return cls(unquote(parts["w"]), int(parts["ov"]), int(parts["un"]), prefill, decode, queue, total,
                   float(parts.get("a", 0.0)))


# One candidate's terms, in CostBreakdown field order; the hot path builds these and CostBreakdowns only on demand.
# A request of a LoRA adapter has one more, the adapter term (``total`` stays at index 6 either way).
CostRow = tuple[WorkerId, int, int, float, float, float, float] | tuple[WorkerId, int, int, float, float, float,
                                                                        float, float]
# The overlap as KVIndex.match_depths gives it: (each candidate's index slot, -1 for none, from KVIndex.slots_of;
# the leading cached blocks per index slot). The many-candidate path takes this instead of a dict per hit worker.
SlotDepths = tuple[np.ndarray, np.ndarray]
Overlap = Mapping[WorkerId, int] | SlotDepths


@dataclass(slots=True, frozen=True)
class ScoredArrays:
    """Every candidate's terms as arrays, in candidate order (the vector path); ``rows`` turns them into CostRows."""

    candidates: Sequence[WorkerId]
    overlap: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    queue: np.ndarray
    total: np.ndarray
    request_blocks: int

    def row(self, i: int) -> CostRow:
        ov = int(self.overlap[i])
        return (self.candidates[i], ov, self.request_blocks - ov, float(self.prefill[i]), float(self.decode[i]),
                float(self.queue[i]), float(self.total[i]))

    def rows(self) -> tuple[CostRow, ...]:
        return tuple(self.row(i) for i in range(len(self.candidates)))


class CostModel:
    __slots__ = ("_pos", "_pos_key", "config")

    def __init__(self, config: CostConfig) -> None:
        self.config = config
        self._pos_key: list[WorkerId] = []
        self._pos: dict[WorkerId, int] = {}

    def terms(self, request_blocks: int, overlap: _Num, tokens: _Num, blocks: _Num,
              queued: _Num) -> tuple[_Num, _Num, _Num, _Num]:
        """The formula of the module docstring, on scalars or on arrays alike (``overlap`` already capped at the
        request; loads are the tracker's effective values, already >= 0): ``(prefill, decode, queue, total)``."""
        cfg = self.config
        uncached = request_blocks - overlap
        prefill = cfg.prefill_weight * (tokens * (1.0 / cfg.block_size) + uncached)
        decode = cfg.decode_weight * (blocks + uncached)
        queue = cfg.queue_weight * queued
        return prefill, decode, queue, prefill + decode + queue

    def score(self, candidates: Sequence[WorkerId], overlap_blocks: Mapping[WorkerId, int], request_blocks: int,
              load: LoadTracker) -> list[CostBreakdown]:
        """One breakdown per candidate, in candidate order."""
        return [CostBreakdown(*row) for row in self.rows(candidates, overlap_blocks, request_blocks, load)]

    def rows(self, candidates: Sequence[WorkerId], overlap_blocks: Mapping[WorkerId, int], request_blocks: int,
             load: LoadTracker, loading: Collection[WorkerId] | None = None) -> list[CostRow]:
        """``score`` as plain tuples, one Python step per candidate (the path for few candidates). ``loading``:
        for a request of a LoRA adapter, the candidates that would have to load it (the adapter term); None for a
        request of the base model (rows without the term)."""
        r = request_blocks
        terms = self.terms
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
                prefill, decode, queue, total = terms(r, overlap, 0, 0, 0)
            else:
                prefill, decode, queue, total = terms(r, overlap, record.prefill_tokens, record.decode_blocks,
                                                      record.queue_depth)
            append((worker, overlap, r - overlap, prefill, decode, queue, total))
        if loading is None:
            return out
        load_cost = self.config.adapter_load_cost
        adapter_rows: list[CostRow] = []
        for worker, overlap, uncached, prefill, decode, queue, total, *_ in out:
            adapter = load_cost if worker in loading else 0.0
            adapter_rows.append((worker, overlap, uncached, prefill, decode, queue, total + adapter, adapter))
        return adapter_rows

    def score_and_choose(self, candidates: list[WorkerId], overlap_blocks: Overlap,
                         request_blocks: int, load: LoadTracker, rng: random.Random,
                         native: bool = True) -> tuple[ScoredArrays, int]:
        """``score_arrays`` then ``choose_array``, as one native call when ``router/cost_kernel.c`` is built (the
        same terms bit for bit, the same rng draws); the numpy path otherwise or with ``native=False``.
        ``overlap_blocks``: a dict per hit worker, or ``SlotDepths``."""
        kernel = _kernel() if native else None
        by_slot = isinstance(overlap_blocks, tuple)
        if kernel is None or not (by_slot or isinstance(overlap_blocks, dict)):
            scored = self.score_arrays(candidates, overlap_blocks, request_blocks, load)
            return scored, self.choose_array(scored.total, request_blocks, rng)
        cfg = self.config
        table, slots = load.table_and_slots(candidates)
        out = np.empty((5, len(candidates)))
        u = rng.random() if cfg.temperature > 0.0 else 0.0
        where, overlap = overlap_blocks if by_slot else (self._positions(candidates), overlap_blocks)
        i = kernel.score(table, slots, where, overlap, request_blocks,
                         float(cfg.prefill_weight), float(cfg.decode_weight), float(cfg.queue_weight),
                         1.0 / cfg.block_size, float(cfg.temperature), u, out)
        total = out[4]
        if i < 0:  # exact ties at temperature 0: choose_array's own tie-break
            i = rng.choice(np.flatnonzero(total <= total.min()).tolist())
        return ScoredArrays(candidates, out[0], out[1], out[2], out[3], total, request_blocks), i

    def _positions(self, candidates: list[WorkerId]) -> dict[WorkerId, int]:
        if self._pos_key != candidates:
            self._pos = {w: i for i, w in enumerate(candidates)}
            self._pos_key = list(candidates)
        return self._pos

    def score_arrays(self, candidates: list[WorkerId], overlap_blocks: Overlap, request_blocks: int,
                     load: LoadTracker) -> ScoredArrays:
        """``rows`` for many candidates: the loads come as one gather, the overlaps are scattered in per hit worker
        (a dict reports only the workers that hold a prefix) or gathered by index slot (``SlotDepths``), and the
        formula runs once on arrays."""
        n = len(candidates)
        if isinstance(overlap_blocks, tuple):
            where, depths = overlap_blocks
            overlap = np.where(where >= 0, depths.take(np.maximum(where, 0)) if len(depths) else 0, 0)
            overlap = np.minimum(overlap.astype(np.float64), request_blocks)
            eff = load.gather(candidates)
            prefill, decode, queue, total = self.terms(request_blocks, overlap, eff[0], eff[1], eff[2])
            return ScoredArrays(candidates, overlap, prefill, decode, queue, total, request_blocks)
        positions = self._positions(candidates)
        overlap = np.zeros(n + 1)  # the last entry takes hits on workers that are not candidates, then is dropped
        if overlap_blocks:
            hits = len(overlap_blocks)
            where = np.fromiter(map(positions.get, overlap_blocks, repeat(n)), dtype=np.intp, count=hits)
            overlap[where] = np.fromiter(overlap_blocks.values(), dtype=np.float64, count=hits)
            np.minimum(overlap, request_blocks, out=overlap)
        overlap = overlap[:n]
        eff = load.gather(candidates)
        prefill, decode, queue, total = self.terms(request_blocks, overlap, eff[0], eff[1], eff[2])
        return ScoredArrays(candidates, overlap, prefill, decode, queue, total, request_blocks)

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

    def choose_array(self, totals: np.ndarray, request_blocks: int, rng: random.Random) -> int:
        """``choose`` on an array, drawing from ``rng`` exactly as ``choose`` does (one ``choice`` among exact ties
        at temperature 0, one ``random()`` against the cumulative weights otherwise)."""
        best = totals[totals.argmin()]  # not totals.min(): a reduction costs ~6x an argmin at this size
        temperature = self.config.temperature
        if temperature == 0.0:
            tied = np.flatnonzero(totals <= best)
            return int(tied[0]) if len(tied) == 1 else rng.choice(tied.tolist())
        inv = 1.0 / (max(request_blocks, 1) * temperature)
        cum = np.cumsum(np.exp((best - totals) * inv))
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        return min(i, len(totals) - 1)
