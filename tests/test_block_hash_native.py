"""The native block-hash chain (engine/kernels/block_hash.c) against hashlib, and the fallback to hashlib.

``reference`` below is the definition, written out with hashlib: block ``i`` hashes ``parent (8 bytes LE)``, its
tokens as int32 LE and ``b"\\x00" + key`` per extra key with keyed BLAKE2b (8-byte digest, read LE). Every case
runs :func:`hash_blocks` (native when built) and compares values, errors included, with it.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import engine.block_hash as bh
import engine.kernels as kernels
import native.build as native_build
import native.extension as native_extension
from engine.block_hash import ROOT_HASH, hash_blocks

REPO = Path(__file__).resolve().parents[1]
KEY_SETS: list[tuple[str, ...]] = [
    (),
    ("model=m",),
    ("model=meta-llama/Llama-3.1-8B", "lora=adapter-7", "salt=s3cr3t"),
    ("model=模型", "salt=ü é 🙂"),
    ("",),
]
BLOCK_SIZES = [1, 16, 17, 64]


def reference(token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...] = (),
              parent: int = ROOT_HASH, start: int = 0) -> list[int]:
    out = []
    for begin in range(start, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(key=b"tandem-kv-block-hash-v2", digest_size=8)
        h.update(parent.to_bytes(8, "little"))
        h.update(struct.pack(f"<{block_size}i", *token_ids[begin : begin + block_size]))
        for key in extra_keys:
            h.update(b"\x00" + key.encode())
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


def _reset_native() -> None:
    bh._native_hasher.cache_clear()
    bh._native_module.cache_clear()
    kernels.block_hasher.cache_clear()
    kernels._loaded.pop("block_hash", None)
    native_extension._modules.pop("engine._block_hash", None)


@pytest.fixture
def fresh_native() -> Iterator[None]:
    """Forget the loaded kernel before and after, so a test can change how it is found."""
    _reset_native()
    yield
    _reset_native()


def native_available() -> bool:
    return native_build.enabled() and native_build.compiler() is not None


def test_native_kernel_is_used_where_kernels_are_enabled() -> None:
    if not native_available():
        pytest.skip("native kernels disabled or no compiler")
    assert bh._native_hasher() is not None


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("extra_keys", KEY_SETS)
def test_native_chain_equals_hashlib_for_every_length(block_size: int, extra_keys: tuple[str, ...]) -> None:
    rng = random.Random(block_size * 1000 + len(extra_keys))
    lengths = {0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 5, 1000, 1024}
    for n in sorted(lengths):
        tokens = [rng.randrange(200_000) for _ in range(n)]
        assert hash_blocks(tokens, block_size, extra_keys) == reference(tokens, block_size, extra_keys), n


@pytest.mark.parametrize("extra_keys", [(), ("model=",), ("x" * 119,)])
def test_messages_ending_on_and_around_blake2b_block_boundaries(extra_keys: tuple[str, ...]) -> None:
    """Block sizes 1..40 put the message (8 + 8*block_size + extras bytes) on, just under and just over 128 and 256."""
    tokens = list(range(1, 200))
    for block_size in range(1, 41):
        assert hash_blocks(tokens, block_size, extra_keys) == reference(tokens, block_size, extra_keys), block_size


def test_no_full_block_gives_an_empty_list() -> None:
    assert hash_blocks([], 16) == []
    assert hash_blocks(list(range(15)), 16) == []
    assert hash_blocks(list(range(40)), 16, start=48) == []


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_continuing_from_start_and_parent_gives_the_rest_of_the_chain(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(1 << 31) for _ in range(10 * block_size + 3)]
    keys = ("model=m", "lora=x")
    full = hash_blocks(tokens, block_size, keys)
    assert full == reference(tokens, block_size, keys)
    for i in range(1, len(full) + 1):
        start = i * block_size
        rest = hash_blocks(tokens, block_size, keys, parent=full[i - 1], start=start)
        assert rest == full[i:] == reference(tokens, block_size, keys, full[i - 1], start)


def test_any_parent_in_uint64_range_and_out_of_range_parents_raise_as_before() -> None:
    tokens = list(range(32))
    for parent in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert hash_blocks(tokens, 16, parent=parent) == reference(tokens, 16, parent=parent)
    for parent in (-1, 1 << 64):
        with pytest.raises(OverflowError):
            hash_blocks(tokens, 16, parent=parent)


def test_unaligned_start_raises() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        hash_blocks(list(range(64)), 16, start=8)


def test_the_whole_int32_range_of_token_ids_including_negative_ones() -> None:
    rng = random.Random(7)
    edges = [0, 1, -1, (1 << 31) - 1, -(1 << 31), (1 << 16), -(1 << 16)]
    tokens = [rng.choice(edges) if rng.random() < 0.3 else rng.randrange(-(1 << 31), 1 << 31) for _ in range(530)]
    for block_size in BLOCK_SIZES:
        assert hash_blocks(tokens, block_size, ("model=m",)) == reference(tokens, block_size, ("model=m",))


@pytest.mark.parametrize("bad", [1 << 31, -(1 << 31) - 1, 1 << 63, 1 << 70])
def test_token_ids_out_of_int32_range_raise_overflow_error_in_a_full_block(bad: int) -> None:
    tokens = list(range(40))
    tokens[20] = bad
    with pytest.raises(struct.error):
        reference(tokens, 16)
    with pytest.raises(OverflowError):
        hash_blocks(tokens, 16)
    # Past the last full block the old path never read the token, so neither does the new one.
    tokens[20] = 0
    tokens[35] = bad
    assert hash_blocks(tokens, 16) == reference(tokens, 16)


def test_non_integer_token_ids_raise_type_error() -> None:
    tokens: list[int] = list(range(32))
    tokens[3] = 1.5  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        hash_blocks(tokens, 16)


def test_arrays_tuples_and_ranges_hash_like_lists() -> None:
    tokens = list(range(-50, 1000, 3))
    expected = reference(tokens, 17, ("model=m",))
    assert hash_blocks(tuple(tokens), 17, ("model=m",)) == expected
    assert hash_blocks(array("i", tokens), 17, ("model=m",)) == expected
    assert hash_blocks(array("q", tokens), 17, ("model=m",)) == expected
    assert hash_blocks(range(-50, 1000, 3), 17, ("model=m",)) == expected
    assert hash_blocks(array("i", tokens), 17, ("model=m",), expected[1], 34) == expected[2:]
    assert hash_blocks(array("q", tokens), 17, ("model=m",), expected[1], 34) == expected[2:]


def test_numpy_token_arrays_hash_like_lists() -> None:
    np = pytest.importorskip("numpy")
    tokens = list(range(-50, 1000, 3))
    expected = reference(tokens, 16)
    assert hash_blocks(np.array(tokens, dtype=np.int64), 16) == expected
    assert hash_blocks(np.array(tokens, dtype=np.int32), 16) == expected
    assert hash_blocks(np.array(tokens, dtype=">i8"), 16) == expected
    assert hash_blocks(np.array(tokens, dtype=">i4"), 16) == expected
    assert hash_blocks(np.array(tokens, dtype=np.int32).repeat(2)[::2], 16) == expected
    assert hash_blocks(np.array(tokens, dtype=np.int64).repeat(2)[::2], 16) == expected  # strided view
    assert hash_blocks(np.array(tokens, dtype=np.int64), 16, (), expected[0], 16) == expected[1:]
    with pytest.raises(OverflowError):
        hash_blocks(np.full(32, 1 << 63, dtype=np.uint64), 16)
    with pytest.raises(OverflowError):
        hash_blocks(np.full(32, 1 << 40, dtype=np.int64), 16)


def test_disabled_native_kernels_fall_back_to_hashlib(fresh_native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")
    assert bh._native_hasher() is None and bh._native_module() is None
    tokens = list(range(100))
    assert hash_blocks(tokens, 16, ("model=m",)) == reference(tokens, 16, ("model=m",))
    assert hash_blocks(tokens, 16, ("model=m",), start=96) == []


def test_a_failing_compiler_falls_back_to_hashlib(fresh_native: None, monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    if not native_build.enabled():
        pytest.skip("TANDEM_NATIVE_KERNELS=0")
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    assert bh._native_hasher() is None and bh._native_module() is None
    tokens = list(range(100))
    assert hash_blocks(tokens, 17) == reference(tokens, 17)


def test_the_router_path_builds_the_kernel_without_importing_torch(tmp_path: Path) -> None:
    if not native_available():
        pytest.skip("native kernels disabled or no compiler")
    script = (
        "import sys\n"
        "import engine.block_hash as b\n"
        "assert 'torch' not in sys.modules and 'engine.kernels' not in sys.modules\n"
        "print(b.hash_blocks(list(range(64)), 16, ('model=m',)))\n"
        "assert b._native_hasher() is not None and b._native_module() is not None\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TANDEM_KERNEL_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(reference(list(range(64)), 16, ("model=m",)))
    assert [p.name.split("-")[0] for p in tmp_path.glob("*.so")] == ["block_hash", "block_hash"]  # ctypes, module


def test_the_list_module_and_the_buffer_kernel_agree_and_the_module_declines_what_it_cannot_read() -> None:
    """Lists and tuples go through engine._block_hash, buffers through the ctypes kernel: both equal hashlib. For a
    token that is not an exact int within int32 the module returns None, and the other paths give the answer or
    the usual error."""
    module = bh._native_module()
    if module is None:
        pytest.skip("no compiler or Python headers")
    rng = random.Random(11)
    tokens = [rng.randrange(-(1 << 31), 1 << 31) for _ in range(16 * 9 + 5)]
    keys = ("model=m", "salt=x")
    extra = bh._extra_bytes(keys)
    expected = reference(tokens, 16, keys)
    assert module.hash_blocks(tokens, 16, extra, ROOT_HASH, 0) == expected
    assert module.hash_blocks(tuple(tokens), 16, extra, expected[2], 48) == expected[3:]
    assert module.hash_blocks(tokens, 16, extra, ROOT_HASH, len(tokens)) == []
    assert hash_blocks(array("i", tokens), 16, keys) == expected
    for odd in (True, 1 << 31, 2.0):
        bad: list[object] = list(tokens)
        bad[7] = odd
        assert module.hash_blocks(bad, 16, extra, ROOT_HASH, 0) is None
    flagged = tokens.copy()
    flagged[7] = True  # type: ignore[call-overload]
    assert hash_blocks(flagged, 16, keys) == reference(flagged, 16, keys)
