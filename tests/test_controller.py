"""The controller on a real local Ray with real worker processes and the real router, in this process.

One :class:`LocalCluster` (what ``tandem up`` runs after Ray starts: controller, router, Control API) is started
for the module on an asyncio loop in a background thread; the tests drive it through the Control gRPC API and
send requests through the router's OpenAI HTTP gateway, and read the controller's and the router's own state on
that loop. Start: 1 prefill + 1 decode replica, each a placement group of one 0.25-CPU bundle.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import httpx
import pytest

from auth.credentials import Credentials
from auth.grpc_client import attach
from controlplane.replica_state import Replica, ReplicaState, in_flight
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

pytestmark = pytest.mark.slow

T = TypeVar("T")
LONG_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]  # its length (the load's are 3) tells its decision apart
LONG_TOKENS = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class Harness:
    def __init__(self, model: Path, home: Path) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        from auth.token import ensure_cluster_token
        from cli.up import router_frontend
        from controlplane.local_cluster import LocalCluster, UpConfig

        ensure_cluster_token()  # as tandem up does: Ray's processes, and so the workers, inherit it
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
                 configure_logging=False)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="controller-loop", daemon=True)
        self.thread.start()
        port = _free_port()
        cfg = UpConfig(model=str(model), prefill=1, decode=1, port=port, grpc_port=-1, cpus_per_replica=0.25,
                       drain_timeout_s=90.0)
        self.cluster = LocalCluster(cfg, model, "tcp", router_frontend(cfg), state_file=home / "up.json")
        self.url = f"http://127.0.0.1:{port}"
        self.model = model.name  # the served model name
        self.call(self.cluster.start(), 240)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.cluster.control_port}")
        self.creds = Credentials.from_env()  # the cluster token SetReplicas and Drain need
        self.control = attach(cpb_grpc.ControlStub(self.channel), self.creds)
        self.dispatch_log: list[tuple[float, int, str, str]] = []  # (when, prompt length, decode, prefill)
        self.on_loop(self._log_dispatch)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def on_loop(self, fn: Callable[[], T]) -> T:
        async def run() -> T:
            return fn()

        return self.call(run())

    @property
    def controller(self) -> Any:
        return self.cluster.controller

    @property
    def router(self) -> Any:
        """The in-process router (cli/up.py's RouterFrontend wraps it)."""
        return cast(Any, self.cluster.frontend).router

    def _log_dispatch(self) -> None:
        """Record every routing decision the router makes (on the loop, so in order with the controller's marks)."""
        dispatcher = self.router.dispatcher
        plan = dispatcher.plan

        def logged(prompt: list[int], exclude: set[str], lora: str = "") -> Any:
            p = plan(prompt, exclude, lora)
            self.dispatch_log.append((time.monotonic(), len(prompt), p.decode.address,
                                      p.prefill.address if p.prefill is not None else ""))
            return p

        dispatcher.plan = logged

    def tier(self, name: str) -> cpb.TierStatus:
        return next(t for t in self.control.Status(cpb.StatusRequest(), timeout=10).tiers if t.tier == name)

    def wait_tier(self, name: str, ready: int, timeout_s: float = 180.0) -> cpb.TierStatus:
        deadline = time.monotonic() + timeout_s
        while True:
            t = self.tier(name)
            if t.ready == ready and t.desired == ready and not t.starting and not t.draining \
                    and len(t.replicas) == ready:
                return t
            assert time.monotonic() < deadline, f"{name} did not converge to {ready}: {t}"
            time.sleep(0.2)

    def close(self) -> None:
        import ray

        self.channel.close()
        self.call(self.cluster.close(), 120)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        ray.shutdown()


@pytest.fixture(scope="module")
def harness(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    h = Harness(checkpoint("llama"), tmp_path_factory.mktemp("tandem-home"))
    yield h
    h.close()


class Load:
    """``clients`` threads sending short greedy completions through the router until stopped; bounded by
    ``max_each`` requests per client and ``max_s`` seconds."""

    def __init__(self, url: str, model: str, clients: int = 3, max_each: int = 2000, max_s: float = 300.0) -> None:
        self.url = url
        self.model = model
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + max_s
        self.threads = [threading.Thread(target=self._client, args=(i, max_each), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, i: int, max_each: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for n in range(max_each):
                if self.stop.is_set() or time.monotonic() > self.deadline:
                    return
                # every 4th request of client 0: an 80-token prompt, routed disaggregated (prefill, then decode)
                prompt = [5 + i, 6 + n % 50, 7] if i or n % 4 else [40 + n % 50, *range(100, 179)]
                body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                try:
                    r = c.post("/v1/completions", json=body)
                    good = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
                    why = "" if good else f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as e:
                    why = repr(e)
                with self.lock:
                    if why:
                        self.failed.append(why)
                    else:
                        self.ok += 1

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


class LongRequest(threading.Thread):
    """One streamed completion of LONG_TOKENS tokens; ``started`` is set at its first chunk."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.model = model
        self.started = threading.Event()
        self.tokens = 0
        self.finish_reason = ""
        self.ended_at = 0.0
        self.error = ""

    def run(self) -> None:
        body = {"model": self.model, "prompt": LONG_PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code} {r.read()[:300]!r}"
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    self.started.set()
                    if chunk.get("usage"):
                        self.tokens = chunk["usage"]["completion_tokens"]
                    for c in chunk.get("choices", []):
                        self.finish_reason = c.get("finish_reason") or self.finish_reason
        except httpx.HTTPError as e:
            self.error = repr(e)
        self.ended_at = time.monotonic()
        self.started.set()


def test_control_api_round_trip_and_refuses_bad_tiers_and_counts(harness: Harness) -> None:
    """Status lists both tiers with their replicas; SetReplicas answers the tier's status; an unknown tier, a
    negative count (a varint of -1 on the wire) and an unknown replica are refused with the right codes."""
    tiers = {t.tier: t for t in harness.control.Status(cpb.StatusRequest(), timeout=10).tiers}
    assert set(tiers) == {"prefill", "decode"}
    for t in tiers.values():
        assert (t.desired, t.ready, t.starting, t.draining) == (1, 1, 0, 0)
        (r,) = t.replicas
        assert r.state == cpb.REPLICA_STATE_READY and r.address.startswith("127.0.0.1:") and r.ranks == 1
    got = harness.control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=1), timeout=10).tier
    assert (got.tier, got.desired, got.ready) == ("decode", 1, 1)

    with pytest.raises(grpc.RpcError) as bad_tier:
        harness.control.SetReplicas(cpb.SetReplicasRequest(tier="router", replicas=2), timeout=10)
    assert bad_tier.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown tier" in bad_tier.value.details()

    raw = harness.channel.unary_unary("/tandem.v1.Control/SetReplicas", request_serializer=None,
                                      response_deserializer=cpb.SetReplicasResponse.FromString)
    minus_one = cpb.SetReplicasRequest(tier="decode").SerializeToString() + b"\x10" + b"\xff" * 9 + b"\x01"
    with pytest.raises(grpc.RpcError) as negative:
        raw(minus_one, timeout=10, metadata=harness.creds.metadata)
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.RpcError) as unknown:
        harness.control.Drain(cpb.DrainReplicaRequest(replica_id="decode-nope"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert harness.tier("decode").desired == 1  # nothing refused changed anything


def test_scale_decode_1_3_1_under_load_drains_before_removing(harness: Harness) -> None:
    """Decode 1 -> 3 -> 1 while three clients send requests (short ones colocated, long ones disaggregated)
    through the router: none fails; after a replica is
    marked draining the router routes nothing to it (its dispatch log, and no retry anywhere: a draining worker
    refuses new work, so a request sent there would have been retried); the replica holding a long request in
    flight is removed only after that request finished, complete; no KV block is left in use, on the removed
    replicas (their last Load) nor on the survivor."""
    load = Load(harness.url, harness.model)
    try:
        t0 = time.monotonic()
        harness.control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=3), timeout=10)
        harness.wait_tier("decode", 3)
        up_s = time.monotonic() - t0

        long = LongRequest(harness.url, harness.model)
        long.start()
        assert long.started.wait(60) and not long.error, long.error
        assert harness.dispatch_log, "no routing decision was logged"
        (addr,) = {d for _, n, d, _ in harness.dispatch_log if n == len(LONG_PROMPT)}  # the others: 3 or 80
        busy = next(r for r in harness.tier("decode").replicas if r.address == addr)

        t1 = time.monotonic()
        drained = harness.control.Drain(cpb.DrainReplicaRequest(replica_id=busy.replica_id), timeout=10).replica
        assert drained.state == cpb.REPLICA_STATE_DRAINING
        harness.control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=1), timeout=10)
        survivor = harness.wait_tier("decode", 1).replicas[0]
        down_s = time.monotonic() - t1
        long.join(120)
    finally:
        load.finish()

    assert not load.failed, f"{len(load.failed)} failed requests, e.g. {load.failed[:3]}"
    assert load.ok > 0
    assert not long.error and long.tokens == LONG_TOKENS and long.finish_reason == "length"

    removed: list[Replica] = harness.on_loop(lambda: [r for r in harness.controller.removed
                                                      if r.tier == "decode" and r.draining_since is not None])
    assert len(removed) == 2 and busy.replica_id in {r.replica_id for r in removed}
    for r in removed:
        marked = r.draining_since
        assert marked is not None
        assert any(d[0] > marked for d in harness.dispatch_log), "no request was routed after the mark"
        late = [d for d in harness.dispatch_log if d[0] > marked and r.address in (d[2], d[3])]
        assert not late, f"{len(late)} requests routed to {r.replica_id} after it was marked draining"
        assert r.drain_acked and r.final_load is not None and r.removed_at is not None
        assert in_flight(r.final_load) == 0 and r.final_load.used_blocks == 0 and r.final_load.held_blocks == 0
    assert any(p for _, _, _, p in harness.dispatch_log), "no request was routed disaggregated"
    stats = harness.router.dispatcher.stats
    assert (stats.retries, stats.migrations) == (0, 0)
    held = next(r for r in removed if r.replica_id == busy.replica_id)
    assert held.draining_since is not None and held.removed_at is not None
    assert held.draining_since < long.ended_at <= held.removed_at, "the drain did not wait for the long request"

    deadline = time.monotonic() + 30
    while True:  # the survivor's Load, as the controller's probe reads it
        last = harness.on_loop(lambda: harness.controller.replicas[survivor.replica_id].load)
        if last is not None and last.used_blocks == 0 and in_flight(last) == 0:
            break
        assert time.monotonic() < deadline, f"blocks still used on the survivor: {last}"
        time.sleep(0.2)
    print(f"\n[controller] decode 1->3 ready in {up_s:.1f}s; 3->1 in {down_s:.1f}s (drain of the replica holding "
          f"a {LONG_TOKENS}-token request: {held.drain_seconds:.1f}s); 1->3->1 total {up_s + down_s:.1f}s; "
          f"{load.ok} requests under load, {len(load.failed)} failed")


def test_scaling_prefill_leaves_every_decode_replica_untouched(harness: Harness) -> None:
    """Prefill 1 -> 2 -> 1: the decode replicas keep their ids, worker PIDs and state throughout."""
    def decode() -> list[tuple[str, int, ReplicaState]]:
        return harness.on_loop(lambda: [(r.replica_id, r.pid, r.state) for r in harness.controller.of_tier("decode")])

    before = decode()
    assert before and all(s == ReplicaState.READY for _, _, s in before)
    harness.control.SetReplicas(cpb.SetReplicasRequest(tier="prefill", replicas=2), timeout=10)
    harness.wait_tier("prefill", 2)
    assert decode() == before
    harness.control.SetReplicas(cpb.SetReplicasRequest(tier="prefill", replicas=1), timeout=10)
    harness.wait_tier("prefill", 1)
    assert decode() == before
    for _, pid, _ in before:
        os.kill(pid, 0)  # still the same live process
    r = httpx.post(f"{harness.url}/v1/completions", timeout=60, json={
        "model": harness.model, "prompt": list(range(3, 140)), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text


def test_a_replica_whose_actor_died_is_replaced_and_its_worker_stopped(harness: Harness) -> None:
    """ray.kill of the prefill replica's actor (its worker process lives on, orphaned): the controller sees the
    actor gone, stops the worker by its PID, removes the group and starts a replacement; decode is untouched."""
    import ray

    decode = harness.on_loop(lambda: [(r.replica_id, r.pid) for r in harness.controller.of_tier("decode")])
    (old,) = harness.on_loop(lambda: harness.controller.of_tier("prefill"))
    ray.kill(old.actor, no_restart=True)
    deadline = time.monotonic() + 180
    while True:
        t = harness.tier("prefill")
        if t.ready == 1 and len(t.replicas) == 1 and t.replicas[0].replica_id != old.replica_id:
            break
        assert time.monotonic() < deadline, f"the prefill replica was not replaced: {t}"
        time.sleep(0.2)
    assert t.replicas[0].restarts == 1
    deadline = time.monotonic() + 30
    while _alive(old.pid):
        assert time.monotonic() < deadline, f"the orphaned worker {old.pid} still runs"
        time.sleep(0.1)
    assert harness.on_loop(lambda: [(r.replica_id, r.pid) for r in harness.controller.of_tier("decode")]) == decode


def test_a_replica_ray_cannot_place_yet_is_the_first_to_go_on_scale_down(harness: Harness) -> None:
    """Every free CPU of the Ray cluster is taken (as if the new replica's pod were pending): scaling decode 1 -> 2
    leaves the new replica STARTING; scaling back to 1 removes that one at once, and the ready replica serves on,
    untouched (a pending replica never holds a scale-down back)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    before = harness.on_loop(lambda: [(r.replica_id, r.pid) for r in harness.controller.of_tier("decode")])
    hog = placement_group([{"CPU": ray.available_resources()["CPU"]}])
    ray.get(hog.ready(), timeout=60)
    try:
        harness.control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=2), timeout=10)
        time.sleep(2.0)  # a few reconcile steps
        t = harness.tier("decode")
        assert (t.desired, t.ready, t.starting) == (2, 1, 1), t
        t1 = time.monotonic()
        harness.control.SetReplicas(cpb.SetReplicasRequest(tier="decode", replicas=1), timeout=10)
        harness.wait_tier("decode", 1, timeout_s=30)
        print(f"\n[controller] pending replica removed {time.monotonic() - t1:.2f}s after the scale-down")
    finally:
        remove_placement_group(hog)
    assert harness.on_loop(lambda: [(r.replica_id, r.pid) for r in harness.controller.of_tier("decode")]) == before
