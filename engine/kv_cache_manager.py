"""Per-request block tables over the shared :class:`BlockPool`, with prefix-cache lookup.

Block tables are append-only: a running request only ever gains blocks, and loses them all at once when it finishes
or is preempted. A full block is published to the prefix cache as soon as the step that computes it is scheduled.
A finished request's table can be *held* instead of freed (a KV connector still sends from it): its blocks keep
their reference, and stay findable in the prefix cache, until :meth:`KVCacheManager.free_held`.
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.block_tables: dict[str, list[KVBlock]] = {}
        self._ids: dict[str, list[int]] = {}  # block ids of each table, kept in step (append-only)
        self._num_cached_blocks: dict[str, int] = {}
        self.held: dict[str, list[KVBlock]] = {}  # tables of finished requests whose blocks a send still reads

    def block_ids(self, request_id: str) -> list[int]:
        return self._ids.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of the request, in whole blocks, leaving at least one token to compute.

        The last token must always be computed: its logits produce the next token. A request that wants prompt
        logprobs gets no hits: its prompt's hidden states are needed.
        """
        if not self.pool.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        hits: list[KVBlock] = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.pool.queried_blocks += min(len(request.block_hashes), max_blocks)
        self.pool.hit_blocks += len(hits)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None,
                       publish: bool = True) -> bool:
        """Make room for ``num_new_tokens`` beyond what is computed; False (and no change) if blocks are short.

        ``computed`` are prefix-cache hits for a request that holds no blocks yet. ``publish=False`` keeps the new
        full blocks out of the prefix cache (their KV will be written by someone else later, see
        :meth:`cache_computed`).
        """
        table = self.block_tables.get(request.request_id)
        computed = computed or []
        if table is None:
            table = []
        elif computed:
            raise ValueError("prefix hits can only be attached to a request without blocks")
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed)
        # Touching a cached block with no holders takes it out of the free queue.
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return False
        ids = self._ids.setdefault(request.request_id, [])
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
            ids.extend(b.block_id for b in computed)
        if need > 0:
            new = self.pool.get_new_blocks(need)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        self.block_tables[request.request_id] = table
        if publish:
            self._cache_full_blocks(request, table, num_computed + num_new_tokens)
        return True

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        if not self.pool.enable_prefix_caching:
            return
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(table[i], request.block_hashes[i])
        if end > start:
            self._num_cached_blocks[rid] = end

    def cache_computed(self, request: Request) -> None:
        """Publish blocks that became full after tokens were appended (their hashes exist only now)."""
        table = self.block_tables.get(request.request_id)
        if table is not None:
            self._cache_full_blocks(request, table, request.num_computed_tokens)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Free the table's tail blocks beyond what ``num_tokens`` tokens need (slots reserved for speculative
        tokens that were rejected, see ``engine/spec``); how many. Those blocks were never published."""
        table = self.block_tables.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is None or len(table) <= keep:
            return 0
        extra = table[keep:]
        del table[keep:]
        del self._ids[request.request_id][keep:]
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def hold(self, request: Request) -> None:
        """Take ``request``'s table out of the live ones without freeing its blocks (see :meth:`free_held`)."""
        table = self.block_tables.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            self.held.setdefault(request.request_id, []).extend(table)

    def free_held(self, request_id: str) -> int:
        """Free the blocks held for ``request_id``; how many there were."""
        table = self.held.pop(request_id, None)
        if not table:
            return 0
        self.pool.free_blocks(reversed(table))
        return len(table)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(t) for t in self.held.values())
