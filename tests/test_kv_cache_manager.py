"""Tests for :mod:`engine.kv_cache_manager`: block tables, prefix-cache hits and all-or-nothing allocation."""

from __future__ import annotations

import pytest

from engine.block_pool import STORED, BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def _manager(num_blocks: int = 8, enable_prefix_caching: bool = True) -> KVCacheManager:
    """A manager over a fresh pool with block_size 4."""
    return KVCacheManager(BlockPool(num_blocks, enable_prefix_caching), BS)


def _request(rid: str, tokens: list[int], extra_keys: tuple[str, ...] = ()) -> Request:
    """A greedy request with the given prompt and block_size 4."""
    return Request(rid, tokens, SamplingParams(temperature=0.0), extra_keys=extra_keys, block_size=BS)


def _prefill(kv: KVCacheManager, req: Request) -> None:
    """Allocate the whole prompt (no prefix hits) and mark it computed."""
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens


def test_block_aligned_prompt_gets_exactly_its_blocks() -> None:
    """An 8-token prompt with block_size 4 takes 2 blocks, the first two of a fresh pool."""
    kv = _manager()
    req = _request("a", list(range(8)))
    assert kv.allocate_slots(req, 8)
    assert kv.block_ids("a") == [0, 1]
    assert kv.pool.num_free_blocks == 6


def test_unaligned_prompt_gets_a_partial_last_block() -> None:
    """A 9-token prompt takes 3 blocks; a 3-token prompt takes 1."""
    kv = _manager()
    assert kv.allocate_slots(_request("a", list(range(9))), 9)
    assert kv.allocate_slots(_request("b", list(range(100, 103))), 3)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("b") == [3]
    assert [kv.blocks_needed(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_decode_takes_a_new_block_only_when_the_last_one_is_full() -> None:
    """Growing a 9-token request one token at a time adds a block at tokens 13 and 17, never otherwise."""
    kv = _manager()
    req = _request("a", list(range(9)))
    _prefill(kv, req)
    sizes = []
    for t in range(8):
        req.append_token(500 + t)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        sizes.append(len(kv.block_ids("a")))
    # After appending token t the request has 10+t tokens.
    assert sizes == [3, 3, 3, 4, 4, 4, 4, 5]
    assert kv.block_ids("a") == [0, 1, 2, 3, 4]


def test_allocation_publishes_only_full_blocks_to_the_prefix_cache() -> None:
    """Allocating a 9-token prompt publishes its 2 full blocks under the request's block hashes, not the partial one."""
    kv = _manager()
    req = _request("a", list(range(9)))
    assert kv.allocate_slots(req, 9)
    table = kv.block_tables["a"]
    assert [kv.pool.lookup(h) for h in req.block_hashes] == table[:2]
    assert table[2].block_hash is None
    batch = kv.pool.take_events()
    assert batch is not None and list(batch) == [(STORED, h) for h in req.block_hashes]


def test_cache_computed_publishes_a_block_filled_by_a_generated_token() -> None:
    """A block completed by an appended output token is published once its tokens are computed."""
    kv = _manager()
    req = _request("a", [1, 2, 3])
    _prefill(kv, req)
    req.append_token(4)
    assert len(req.block_hashes) == 1
    assert kv.pool.lookup(req.block_hashes[0]) is None
    req.num_computed_tokens = 4
    kv.cache_computed(req)
    assert kv.pool.lookup(req.block_hashes[0]) is kv.block_tables["a"][0]


def test_computed_blocks_are_the_longest_cached_prefix_in_whole_blocks() -> None:
    """A prompt sharing 2 full blocks with a finished one gets those 2 blocks back, in order."""
    kv = _manager()
    first = _request("a", list(range(10)))
    _prefill(kv, first)
    a_ids = kv.block_ids("a")
    kv.free(first)

    shares_two = _request("b", [*range(8), 77, 78, 79])
    assert [b.block_id for b in kv.get_computed_blocks(shares_two)] == a_ids[:2]
    shares_one = _request("c", [*range(4), 99, 5, 6, 7, 8, 9])
    assert [b.block_id for b in kv.get_computed_blocks(shares_one)] == a_ids[:1]
    shares_none = _request("d", [42, *range(1, 10)])
    assert kv.get_computed_blocks(shares_none) == []


def test_fully_cached_prompt_leaves_its_last_block_to_compute() -> None:
    """A prompt whose every block is cached gets one block fewer, so at least one token is computed."""
    kv = _manager()
    first = _request("a", list(range(12)))
    _prefill(kv, first)
    kv.free(first)
    same = _request("b", list(range(12)))
    hits = kv.get_computed_blocks(same)
    assert len(hits) == 2
    assert same.num_tokens - len(hits) * BS == 4
    one_more = _request("c", list(range(13)))
    assert len(kv.get_computed_blocks(one_more)) == 3


def test_single_block_prompt_never_gets_a_hit() -> None:
    """A prompt of exactly one cached block gets no hits: its only block holds the token to compute."""
    kv = _manager()
    first = _request("a", [1, 2, 3, 4, 5])
    _prefill(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(_request("b", [1, 2, 3, 4])) == []


def test_different_extra_keys_get_no_prefix_hits() -> None:
    """The same tokens under a different model / salt do not hit each other's blocks."""
    kv = _manager()
    first = _request("a", list(range(9)), extra_keys=("model=x",))
    _prefill(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(_request("b", list(range(9)), extra_keys=("model=y",))) == []
    assert len(kv.get_computed_blocks(_request("c", list(range(9)), extra_keys=("model=x",)))) == 2


def test_prefix_caching_disabled_finds_no_computed_blocks() -> None:
    """With prefix caching off, get_computed_blocks is always empty."""
    kv = _manager(enable_prefix_caching=False)
    first = _request("a", list(range(9)))
    _prefill(kv, first)
    kv.free(first)
    assert kv.get_computed_blocks(_request("b", list(range(9)))) == []


def test_allocate_with_hits_attaches_them_before_new_blocks() -> None:
    """Hits lead the block table, gain a reference and leave the free queue; new blocks follow."""
    kv = _manager(num_blocks=6)
    first = _request("a", list(range(8)))
    _prefill(kv, first)
    kv.free(first)
    assert kv.pool.free_queue.ids() == [2, 3, 4, 5, 1, 0]
    req = _request("b", [*range(8), 50, 51, 52, 53, 54])
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - 8, hits)
    assert kv.block_ids("b") == [0, 1, 2, 3]
    assert [b.ref_cnt for b in kv.block_tables["b"]] == [1, 1, 1, 1]
    assert kv.pool.free_queue.ids() == [4, 5]


def test_attaching_hits_to_a_request_that_holds_blocks_is_refused() -> None:
    """Prefix hits can only be attached to a request with no block table yet."""
    kv = _manager()
    first = _request("a", list(range(8)))
    _prefill(kv, first)
    kv.free(first)
    req = _request("b", list(range(12)))
    assert kv.allocate_slots(req, 1)
    with pytest.raises(ValueError, match="without blocks"):
        kv.allocate_slots(req, 4, kv.get_computed_blocks(req))


def test_allocation_short_of_blocks_returns_false_and_changes_nothing() -> None:
    """When the pool is short, allocate_slots returns False with no table, no ref change and no event."""
    kv = _manager(num_blocks=4)
    holder = _request("a", list(range(12)))
    _prefill(kv, holder)
    kv.pool.take_events()
    free_before = kv.pool.free_queue.ids()
    req = _request("b", list(range(100, 108)))
    assert not kv.allocate_slots(req, 8)
    assert "b" not in kv.block_tables
    assert kv.pool.free_queue.ids() == free_before
    assert kv.pool.take_events() is None
    # A running request that cannot grow keeps exactly the blocks it had.
    holder.append_token(7)
    holder.append_token(8)
    assert kv.allocate_slots(holder, 1)  # token 13 takes the last free block
    holder.num_computed_tokens += 1
    for t in range(4):
        holder.append_token(9 + t)
    table_before = kv.block_ids("a")
    assert not kv.allocate_slots(holder, 5)
    assert kv.block_ids("a") == table_before


def test_allocation_counts_evictable_hits_as_unavailable() -> None:
    """Hits that are themselves free cached blocks cannot also be handed out as new blocks."""
    kv = _manager(num_blocks=4)
    first = _request("a", list(range(12)))
    _prefill(kv, first)
    kv.free(first)
    kv.pool.take_events()
    assert kv.pool.free_queue.ids() == [3, 2, 1, 0]

    # 20 tokens: 3 evictable hits + 2 new blocks, but only 1 block is free beyond the hits.
    big = _request("b", [*range(12), *range(200, 208)])
    hits = kv.get_computed_blocks(big)
    assert [b.block_id for b in hits] == [0, 1, 2]
    assert not kv.allocate_slots(big, big.num_tokens - 12, hits)
    assert "b" not in kv.block_tables
    assert kv.pool.free_queue.ids() == [3, 2, 1, 0]
    assert [b.ref_cnt for b in kv.pool.blocks] == [0, 0, 0, 0]
    assert all(kv.pool.lookup(h) is not None for h in first.block_hashes)
    assert kv.pool.take_events() is None

    # 16 tokens: 3 hits + 1 new block fits exactly.
    fits = _request("c", [*range(12), 300, 301, 302, 303])
    hits = kv.get_computed_blocks(fits)
    assert kv.allocate_slots(fits, fits.num_tokens - 12, hits)
    assert kv.block_ids("c") == [0, 1, 2, 3]
    kv.free(fits)
    kv.pool.check_accounting()


def test_free_returns_blocks_tail_first() -> None:
    """free puts a request's blocks on the free list in reverse, so its tail blocks are evicted before its head."""
    kv = _manager(num_blocks=4)
    req = _request("a", list(range(12)))
    _prefill(kv, req)
    kv.free(req)
    assert kv.pool.free_queue.ids() == [3, 2, 1, 0]
    assert "a" not in kv.block_tables
    other = _request("b", list(range(100, 108)))
    assert kv.allocate_slots(other, 8)
    assert kv.block_ids("b") == [3, 2]
    assert kv.pool.lookup(req.block_hashes[2]) is None
    assert kv.pool.lookup(req.block_hashes[0]) is kv.pool.blocks[0]
    assert kv.pool.lookup(req.block_hashes[1]) is kv.pool.blocks[1]
    kv.free(other)
    kv.pool.check_accounting()


def test_free_of_a_request_without_blocks_is_a_no_op() -> None:
    """Freeing an unknown request (or twice) changes nothing."""
    kv = _manager()
    req = _request("a", list(range(4)))
    kv.free(req)
    _prefill(kv, req)
    kv.free(req)
    kv.free(req)
    kv.pool.check_accounting()


def test_shared_prefix_blocks_are_freed_only_by_the_last_holder() -> None:
    """Two requests sharing cached blocks each hold a reference; the blocks return to the free list after both."""
    kv = _manager()
    first = _request("a", list(range(9)))
    _prefill(kv, first)
    second = _request("b", [*range(8), 60, 61])
    hits = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 2, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [b.ref_cnt for b in kv.pool.blocks[:2]] == [2, 2]
    kv.free(first)
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2]
    kv.free(second)
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    kv.pool.check_accounting()


def test_request_block_hashes_are_the_router_chain_as_tokens_arrive() -> None:
    """A request's hashes, extended block by block as its output grows, equal the one chain the router computes
    over the same tokens (engine.block_hash), so the router's index names exactly the blocks workers cache."""
    from engine.block_hash import hash_blocks

    prompt = list(range(100, 100 + 3 * BS + 2))
    req = Request("r", prompt, SamplingParams(temperature=0.0), extra_keys=("model=m",), block_size=BS)
    assert req.block_hashes == hash_blocks(prompt, BS, ("model=m",))
    for t in range(2 * BS + 1):
        req.append_token(7000 + t)
        assert req.block_hashes == hash_blocks(req.all_token_ids, BS, ("model=m",))
    assert len(req.block_hashes) == (len(prompt) + 2 * BS + 1) // BS
