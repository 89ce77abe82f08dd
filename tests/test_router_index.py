"""KVIndex: exact prefix counts, event semantics (store/remove, gaps, resync), determinism, eviction, workers."""

from __future__ import annotations

import random

import pytest

from engine.block_hash import hash_blocks
from router.kv_index import KVIndex

STORE, REMOVE = 1, 0


def chain(n: int, salt: int = 0) -> list[int]:
    """Hashes of an ``n``-block prompt with block size 4 (real chained hashes, as workers publish them)."""
    return hash_blocks([salt * 100_000 + t for t in range(4 * n)], 4)


def stored(hashes: list[int]) -> bytes:
    return bytes([STORE] * len(hashes))


def test_match_counts_leading_blocks_per_worker_on_a_hand_built_chain() -> None:
    """Each worker's count is its run of leading request blocks; a later block it holds past a hole does not count."""
    h = chain(6)
    index = KVIndex(1000)
    assert index.apply("a", 0, h, stored(h))  # all 6
    assert index.apply("b", 0, h[:3], stored(h[:3]))  # first 3
    assert index.apply("c", 0, [h[0], h[1], h[3]], stored(h[:3]))  # hole at block 2 -> 2
    assert index.apply("d", 0, [h[4]], stored(h[:1]))  # no leading block -> absent
    assert index.match(h) == {"a": 6, "b": 3, "c": 2}
    assert index.match(h[:2]) == {"a": 2, "b": 2, "c": 2}
    assert index.match(h + chain(2, salt=9)) == {"a": 6, "b": 3, "c": 2}
    assert index.match(chain(3, salt=7)) == {}
    assert index.match([]) == {}
    assert len(index) == 6 + 3 + 3 + 1


def test_match_stops_at_the_first_block_no_worker_holds() -> None:
    """Blocks after the first hash that nobody holds never count, even if some worker holds them."""
    h = chain(5)
    index = KVIndex(1000)
    index.apply("a", 0, [h[0], h[1], h[3], h[4]], stored(h[:4]))
    index.apply("b", 0, [h[0], h[3]], stored(h[:2]))
    assert index.match(h) == {"a": 2, "b": 1}


def test_removed_events_shorten_the_match_and_last_holder_removal_drops_the_hash() -> None:
    """A removal clears only that worker's entry; when the last holder removes a hash it leaves the index."""
    h = chain(4)
    index = KVIndex(1000)
    index.apply("a", 0, h, stored(h))
    index.apply("b", 0, h[:2], stored(h[:2]))
    assert index.apply("a", 1, [h[2]], bytes([REMOVE]))
    assert index.match(h) == {"a": 2, "b": 2}
    assert index.apply("b", 1, [h[0], h[0]], bytes([REMOVE, REMOVE]))  # repeated removal is harmless
    assert index.match(h) == {"a": 2}
    assert index.apply("a", 2, [h[0]], bytes([REMOVE]))
    assert index.match(h) == {}
    assert len(index) == 3 and index.stats().hashes == 2  # a: h[1], h[3]; b: h[1]
    assert index.apply("a", 3, [h[2], h[0]], bytes([STORE, STORE]))
    assert index.match(h) == {"a": 4}


def test_gap_makes_apply_return_false_without_change_and_resync_repairs() -> None:
    """A skipped, repeated or older seq is a gap: nothing changes; resync replaces the worker's set and its seq."""
    h = chain(6)
    index = KVIndex(1000)
    index.apply("a", 10, h[:2], stored(h[:2]))
    before = index.snapshot()
    assert not index.apply("a", 12, h[2:4], stored(h[2:4]))  # skipped 11
    assert not index.apply("a", 10, h[2:4], stored(h[2:4]))  # repeated (or a restarted worker)
    assert index.snapshot() == before and index.stats().gaps == 2
    index.resync("a", 20, h[:1] + h[2:5])  # the worker's real cache: h0, h2, h3, h4 (h1 was evicted there)
    assert index.match(h) == {"a": 1}
    assert index.seq("a") == 20
    assert index.apply("a", 21, [h[1]], stored([h[1]]))
    assert index.match(h) == {"a": 5}
    index.resync("new", 7, h[:3])  # a worker first seen through its snapshot
    assert index.match(h) == {"a": 5, "new": 3} and index.seq("new") == 7


def test_apply_rejects_malformed_batches_without_change() -> None:
    """Mismatched lengths or unknown kinds raise ValueError and leave the worker's seq alone."""
    h = chain(2)
    index = KVIndex(1000)
    with pytest.raises(ValueError):
        index.apply("a", 0, h, bytes([STORE]))
    with pytest.raises(ValueError):
        index.apply("a", 0, h, bytes([STORE, 2]))
    assert index.seq("a") is None and len(index) == 0
    with pytest.raises(ValueError):
        KVIndex(0)


def _event_stream(rng: random.Random, workers: int, steps: int) -> list[tuple[str, str, int, list[int], bytes]]:
    """Random stores/removals over shared prefixes, with one gap+resync per worker."""
    trees = [chain(12, salt=s) for s in range(8)]
    seqs = dict.fromkeys((f"w{i}" for i in range(workers)), 0)
    held: dict[str, set[int]] = {w: set() for w in seqs}
    out: list[tuple[str, str, int, list[int], bytes]] = []
    for step in range(steps):
        w = rng.choice(list(seqs))
        tree = rng.choice(trees)
        n = rng.randint(1, len(tree))
        if rng.random() < 0.7:
            hashes, kinds = tree[:n], stored(tree[:n])
            held[w].update(hashes)
        else:
            hashes = tree[n - 1 :]
            kinds = bytes([REMOVE] * len(hashes))
            held[w].difference_update(hashes)
        seqs[w] += 1
        out.append(("apply", w, seqs[w], hashes, kinds))
        if step % 97 == 50:
            seqs[w] += 5
            out.append(("apply", w, seqs[w] + 1, [tree[0]], stored([tree[0]])))  # a gap: rejected
            out.append(("resync", w, seqs[w], sorted(held[w]), b""))
    return out


def _feed(index: KVIndex, events: list[tuple[str, str, int, list[int], bytes]]) -> None:
    for op, w, seq, hashes, kinds in events:
        if op == "apply":
            index.apply(w, seq, hashes, kinds)
        else:
            index.resync(w, seq, hashes)


def test_same_events_in_same_order_give_identical_snapshots_even_under_eviction() -> None:
    """Replicas fed one stream agree; with event-only recency they agree under eviction even if one also matched."""
    events = _event_stream(random.Random(3), workers=6, steps=600)
    big_a, big_b = KVIndex(10_000), KVIndex(10_000)
    _feed(big_a, events)
    _feed(big_b, events)
    assert big_a.snapshot() == big_b.snapshot() and big_a.stats() == big_b.stats()

    small_a, small_b = KVIndex(60, touch_on_match=False), KVIndex(60, touch_on_match=False)
    probe = chain(12, salt=2)
    for i in range(0, len(events), 50):
        _feed(small_a, events[i : i + 50])
        _feed(small_b, events[i : i + 50])
        small_a.match(probe)  # only replica A serves traffic
    assert small_a.stats().evictions > 0
    assert small_a.snapshot() == small_b.snapshot()


def test_eviction_keeps_entries_at_most_max_and_degrades_to_fewer_hits() -> None:
    """Past max_blocks the oldest unreferenced entries go; the index keeps answering, with shorter or no hits."""
    index = KVIndex(50)
    trees = [chain(10, salt=s) for s in range(20)]
    for seq, tree in enumerate(trees):
        index.apply("a", seq, tree, stored(tree))
        assert len(index) <= 50
    stats = index.stats()
    assert stats.entries == 50 and stats.evictions == 150
    assert index.match(trees[0]) == {}  # the oldest prompts are forgotten...
    assert index.match(trees[-1]) == {"a": 10}  # ...the newest are intact
    index.apply("b", 0, trees[-1], stored(trees[-1]))  # a second holder of one hash is a second entry
    assert len(index) <= 50
    assert all(n <= 10 for n in index.match(trees[-1]).values())


def test_matched_prefix_survives_eviction_second_chance() -> None:
    """A prefix that keeps being matched is kept while unmatched newer blocks are evicted around it.

    Reference bits are sampled (one match in eight sets them), so "hot" here is eight matches per cold insert."""
    index = KVIndex(40)
    hot = chain(8, salt=1)
    index.apply("a", 0, hot, stored(hot))
    for seq in range(1, 30):
        cold = chain(8, salt=100 + seq)
        index.apply("a", seq, cold, stored(cold))
        for _ in range(8):
            assert index.match(hot) == {"a": 8}
    assert index.stats().evictions > 100 and len(index) <= 40


def test_remove_worker_forgets_its_blocks_and_frees_its_slot() -> None:
    """A removed worker vanishes from matches and stats; a new worker may take its slot without inheriting bits."""
    h = chain(4)
    index = KVIndex(1000)
    index.apply("a", 0, h, stored(h))
    index.apply("b", 0, h[:2], stored(h[:2]))
    assert index.remove_worker("a")
    assert not index.remove_worker("a")
    assert index.match(h) == {"b": 2}
    assert index.workers() == ["b"] and len(index) == 2 and index.seq("a") is None
    index.apply("c", 0, h[:1], stored(h[:1]))  # reuses a's slot
    assert index.match(h) == {"b": 2, "c": 1}
    assert index.apply("a", 5, h[:3], stored(h[:3]))  # a comes back as a new stream
    assert index.match(h) == {"b": 2, "c": 1, "a": 3}
