"""The router's global prefix index: which worker holds which KV block, asked as "how many leading blocks".

Event stream, per worker (the KV-event contract in DESIGN.md)::

    unknown ──first batch / snapshot──► known@seq ──apply(seq+1)──► known@seq+1 ...
                                            │
                                            └─apply(any other seq): a gap ─► apply returns False, changes nothing;
                                              the consumer fetches the worker's snapshot and calls resync()

A worker that restarts restarts its sequence, which is also "any other seq", so it resyncs too; that is why a
repeated or older seq is treated as a gap rather than silently ignored.

Layout (chosen for CPython speed; ``match`` is the hot path):

* Each worker gets a small integer *slot* when first seen (the lowest free one, so slots are a function of the event
  order alone). A block hash maps to an ``int`` bitmask of the slots holding it.
* ``match`` looks the request's hashes up lazily (``map(dict.get)``) and walks *runs* of equal masks
  (``itertools.groupby``), all in C; Python only runs once per run, and a request has a handful of runs (shared
  system prompt, then one worker's conversation, then nothing). The running AND of the masks says which workers are
  still matching; the workers that drop out at position ``p`` matched ``p`` leading blocks. The walk stops at the
  first hash that no (still matching) worker holds. Masks are interned (one object per value) so that comparing
  neighbouring masks is a pointer comparison rather than another memory load.
* Lookups go through ``router/prefix_map.c`` when it builds (a CPython extension compiled on first use, like the
  engine's kernels): an open-addressing table keyed by the 64-bit hash inline, mirrored on every write to the
  ``OrderedDict``, which then only keeps the eviction order. There ``match`` is one C call: a lookup is one DRAM
  miss instead of the dict's three (index, entry, key object), the next 16 positions' slots are prefetched while it
  walks, and the dropped workers are read off the mask's bits. The Python walk above is the fallback and the
  reference (``tests/test_router_prefix_map.py`` runs both on one event stream); hashes must be 64-bit ints.
* A per-worker set of its hashes makes ``resync`` a set difference and ``remove_worker`` proportional to that
  worker's blocks rather than to the whole index.

Memory bound: at most ``max_blocks`` (hash, worker) entries once each call returns (one batch may overshoot
transiently). The hash table is an ``OrderedDict`` in insertion order and eviction is second-chance (CLOCK) LRU: a
hash that is stored again, gains a worker, or is matched gets a reference bit; the evictor pops the oldest hash and,
if it has the bit, clears it and moves the hash to the back, else drops all of the hash's entries. Each reference bit
is spent once, so eviction is amortised O(1). Matched prefixes are marked as a whole, so a hot system prompt's first
block is not evicted from under its chain. Marking is a set update with a cache miss per block on a big index, so it
is sampled (one match in eight marks its prefix; a prefix hot enough to matter is matched far more often than the
index turns over) and skipped while the index is under 3/4 full, where no eviction is near. Forgetting an entry only
costs the router a hit; it never makes a match claim a block that the worker does not hold.

Determinism: which worker holds which hash, and each worker's seq, is a function of the event sequence, so router
replicas reading the same stream have equal ``snapshot()``s. With ``touch_on_match`` (the default) the *eviction
order* also depends on the requests a replica has matched, so under eviction replicas can forget different entries;
size ``max_blocks`` at or above the cluster's total KV blocks (then nothing is evicted), or pass
``touch_on_match=False`` for event-only recency.
"""

from __future__ import annotations

import functools
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby, islice, repeat
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

WorkerId = str

_KINDS = b"\x00\x01"
_IDS_CACHE_MAX = 4096
_INTERN_MAX = 1 << 16
_TOUCH_EVERY_MASK = 7  # one match in 8 sets reference bits


@dataclass(slots=True, frozen=True)
class IndexStats:
    entries: int
    hashes: int
    workers: int
    evictions: int
    gaps: int
    resyncs: int


@dataclass(slots=True, frozen=True)
class IndexSnapshot:
    """Content of the index: ``(worker_id, seq, hashes)`` per worker, sorted by worker id. Compare with ``==``."""

    workers: tuple[tuple[WorkerId, int, frozenset[int]], ...]


@functools.cache
def _native() -> ModuleType | None:
    """``router/prefix_map.c`` built for this interpreter, or None (no compiler or headers): the Python path."""
    from native.extension import load_python_extension

    return load_python_extension("router._prefix_map", Path(__file__).with_name("prefix_map.c"))


def native_available() -> bool:
    return _native() is not None


class KVIndex:
    __slots__ = ("_bits", "_depths", "_entries", "_evictions", "_free", "_gaps", "_get", "_held", "_ids",
                 "_ids_cache", "_intern", "_lookup", "_masks", "_matches", "_max", "_ref", "_resyncs", "_seq", "_slot",
                 "_slots_key", "_slots_of", "_slots_version", "_touch", "_touch_from")

    def __init__(self, max_blocks: int, *, touch_on_match: bool = True, native: bool | None = None) -> None:
        """``native``: use ``router/prefix_map.c`` for lookups (None: when it builds; True: require it)."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._max = max_blocks
        self._touch = touch_on_match
        self._touch_from = max_blocks * 3 // 4
        self._masks: OrderedDict[int, int] = OrderedDict()  # insertion order = eviction order; the masks
        module = _native() if native is not False else None
        if native and module is None:
            raise RuntimeError("the native prefix map is unavailable (no C compiler or Python headers)")
        # The lookup table: the native PrefixMap mirrors every write to _masks, or _masks serves lookups itself.
        self._lookup: Any = module.PrefixMap() if module is not None else None
        self._get = self._lookup.get if self._lookup is not None else self._masks.get
        self._ref: set[int] = set()
        self._slot: dict[WorkerId, int] = {}
        self._ids: list[WorkerId | None] = []
        self._bits: list[int] = []  # 1 << slot, one object per slot
        self._intern: dict[int, int] = {}  # mask -> one canonical object (see _canonical)
        self._matches = 0
        self._held: list[set[int]] = []
        self._free: list[int] = []
        self._seq: dict[WorkerId, int] = {}
        self._ids_cache: dict[int, tuple[WorkerId, ...]] = {}
        self._depths = np.zeros(0, dtype=np.int32)  # match_depths' result, one entry per slot, reused
        self._slots_version = 0  # bumped whenever a worker gains or loses its slot
        self._slots_key: tuple[int, list[WorkerId]] = (-1, [])
        self._slots_of = np.zeros(0, dtype=np.intp)
        self._entries = 0
        self._evictions = 0
        self._gaps = 0
        self._resyncs = 0

    # -- events -----------------------------------------------------------------------------------------------

    def apply(self, worker_id: WorkerId, seq: int, hashes: Sequence[int], kinds: bytes) -> bool:
        """Apply one event batch. False (and no change) on a gap: the caller must ``resync`` this worker."""
        if len(hashes) != len(kinds):
            raise ValueError(f"{len(hashes)} hashes but {len(kinds)} kinds")
        if bytes(kinds).translate(None, _KINDS):
            raise ValueError("kinds must be 1 (stored) or 0 (removed)")
        _check_hashes(hashes)
        last = self._seq.get(worker_id)
        if last is not None and seq != last + 1:
            self._gaps += 1
            return False
        slot = self._slot_for(worker_id)
        self._seq[worker_id] = seq
        bit = self._bits[slot]
        held = self._held[slot]
        for h, kind in zip(hashes, kinds, strict=True):
            if kind:
                self._store(h, bit, held)
            else:
                self._remove(h, bit, held)
        if self._entries > self._max:
            self._evict()
        return True

    def resync(self, worker_id: WorkerId, seq: int, hashes: Sequence[int]) -> None:
        """Replace everything known about ``worker_id`` with its snapshot ``hashes`` taken at ``seq``."""
        _check_hashes(hashes)
        slot = self._slot_for(worker_id)
        bit = self._bits[slot]
        held = self._held[slot]
        wanted = set(hashes)
        for h in [h for h in held if h not in wanted]:
            self._remove(h, bit, held)
        for h in hashes:
            if h not in held:
                self._store(h, bit, held)
        self._seq[worker_id] = seq
        self._resyncs += 1
        if self._entries > self._max:
            self._evict()

    def remove_worker(self, worker_id: WorkerId) -> bool:
        """Forget a worker (it left the registry). False if it was unknown."""
        slot = self._slot.pop(worker_id, None)
        if slot is None:
            return False
        bit = self._bits[slot]
        held = self._held[slot]
        for h in list(held):
            self._remove(h, bit, held)
        self._ids[slot] = None
        heapq.heappush(self._free, slot)
        del self._seq[worker_id]
        self._ids_cache.clear()
        self._slots_version += 1
        return True

    # -- queries ----------------------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int]) -> dict[WorkerId, int]:
        """Leading request blocks cached per worker; workers with no leading hit are absent."""
        lookup = self._lookup
        if lookup is None:
            return self._match_python(block_hashes)
        out, pos = lookup.match(block_hashes, self._ids)
        if pos:
            self._count_match(block_hashes, pos)
        return out

    def match_depths(self, block_hashes: Sequence[int]) -> tuple[np.ndarray, int]:
        """``match`` as an array: ``depths[slot]`` is the leading blocks cached by the worker in index slot ``slot``
        (see ``slots_of``), and the position where the walk ended. No per-worker dict is built, which at hundreds of
        workers was most of a cold match (a shared system prompt drops ~90 workers into it).

        The array is the index's own buffer, rewritten by the next call: read it before matching again.
        """
        depths = self._depths
        lookup = self._lookup
        if lookup is None:
            depths[:] = 0
            slot = self._slot
            for worker, n in self._match_python(block_hashes).items():
                depths[slot[worker]] = n
            return depths, int(depths.max()) if len(depths) else 0
        pos = lookup.match_depths(block_hashes, depths)
        if pos:
            self._count_match(block_hashes, pos)
        return depths, pos

    def slots_of(self, workers: list[WorkerId]) -> np.ndarray:
        """Each worker's index slot (-1 for a worker the index has never seen), for reading ``match_depths``.
        Looked up once per distinct list while no worker joins or leaves the index."""
        version, cached = self._slots_key
        if version != self._slots_version or cached != workers:
            slot = self._slot
            self._slots_of = np.fromiter((slot.get(w, -1) for w in workers), dtype=np.intp, count=len(workers))
            self._slots_key = (self._slots_version, list(workers))
        return self._slots_of

    def _match_python(self, block_hashes: Sequence[int]) -> dict[WorkerId, int]:
        out: dict[WorkerId, int] = {}
        run = 0
        pos = 0
        ids = self._ids_of
        for mask, group in groupby(map(self._get, block_hashes, repeat(0))):
            if pos:
                new = run & mask
                if new != run:
                    out.update(dict.fromkeys(ids(run & ~new), pos))
                    run = new
                    if not new:
                        break
            elif mask:
                run = mask
            else:
                return out
            pos += len(list(group))
        if run:
            out.update(dict.fromkeys(ids(run), pos))
        self._count_match(block_hashes, pos)
        return out

    def _count_match(self, block_hashes: Sequence[int], pos: int) -> None:
        """Count a match and, one in eight once the index is 3/4 full, mark its matched prefix as referenced."""
        self._matches += 1
        if self._touch and not self._matches & _TOUCH_EVERY_MASK and self._entries >= self._touch_from:
            self._ref.update(islice(block_hashes, pos))

    def seq(self, worker_id: WorkerId) -> int | None:
        """Last applied seq of ``worker_id``, None if unknown."""
        return self._seq.get(worker_id)

    def workers(self) -> list[WorkerId]:
        return sorted(self._slot)

    def __len__(self) -> int:
        return self._entries

    def stats(self) -> IndexStats:
        return IndexStats(entries=self._entries, hashes=len(self._masks), workers=len(self._slot),
                          evictions=self._evictions, gaps=self._gaps, resyncs=self._resyncs)

    def snapshot(self) -> IndexSnapshot:
        return IndexSnapshot(tuple(sorted((w, self._seq[w], frozenset(self._held[s])) for w, s in self._slot.items())))

    # -- internals --------------------------------------------------------------------------------------------

    def _slot_for(self, worker_id: WorkerId) -> int:
        slot = self._slot.get(worker_id)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._ids[slot] = worker_id
            self._held[slot] = set()
        else:
            slot = len(self._ids)
            self._ids.append(worker_id)
            self._held.append(set())
            self._bits.append(self._canonical(1 << slot))
            self._depths = np.zeros(len(self._ids), dtype=np.int32)
        self._slot[worker_id] = slot
        self._ids_cache.clear()
        self._slots_version += 1
        return slot

    def _store(self, h: int, bit: int, held: set[int]) -> None:
        mask = self._get(h)
        if mask is None:
            new = bit
        elif mask & bit:
            self._ref.add(h)
            return
        else:
            new = self._canonical(mask | bit)
            self._ref.add(h)
        self._masks[h] = new  # a new hash goes to the back of the eviction order; a known one keeps its place
        if self._lookup is not None:
            self._lookup[h] = new
        held.add(h)
        self._entries += 1

    def _remove(self, h: int, bit: int, held: set[int]) -> None:
        mask = self._get(h)
        if mask is None or not mask & bit:
            return
        mask ^= bit
        lookup = self._lookup
        if mask:
            self._masks[h] = mask = self._canonical(mask)
            if lookup is not None:
                lookup[h] = mask
        else:
            del self._masks[h]
            if lookup is not None:
                del lookup[h]
            self._ref.discard(h)
        held.discard(h)
        self._entries -= 1

    def _evict(self) -> None:
        masks, ref, held, lookup = self._masks, self._ref, self._held, self._lookup
        while self._entries > self._max:
            h, mask = masks.popitem(last=False)
            if h in ref:
                ref.discard(h)
                masks[h] = mask
                continue
            if lookup is not None:
                del lookup[h]
            n = mask.bit_count()
            self._entries -= n
            self._evictions += n
            while mask:
                low = mask & -mask
                held[low.bit_length() - 1].discard(h)
                mask ^= low

    def _canonical(self, mask: int) -> int:
        """One object per mask value: runs of equal masks then compare by identity in ``match`` (no memory load)."""
        canonical = self._intern.get(mask)
        if canonical is None:
            if len(self._intern) >= _INTERN_MAX:
                self._intern.clear()
                for bit in self._bits:
                    self._intern[bit] = bit
            canonical = self._intern[mask] = mask
        return canonical

    def _ids_of(self, mask: int) -> tuple[WorkerId, ...]:
        ids = self._ids_cache.get(mask)
        if ids is None:
            if len(self._ids_cache) >= _IDS_CACHE_MAX:
                self._ids_cache.clear()
            names = self._ids
            ids = tuple(w for i in range(mask.bit_length()) if mask >> i & 1 and (w := names[i]) is not None)
            self._ids_cache[mask] = ids
        return ids


def _check_hashes(hashes: Sequence[int]) -> None:
    """Block hashes are 64-bit digests: refuse a batch holding anything else before any of it is applied."""
    if hashes and (min(hashes) < 0 or max(hashes) >> 64):
        raise ValueError("block hashes must be ints in [0, 2**64)")
