"""Speculative decoding in the engine's step: propose, verify in the same forward, keep the accepted tokens.

Per step, around the ordinary schedule → forward → sample:

1. :meth:`SpecDecoder.plan`: each scheduled request that is decoding (one new token, nothing else to compute) and
   whose sampling allows it gets up to K proposed tokens (n-gram lookup or a draft model), capped by its remaining
   ``max_tokens``, the context and the step's token budget. With ``adaptive`` (the default) the cost-aware policy
   (``policy.py``) then keeps 0..K of them per request: as many as maximise the step's expected tokens per second,
   from the engine's measured step times (``observe_step``) and the request's acceptance so far. Its KV slots for
   the kept extra positions are reserved (``allocate_slots``); a request that cannot get them simply is not
   speculated this step.
2. The model runner computes the request's last token plus its K proposals as one chunk of K+1 rows, over the
   paged KV cache, in the same forward as every other request, and returns the K+1 rows' logits.
3. :meth:`SpecDecoder.verify` accepts a prefix of the proposals and adds one token of the target's own
   (``rejection.py``): greedy output equals non-speculative decoding token for token; sampled output has the
   target's distribution.
4. :meth:`SpecDecoder.settle`: the request's computed length moves past the accepted tokens; the KV written for
   rejected positions lies beyond it (overwritten by the next step), and the blocks reserved only for them go back
   to the pool (``KVCacheManager.trim``), so block accounting is exactly that of a non-speculative run.

Back-off: a request whose verified proposals were all rejected sits out the next 2, 4, 8 ... (at most
``MAX_BACKOFF_STEPS``) steps, and is back to every step once one is accepted; on text that does not repeat itself
the proposer then costs a lookup now and then instead of K extra rows every step.

Not speculated: requests with penalties, logprobs, prompt logprobs or a grammar (their distribution at one
position depends on the tokens emitted before it in the same step, or they need per-token logprobs), and steps
where a request asks for prompt logprobs (their rows' offsets). A disaggregated decode engine speculates like a
colocated one once a request's KV has landed (its connector saves nothing per layer); a prefill worker is never
given speculation (it never decodes). A migrated request arrives at its new worker as a new request (prompt + the
tokens so far): no proposal, back-off or rejected slot's KV comes with it, since none of them outlives a step but
the back-off, which is held with its request (tests/test_spec_migration.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import NgramProposer
from engine.spec.policy import GLOBAL_DECAY, PRIOR_TRIED, REQUEST_DECAY, Acceptance, StepCosts, choose
from engine.spec.rejection import target_probs, verify_greedy, verify_sampled

MAX_BACKOFF_STEPS = 32


class Proposer(Protocol):
    def propose_batch(self, items: list[tuple[list[int], int]]) -> list[list[int]]: ...


class NgramBatch:
    """The n-gram proposer over a batch (one lookup per request)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config)

    def propose_batch(self, items: list[tuple[list[int], int]]) -> list[list[int]]:
        return [self.ngram.propose(ids, k) for ids, k in items]


@dataclass(slots=True)
class SpecStats:
    """Counters since start: steps with proposals, tokens proposed, proposals accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per speculated request-step: 1 (the target's own) plus the accepted proposals."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class _RequestSpec:
    """A request's speculation state: its proposals rejected in a row (steps with none accepted), the steps it
    still sits out, its acceptance counts (``policy.py``) and a proposal left unverified whose outcome its next
    tokens will show (its first position, its tokens). Held with the request it belongs to: a later request under
    the same id (a client's reused id, a request resent to this worker after a migration) starts afresh instead of
    inheriting it."""

    request: Request
    misses: int = 0
    skip: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)
    shadow: tuple[int, list[int]] | None = None


def speculable(req: Request) -> bool:
    p = req.params
    return (req.matcher is None and p.logprobs is None and p.prompt_logprobs is None and not p.needs_penalties)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, kv: KVCacheManager, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stats = SpecStats()
        self.drafts: dict[str, list[int]] = {}
        self._state: dict[str, _RequestSpec] = {}  # request id -> its back-off, acceptance and unverified proposal
        self.costs = StepCosts()
        self.acceptance = Acceptance()  # engine-wide: each request's prior
        self._step: tuple[int, int] | None = None  # this step's batch size and extra rows, when it only decodes

    def plan(self, sched: SchedulerOutput) -> dict[str, list[int]]:
        """Propose for this step's decoding requests, choose how many proposals each verifies (``policy.py``) and
        reserve their slots; request id -> proposed tokens."""
        self.drafts = {}
        self._step = None
        if any(r.params.prompt_logprobs is not None for r in sched.requests):
            return self.drafts
        budget = self.max_num_batched_tokens - sched.total_tokens
        decoding = True  # every request of the step decodes one token: its time goes into the cost table
        chosen: list[tuple[Request, int, _RequestSpec]] = []
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            if n != 1 or req.num_computed_tokens + 1 != req.num_tokens:
                decoding = False
                continue
            if budget <= 0 or not speculable(req):
                continue
            st = self._state.get(req.request_id)
            if st is None or st.request is not req:  # none yet, or an earlier request's under the same id
                st = self._state[req.request_id] = _RequestSpec(req)
            if st.shadow is not None:
                self._resolve_shadow(req, st)
            if st.skip:
                st.skip -= 1
                continue
            k = min(self.config.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1, budget)
            if k > 0:
                chosen.append((req, k, st))
                budget -= k
        if len(self._state) > 2 * len(sched.requests) + 64:  # forget finished requests' state
            live = {r.request_id for r in sched.requests}
            self._state = {r: b for r, b in self._state.items() if r in live}
        batch = len(sched.requests)
        adaptive = self.config.adaptive and decoding
        if adaptive and chosen and self.config.method == "draft":  # proposing costs a draft forward: ask first
            ks = choose(self.costs, batch, [(self._rate(st), k) for _, k, st in chosen])
            chosen = [(req, k, st) for (req, _, st), k in zip(chosen, ks, strict=True) if k > 0]
        extra = 0
        if chosen:
            proposals = [d[:k] for (_, k, _), d in zip(chosen, self.proposer.propose_batch(
                [(req.all_token_ids, k) for req, k, _ in chosen]), strict=True)]
            if adaptive and self.config.method != "draft" and any(proposals):
                ks = choose(self.costs, batch, [(self._rate(st) if d else 0.0, len(d))
                                                for (_, _, st), d in zip(chosen, proposals, strict=True)])
            else:
                ks = [len(d) for d in proposals]
            for (req, _, st), d, k in zip(chosen, proposals, ks, strict=True):
                if k < len(d) and st.shadow is None:  # not verified: the next tokens will show how it fared
                    st.shadow = (req.num_tokens, d)
                d = d[:k]
                if d and self.kv.allocate_slots(req, 1 + len(d)):
                    self.drafts[req.request_id] = d
                    extra += len(d)
        if decoding:
            self._step = (batch, extra)
        return self.drafts

    def observe_step(self, seconds: float) -> None:
        """The wall time of the step :meth:`plan` planned (its forward, verification and bookkeeping)."""
        if self._step is not None:
            self.costs.observe(self._step[0], self._step[1], seconds)
            self._step = None

    def _rate(self, st: _RequestSpec) -> float:
        return st.acceptance.rate(self.acceptance.rate(0.5, 1.0), PRIOR_TRIED)

    def _learn(self, st: _RequestSpec, accepted: int, proposed: int) -> None:
        st.acceptance.add(accepted, proposed, REQUEST_DECAY)
        self.acceptance.add(accepted, proposed, GLOBAL_DECAY)

    def _resolve_shadow(self, req: Request, st: _RequestSpec) -> None:
        """Count how much of an unverified proposal the request's own tokens since then matched, once known."""
        assert st.shadow is not None
        start, d = st.shadow
        emitted = req.all_token_ids[start : start + len(d)]
        n = 0
        while n < len(emitted) and emitted[n] == d[n]:
            n += 1
        if n < len(emitted) or n == len(d):
            self._learn(st, n, len(d))
            st.shadow = None

    def verify(self, req: Request, logits: torch.Tensor, generator: torch.Generator) -> list[int]:
        """The tokens ``req`` emits this step (1 to K+1) from the target's logits over its K+1 verified rows."""
        d = self.drafts[req.request_id]
        p = req.params
        if p.greedy:
            out = verify_greedy(logits, d, p)
        else:
            out = verify_sampled(target_probs(logits, p), d, None, req.generator or generator)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(d)
        self.stats.num_accepted_tokens += len(out) - 1
        st = self._state.get(req.request_id)
        if st is None or st.request is not req:  # none yet, or an earlier request's under the same id
            st = self._state[req.request_id] = _RequestSpec(req)
        self._learn(st, len(out) - 1, len(d))
        if len(out) > 1:
            st.misses = 0
        else:
            st.misses += 1
            st.skip = min(2 ** st.misses, MAX_BACKOFF_STEPS)
        return out

    def settle(self, req: Request, num_emitted: int) -> None:
        """After the engine appended ``num_emitted`` tokens to a live ``req`` (the scheduler already counted one as
        computed): the accepted proposals are computed too, their blocks published, the rest of the slots freed."""
        req.num_computed_tokens += num_emitted - 1
        self.kv.cache_computed(req)
        self.kv.trim(req, req.num_computed_tokens)


def build_proposer(config: SpeculativeConfig, draft: Callable[[], Proposer]) -> Proposer:
    """The configured proposer; ``draft`` builds the draft-model one (it needs an engine, which the caller has)."""
    return draft() if config.method == "draft" else NgramBatch(config)
