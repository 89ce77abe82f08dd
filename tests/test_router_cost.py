"""Cost function, picking and the selector: prefix affinity, balance, no herding, explainability, drain."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.block_hash import extra_keys_for, hash_blocks
from router.cost import VECTOR_MIN, CostBreakdown, CostConfig, CostModel
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.selector import NoWorkerAvailable, Reason, Selector

BS = 16
KEYS = extra_keys_for(model="tiny")
WORKERS = ["w0", "w1", "w2", "w3"]


def make_selector(temperature: float = 0.0, seed: int = 0, **weights: float) -> Selector:
    return Selector(KVIndex(100_000), LoadTracker(), CostConfig(temperature=temperature, block_size=BS, **weights),
                    BS, KEYS, seed=seed)


def cache_on(selector: Selector, worker: str, tokens: list[int]) -> None:
    hashes = hash_blocks(tokens, BS, KEYS)
    seq = selector.index.seq(worker)
    selector.index.apply(worker, 0 if seq is None else seq + 1, hashes, bytes([1] * len(hashes)))


def test_repeated_long_prefix_goes_to_the_worker_holding_it() -> None:
    """A cached 48-block prefix outweighs a moderately busier worker: every repeat lands where the KV is."""
    selector = make_selector(temperature=0.05, seed=1)
    prefix = list(range(48 * BS))
    cache_on(selector, "w2", prefix)
    for w in WORKERS:
        selector.load.update_from_report(w, waiting=0, running=2, active_tokens=0, used_blocks=100, total_blocks=1000)
    selector.load.update_from_report("w2", waiting=1, running=3, active_tokens=4 * BS, used_blocks=108,
                                     total_blocks=1000)
    for i in range(50):
        decision = selector.select([*prefix, *range(10_000 + i * 64, 10_000 + i * 64 + 64)], WORKERS)
        assert decision.worker_id == "w2" and decision.overlap_blocks == 48
        assert decision.reason is Reason.PREFIX_HIT and decision.request_blocks == 52
        assert decision.prefill_tokens == 4 * BS
        selector.release(decision)


def test_zero_prefix_reuse_balances_dispatched_prefill_tokens_within_20_percent() -> None:
    """1000 unique prompts of random lengths, released in random order: each worker gets within 20% of the mean."""
    rng = random.Random(7)
    selector = make_selector(seed=7)
    dispatched = dict.fromkeys(WORKERS, 0)
    inflight = []
    next_token = 0
    for _ in range(1000):
        n = rng.randint(8, 1500)
        decision = selector.select(range(next_token, next_token + n), WORKERS)
        next_token += n
        assert decision.overlap_blocks == 0
        dispatched[decision.worker_id] += decision.prefill_tokens
        inflight.append(decision)
        while len(inflight) > rng.randint(4, 48):
            selector.release(inflight.pop(rng.randrange(len(inflight))))
    for decision in inflight:
        selector.release(decision)
    mean = sum(dispatched.values()) / len(WORKERS)
    assert all(abs(tokens - mean) <= 0.2 * mean for tokens in dispatched.values()), dispatched
    assert selector.booked() == 0
    assert all(record.effective() == (0, 0, 0) for record in selector.load)


def test_concurrent_selectors_fed_identical_reports_do_not_always_pick_the_same_worker() -> None:
    """Two routers sharing nothing but the same load reports spread near-ties instead of herding onto one worker."""
    a, b = make_selector(temperature=0.2, seed=11), make_selector(temperature=0.2, seed=12)
    picks_a: list[str] = []
    picks_b: list[str] = []
    for round_ in range(200):
        for selector in (a, b):
            for i, w in enumerate(WORKERS):
                active = 1000 + 40 * i + (round_ % 3) * 10
                selector.load.update_from_report(w, waiting=0, running=1, active_tokens=active, used_blocks=200,
                                                 total_blocks=1000)
        prompt = range(round_ * 512, round_ * 512 + 512)
        for selector, picks in ((a, picks_a), (b, picks_b)):
            decision = selector.select(prompt, WORKERS)
            picks.append(decision.worker_id)
            selector.release(decision)  # completed before the next round's reports
    assert sum(x != y for x, y in zip(picks_a, picks_b, strict=True)) >= 40
    assert picks_a.count("w0") > picks_a.count("w3")  # still prefers the cheaper worker


def test_exact_ties_are_broken_by_the_rng_not_by_list_order() -> None:
    """With temperature 0 and identical idle workers, picks vary with the seed and are not all the first worker."""
    breakdowns = make_selector().cost.score(WORKERS, {}, 8, LoadTracker())
    model = CostModel(CostConfig(temperature=0.0, block_size=BS))
    rng = random.Random(5)
    picks = {model.pick(breakdowns, rng)[0].worker_id for _ in range(100)}
    assert picks == set(WORKERS)


def test_breakdown_total_is_the_sum_of_its_terms_and_header_round_trips() -> None:
    """Every breakdown adds up, and its x-tandem-route value parses back to the same fields, odd worker ids too."""
    load = LoadTracker()
    load.update_from_report("w;1=x", waiting=3, running=2, active_tokens=100, used_blocks=40, total_blocks=500)
    load.on_dispatch("w2", prefill_tokens=37, decode_blocks=5)
    model = CostModel(CostConfig(prefill_weight=1.5, decode_weight=0.25, queue_weight=2.0, block_size=BS))
    breakdowns = model.score(["w;1=x", "w2", "w3"], {"w;1=x": 6, "w2": 50}, 10, load)
    for b in breakdowns:
        assert b.total == pytest.approx(b.prefill_term + b.decode_term + b.queue_term)
        assert b.overlap_blocks + b.uncached_prefill_blocks == 10
        assert CostBreakdown.from_header(b.as_header()) == b
    first = breakdowns[0]
    assert first.prefill_term == pytest.approx(1.5 * (100 / BS + 4))
    assert first.decode_term == pytest.approx(0.25 * (40 + 4)) and first.queue_term == pytest.approx(6.0)
    assert breakdowns[1].overlap_blocks == 10  # overlap never exceeds the request
    with pytest.raises(ValueError):
        CostBreakdown.from_header("w=a;t=1.0")


def test_draining_worker_is_never_chosen_even_when_it_holds_the_prefix() -> None:
    """Drain excludes a worker outright; with nothing left to choose the selector raises NoWorkerAvailable."""
    selector = make_selector(temperature=0.5, seed=3)
    prefix = list(range(32 * BS))
    cache_on(selector, "w1", prefix)
    selector.load.set_draining("w1")
    for i in range(200):
        decision = selector.select([*prefix, i], WORKERS)
        assert decision.worker_id != "w1" and all(b.worker_id != "w1" for b in decision.breakdowns)
    for w in WORKERS:
        selector.load.set_draining(w)
    with pytest.raises(NoWorkerAvailable):
        selector.select(prefix, WORKERS)
    with pytest.raises(NoWorkerAvailable):
        selector.select(prefix, [])


def test_temperature_zero_picks_the_argmin() -> None:
    """Temperature 0 always returns the lowest total; the decision explains itself with reason and header."""
    selector = make_selector(temperature=0.0)
    for i, w in enumerate(WORKERS):
        selector.load.update_from_report(w, waiting=0, running=1, active_tokens=[500, 90, 300, 700][i],
                                         used_blocks=50, total_blocks=1000)
    decision = selector.select(range(64), WORKERS)
    assert decision.worker_id == "w1" and decision.reason is Reason.LOAD
    assert decision.chosen.total == min(b.total for b in decision.breakdowns)
    assert decision.as_header().startswith("r=load;w=w1;")


def test_release_undoes_the_booking_once_and_reports_combine_with_bookings_by_max() -> None:
    """Booking shows up at once, release (or prefill_done then release) undoes it exactly once; a report can
    neither erase in-flight bookings nor be driven below what the worker measured."""
    selector = make_selector()
    decision = selector.select(range(100), ["w0"])
    record = selector.load.get("w0")
    assert record is not None and decision.reason is Reason.SINGLE_CANDIDATE
    assert record.effective() == (100, 7, 1)
    selector.prefill_done(decision)
    assert record.effective() == (0, 7, 0)
    selector.release(decision)
    selector.release(decision)
    assert record.effective() == (0, 0, 0) and selector.booked() == 0
    inflight = selector.select(range(50), ["w0"])
    selector.load.update_from_report("w0", waiting=2, running=3, active_tokens=10, used_blocks=20, total_blocks=64)
    assert record.effective() == (50, 20, 2)  # own 50 prefill tokens in flight outweigh the report's 10
    selector.release(inflight)
    assert record.effective() == (10, 20, 2)  # now the report speaks
    selector.load.update_from_report("w0", waiting=0, running=0, active_tokens=0, used_blocks=0, total_blocks=64)
    assert record.effective() == (0, 0, 0)


def test_configs_reject_invalid_values() -> None:
    """Config is validated with ValueError: negative weights, NaN temperature, block size mismatch."""
    with pytest.raises(ValueError):
        CostConfig(prefill_weight=-1.0)
    with pytest.raises(ValueError):
        CostConfig(temperature=float("nan"))
    with pytest.raises(ValueError):
        CostConfig(block_size=0)
    with pytest.raises(ValueError):
        Selector(KVIndex(10), LoadTracker(), CostConfig(block_size=32), BS)


def test_array_scoring_equals_the_row_loop_and_draws_the_same_picks() -> None:
    """The vector path (many candidates; numpy, and the native kernel when it builds) computes the same terms as
    the per-candidate loop, bit for bit, and, fed an rng in the same state, chooses the same worker at temperature
    0 and above; workers with no record, hits on non-candidates and overlaps beyond the request are handled
    alike."""
    rng = random.Random(11)
    for trial in range(40):
        n = rng.randint(VECTOR_MIN, 300)
        workers = [f"w{i}" for i in range(n)]
        load = LoadTracker()
        for w in rng.sample(workers, n * 3 // 4):  # a quarter never reported nor dispatched
            load.update_from_report(w, waiting=rng.randint(0, 9), running=1, active_tokens=rng.randint(0, 4000),
                                    used_blocks=rng.randint(0, 900), total_blocks=1000)
        for w in rng.sample(workers, n // 5):
            load.on_dispatch(w, rng.randint(0, 500), rng.randint(0, 40))
        r = rng.randint(1, 80)
        overlap = {w: rng.randint(1, 100) for w in rng.sample(workers, rng.randint(0, n // 3))}
        overlap["not-a-candidate"] = 7
        for temperature in (0.0, 0.05, 1.0):
            weights = {"queue_weight": 0.5 + trial % 3, "prefill_weight": (1.0, 0.7, 2.3)[trial % 3],
                       "decode_weight": (1.0, 1.9)[trial % 2]}
            model = CostModel(CostConfig(temperature=temperature, block_size=BS, **weights))
            rows = model.rows(workers, overlap, r, load)
            scored = model.score_arrays(workers, overlap, r, load)
            assert scored.rows() == tuple(rows)
            a, b = random.Random(trial), random.Random(trial)
            for _ in range(20):
                assert model.choose_array(scored.total, r, a) == model.choose([row[6] for row in rows], r, b)
            # router/cost_kernel.c (when built): the same terms bit for bit and the same picks from the same draws.
            c, d = random.Random(trial), random.Random(trial)
            for _ in range(20):
                native, i = model.score_and_choose(workers, overlap, r, load, c)
                reference, j = model.score_and_choose(workers, overlap, r, load, d, native=False)
                assert native.rows() == reference.rows() == tuple(rows) and i == j
            # The same overlap as KVIndex.match_depths gives it (index slots in another order than the candidates,
            # some candidates unknown to the index): the same terms and picks, natively and in numpy.
            by_slot = _as_slot_depths(rng, workers, overlap)
            c, d = random.Random(trial), random.Random(trial)
            for _ in range(20):
                native, i = model.score_and_choose(workers, by_slot, r, load, c)
                reference, j = model.score_and_choose(workers, by_slot, r, load, d, native=False)
                assert native.rows() == reference.rows() == tuple(rows) and i == j


def _as_slot_depths(rng: random.Random, workers: list[str], overlap: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """``overlap`` as (each worker's index slot or -1, depth per slot): slots shuffled, with room for non-candidates."""
    known = [w for w in workers if w in overlap or rng.random() < 0.5]
    slots = list(range(len(known) + 5))
    rng.shuffle(slots)
    slot_of = dict(zip(known, slots, strict=False))
    depths = np.zeros(len(slots), dtype=np.int32)
    for w, s in slot_of.items():
        depths[s] = overlap.get(w, 0)
    depths[slots[-1]] = 7  # a hit on a worker that is not a candidate
    return np.array([slot_of.get(w, -1) for w in workers], dtype=np.intp), depths


def test_selector_vector_path_books_like_the_row_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selectors over 64 workers, the second forced onto rows, agree decision by decision (worker, overlap,
    reason and breakdowns), and the tracker's array follows dispatches, releases and a removed worker's slot."""
    import router.selector as selector_mod

    workers = [f"w{i}" for i in range(64)]
    selectors = [make_selector(temperature=0.1, seed=4) for _ in range(2)]
    prefix = list(range(20 * BS))
    decisions: list[list[object]] = [[], []]
    for k, sel in enumerate(selectors):
        for w in workers[::8]:
            cache_on(sel, w, prefix)
        if k:
            monkeypatch.setattr(selector_mod, "VECTOR_MIN", 10**9)
        for i in range(60):
            d = sel.select([*prefix[: (i % 20 + 1) * BS], *range(9000 + i * 50, 9000 + i * 50 + 40)], workers)
            decisions[k].append((d.worker_id, d.overlap_blocks, d.reason, d.breakdowns, d.chosen))
            if i % 3 == 0:
                sel.release(d)
        assert isinstance(d.scored, tuple) == bool(k)
    assert decisions[0] == decisions[1]
    load = selectors[0].load
    eff = load.gather(workers)
    for i, w in enumerate(workers):
        rec = load.get(w)
        assert tuple(eff[:, i]) == (rec.effective() if rec is not None else (0, 0, 0))
    gone = next(w for w in workers if load.get(w) is not None)
    load.remove(gone)
    assert tuple(load.gather([gone])[:, 0]) == (0.0, 0.0, 0.0)
    load.on_dispatch("newcomer", 16, 1)  # takes the freed slot, starting from its own load only
    assert tuple(load.gather(["newcomer", gone])[:, 0]) == (16.0, 1.0, 1.0)


def test_native_cost_kernel_is_built_where_native_code_is() -> None:
    """Where a compiler and Python's headers exist (here and in CI) the selector's array path is the C kernel."""
    from native.build import compiler, enabled
    from router.cost import _kernel

    if not enabled() or compiler() is None:
        pytest.skip("native code disabled or no compiler")
    assert _kernel() is not None
