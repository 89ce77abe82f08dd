"""router/prefix_map.c: the native lookup table behaves as a dict, and KVIndex gives the same answers on it as on its
Python path, event for event and match for match (many workers, eviction, worker removal and slot reuse)."""

from __future__ import annotations

import random
import sys

import pytest

from engine.block_hash import hash_blocks
from router.kv_index import KVIndex, _native, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler or Python headers: Python path only")


def _prefix_map() -> object:
    module = _native()
    assert module is not None
    return module.PrefixMap()


def test_prefix_map_matches_a_dict_through_growth_collisions_and_deletes() -> None:
    """Random sets, overwrites and deletes over keys that crowd a few home slots (small ints, multiples of 2**60,
    the extremes) agree with a dict after every step; backward-shift deletion must keep every later key findable."""
    rng = random.Random(7)
    keys = [*range(40), *(k << 60 for k in range(16)), 2**64 - 1, 2**63, *(rng.getrandbits(64) for _ in range(200))]
    masks = [1 << i for i in range(70)]  # multi-digit ints too
    table = _prefix_map()
    ref: dict[int, int] = {}
    for step in range(6000):
        key = rng.choice(keys)
        if rng.random() < 0.55:
            value = rng.choice(masks)
            table[key] = value  # type: ignore[index]
            ref[key] = value
        elif key in ref:
            del table[key]  # type: ignore[attr-defined]
            del ref[key]
        else:
            with pytest.raises(KeyError):
                del table[key]  # type: ignore[attr-defined]
        if step % 50 == 0:
            assert len(table) == len(ref)  # type: ignore[arg-type]
            assert all(table.get(k) == ref.get(k) for k in keys)  # type: ignore[attr-defined]
    assert {k: table[k] for k in ref} == ref  # type: ignore[index]
    table.clear()  # type: ignore[attr-defined]
    assert len(table) == 0 and table.get(keys[0], "none") == "none"  # type: ignore[arg-type, attr-defined]


def test_prefix_map_refuses_what_is_not_a_64_bit_hash_and_int_mask() -> None:
    table = _prefix_map()
    for bad in (-1, 2**64, 2**100):
        with pytest.raises(OverflowError):
            table[bad] = 1  # type: ignore[index]
        assert table.get(bad, 0) == 0  # type: ignore[attr-defined]
        with pytest.raises(KeyError):
            del table[bad]  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        table["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        table[1] = "mask"  # type: ignore[index]
    with pytest.raises(KeyError):
        table[5]  # type: ignore[index]
    assert len(table) == 0  # type: ignore[arg-type]


def test_prefix_map_releases_its_values() -> None:
    """Overwrite, delete, clear and dropping the table give back every reference it took."""
    mask = 1 << 100
    base = sys.getrefcount(mask)
    table = _prefix_map()
    for k in range(100):
        table[k] = mask  # type: ignore[index]
    assert sys.getrefcount(mask) == base + 100
    for k in range(50):
        del table[k]  # type: ignore[attr-defined]
    table[60] = 3  # type: ignore[index]
    assert sys.getrefcount(mask) == base + 49
    table.clear()  # type: ignore[attr-defined]
    assert sys.getrefcount(mask) == base
    for k in range(10):
        table[k] = mask  # type: ignore[index]
    del table
    assert sys.getrefcount(mask) == base


def test_apply_refuses_a_hash_outside_64_bits_before_changing_anything() -> None:
    index = KVIndex(100)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        index.apply("a", 0, [5, 2**64], b"\x01\x01")
    with pytest.raises(ValueError, match="2\\*\\*64"):
        index.resync("a", 0, [-3])
    assert len(index) == 0 and index.seq("a") is None and index.workers() == []


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts sharing system prefixes, hashed for real (block size 4)."""
    systems = [[rng.randrange(1000) for _ in range(4 * rng.randint(1, 5))] for _ in range(6)]
    out = []
    for _ in range(n):
        tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(4 * rng.randint(0, 8))]
        out.append(hash_blocks(tokens, 4))
    return out


def _by_slot(index: KVIndex, probe: list[int], names: list[str]) -> tuple[dict[str, int], int]:
    """``match_depths`` read back per worker through ``slots_of``, and where the walk ended."""
    depths, pos = index.match_depths(probe)
    return {w: int(depths[s]) for w, s in zip(names, index.slots_of(names), strict=True) if s >= 0 and depths[s]}, pos


def test_match_depths_is_match_as_an_array_per_slot() -> None:
    """On both paths: every hit worker's depth sits in its slot, every other slot is 0 (also the slot of a removed
    worker, and after a longer match wrote deeper values), unknown workers map to -1, and the walk's end is the
    deepest hit; ``slots_of`` follows workers joining, leaving and reusing a slot."""
    for native in (True, False):
        index = KVIndex(1000, native=native)
        index.apply("a", 0, [1, 2, 3, 4], b"\x01" * 4)
        index.apply("b", 0, [1, 2], b"\x01" * 2)
        index.apply("c", 0, [1, 2, 3], b"\x01" * 3)
        names = ["c", "ghost", "a", "b"]
        assert list(index.slots_of(names)) == [2, -1, 0, 1]
        assert _by_slot(index, [1, 2, 3, 4, 5], names) == ({"a": 4, "b": 2, "c": 3}, 4)
        assert _by_slot(index, [1, 2, 9], names) == ({"a": 2, "b": 2, "c": 2}, 2)
        assert _by_slot(index, [7], names) == ({}, 0)
        assert index.remove_worker("b")
        assert list(index.slots_of(names)) == [2, -1, 0, -1]
        depths, pos = index.match_depths([1, 2, 3])
        assert (list(depths), pos) == ([3, 0, 3], 3)
        index.apply("d", 0, [1], b"\x01")  # takes b's free slot
        assert list(index.slots_of(["d"])) == [1]
        assert _by_slot(index, [1, 2], ["a", "c", "d"]) == ({"a": 2, "c": 2, "d": 1}, 2)


@pytest.mark.parametrize(("workers", "max_blocks"), [(5, 100_000), (150, 100_000), (150, 400)])
def test_native_and_python_index_agree_event_for_event(workers: int, max_blocks: int) -> None:
    """Both paths fed one random stream (stores, removes, gaps with resync, worker removal, slot reuse, eviction)
    answer every probe identically and end with equal snapshots and stats. 150 workers make masks of several
    machine words; max_blocks=400 keeps eviction running. Matches also set reference bits, which steer eviction,
    so both indexes see the same probes in the same order."""
    rng = random.Random(workers * 31 + max_blocks)
    chains = _chains(rng, 120)
    native, python = KVIndex(max_blocks, native=True), KVIndex(max_blocks, native=False)
    names = [f"w{i}" for i in range(workers)]
    seqs: dict[str, int] = {}
    for step in range(3000):
        w = rng.choice(names)
        op = rng.random()
        if op < 0.02 and w in seqs:
            assert native.remove_worker(w) == python.remove_worker(w)
            del seqs[w]
        elif op < 0.05 and w in seqs:
            seqs[w] += 3
            snapshot = sorted(set(rng.choice(chains)) | set(rng.choice(chains)))
            native.resync(w, seqs[w], snapshot)
            python.resync(w, seqs[w], snapshot)
        else:
            chain = rng.choice(chains)
            cut = rng.randint(1, len(chain)) if chain else 0
            hashes = chain[:cut] if op < 0.75 else chain[cut - 1 :]
            kind = b"\x01" if op < 0.75 else b"\x00"
            seq = seqs.get(w, -1) + 1
            assert native.apply(w, seq, hashes, kind * len(hashes)) == python.apply(w, seq, hashes,
                                                                                    kind * len(hashes))
            seqs[w] = seq
        probe = rng.choice(chains) + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
        if step % 2:
            assert native.match(probe) == python.match(probe), step
        else:  # the array form (the selector's, at many candidates) says the same, free and reused slots included
            assert _by_slot(native, probe, names) == _by_slot(python, probe, names), step
    assert native.snapshot() == python.snapshot()
    assert native.stats() == python.stats()
    if max_blocks < 1000:
        assert native.stats().evictions > 0


def test_masks_wider_than_2048_workers_match_like_the_python_path() -> None:
    """3000 workers share a prefix and split on its last block: masks of 3000 bits (past the 2048 slots a
    byte-buffer conversion would fit on the stack) report every worker at its depth, as the Python walk does."""
    native, python = KVIndex(100_000, native=True), KVIndex(100_000, native=False)
    for i in range(3000):
        for index in (native, python):
            index.apply(f"w{i}", 0, [7, 8, 9 + i % 2], b"\x01\x01\x01")
    for probe in ([7, 8, 9], [7, 8, 10], [7, 8], [7, 99]):
        assert native.match(probe) == python.match(probe)
    assert len(native.match([7, 8, 9])) == 3000 and native.match([7, 8, 9])["w1"] == 2
    names = [f"w{i}" for i in range(3000)]
    assert _by_slot(native, [7, 8, 9], names) == _by_slot(python, [7, 8, 9], names) == (native.match([7, 8, 9]), 3)
