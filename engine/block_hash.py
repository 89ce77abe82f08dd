"""The block-hash chain: the one function the router and every worker use to name a KV block.

Only full blocks get a hash. Block ``i``'s hash is ``H(parent, token_ids, extra_keys)`` where ``parent`` is the hash
of block ``i-1`` (``ROOT_HASH`` for the first block) and ``extra_keys`` covers whatever else changes the KV content
(model, LoRA adapter, cache salt). ``H`` is keyed BLAKE2b with a fixed key, so every process on every machine computes
the same 64-bit value; Python's ``hash()`` is not used because it is salted per process for strings.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_KEY = b"tandem-kv-block-hash-v1"
ROOT_HASH: int = int.from_bytes(hashlib.blake2b(b"root", key=_KEY, digest_size=8).digest(), "little")


def extra_keys_for(model: str = "", lora: str | None = None, cache_salt: str | None = None) -> tuple[str, ...]:
    """Canonical extra keys: the same inputs always give the same tuple, and empty parts are dropped."""
    keys = [f"model={model}"] if model else []
    if lora:
        keys.append(f"lora={lora}")
    if cache_salt:
        keys.append(f"salt={cache_salt}")
    return tuple(keys)


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
    h = hashlib.blake2b(key=_KEY, digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00")
        h.update(key.encode())
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] = (),
    parent: int = ROOT_HASH,
    start: int = 0,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids[start:]``; ``start`` must be block aligned, ``parent`` its parent."""
    if start % block_size:
        raise ValueError(f"start={start} is not a multiple of block_size={block_size}")
    out: list[int] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra_keys)
        out.append(parent)
    return out
