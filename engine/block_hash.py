"""The block-hash chain: the one function the router and every worker use to name a KV block.

Only full blocks get a hash. Block ``i``'s hash is ``H(parent, token_ids, extra_keys)`` where ``parent`` is the hash
of block ``i-1`` (``ROOT_HASH`` for the first block) and ``extra_keys`` covers whatever else changes the KV content
(model, LoRA adapter, cache salt). ``H`` is keyed BLAKE2b with a fixed key, so every process on every machine computes
the same 64-bit value; Python's ``hash()`` is not used because it is salted per process for strings. The message is
``parent (8 bytes LE) | tokens (int32 LE each) | b"\\x00" + key per extra key``: int32 holds any vocabulary's ids, and
at block size 16 with a model key the message fits in one 128-byte BLAKE2b block (int64 tokens took two), which
halves the router's hashing per request. A token id outside int32 raises ``OverflowError``.

:func:`hash_blocks` computes the whole chain in one call to ``engine/kernels/block_hash.c`` when it is built
(compiled on first use, no torch import: the router calls this for every request): token lists and tuples go to the
file's CPython-module build, which reads the ints in place, buffers (``array``, numpy) to its ctypes build; otherwise
it hashes block by block with :func:`hash_block`, the reference, which gives the same values.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

_KEY = b"tandem-kv-block-hash-v2"  # v2: int32 tokens (v1 hashed them as int64)
ROOT_HASH: int = int.from_bytes(hashlib.blake2b(b"root", key=_KEY, digest_size=8).digest(), "little")


def extra_keys_for(model: str = "", lora: str | None = None, cache_salt: str | None = None) -> tuple[str, ...]:
    """Canonical extra keys: the same inputs always give the same tuple, and empty parts are dropped."""
    keys = [f"model={model}"] if model else []
    if lora:
        keys.append(f"lora={lora}")
    if cache_salt:
        keys.append(f"salt={cache_salt}")
    return tuple(keys)


def _int32_le(token_ids: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian; OverflowError outside int32, TypeError for a non-integer (as ``array``)."""
    buf = array("i", token_ids)
    if buf.itemsize != 4:
        raise RuntimeError(f"C int is {buf.itemsize} bytes here; the block hash needs 4")
    if not _LITTLE:
        buf.byteswap()
    return buf.tobytes()


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> int:
    h = hashlib.blake2b(key=_KEY, digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(_int32_le(token_ids))
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
        if isinstance(parent, int) and 0 <= parent < 1 << 64:
            module = _native_module() if type(token_ids) in (list, tuple) else None
            if module is not None:
                out = module.hash_blocks(token_ids, block_size, _extra_bytes(extra_keys), parent, start)
                if out is not None:
                    return out
            native = _native_hasher()
            if native is not None:
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
def _native_module() -> Any:
    from engine.kernels import block_hash_module

    return block_hash_module()


def _extra_bytes(extra_keys: tuple[str, ...]) -> bytes:
    return b"".join([b"\x00" + key.encode() for key in extra_keys])


@functools.cache
def _native_hasher() -> Callable[..., int] | None:
    from engine.kernels import block_hasher  # here, not at the top: importing this module stays cheap

    return block_hasher()


_INT32_FORMATS = frozenset({"i", "<i", "=i", "@i"})  # 4-byte signed, native order (memoryview formats)
_LITTLE = sys.byteorder == "little"


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
        try:  # array('i') or an int32 numpy array: one copy of the buffer, no per-token work
            view = memoryview(token_ids)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if view.ndim == 1 and view.itemsize == 4 and view.format in _INT32_FORMATS:
                tokens = view[start:end].tobytes()
    if tokens is None:
        ids = token_ids if start == 0 and end == len(token_ids) else token_ids[start:end]
        try:
            tokens = struct.pack(f"{end - start}i", *ids)  # native order (the kernel's); 2x array's speed
        except struct.error:  # out of int32 range or not an integer: the reference raises its usual error
            return None
    extra = _extra_bytes(extra_keys)
    out = array("Q", bytes(8 * n_blocks))
    if native(tokens, end - start, block_size, extra, len(extra), parent, out.buffer_info()[0]) != n_blocks:
        return None
    return out.tolist()
