"""The Redis registry under security: signed entries only, and ``rediss://`` with AUTH against a real redis-server.

A real redis-server each time (Debian's build has TLS: ``tls-port`` with certificates from a throwaway CA made
here, ``requirepass`` for AUTH). A worker's publisher (worker/redis_bus.py) writes its signed entry over
``rediss://:PASSWORD@...`` presenting its certificate; a router's bus (router/redis_bus.py) reads it the same way.
Entries that are unsigned, signed with another token or altered after signing are ignored and logged; a wrong
password and a certificate from another CA are refused by Redis itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from auth.credentials import Credentials
from auth.dev_certs import DevCA
from auth.signing import sign
from auth.tls import TLSFiles
from auth.token import new_token
from router.pool import WorkerPool
from router.redis_bus import RedisBus
from worker.redis_bus import RedisPublisher, WorkerAd

PASSWORD = "s3cret-redis-pass"
MODEL = "m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def _redis(tmp: Path, args: list[str], ping: redis.Redis) -> Iterator[None]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (.ci/run installs it)")
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            ping.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                proc.kill()
                pytest.fail(f"redis-server did not start: {out[-2000:]}")
            time.sleep(0.05)
    ping.close()
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def plain_redis(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    with _redis(tmp_path, ["--port", str(port)], redis.Redis(port=port)):
        yield f"redis://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSFiles]:
    d = tmp_path_factory.mktemp("pki")
    ca, other = DevCA.create(d / "ca"), DevCA.create(d / "other", "other-ca")
    return {"redis": ca.issue(d, "redis"), "worker": ca.issue(d, "worker"), "router": ca.issue(d, "router"),
            "foreign": other.issue(d / "foreign", "intruder")}


@pytest.fixture
def tls_redis(tmp_path: Path, pki: dict[str, TLSFiles]) -> Iterator[str]:
    port = _free_port()
    srv = pki["redis"]
    ping = redis.Redis(port=port, ssl=True, password=PASSWORD, ssl_ca_certs=srv.ca, ssl_certfile=srv.cert,
                       ssl_keyfile=srv.key)
    with _redis(tmp_path, ["--port", "0", "--tls-port", str(port), "--tls-cert-file", srv.cert, "--tls-key-file",
                           srv.key, "--tls-ca-cert-file", srv.ca, "--requirepass", PASSWORD], ping):
        yield str(port)


async def _discovered(url: str, creds: Credentials) -> tuple[set[str], dict[bytes | str, str]]:
    pool = WorkerPool([], credentials=creds)
    bus = RedisBus(url, MODEL, index=None, pool=pool)  # type: ignore[arg-type]
    try:
        await bus.discover()
        return set(pool.workers), bus.refused
    finally:
        await bus.client.aclose()
        await pool.close()


def test_unsigned_forged_and_altered_registry_entries_are_ignored_and_logged(
        plain_redis: str, caplog: pytest.LogCaptureFixture) -> None:
    token = new_token()
    ad = {"worker_id": "w-good", "address": "127.0.0.1:9", "role": "decode", "compat_hash": "", "draining": False}
    client = redis.Redis.from_url(plain_redis)
    prefix = f"tandem:{MODEL}:worker:"
    client.set(prefix + "good", sign(ad, token))
    client.set(prefix + "unsigned", json.dumps({**ad, "worker_id": "w-unsigned", "address": "127.0.0.1:10"}))
    client.set(prefix + "forged", sign({**ad, "worker_id": "w-forged", "address": "127.0.0.1:11"}, new_token()))
    altered = json.loads(sign({**ad, "worker_id": "w-altered", "address": "127.0.0.1:12"}, token))
    altered["address"] = "10.6.6.6:1"  # redirected after signing
    client.set(prefix + "altered", json.dumps(altered))
    client.set(prefix + "garbage", b"\xff not json")
    client.close()
    with caplog.at_level(logging.WARNING, logger="router.redis_bus"):
        workers, refused = asyncio.run(_discovered(plain_redis, Credentials(token)))
    assert workers == {"127.0.0.1:9"}
    assert sorted(refused.values()) == ["not JSON: 'utf-8' codec can't decode byte 0xff in position 0: invalid "
                                        "start byte", "signature does not match", "signature does not match",
                                        "unsigned"]
    logged = [r.getMessage() for r in caplog.records if "ignoring registry entry" in r.getMessage()]
    assert len(logged) == 4 and all(prefix in m for m in logged)
    # A router holding another token trusts none of them.
    workers, _ = asyncio.run(_discovered(plain_redis, Credentials(new_token())))
    assert workers == set()


def test_rediss_with_auth_carries_a_signed_entry_from_worker_to_router(tls_redis: str,
                                                                       pki: dict[str, TLSFiles]) -> None:
    token = new_token()
    url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis}"
    pub = RedisPublisher(url, MODEL, WorkerAd("w-tls", "127.0.0.1:7", "decode", ""), 3.0, token=token,
                         tls=pki["worker"])
    pub.start()
    try:
        workers, refused = asyncio.run(_discovered(url, Credentials(token, pki["router"])))
        assert workers == {"127.0.0.1:7"} and refused == {}
    finally:
        pub.stop()


def test_rediss_refuses_a_wrong_password_and_a_foreign_certificate(tls_redis: str,
                                                                   pki: dict[str, TLSFiles]) -> None:
    ad = WorkerAd("w-x", "127.0.0.1:8", "decode", "")
    bad_password = RedisPublisher(f"rediss://:wrong-password@127.0.0.1:{tls_redis}", MODEL, ad, token=new_token(),
                                  tls=pki["worker"])
    with pytest.raises(redis.AuthenticationError):
        bad_password.start()
    bad_password.client.close()
    no_password = RedisPublisher(f"rediss://127.0.0.1:{tls_redis}", MODEL, ad, token=new_token(), tls=pki["worker"])
    with pytest.raises(redis.AuthenticationError):
        no_password.start()
    no_password.client.close()
    foreign = RedisPublisher(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis}", MODEL, ad, token=new_token(),
                             tls=pki["foreign"])
    with pytest.raises(redis.ConnectionError):
        foreign.start()
    foreign.client.close()
    plain = RedisPublisher(f"redis://:{PASSWORD}@127.0.0.1:{tls_redis}", MODEL, ad, token=new_token())
    with pytest.raises(redis.ConnectionError):
        plain.start()
    plain.client.close()
