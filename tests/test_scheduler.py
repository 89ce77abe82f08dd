"""Tests for :mod:`engine.scheduler`, driven without a model.

Each simulated step is ``schedule()`` → ``finish_step(out)`` → one fake sampled token for every request whose
``num_computed_tokens`` reached ``num_tokens`` → ``finish(..., FINISHED_LENGTH)`` at ``max_tokens`` or
``max_model_len``, which is what :class:`engine.llm_engine.LLMEngine` does around the forward pass.
"""

from __future__ import annotations

import contextlib

import pytest

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def _scheduler(num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 256) -> Scheduler:
    """A scheduler over a fresh pool with block_size 4."""
    kv = KVCacheManager(BlockPool(num_blocks), BS)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv, max_model_len)


def _request(rid: str, num_prompt: int, max_tokens: int = 4, first: int = 0) -> Request:
    """A greedy request whose prompt is ``first, first+1, ...`` (block_size 4)."""
    return Request(rid, list(range(first, first + num_prompt)), SamplingParams(max_tokens=max_tokens,
                                                                               temperature=0.0), block_size=BS)


def _step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, advance, sample a fake token, finish at max_tokens."""
    out = s.schedule()
    s.finish_step(out)
    for req in out.requests:
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(1000 + req.num_output_tokens)
            if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= s.max_model_len:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
    return out


def _plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, new tokens) for each scheduled request, in batch order."""
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)]


def _run_to_completion_and_check(s: Scheduler, max_steps: int = 200) -> None:
    """Step until nothing is unfinished, then assert every block is back and no block table is left."""
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        _step(s)
    assert not s.has_unfinished()
    assert s.kv.block_tables == {}
    s.kv.pool.check_accounting()


# ---- token budget and ordering ---------------------------------------------------------------------------------


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    """A 40-token prompt with a 16-token budget runs as chunks 16, 16, 8, then decodes one token a step."""
    s = _scheduler(budget=16)
    req = _request("a", 40, max_tokens=3)
    s.add(req)
    plans = [_plan(_step(s)) for _ in range(5)]
    assert plans == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)], [("a", 1)]]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [1000, 1001, 1002]
    _run_to_completion_and_check(s)


def test_partial_chunks_produce_no_token() -> None:
    """Only the chunk that reaches the end of the prompt yields a sampled token."""
    s = _scheduler(budget=16)
    req = _request("a", 40, max_tokens=2)
    s.add(req)
    _step(s)
    _step(s)
    assert req.num_computed_tokens == 32
    assert req.output_token_ids == []
    _step(s)
    assert req.output_token_ids == [1000]
    _run_to_completion_and_check(s)


def test_waiting_prompts_share_the_remaining_budget_in_arrival_order() -> None:
    """Two 10-token prompts with budget 16 are scheduled as 10 and 6 in the same step."""
    s = _scheduler(budget=16)
    s.add(_request("a", 10))
    s.add(_request("b", 10, first=100))
    assert _plan(_step(s)) == [("a", 10), ("b", 6)]
    assert _plan(_step(s)) == [("a", 1), ("b", 4)]
    _run_to_completion_and_check(s)


def test_decodes_are_scheduled_before_new_prefills() -> None:
    """Running decodes take their one token each before a newly arrived prompt gets the rest of the budget."""
    s = _scheduler(budget=16)
    s.add(_request("a", 8))
    s.add(_request("b", 4, first=50))
    _step(s)
    s.add(_request("c", 40, first=100))
    assert _plan(_step(s)) == [("a", 1), ("b", 1), ("c", 14)]
    _run_to_completion_and_check(s)


def test_new_prompt_waits_while_decodes_use_the_whole_budget() -> None:
    """With budget 2 and two running decodes, a waiting prompt is not scheduled at all."""
    s = _scheduler(budget=2)
    s.add(_request("a", 1, max_tokens=5))
    s.add(_request("b", 1, max_tokens=5, first=50))
    _step(s)
    s.add(_request("c", 4, first=100))
    assert _plan(_step(s)) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"]
    _run_to_completion_and_check(s)


def test_max_num_seqs_caps_the_running_batch() -> None:
    """With max_num_seqs=2 a third request waits until one of the first two finishes."""
    s = _scheduler(max_num_seqs=2)
    s.add(_request("a", 4, max_tokens=1))
    s.add(_request("b", 4, max_tokens=3, first=50))
    s.add(_request("c", 4, max_tokens=1, first=100))
    assert _plan(_step(s)) == [("a", 4), ("b", 4)]
    assert s.requests["c"].status == RequestStatus.WAITING
    # a finished after its first token, so c joins b.
    assert _plan(_step(s)) == [("b", 1), ("c", 4)]
    _run_to_completion_and_check(s)


def test_waiting_queue_is_first_come_first_served() -> None:
    """A head-of-queue prompt that does not fit blocks smaller prompts behind it (no skipping)."""
    s = _scheduler(num_blocks=6)
    s.add(_request("a", 12, max_tokens=8))  # 3 blocks
    _step(s)
    s.add(_request("b", 16, first=100))  # needs 4 blocks, 3 free
    s.add(_request("c", 2, first=200))  # would fit in 1
    assert _plan(_step(s)) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    _run_to_completion_and_check(s)


# ---- preemption ------------------------------------------------------------------------------------------------


def test_preemption_evicts_the_most_recently_arrived_running_request() -> None:
    """When a decode needs a block and none is free, the newest running request is preempted and requeued first."""
    s = _scheduler(num_blocks=6)
    a, b, c = _request("a", 8), _request("b", 8, first=100), _request("c", 7, first=200)
    for r in (a, b, c):
        s.add(r)
    s.add(_request("d", 4, first=300))
    assert _plan(_step(s)) == [("a", 8), ("b", 8), ("c", 7)]
    assert s.kv.pool.num_free_blocks == 0
    assert s.kv.block_ids("c") == [4, 5]

    out = _step(s)
    assert _plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0
    assert c.num_preemptions == 1
    assert "c" not in s.kv.block_tables
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert s.running == [a, b]
    # c's blocks were freed tail first, so a took 5 and b took 4.
    assert s.kv.block_ids("a") == [0, 1, 5]
    assert s.kv.block_ids("b") == [2, 3, 4]
    _run_to_completion_and_check(s)


def test_no_new_prefill_is_admitted_in_a_step_that_preempted() -> None:
    """In a step that preempted a request, waiting requests are not scheduled even if budget remains."""
    s = _scheduler(num_blocks=4)
    s.add(_request("a", 8))
    s.add(_request("b", 8, first=100))
    _step(s)
    s.add(_request("c", 1, first=200))
    out = _step(s)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert _plan(out) == [("a", 1)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    _run_to_completion_and_check(s)


def test_request_that_cannot_grow_preempts_itself_when_it_is_the_newest() -> None:
    """If the request needing a block is itself the newest, it is preempted and nothing behind it runs."""
    s = _scheduler(num_blocks=8)
    a, b = _request("a", 12, max_tokens=3), _request("b", 16, max_tokens=2, first=100)
    s.add(a)
    s.add(b)
    assert _plan(_step(s)) == [("a", 12), ("b", 16)]
    assert s.kv.pool.num_free_blocks == 1
    out = _step(s)
    assert _plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert s.waiting[0] is b
    assert b.num_tokens == 17 and b.num_computed_tokens == 0
    _run_to_completion_and_check(s)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    """A preempted request is rescheduled with its still-cached prompt blocks attached; only the rest is computed."""
    s = _scheduler(num_blocks=8)
    a, b = _request("a", 12, max_tokens=3), _request("b", 16, max_tokens=2, first=100)
    s.add(a)
    s.add(b)
    _step(s)
    b_blocks = s.kv.block_ids("b")
    assert b_blocks == [3, 4, 5, 6]
    out = _step(s)
    assert out.preempted == [b]
    assert s.kv.pool.free_queue.ids() == [6, 5, 4, 3]
    # Step 3: a decodes and finishes; b still cannot get a 5th block beside its 4 evictable hits.
    assert _plan(_step(s)) == [("a", 1)]
    assert a.is_finished
    # Step 4: b's four prompt blocks are found in the cache; only its one output token is recomputed.
    out = s.schedule()
    assert _plan(out) == [("b", 1)]
    assert b.num_computed_tokens == 16
    assert s.kv.block_ids("b")[:4] == b_blocks
    assert b.num_cached_tokens == 0  # first admission had no hits; the resume does not overwrite it
    s.finish_step(out)
    b.append_token(1001)
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [1000, 1001]
    _run_to_completion_and_check(s)


def test_preempted_request_keeps_its_output_tokens() -> None:
    """Preemption recomputes prompt plus output: the request's output tokens are not dropped."""
    s = _scheduler(num_blocks=4)
    a, b = _request("a", 8, max_tokens=6), _request("b", 7, max_tokens=2, first=100)
    s.add(a)
    s.add(b)
    _step(s)
    assert b.output_token_ids == [1000]
    out = _step(s)
    assert out.preempted == [b]
    assert b.num_tokens == 8
    assert b.output_token_ids == [1000]
    _run_to_completion_and_check(s)
    assert b.output_token_ids == [1000, 1001]


# ---- abort, remote KV, admission -------------------------------------------------------------------------------


def test_abort_frees_running_and_waiting_requests() -> None:
    """abort finishes running and waiting requests as FINISHED_ABORTED and returns their blocks."""
    s = _scheduler(max_num_seqs=1)
    run, wait = _request("run", 9, max_tokens=50), _request("wait", 5, first=100)
    s.add(run)
    s.add(wait)
    _step(s)
    assert s.kv.block_ids("run") == [0, 1, 2]
    aborted = s.abort(["run", "wait", "unknown"])
    assert aborted == [run, wait]
    assert run.status == wait.status == RequestStatus.FINISHED_ABORTED
    assert run.status.finish_reason == "abort"
    assert not s.has_unfinished()
    assert s.abort(["run"]) == []
    _run_to_completion_and_check(s)


def test_finish_is_idempotent() -> None:
    """Finishing an already finished request changes neither its status nor the pool."""
    s = _scheduler()
    req = _request("a", 4)
    s.add(req)
    _step(s)
    s.finish(req, RequestStatus.FINISHED_STOPPED)
    s.finish(req, RequestStatus.FINISHED_ABORTED)
    assert req.status == RequestStatus.FINISHED_STOPPED
    _run_to_completion_and_check(s)


def test_remote_kv_request_is_not_scheduled_until_ready() -> None:
    """A request added with add_remote holds its blocks but is skipped until remote_kv_ready."""
    s = _scheduler()
    req = _request("r", 9, max_tokens=3)
    req.append_token(1000)  # the prefill worker sampled the first token
    assert s.add_remote(req, 9)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert s.kv.block_ids("r") == [0, 1, 2]
    s.add(_request("local", 4, max_tokens=1, first=100))
    assert _plan(_step(s)) == [("local", 4)]
    assert _step(s).requests == []
    assert s.has_unfinished()

    s.remote_kv_ready("r", 9)
    assert req.status == RequestStatus.RUNNING
    assert _plan(_step(s)) == [("r", 1)]
    assert s.kv.block_ids("r") == [0, 1, 2]
    _run_to_completion_and_check(s)
    assert req.output_token_ids == [1000, 1001, 1002]


def test_add_remote_without_room_returns_false_and_registers_nothing() -> None:
    """add_remote returns False when the blocks are not there, and the request is unknown to the scheduler."""
    s = _scheduler(num_blocks=2)
    req = _request("r", 12)
    assert not s.add_remote(req, 12)
    assert not s.has_unfinished()
    assert "r" not in s.requests
    _run_to_completion_and_check(s)


def test_abort_frees_a_request_waiting_for_remote_kv() -> None:
    """Aborting a WAITING_FOR_REMOTE_KV request returns its reserved blocks."""
    s = _scheduler()
    assert s.add_remote(_request("r", 9), 9)
    assert s.kv.pool.num_free_blocks == 29
    (req,) = s.abort(["r"])
    assert req.status == RequestStatus.FINISHED_ABORTED
    _run_to_completion_and_check(s)


def test_reserved_remote_blocks_are_not_prefix_hits_before_the_kv_lands() -> None:
    """Blocks reserved for remote KV are neither prefix-cache hits nor STORED events until remote_kv_ready."""
    s = _scheduler()
    remote = _request("r", 9)
    remote.append_token(1000)
    assert s.add_remote(remote, 9)
    events = s.kv.pool.take_events()
    local = _request("local", 9)  # same tokens, arrives while the transfer is in flight
    s.add(local)
    _step(s)
    try:
        assert events is None
        assert local.num_cached_tokens == 0
    finally:
        s.remote_kv_ready("r", 9)
        _run_to_completion_and_check(s)


def test_remote_request_is_never_scheduled_with_zero_new_tokens() -> None:
    """remote_kv_ready covering every token must not lead to a scheduled entry with zero new tokens."""
    s = _scheduler()
    req = _request("r", 9)
    assert s.add_remote(req, 9)
    with contextlib.suppress(ValueError):
        s.remote_kv_ready("r", 9)
    out = s.schedule()
    s.abort(["r"])
    _run_to_completion_and_check(s)
    assert all(n > 0 for n in out.num_new_tokens)


def test_prompt_that_fills_max_model_len_is_refused() -> None:
    """A prompt of max_model_len tokens leaves no room to generate and is refused; one token shorter is accepted."""
    s = _scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=16"):
        s.add(_request("a", 16))
    s.add(_request("b", 15))
    _run_to_completion_and_check(s)
    assert "a" not in s.requests


def test_prompt_larger_than_the_whole_cache_is_refused() -> None:
    """A prompt needing more blocks than the pool has (counting one generated token) is refused."""
    s = _scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="4 in all"):
        s.add(_request("a", 16))
    s.add(_request("b", 15, max_tokens=1))
    _run_to_completion_and_check(s)


def test_duplicate_request_id_is_refused() -> None:
    """Adding a second request with a live request's id raises ValueError."""
    s = _scheduler()
    s.add(_request("a", 4))
    with pytest.raises(ValueError, match="duplicate"):
        s.add(_request("a", 4))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_remote(_request("a", 4), 4)
    _run_to_completion_and_check(s)


def test_request_outgrowing_the_whole_cache_does_not_livelock() -> None:
    """A request allowed by max_model_len but larger than the cache must finish rather than stall forever."""
    s = _scheduler(num_blocks=4, max_model_len=64)  # 16 tokens of KV in all
    req = _request("a", 10, max_tokens=40)
    s.add(req)
    stalled = 0
    for _ in range(100):
        if not s.has_unfinished():
            break
        if not _step(s):
            stalled += 1
    s.abort(["a"])
    _run_to_completion_and_check(s)
    assert stalled == 0
    assert req.status == RequestStatus.FINISHED_LENGTH
