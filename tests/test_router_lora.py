"""The router's side of LoRA adapters, in-process: the cost function's adapter term (a worker holding the adapter
wins, another that serves it is the fall-back, and the breakdown and the x-tandem-route header show the term), the
adapter in the block hash (a prefix cached under one adapter matches only that adapter, with the keys the workers'
engine uses), and a request's ``model`` naming an adapter (or nothing served: a 404 naming it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.block_hash import extra_keys_for, hash_blocks
from engine.tokenizer import Tokenizer
from router.api_error import APIError
from router.cost import VECTOR_MIN, CostBreakdown, CostConfig
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.openai_protocol import parse_request
from router.selector import Reason, Selector

BS = 16
KEYS = extra_keys_for(model="tiny")
WORKERS = ["w0", "w1", "w2", "w3"]


def make_selector(**config: float) -> Selector:
    return Selector(KVIndex(100_000), LoadTracker(), CostConfig(block_size=BS, **config), BS, KEYS, seed=0)


def even_load(selector: Selector, workers: list[str]) -> None:
    for w in workers:
        selector.load.update_from_report(w, waiting=0, running=1, active_tokens=0, used_blocks=40, total_blocks=1000)


def test_the_worker_holding_the_adapter_wins_and_the_breakdown_shows_the_adapter_term() -> None:
    selector = make_selector(adapter_load_cost=16.0)
    even_load(selector, WORKERS)
    decision = selector.select(range(64), WORKERS, lora="a", holders=["w2"])
    assert decision.worker_id == "w2" and decision.reason is Reason.LOAD
    by_worker = {b.worker_id: b for b in decision.breakdowns}
    assert {w: b.adapter_term for w, b in by_worker.items()} == {"w0": 16.0, "w1": 16.0, "w2": 0.0, "w3": 16.0}
    for b in by_worker.values():
        assert b.total == b.prefill_term + b.decode_term + b.queue_term + b.adapter_term
    assert by_worker["w0"].total - by_worker["w2"].total == 16.0
    assert ";a=" not in decision.as_header()  # the holder pays no adapter term
    selector.release(decision)


def test_a_worker_that_must_load_the_adapter_is_the_fall_back_when_the_holder_is_busy() -> None:
    selector = make_selector(adapter_load_cost=16.0)
    even_load(selector, ["w0", "w1"])
    selector.load.update_from_report("w1", waiting=3, running=4, active_tokens=40 * BS, used_blocks=80,
                                     total_blocks=1000)  # the holder is busier by far more than 16 blocks
    decision = selector.select(range(64), ["w0", "w1"], lora="a", holders=["w1"])
    assert decision.worker_id == "w0"
    chosen = decision.chosen
    assert chosen.adapter_term == 16.0 and ";a=16.0;t=" in decision.as_header()
    assert CostBreakdown.from_header(chosen.as_header()) == chosen
    base = selector.select(range(64), ["w0", "w1"])  # a base-model request: no adapter term, the old header
    assert all(b.adapter_term == 0.0 for b in base.breakdowns) and ";a=" not in base.as_header()
    assert CostBreakdown.from_header(base.chosen.as_header()) == base.chosen


def test_many_candidates_score_the_adapter_term_too() -> None:
    workers = [f"w{i}" for i in range(VECTOR_MIN + 4)]
    selector = make_selector()
    even_load(selector, workers)
    decision = selector.select(range(64), workers, lora="a", holders=[workers[7]])
    assert decision.worker_id == workers[7]
    assert sum(b.adapter_term > 0 for b in decision.breakdowns) == len(workers) - 1


def test_a_prefix_cached_under_an_adapter_matches_only_that_adapter() -> None:
    selector = make_selector()
    even_load(selector, WORKERS)
    assert selector.keys_for("a") == extra_keys_for(model="tiny", lora="a")  # what the workers' engine hashes with
    assert selector.keys_for(None) == KEYS
    prompt = list(range(40 * BS))
    hashes = hash_blocks(prompt, BS, selector.keys_for("a"))
    selector.index.apply("w3", 1, hashes, bytes([1] * len(hashes)))
    hit = selector.select([*prompt, 7], WORKERS, lora="a", holders=WORKERS)
    assert hit.worker_id == "w3" and hit.overlap_blocks == 40 and hit.reason is Reason.PREFIX_HIT
    for other in (selector.select([*prompt, 7], WORKERS), selector.select([*prompt, 7], WORKERS, lora="b",
                                                                          holders=WORKERS)):
        assert max(b.overlap_blocks for b in other.breakdowns) == 0


def test_cost_config_refuses_a_negative_adapter_load_cost() -> None:
    with pytest.raises(ValueError, match="adapter_load_cost"):
        CostConfig(adapter_load_cost=-1.0)


def test_model_names_an_adapter_or_gets_a_404_naming_it(checkpoint: Callable[[str], Path]) -> None:
    tok = Tokenizer(checkpoint("llama"))
    body = {"model": "a", "prompt": "Hello"}
    assert parse_request(body, False, tok, "tiny", 256, 512, adapters={"a", "b"}).lora == "a"
    assert parse_request({**body, "model": "tiny"}, False, tok, "tiny", 256, 512, adapters={"a"}).lora == ""
    with pytest.raises(APIError) as e:
        parse_request({**body, "model": "c"}, False, tok, "tiny", 256, 512, adapters={"a", "b"})
    assert e.value.status == 404 and e.value.param == "model"
    assert "'c' does not exist" in e.value.message and "'a', 'b'" in e.value.message
    with pytest.raises(APIError) as e:
        parse_request(body, False, tok, "tiny", 256, 512)  # no adapter served
    assert e.value.status == 404 and "'a' does not exist" in e.value.message


def test_dispatch_narrows_both_tiers_to_the_adapter_and_its_content() -> None:
    """Decode candidates serve the adapter; prefill candidates serve the same content (hash) as the chosen decode
    worker, else the request runs colocated; an adapter no worker serves is a 503 (the gateway 404s unknown ones)."""
    from router.dispatch import DisaggConfig, Dispatcher, DispatchError
    from router.pool import Worker, WorkerPool

    pool = WorkerPool([])
    for wid, role, loras in (("d1", "decode", {"a": "h1"}), ("d2", "decode", {}), ("p1", "prefill", {"a": "h2"}),
                             ("p2", "prefill", {"a": "h1"}), ("p3", "prefill", {})):
        pool.workers[wid] = Worker(wid, role=role, worker_id=wid, healthy=True, loras=loras,
                                   resident_loras=frozenset(loras))
    index, load = KVIndex(1000), LoadTracker()
    dispatcher = Dispatcher(pool, Selector(index, load, CostConfig(block_size=BS), BS, KEYS),
                            Selector(index, load, CostConfig(block_size=BS), BS, KEYS),
                            DisaggConfig(min_uncached_tokens=64))
    long = list(range(200))
    plan = dispatcher.plan(long, set(), lora="a")
    assert (plan.mode, plan.decode.worker_id, plan.prefill and plan.prefill.worker_id) == ("disaggregated", "d1", "p2")
    assert plan.lora == "a"
    plan = dispatcher.plan(long, {"p2"}, lora="a")  # p1 holds other content under the name: not a candidate
    assert (plan.mode, plan.reason, plan.decode.worker_id) == ("colocated", "no_prefill_worker", "d1")
    with pytest.raises(DispatchError) as e:
        dispatcher.plan(long, set(), lora="zz")
    assert e.value.status == 503 and "'zz'" in e.value.message
    base = dispatcher.plan(long, set())  # the base model: every worker is a candidate
    assert base.mode == "disaggregated" and base.lora == ""
