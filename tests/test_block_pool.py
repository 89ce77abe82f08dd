"""Tests for :mod:`engine.block_pool` and :mod:`engine.block_hash`: exact block ids, LRU eviction order, KV events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.block_hash import ROOT_HASH, extra_keys_for, hash_block, hash_blocks
from engine.block_pool import REMOVED, STORED, BlockPool, FreeBlockQueue, KVBlock, KVEventBatch

H0, H1, H2, H3 = 1000, 1001, 1002, 1003


def _replay(batches: list[KVEventBatch], initial: set[int] | None = None) -> set[int]:
    """Apply KV event batches to a set of hashes, the way a router's index would."""
    state = set(initial or ())
    for batch in batches:
        for kind, h in batch:
            if kind == STORED:
                state.add(h)
            else:
                state.discard(h)
    return state


# ---- allocation and the free list ------------------------------------------------------------------------------


def test_fresh_pool_hands_out_blocks_in_id_order() -> None:
    """A new pool allocates blocks 0, 1, 2, ... and the rest stay on the free list in id order."""
    pool = BlockPool(6)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
    assert pool.free_queue.ids() == [3, 4, 5]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 4]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 5


def test_allocated_blocks_have_one_reference_and_no_hash() -> None:
    """A newly handed-out block has ref_cnt 1 and is not in the prefix cache."""
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    assert block.ref_cnt == 1
    assert block.block_hash is None


def test_freed_blocks_go_to_the_tail_in_the_order_given() -> None:
    """free_blocks appends to the tail in argument order, so the free list order is the eviction order."""
    pool = BlockPool(6)
    b = pool.get_new_blocks(4)
    pool.free_blocks([b[2], b[0]])
    assert pool.free_queue.ids() == [4, 5, 2, 0]
    pool.free_blocks([b[3], b[1]])
    assert pool.free_queue.ids() == [4, 5, 2, 0, 3, 1]
    assert [x.block_id for x in pool.get_new_blocks(3)] == [4, 5, 2]
    pool.free_blocks(pool.blocks[i] for i in (2, 5, 4))
    pool.check_accounting()


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing() -> None:
    """get_new_blocks(n) with fewer than n free raises RuntimeError and leaves the free list untouched."""
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="asked for 3"):
        pool.get_new_blocks(3)
    assert pool.free_queue.ids() == [2, 3]


def test_pool_with_no_blocks_is_refused() -> None:
    """BlockPool(0) raises ValueError."""
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_free_queue_popleft_on_empty_queue_raises() -> None:
    """Popping from an empty FreeBlockQueue raises RuntimeError instead of returning a sentinel."""
    queue = FreeBlockQueue([KVBlock(0)])
    assert queue.popleft().block_id == 0
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        queue.popleft()


def test_free_queue_removes_a_block_from_the_middle() -> None:
    """FreeBlockQueue.remove unlinks a middle block in O(1) and keeps the others' order."""
    blocks = [KVBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.ids() == [0, 1, 3]
    assert queue.num_free == 3
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[2])


def test_double_free_raises() -> None:
    """Freeing a block whose ref count is already zero raises RuntimeError."""
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([block])
    assert pool.free_queue.ids() == [1, 2, 3, 0]


def test_check_accounting_raises_while_a_block_is_referenced() -> None:
    """check_accounting raises AssertionError while any block is held, and passes once all are freed."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(AssertionError, match="2 KV blocks still referenced"):
        pool.check_accounting()
    pool.free_blocks(blocks[:1])
    with pytest.raises(AssertionError, match="1 KV blocks still referenced"):
        pool.check_accounting()
    pool.free_blocks(blocks[1:])
    pool.check_accounting()


# ---- prefix cache ----------------------------------------------------------------------------------------------


def test_freed_cached_block_stays_findable_until_reallocated() -> None:
    """A freed block keeps its hash and is found by lookup until get_new_blocks hands it out again."""
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, H0)
    pool.free_blocks([a])
    assert pool.lookup(H0) is a
    assert a.block_hash == H0
    pool.free_blocks([b])
    assert pool.free_queue.ids() == [0, 1]
    (again,) = pool.get_new_blocks(1)
    assert again is a
    assert pool.lookup(H0) is None
    assert a.block_hash is None
    pool.free_blocks([again])
    pool.check_accounting()


def test_reallocation_evicts_least_recently_freed_first_and_emits_removed() -> None:
    """Cached free blocks are evicted in LRU (free) order, each eviction emitting one REMOVED event."""
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    for block, h in zip(blocks, (H0, H1, H2, H3), strict=True):
        pool.cache_block(block, h)
    stored = pool.take_events()
    assert stored is not None
    assert stored.stored == [H0, H1, H2, H3]
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.free_queue.ids() == [2, 0, 3, 1]

    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 0]
    batch = pool.take_events()
    assert batch is not None
    assert batch.removed == [H2, H0]
    assert batch.stored == []
    assert pool.lookup(H2) is None and pool.lookup(H0) is None
    assert pool.lookup(H3) is blocks[3] and pool.lookup(H1) is blocks[1]


def test_reallocating_an_uncached_block_emits_no_event() -> None:
    """Handing out a free block that never had a hash records no KV event."""
    pool = BlockPool(3)
    pool.free_blocks(pool.get_new_blocks(3))
    pool.get_new_blocks(3)
    assert pool.take_events() is None


def test_touch_on_cached_free_block_removes_it_from_the_free_queue() -> None:
    """touch takes a reference on a free cached block, so it leaves the free queue and cannot be evicted."""
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, H0)
    pool.free_blocks([b, a])
    assert pool.free_queue.ids() == [2, 3, 1, 0]
    pool.touch([a])
    assert a.ref_cnt == 1
    assert pool.free_queue.ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3
    assert [x.block_id for x in pool.get_new_blocks(3)] == [2, 3, 1]
    assert pool.lookup(H0) is a
    pool.free_blocks([a])
    assert pool.free_queue.ids() == [0]


def test_touch_on_a_held_block_only_adds_a_reference() -> None:
    """touch on a block that is in use bumps its ref count and leaves the free queue alone."""
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, H0)
    pool.touch([a])
    assert a.ref_cnt == 2
    assert pool.free_queue.ids() == [1, 2]
    pool.free_blocks([a])
    assert a.ref_cnt == 1
    assert pool.free_queue.ids() == [1, 2]
    pool.free_blocks([a])
    assert pool.free_queue.ids() == [1, 2, 0]
    pool.check_accounting()


def test_cache_block_refuses_a_hash_already_held_by_another_block() -> None:
    """cache_block returns False (and records no event) when another block already holds that hash."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, H0)
    assert not pool.cache_block(b, H0)
    assert not pool.cache_block(a, H1)  # a block is published once
    assert b.block_hash is None
    assert pool.lookup(H0) is a
    batch = pool.take_events()
    assert batch is not None and list(batch) == [(STORED, H0)]


def test_disabled_prefix_caching_never_caches_or_emits_events() -> None:
    """With enable_prefix_caching=False, cache_block is a no-op and freed blocks carry no hash."""
    pool = BlockPool(2, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_block(a, H0)
    pool.free_blocks([a])
    assert pool.lookup(H0) is None
    assert a.block_hash is None
    assert pool.take_events() is None


def test_reset_prefix_cache_only_when_idle_and_removes_every_hash() -> None:
    """reset_prefix_cache refuses while blocks are in use, then forgets all hashes with REMOVED events."""
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, H0)
    pool.cache_block(b, H1)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.lookup(H0) is a
    pool.free_blocks([b])
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.cached_hashes() == []
    batch = pool.take_events()
    assert batch is not None
    assert sorted(batch.removed) == [H0, H1]
    pool.check_accounting()


# ---- KV events -------------------------------------------------------------------------------------------------


def test_take_events_returns_none_when_nothing_happened() -> None:
    """take_events is None on a fresh pool and after draining, and the sequence number does not advance."""
    pool = BlockPool(2)
    assert pool.take_events() is None
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, H0)
    first = pool.take_events()
    assert first is not None and first.seq == 1
    assert pool.take_events() is None
    assert pool.event_seq == 1


def test_event_batches_are_numbered_1_2_3_in_order() -> None:
    """Each non-empty take_events batch carries the next sequence number, starting at 1."""
    pool = BlockPool(1)
    seqs = []
    for h in (H0, H1, H2):
        (a,) = pool.get_new_blocks(1)
        pool.cache_block(a, h)
        pool.free_blocks([a])
        batch = pool.take_events()
        assert batch is not None
        seqs.append(batch.seq)
    assert seqs == [1, 2, 3]


def test_stored_then_removed_for_the_same_hash_keeps_its_order_in_one_batch() -> None:
    """A hash stored and then evicted before the batch is taken appears as STORED then REMOVED, in that order."""
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, H0)
    pool.free_blocks([a])
    (a,) = pool.get_new_blocks(1)  # evicts H0
    pool.cache_block(a, H1)
    batch = pool.take_events()
    assert batch is not None
    assert batch.seq == 1
    assert batch.hashes == (H0, H0, H1)
    assert batch.kinds == bytes([STORED, REMOVED, STORED])
    assert list(batch) == [(STORED, H0), (REMOVED, H0), (STORED, H1)]
    assert _replay([batch]) == {H1}


def test_cached_hashes_snapshot_equals_replayed_events() -> None:
    """cached_hashes() equals the set of stored-minus-removed hashes replayed from every event batch."""
    pool = BlockPool(4)
    batches = []
    next_hash = 5000
    held: list[KVBlock] = []
    # A fixed script of allocations, publications, frees and evictions.
    for round_ in range(6):
        new = pool.get_new_blocks(min(2 + round_ % 2, pool.num_free_blocks))
        for block in new:
            pool.cache_block(block, next_hash)
            next_hash += 1
        held.extend(new)
        pool.free_blocks(reversed(held[: len(held) // 2 + 1]))
        held = held[len(held) // 2 + 1 :]
        batch = pool.take_events()
        if batch is not None:
            batches.append(batch)
        assert set(pool.cached_hashes()) == _replay(batches)
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    assert any(b.removed for b in batches)
    pool.free_blocks(held)
    pool.check_accounting()


# ---- block hashes ----------------------------------------------------------------------------------------------

_HASH_SCRIPT = (
    "import json; from engine.block_hash import extra_keys_for, hash_blocks; "
    "print(json.dumps(hash_blocks(list(range(10)), 4, extra_keys_for('m', 'lora-a', 'salt-1'))))"
)


def test_block_hashes_are_identical_across_processes_with_different_hash_seeds() -> None:
    """hash_blocks gives the same values in separate Python processes with different PYTHONHASHSEED."""
    here = hash_blocks(list(range(10)), 4, extra_keys_for("m", "lora-a", "salt-1"))
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=60, check=True)
        assert json.loads(proc.stdout) == here


def test_first_block_hash_chains_from_root_hash() -> None:
    """Block 0's hash is hash_block(ROOT_HASH, tokens[:block_size]) and block 1 chains from block 0."""
    tokens = list(range(8))
    h = hash_blocks(tokens, 4)
    assert h[0] == hash_block(ROOT_HASH, tokens[:4])
    assert h[1] == hash_block(h[0], tokens[4:8])


def test_changing_block_0_changes_every_later_hash() -> None:
    """Parent chaining: a different first block changes every block's hash, a different block 1 keeps block 0's."""
    tokens = list(range(12))
    base = hash_blocks(tokens, 4)
    first_changed = hash_blocks([99, *tokens[1:]], 4)
    assert all(a != b for a, b in zip(base, first_changed, strict=True))
    second_changed = hash_blocks([*tokens[:4], 99, *tokens[5:]], 4)
    assert second_changed[0] == base[0]
    assert second_changed[1] != base[1] and second_changed[2] != base[2]


def test_extra_keys_change_the_hash() -> None:
    """Model, LoRA and cache salt each change the block hash; the same keys give the same hash."""
    tokens = [1, 2, 3, 4]
    plain = hash_block(ROOT_HASH, tokens)
    variants = [
        extra_keys_for("model-a"),
        extra_keys_for("model-b"),
        extra_keys_for("model-a", lora="l1"),
        extra_keys_for("model-a", cache_salt="s1"),
    ]
    hashes = [hash_block(ROOT_HASH, tokens, k) for k in variants]
    assert len({plain, *hashes}) == 5
    assert hash_block(ROOT_HASH, tokens, extra_keys_for("model-a")) == hashes[0]
    assert hash_block(ROOT_HASH, tokens, ("a", "b")) != hash_block(ROOT_HASH, tokens, ("ab",))


def test_extra_keys_for_drops_empty_parts() -> None:
    """extra_keys_for omits empty model, LoRA and salt, so no extras hash like plain tokens."""
    assert extra_keys_for() == ()
    assert extra_keys_for("", None, "") == ()
    assert extra_keys_for("m", None, "s") == ("model=m", "salt=s")


def test_hash_blocks_hashes_only_full_blocks() -> None:
    """A trailing partial block gets no hash; fewer tokens than a block give none."""
    assert len(hash_blocks(list(range(11)), 4)) == 2
    assert len(hash_blocks(list(range(12)), 4)) == 3
    assert hash_blocks([1, 2, 3], 4) == []
    assert hash_blocks(list(range(11)), 4) == hash_blocks(list(range(8)), 4)


def test_hash_blocks_resumes_from_an_aligned_start_with_its_parent() -> None:
    """Hashing from start=k*block_size with parent=hash of block k-1 continues the same chain."""
    tokens = list(range(16))
    full = hash_blocks(tokens, 4)
    assert hash_blocks(tokens, 4, parent=full[1], start=8) == full[2:]


def test_hash_blocks_with_unaligned_start_raises() -> None:
    """A start that is not a multiple of block_size raises ValueError."""
    with pytest.raises(ValueError, match="start=3"):
        hash_blocks(list(range(16)), 4, start=3)
