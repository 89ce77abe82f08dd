"""Mooncake hash ids to token ids, and token ids to the engine's real block hashes.

Each hash id stands for 512 tokens; id ``h`` becomes the token ids ``h·512 + j`` (``j`` < 512, modulo the int32 range
the block hash takes), so equal ids give equal tokens and the real chain hash (``engine/block_hash.py``, at the
simulated engine's block size) gives equal block hashes exactly where the trace shares prefixes. The last id covers
only the prompt's remainder.
"""

from __future__ import annotations

from itertools import chain

from engine.block_hash import hash_blocks
from sim.trace import MOONCAKE_BLOCK

_INT32 = (1 << 31) - 1


def token_ids(hash_ids: tuple[int, ...], input_len: int) -> list[int]:
    n = MOONCAKE_BLOCK
    ids = list(chain.from_iterable(range(h * n % _INT32, h * n % _INT32 + n) for h in hash_ids))
    if len(ids) < input_len:  # a trace whose ids do not cover the prompt: unique filler tokens
        base = (hash_ids[-1] if hash_ids else 0) * n + len(ids)
        ids.extend(range(base % _INT32, base % _INT32 + input_len - len(ids)))
    del ids[input_len:]
    return [t % _INT32 for t in ids] if ids and max(ids) >= _INT32 else ids


def prompt_block_hashes(hash_ids: tuple[int, ...], input_len: int, block_size: int,
                        extra_keys: tuple[str, ...]) -> list[int]:
    return hash_blocks(token_ids(hash_ids, input_len), block_size, extra_keys)
