"""The block-hash chain: the one function the router and every worker use to name a KV block.

Only full blocks get a hash. Block ``i``'s hash is ``H(parent, token_ids, extra_keys)`` where ``parent`` is the hash
of block ``i-1`` (``ROOT_HASH`` for the first block) and ``extra_keys`` covers whatever else changes the KV content
(model, LoRA adapter, cache salt). ``H`` is keyed BLAKE2b with a fixed key, so every process on every machine computes
the same 64-bit value; Python's ``hash()`` is not used because it is salted per process for strings.

:func:`hash_blocks` computes the whole chain in one call to ``engine/kernels/block_hash.c`` when the native kernels
are available (compiled on first use, no torch import: the router calls this for every request), and otherwise
block by block with :func:`hash_block`, the reference, which gives the same values.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence

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
    if isinstance(block_size, int) and isinstance(start, int) and block_size > 0 and start >= 0:
        n_blocks = (len(token_ids) - start) // block_size
        if n_blocks <= 0:
            return []
        native = _native_hasher()
        if native is not None and isinstance(parent, int) and 0 <= parent < 1 << 64:
            out = _hash_native(native, token_ids, block_size, extra_keys, parent, start, n_blocks)
            if out is not None:
                return out
    return _hash_blocks_reference(token_ids, block_size, extra_keys, parent, start)


def _hash_blocks_reference(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...], parent: int, start: int
) -> list[int]:
    out: list[int] = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extra_keys)
        out.append(parent)
    return out


@functools.cache
def _native_hasher() -> Callable[..., int] | None:
    from engine.kernels import block_hasher  # here, not at the top: importing this module stays cheap

    return block_hasher()


_INT64_FORMATS = frozenset({"q", "<q", "=q", "@q", "l", "@l"})  # 8-byte signed, native order (memoryview formats)


def _hash_native(
    native: Callable[..., int],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...],
    parent: int,
    start: int,
    n_blocks: int,
) -> list[int] | None:
    """The chain from the native kernel, or None to let the reference path decide (it raises what it raised)."""
    end = start + n_blocks * block_size
    tokens: bytes | None = None
    if not isinstance(token_ids, list | tuple):
        try:  # array('q') or an int64 numpy array: one copy of the buffer, no per-token work
            view = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if view.ndim == 1 and view.itemsize == 8 and view.format in _INT64_FORMATS:
                tokens = view[start:end].tobytes()
    if tokens is None:
        ids = token_ids if start == 0 and end == len(token_ids) else token_ids[start:end]
        try:
            tokens = struct.pack(f"{end - start}q", *ids)  # ~2x faster than array('q', ids)
        except struct.error:  # out of int64 range or not an integer: the reference raises its usual error
            return None
    extra = b"".join([b"\x00" + key.encode() for key in extra_keys])
    out = array("Q", bytes(8 * n_blocks))
    if native(tokens, end - start, block_size, extra, len(extra), parent, out.buffer_info()[0]) != n_blocks:
        return None
    return out.tolist()
