"""The cost-aware speculation policy (engine/spec/policy.py) and the decoder that applies it (engine/spec/decoder.py):
a request whose proposals are never accepted stops being speculated (bar a re-test every PROBE_EVERY steps), one
whose proposals are always accepted keeps K while extra rows are cheap and none when they cost as much as they
return, proposals not verified still teach acceptance, block accounting stays exact, and the engine's greedy output
under the adaptive policy equals decoding without speculation.

The decoder-level tests drive plan → verify → settle as the engine does, with the step times the cost model sees
given by the test (a made-up cost per extra row), so the policy's decisions do not depend on this host's load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import SpecDecoder
from engine.spec.policy import PROBE_EVERY, StepCosts, choose, expected_tokens

TARGET = 5  # the token the "target model" emits at every position


class Guess:
    """Proposes ``token`` k times (the target's own token: always accepted; another: never)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose_batch(self, items: list[tuple[list[int], int]]) -> list[list[int]]:
        return [[self.token] * k for _, k in items]


def _logits(rows: int) -> torch.Tensor:
    x = torch.zeros(rows, 16)
    x[:, TARGET] = 1.0
    return x


def _run(proposal: int, per_row: float, steps: int, adaptive: bool = True, k: int = 4) -> tuple[list[int], SpecDecoder]:
    """``steps`` single-sequence decode steps whose time is 10 ms x (1 + per_row x extra rows); the number of
    proposals verified at each step. Checks after every step that the request holds exactly the blocks its
    computed tokens need, and at the end that every block is back in the pool."""
    pool = BlockPool(512)
    kv = KVCacheManager(pool, 4)
    spec = SpecDecoder(SpeculativeConfig("ngram", k, adaptive=adaptive), Guess(proposal), kv, max_model_len=4096,
                       max_num_batched_tokens=64)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2000, temperature=0.0), block_size=4)
    assert kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.append_token(TARGET)
    verified = []
    for _ in range(steps):
        assert kv.allocate_slots(req, 1)
        drafts = spec.plan(SchedulerOutput([req], [1]))
        req.num_computed_tokens += 1
        d = drafts.get("r", [])
        if d:
            tokens = spec.verify(req, _logits(len(d) + 1), torch.Generator())
            for t in tokens:
                req.append_token(t)
            spec.settle(req, len(tokens))
        else:
            req.append_token(TARGET)
        spec.observe_step(0.010 * (1 + per_row * len(d)))
        verified.append(len(d))
        assert len(kv.block_ids("r")) == kv.blocks_needed(req.num_computed_tokens)
        assert req.num_computed_tokens == req.num_tokens - 1
    kv.free(req)
    assert pool.num_free_blocks == 512
    pool.check_accounting()
    return verified, spec


def test_a_request_whose_proposals_are_never_accepted_stops_being_speculated() -> None:
    """Fixed K keeps re-trying on the back-off's schedule (every 33 steps at the cap); adaptive stops after the
    first rejections and re-tests only every PROBE_EVERY steps, while its unverified proposals keep its rate low."""
    adaptive, spec = _run(proposal=9, per_row=0.1, steps=300)
    fixed, _ = _run(proposal=9, per_row=0.1, steps=300, adaptive=False)
    assert sum(1 for v in fixed if v) >= 12
    # the first steps measure (nothing known, the plain step, the extra rows), then only the re-tests
    assert [i for i, v in enumerate(adaptive) if v and i >= 10] == list(range(PROBE_EVERY, 300, PROBE_EVERY))
    assert spec.stats.num_accepted_tokens == 0
    st = spec._state["r"]
    assert st.acceptance.tried > 0 and st.acceptance.accepted == 0
    assert spec._rate(st) < 0.1


def test_a_request_whose_proposals_are_always_accepted_keeps_k_while_rows_are_cheap() -> None:
    verified, spec = _run(proposal=TARGET, per_row=0.1, steps=60)
    # step 1: no cost known yet, K verified; step 2: the plain step's cost is measured; then K every step
    assert verified[0] == 4 and verified[1] == 0
    assert verified[2:] == [4] * 58
    assert spec.stats.num_accepted_tokens == spec.stats.num_draft_tokens


def test_no_speculation_where_extra_rows_cost_what_they_return() -> None:
    """Each extra row costs a whole step: K accepted tokens for K+1 steps' time never beats a plain step, even at
    full acceptance; the policy still re-tests every PROBE_EVERY steps."""
    verified, _ = _run(proposal=TARGET, per_row=1.0, steps=200)
    assert verified[:2] == [4, 0]
    # the first steps measure what 1..K extra rows cost (4 are measured, fewer interpolated), then only re-tests
    assert sum(1 for v in verified[:10] if v) <= 1 + 4
    assert [i for i, v in enumerate(verified) if v and i >= 10] == list(range(PROBE_EVERY, 200, PROBE_EVERY))


def test_choose_picks_k_from_acceptance_and_measured_costs() -> None:
    costs = StepCosts()
    assert choose(costs, 1, [(0.5, 4)]) == [4]  # nothing measured at this batch size: every proposal
    costs.observe(1, 4, 0.012)  # a ratio needs the plain cost: ignored
    assert choose(costs, 1, [(0.5, 4)]) == [0]  # the plain step's cost unknown: measure it next
    costs.observe(1, 0, 0.010)
    assert choose(costs, 1, [(0.9, 4)]) == [4]  # extra rows not measured yet: assumed free
    for e in (1, 4):
        costs.observe(1, e, 0.010 * (1 + 0.25 * e))  # ratios 1.25 and 2.0; 2 and 3 interpolated
    assert costs.ratio(1, 2) == pytest.approx(1.25 ** (2 / 3) * 2.0 ** (1 / 3))
    assert costs.ratio(1, 7) == pytest.approx(2.0 * 1.6 ** (3 / 3))  # beyond the largest: the last two's slope
    assert choose(costs, 1, [(0.0, 4)]) == [0]
    assert choose(costs, 1, [(1.0, 4)]) == [4]  # 5 tokens for 2x the time
    a = 0.4  # E(a, 1) = 1.4 > 1.25, E(a, 4) = 1.66 < 2
    assert expected_tokens(a, 1) > 1.25 and expected_tokens(a, 4) < 2.0
    assert choose(costs, 1, [(a, 4)]) == [1]


def test_choose_in_a_batch_serves_the_most_accepting_requests_first() -> None:
    costs = StepCosts()
    costs.observe(4, 0, 0.010)
    for e in range(1, 9):
        costs.observe(4, e, 0.010 * (1 + 0.05 * e))
    assert choose(costs, 4, [(0.0, 4), (0.95, 4), (0.02, 4), (0.9, 4)]) == [0, 4, 0, 4]


def test_greedy_output_is_unchanged_under_the_adaptive_policy(checkpoint: Callable[[str], Path]) -> None:
    """The engine with the policy on (its own measured step times, whatever they are) prints the tokens decoding
    without speculation prints, in a batch and one request at a time, and leaks no block."""
    model = checkpoint("llama")
    prompts = ["a b c d a b c d a b c", "The server runs the model. The server runs", "hello", "def f(x): return x"]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    base = LLM(str(model), block_size=4, num_kv_blocks=256, num_threads=1).generate(prompts, greedy)
    llm = LLM(str(model), block_size=4, num_kv_blocks=256, num_threads=1,
              speculative=SpeculativeConfig("ngram", 4, ngram_min=1))
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == [o.token_ids for o in base]
    for p, b in zip(prompts, base, strict=True):
        assert llm.generate([p], greedy)[0].token_ids == b.token_ids
    spec = llm.engine.spec
    assert spec is not None and spec.stats.num_drafts > 0 and spec.costs.shapes
    llm.engine.check_block_accounting()
