"""Registry faults: a real redis-server restarted (empty) under load through a real router and real workers.

Two ``tandem worker`` processes register in Redis (``--redis``, a 1.5 s lease: a heartbeat every 0.5 s) and a
router discovers them there and follows the shared KV event stream. Mid-load, redis-server is killed and started
again empty on the same port. Checked: no request fails; the router never drops a worker whose connections are
alive though its entry is gone; each worker's entry is back within about a heartbeat (measured, with slack for a
loaded 2-core machine); and the KV index catches up with what was cached while Redis was away (a sequence gap
resyncs the worker from its ``Snapshot``), so a prefix first sent during the outage is routed as a hit afterwards.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateway_harness import RouterThread

from router.server import RouterConfig
from worker.launcher import WorkerProcess, start_worker

pytestmark = pytest.mark.slow
LEASE_S = 1.5
FLAGS = ["--num-kv-blocks", "256", "--threads", "1", "--lease-seconds", str(LEASE_S)]


class RedisServer:
    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (.ci/run installs it)")
        self.exe = exe
        self.dir = directory
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    yield server
    server.kill()


def _complete(url: str, model: str, prompt: list[int], explain: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0, "ignore_eos": True},
                      headers={"x-tandem-explain": "1"} if explain else None, timeout=120)


def _entries(port: int) -> int:
    client = redis.Redis(port=port, socket_timeout=2)
    try:
        return sum(1 for _ in client.scan_iter(match="tandem:*:worker:*"))
    except redis.RedisError:
        return 0
    finally:
        client.close()


def _overlap(route: str, worker_id: str) -> int:
    """The cached-prefix blocks the routing decision saw on ``worker_id`` (``w=ID;ov=N;...`` in x-tandem-route)."""
    m = re.search(rf"w={re.escape(worker_id)};ov=(\d+)", route)
    return int(m.group(1)) if m else 0


def test_redis_restarted_empty_mid_load_fails_no_request_and_the_index_resyncs(
        redis_server: RedisServer, checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint("llama")
    workers: list[WorkerProcess] = []
    rt: RouterThread | None = None
    try:
        workers = [start_worker("decode", str(path), "tcp", [*FLAGS, "--worker-id", f"rf-{i}",
                                                              "--redis", redis_server.url]) for i in range(2)]
        rt = RouterThread(RouterConfig(model=str(path), workers=(), redis=redis_server.url))
        deadline = time.monotonic() + 30
        while len(rt.call(lambda r: r.pool.available("decode"))) < 2:
            assert time.monotonic() < deadline, "the router did not discover both workers"
            time.sleep(0.1)

        failures: list[str] = []
        done = 0
        stop = threading.Event()

        def load(seed: int) -> None:  # bounded: 60 requests or 90 s per client, whichever comes first
            nonlocal done
            rng = random.Random(seed)
            end = time.monotonic() + 90
            for _ in range(60):
                if stop.is_set() or time.monotonic() > end:
                    return
                try:
                    r = _complete(rt.url, path.name, [rng.randrange(2000) for _ in range(rng.randrange(8, 40))])
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    done += 1
                except httpx.HTTPError as e:
                    failures.append(repr(e))

        clients = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(3)]
        for c in clients:
            c.start()
        time.sleep(1.0)
        before = done
        redis_server.kill()
        # A prefix first cached while Redis is away: its KV events cannot reach the stream.
        rng = random.Random(99)
        prefix = [rng.randrange(2000) for _ in range(96)]
        first = _complete(rt.url, path.name, prefix, explain=True)
        assert first.status_code == 200, first.text
        time.sleep(2 * LEASE_S)  # every entry has expired by now, had Redis kept them
        redis_server.start()
        back = time.monotonic()
        while _entries(redis_server.port) < 2:
            assert time.monotonic() - back < 10, "workers did not re-register"
            time.sleep(0.02)
        reregistered_s = time.monotonic() - back
        time.sleep(1.0)  # load goes on against the fresh Redis
        stop.set()
        for c in clients:
            c.join(120)

        print(f"{done} requests, {before} before the restart; workers re-registered {reregistered_s:.2f}s after")
        assert failures == [], failures
        assert done > before, "no request ran across the restart"
        assert reregistered_s < LEASE_S / 3 + 2.0, f"re-registered after {reregistered_s:.2f}s"
        assert sorted(rt.call(lambda r: [w.worker_id for w in r.pool.workers.values()])) == ["rf-0", "rf-1"]
        assert rt.call(lambda r: sum(w.cutoffs for w in r.pool.workers.values())) == 0

        # The worker that served the prefix publishes again (a gap in its sequence numbers): the router resyncs
        # it from its snapshot, which holds the prefix cached during the outage.
        holder = first.headers["x-tandem-route"]
        deadline = time.monotonic() + 30
        while True:
            again = _complete(rt.url, path.name, prefix, explain=True)
            assert again.status_code == 200, again.text
            route = again.headers["x-tandem-route"]
            if any(_overlap(route, f"rf-{i}") >= 4 for i in range(2)):
                break
            assert time.monotonic() < deadline, f"no prefix hit after the restart: {route} (first: {holder})"
            time.sleep(0.2)
    finally:
        if rt is not None:
            rt.stop()
        for w in workers:
            w.stop()
