"""The Redis bus format (wire/redis_keys.py) that workers write and routers and the controller read: the key
layout is the documented one, and a KV event batch survives a real Redis stream round trip unchanged."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from wire.redis_keys import (
    KVEventEntry,
    kv_event_fields,
    kv_stream_key,
    pack_hashes,
    unpack_hashes,
    worker_key,
    worker_pattern,
)


def test_keys_follow_the_documented_layout() -> None:
    assert worker_key("m", "w-1") == "tandem:m:worker:w-1"
    assert worker_pattern("m") == "tandem:m:worker:*"
    assert worker_pattern() == "tandem:*:worker:*"
    assert kv_stream_key("m") == "tandem:m:kv"


def test_hashes_pack_as_little_endian_u64_and_a_torn_buffer_is_refused() -> None:
    hashes = [0, 1, 2**64 - 1, 0x0102030405060708]
    packed = pack_hashes(hashes)
    assert packed[24:] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert unpack_hashes(packed) == hashes
    with pytest.raises(ValueError, match="multiple of 8"):
        unpack_hashes(packed[:-1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real redis-server on a unix socket, stopped by its PID."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([exe, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_kv_event_batch_reads_back_from_the_stream_as_it_was_written(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        stream = kv_stream_key("m")
        client.xadd(stream, kv_event_fields("w-1", 7, (11, 2**63), b"\x01\x02"))  # type: ignore[arg-type]
        # RESP2, undecoded: [[stream, [(entry_id, {field: value})]]] (redis' annotation is the union over protocols)
        ((_, ((_, fields),)),) = cast("list[list[Any]]", client.xread({stream: b"0-0"}))
        assert KVEventEntry.from_fields(fields) == KVEventEntry("w-1", 7, [11, 2**63], b"\x01\x02")
    finally:
        client.close()
