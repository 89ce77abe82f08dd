"""The speculative decoder's bookkeeping without a model (engine/spec/decoder.py): slots reserved for proposals and
freed when they are rejected, and a request whose proposals were all rejected sits out 2, then 4 steps."""

from __future__ import annotations

import torch

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import SpecDecoder


class CountingProposer:
    def __init__(self) -> None:
        self.calls = 0

    def propose_batch(self, items: list[tuple[list[int], int]]) -> list[list[int]]:
        self.calls += 1
        return [[9] * k for _, k in items]


def _logits(rows: int, token: int) -> torch.Tensor:
    x = torch.zeros(rows, 16)
    x[:, token] = 1.0
    return x


def test_rejected_proposals_free_their_slots_and_back_the_request_off() -> None:
    pool = BlockPool(32)
    kv = KVCacheManager(pool, 4)
    proposer = CountingProposer()
    spec = SpecDecoder(SpeculativeConfig("ngram", 4), proposer, kv, max_model_len=64, max_num_batched_tokens=64)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0), block_size=4)
    assert kv.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    free0 = pool.num_free_blocks  # 1 block for 3 tokens

    def step() -> bool:
        """One decode step as the engine runs it; True if the request was speculated."""
        assert kv.allocate_slots(req, 1)
        sched = SchedulerOutput([req], [1])
        drafts = spec.plan(sched)
        req.num_computed_tokens += 1
        if not drafts:
            req.append_token(5)
            return False
        assert len(kv.block_ids("r")) == kv.blocks_needed(req.num_computed_tokens + 4)  # slots for 4 proposals
        tokens = spec.verify(req, _logits(5, 5), torch.Generator())
        assert tokens == [5]  # the target wanted 5, not the proposed 9
        req.append_token(5)
        spec.settle(req, len(tokens))
        assert len(kv.block_ids("r")) == kv.blocks_needed(req.num_computed_tokens)
        return True

    req.append_token(5)
    pattern = [step() for _ in range(10)]
    assert pattern == [True, False, False, True, False, False, False, False, True, False]
    assert proposer.calls == 3
    assert spec.stats.num_drafts == 3 and spec.stats.num_accepted_tokens == 0
    kv.free(req)
    assert pool.num_free_blocks == free0 + 1


def test_a_later_request_under_the_same_id_does_not_inherit_the_back_off() -> None:
    """A request that backed off, then ended (aborted, or migrated away), leaves its back-off behind; a new request
    under the same id (a client's reused id, a resend to this worker) is speculated on its first decode step."""
    pool = BlockPool(32)
    kv = KVCacheManager(pool, 4)
    proposer = CountingProposer()
    spec = SpecDecoder(SpeculativeConfig("ngram", 4), proposer, kv, max_model_len=64, max_num_batched_tokens=64)

    def decode_step(req: Request) -> bool:
        assert kv.allocate_slots(req, 1)
        drafts = spec.plan(SchedulerOutput([req], [1]))
        req.num_computed_tokens += 1
        if drafts:
            spec.verify(req, _logits(5, 5), torch.Generator())  # the proposals (9s) are all rejected
        req.append_token(5)
        if drafts:
            spec.settle(req, 1)
        return bool(drafts)

    def fresh() -> Request:
        req = Request("same", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0), block_size=4)
        assert kv.allocate_slots(req, 3)
        req.num_computed_tokens = 3
        req.append_token(5)
        return req

    first = fresh()
    assert [decode_step(first) for _ in range(2)] == [True, False]  # rejected, then sitting out
    kv.free(first)
    second = fresh()
    assert decode_step(second)
    kv.free(second)
    assert pool.num_free_blocks == 32
