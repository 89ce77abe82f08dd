"""Block pool: ref-counted KV blocks, an intrusive LRU free list, the prefix cache and KV events.

Design (after vLLM v1's ``FreeKVCacheBlockQueue``):
- Every block is one slotted ``KVBlock`` allocated at start-up. The free list threads ``prev``/``next`` through the
  blocks themselves, so allocating, freeing and touching a block allocates no Python objects.
- A freed block keeps its hash and stays findable in the prefix cache until it is reused. The free list is the LRU
  order: allocation pops from the head (least recently freed), freeing appends to the tail. Callers free a request's
  blocks in reverse order, so a prefix's tail blocks are evicted before its head.
- Every change to the set of cached hashes is recorded as a KV event (``stored`` / ``removed``). Events are handed out
  in batches that carry a monotonically increasing sequence number, so a consumer that sees a gap knows to resync
  from :meth:`BlockPool.cached_hashes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove-from-the-middle."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self.num_free = 0
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block!r} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def ids(self) -> list[int]:
        """Block ids from head (next to evict) to tail. For tests and debugging; allocates."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


STORED = 1
REMOVED = 0


@dataclass(slots=True, frozen=True)
class KVEventBatch:
    """One batch of KV events, in the order they happened: ``kinds[i]`` (STORED or REMOVED) applies to ``hashes[i]``."""

    seq: int
    hashes: tuple[int, ...]
    kinds: bytes

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.kinds, self.hashes, strict=True)

    @property
    def stored(self) -> list[int]:
        return [h for k, h in self if k == STORED]

    @property
    def removed(self) -> list[int]:
        return [h for k, h in self if k == REMOVED]


@dataclass(slots=True)
class _EventBuffer:
    seq: int = 0
    hashes: list[int] = field(default_factory=list)
    kinds: bytearray = field(default_factory=bytearray)

    def add(self, kind: int, block_hash: int) -> None:
        self.hashes.append(block_hash)
        self.kinds.append(kind)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self._events = _EventBuffer()
        # Prefix-cache statistics, in blocks.
        self.hit_blocks = 0
        self.queried_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, including evictable cached ones)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); a block with no holders leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (pass eviction order: tail blocks first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_prefix_caching:
                    block.block_hash = None
                self.free_queue.append(block)

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Publish a full, computed block under its hash. Returns False if another block already holds it."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        self._events.add(STORED, block_hash)
        return True

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        assert h is not None
        block.block_hash = None
        if self.cached.get(h) is block:
            del self.cached[h]
            self._events.add(REMOVED, h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            if block.block_hash is not None:
                self._evict(block)
        return True

    def take_events(self) -> KVEventBatch | None:
        ev = self._events
        if not ev.hashes:
            return None
        ev.seq += 1
        batch = KVEventBatch(seq=ev.seq, hashes=tuple(ev.hashes), kinds=bytes(ev.kinds))
        ev.hashes.clear()
        ev.kinds.clear()
        return batch

    @property
    def event_seq(self) -> int:
        return self._events.seq

    def cached_hashes(self) -> list[int]:
        """Snapshot of every cached hash, for a consumer that must resync after a sequence gap."""
        return list(self.cached)

    def check_accounting(self) -> None:
        """Raise if any block is referenced, or if the free list and ref counts disagree."""
        in_use = [b for b in self.blocks if b.ref_cnt]
        if in_use:
            raise AssertionError(f"{len(in_use)} KV blocks still referenced: {in_use[:8]}")
        if self.free_queue.num_free != self.num_blocks:
            raise AssertionError(f"free queue holds {self.free_queue.num_free} of {self.num_blocks} blocks")
