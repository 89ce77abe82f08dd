"""Worker selection: hash → match → score → pick → book, and the matching release.

One decision::

    token ids ──hash_blocks──► block hashes ──KVIndex.match (few candidates) / match_depths (many)──► overlap
              ──CostModel.rows / score_and_choose (non-draining candidates)──► terms ──choose──► chosen
              ──LoadTracker.on_dispatch(chosen)──► Decision          ...later: prefill_done / release(Decision)

The dispatch is booked before ``select`` returns, so the next decision (this router's next request, even one being
decided concurrently on the same event loop) already sees the chosen worker as busier. The selector remembers which
decisions are still booked, so releasing twice, or releasing an unknown decision, changes nothing.

Hashes come from ``engine.block_hash`` (the one function workers use too), with the same ``extra_keys`` (model, LoRA,
cache salt) the workers use; a mismatch there would silently turn every lookup into a miss. A request of a LoRA
adapter hashes with the adapter appended to the model's keys (``extra_keys_for(lora=NAME)``, as the worker's engine
builds them), so it matches only prefixes cached under that adapter, and its cost carries the adapter term for the
candidates that do not hold the adapter (router/cost.py): scored as rows, whatever the number of candidates.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from engine.block_hash import extra_keys_for, hash_blocks
from router.cost import VECTOR_MIN, CostBreakdown, CostConfig, CostModel, CostRow, Overlap, ScoredArrays
from router.kv_index import KVIndex
from router.load import LoadTracker, WorkerId


class NoWorkerAvailable(RuntimeError):
    """No candidate worker can take the request (none given, or every one is draining)."""


class Reason(StrEnum):
    """Why the chosen worker won; the label of the ``tandem_router_decisions`` metric."""

    SINGLE_CANDIDATE = "single_candidate"
    PREFIX_HIT = "prefix_hit"  # the winner holds the longest cached prefix among the candidates
    LOAD = "load"  # no prefix advantage: the winner is the least loaded (or was sampled near it)


@dataclass(slots=True, frozen=True)
class Decision:
    worker_id: WorkerId
    scored: tuple[CostRow, ...] | ScoredArrays  # every candidate's terms (as rows, or as arrays for many)
    request_blocks: int  # prompt length in blocks, rounded up
    overlap_blocks: int  # the chosen worker's cached leading blocks
    reason: Reason
    prefill_tokens: int  # uncached prompt tokens booked on the worker
    decode_blocks: int  # KV blocks booked on the worker
    decision_id: int
    chosen_index: int

    @property
    def rows(self) -> tuple[CostRow, ...]:
        """Every candidate's terms, in candidate order (built from the arrays on demand)."""
        scored = self.scored
        return scored if isinstance(scored, tuple) else scored.rows()

    @property
    def breakdowns(self) -> tuple[CostBreakdown, ...]:
        """Every candidate's cost breakdown, in candidate order (built on demand: logging, debugging, tests)."""
        return tuple(CostBreakdown(*row) for row in self.rows)

    @property
    def chosen(self) -> CostBreakdown:
        scored = self.scored
        row = scored[self.chosen_index] if isinstance(scored, tuple) else scored.row(self.chosen_index)
        return CostBreakdown(*row)

    def as_header(self) -> str:
        """``x-tandem-route`` value: the reason, then the chosen worker's breakdown."""
        return f"r={self.reason.value};{self.chosen.as_header()}"


class Selector:
    __slots__ = ("_booked", "_next_id", "block_size", "cost", "extra_keys", "index", "load", "rng")

    def __init__(self, index: KVIndex, load: LoadTracker, cost_config: CostConfig, block_size: int,
                 extra_keys: tuple[str, ...] = (), seed: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if cost_config.block_size != block_size:
            raise ValueError(f"cost_config.block_size={cost_config.block_size} != block_size={block_size}")
        self.index = index
        self.load = load
        self.cost = CostModel(cost_config)
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.rng = random.Random(seed)
        self._booked: dict[int, bool] = {}  # decision id -> prefill still booked
        self._next_id = 0

    def keys_for(self, lora: str | None) -> tuple[str, ...]:
        """The block hash's extra keys of a request of ``lora`` (None: the base model), as the workers build them."""
        return self.extra_keys + extra_keys_for(lora=lora) if lora else self.extra_keys

    def select(self, token_ids: Sequence[int], workers: Sequence[WorkerId], lora: str | None = None,
               holders: Collection[WorkerId] = ()) -> Decision:
        """Choose a worker for a prompt and book the request on it. ``lora``: the request's adapter (every one of
        ``workers`` serves it); ``holders``: those of them that hold it loaded (the others pay the adapter term)."""
        hashes = hash_blocks(token_ids, self.block_size, self.keys_for(lora))
        loading = None if lora is None else [w for w in workers if w not in holders]
        return self.select_hashed(hashes, len(token_ids), workers, loading)

    def select_hashed(self, block_hashes: Sequence[int], num_tokens: int, workers: Sequence[WorkerId],
                      loading: Collection[WorkerId] | None = None) -> Decision:
        """``select`` for a caller that already hashed the prompt's full blocks. ``workers`` must be distinct.
        ``loading``: for a request of a LoRA adapter, the workers that would have to load it (None: base model)."""
        load = self.load
        draining = load.draining
        candidates = [w for w in workers if w not in draining] if draining else workers
        if not candidates:
            raise NoWorkerAvailable(f"no worker can take the request: {len(workers)} given, all draining"
                                    if workers else "no worker can take the request: none registered")
        request_blocks = -(-num_tokens // self.block_size)
        scored: tuple[CostRow, ...] | ScoredArrays
        if len(candidates) >= VECTOR_MIN and loading is None:
            names = candidates if isinstance(candidates, list) else list(candidates)
            index = self.index
            by_slot: Overlap = (index.slots_of(names), index.match_depths(block_hashes)[0]) if block_hashes else {}
            scored, i = self.cost.score_and_choose(names, by_slot, request_blocks, load, self.rng)
            worker, chosen_overlap = candidates[i], int(scored.overlap[i])
            best_overlap = int(scored.overlap.max())
        else:
            overlap = self.index.match(block_hashes) if block_hashes else {}
            scored = tuple(self.cost.rows(candidates, overlap, request_blocks, load, loading))
            # One candidate is the choice: no draw (the softmax of one is certain).
            i = 0 if len(scored) == 1 else self.cost.choose([row[6] for row in scored], request_blocks, self.rng)
            worker, chosen_overlap = scored[i][0], scored[i][1]
            best_overlap = max(row[1] for row in scored)
        if len(candidates) == 1:
            reason = Reason.SINGLE_CANDIDATE
        elif chosen_overlap and chosen_overlap >= best_overlap:
            reason = Reason.PREFIX_HIT
        else:
            reason = Reason.LOAD
        prefill_tokens = max(num_tokens - chosen_overlap * self.block_size, 0)
        new_blocks = request_blocks - chosen_overlap  # cached blocks are shared, not new KV
        load.on_dispatch(worker, prefill_tokens, new_blocks)
        self._next_id += 1
        self._booked[self._next_id] = True
        return Decision(worker, scored, request_blocks, chosen_overlap, reason, prefill_tokens, new_blocks,
                        self._next_id, i)

    def prefill_done(self, decision: Decision) -> None:
        """The prompt is prefilled (first token seen): release its prefill tokens and its queue slot."""
        if self._booked.get(decision.decision_id):
            self._booked[decision.decision_id] = False
            self.load.on_complete(decision.worker_id, decision.prefill_tokens, 0, left_queue=True)

    def release(self, decision: Decision) -> None:
        """The request ended (or failed): undo whatever of its booking is still held."""
        prefill_booked = self._booked.pop(decision.decision_id, None)
        if prefill_booked is None:
            return
        self.load.on_complete(decision.worker_id, decision.prefill_tokens if prefill_booked else 0,
                              decision.decode_blocks, left_queue=prefill_booked)

    def booked(self) -> int:
        """Decisions booked and not yet released."""
        return len(self._booked)
