"""The controller: holds every tier's replicas as Ray placement groups and converges actual to desired.

One asyncio task, the reconcile loop, wakes on every change of desired counts and at least every
``reconcile_interval_s``. Per tier, independently (scaling or repairing one tier never touches another's
replicas):

- **probe**: each READY or DRAINING replica's ``Load`` (its in-flight count for Status and for choosing what to
  drain) and each READY replica's actor ``alive()`` (its worker process). A dead worker or actor: FAILED.
- **scale up**: fewer active (STARTING + READY) replicas than desired starts new ones, each in its own task: a
  placement group with one bundle per rank of that tier (PACK, or STRICT_PACK for TP on GPUs:
  :meth:`ControllerConfig.strategy`; in Kubernetes each bundle also asks for the tier's
  Ray resource ``tandem_<tier>``, so it lands on that tier's pods), a :class:`WorkerReplica` actor in its first
  bundle, the worker process, then ``Health`` until SERVING, then registration (the :class:`Registrar`: the
  in-process router of ``tandem up``; with a Redis URL, its lease in the registry). Only then READY. A placement
  group that Ray cannot place yet (a pending pod) stays STARTING and never blocks a scale-down.
- **scale down**: more active replicas than desired drains the surplus, STARTING ones first (nothing runs there),
  then the READY ones with the least in-flight work. Draining: the registrar hears it first (the router stops
  choosing it), then the worker's ``Drain`` RPC marks it draining in the registry and makes it refuse new work;
  the controller polls its ``Load`` until no request, KV transfer or held block is left, bounded by
  ``drain_timeout_s``, and only then stops the actor and removes the placement group.
- **replace**: a FAILED replica is unregistered and removed; the scale-up step starts its replacement (with a
  growing back-off while replacements keep failing, so a model that cannot load does not spin).

A tier whose parallel layout (tp, pp, ep) its workers would refuse is refused once, when the controller is made
(:func:`layout_refusals`: the worker's own rules on the model's HF config): the loop never starts a replica of it,
so no placement group of it ever exists, and Status carries why (``TierStatus.refused``; the operator turns it into
the TandemDeployment's Degraded condition). A multi-rank tier's replica has ``max(tp, ep) * pp`` bundles.

Status is read from the :class:`Replica` records (controlplane/replica_state.py); the gRPC Control API
(controlplane/control_server.py) and ``tandem up`` (controlplane/local_cluster.py) drive it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import grpc

from auth.credentials import Credentials
from auth.grpc_client import aio_channel, attach
from controlplane.replica_state import TIERS, Replica, ReplicaState, holds_nothing, in_flight
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc

if TYPE_CHECKING:
    from ray.actor import ActorClass
    from ray.util.placement_group import PlacementGroup

    from controlplane.replica import WorkerReplica

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ControllerConfig:
    model: str
    prefill: int = 1
    decode: int = 1
    kv_backend: str = "tcp"  # every tier's unless the tier names its own below
    cpus_per_replica: float = 0.5  # per rank: each placement-group bundle asks for this many CPUs
    ranks: int = 1  # bundles per replica of a single-rank layout, every tier's unless the tier names its own; a
    # multi-rank layout (below) has exactly its world size: max(tp, ep) * pp (:meth:`ranks_of`)
    worker_flags: tuple[str, ...] = ()
    worker_host: str = "127.0.0.1"  # controlplane.replica.NODE_IP in a cluster: each node's own IP
    redis: str | None = None  # set: a replica is READY once its lease is in this registry
    drain_timeout_s: float = 120.0
    start_timeout_s: float = 300.0  # from a placed group to a healthy, registered worker
    reconcile_interval_s: float = 0.5
    max_replicas: int = 256  # per tier: SetReplicas above it is refused
    prefill_ranks: int | None = None  # None: ``ranks``
    decode_ranks: int | None = None
    prefill_kv_backend: str | None = None  # None: ``kv_backend``
    decode_kv_backend: str | None = None
    # (tp, pp, ep) of a tier's replicas: handed to its workers as --tp/--pp/--ep (worker/server.py checks them
    # against the model; its ranks are the worker's child processes, inside the replica's bundles)
    prefill_parallel: tuple[int, int, int] = (1, 1, 1)
    decode_parallel: tuple[int, int, int] = (1, 1, 1)
    # Each rank's torch threads in a tier (its workers' --threads; the operator derives them from a rank's CPUs).
    # None: whatever ``worker_flags`` say, else the worker's default (one thread under Ray's OMP_NUM_THREADS=1).
    prefill_threads: int | None = None
    decode_threads: int | None = None
    # Each bundle also asks for one unit of the Ray custom resource ``tandem_<tier>``, which the operator's worker
    # group of that tier advertises once per rank (operators/render_ray.py): a tier's replicas land only on its own
    # pods. Off for a local Ray (``tandem up``), which advertises no such resource.
    tier_resources: bool = False
    # Each worker's own /metrics (tandem worker --metrics-port): None: not served; 0: a free port (tandem up, on
    # loopback; advertised as Replica.metrics_address); a fixed port in a pod, where Prometheus finds it by name.
    worker_metrics_port: int | None = None
    # LoRA adapters (``NAME=DIR``, DIR on every node) that every replica of every tier serves (--lora NAME=DIR each):
    # prefill and decode both apply a disaggregated request's adapter (worker/lora_handoff.py)
    lora: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_lora(self.lora)
        from worker.launcher import KV_BACKENDS

        for name in ("kv_backend", "prefill_kv_backend", "decode_kv_backend"):
            backend = getattr(self, name)
            if backend is not None and backend not in KV_BACKENDS:
                raise ValueError(f"unknown {name} {backend!r} (choose from {', '.join(KV_BACKENDS)})")
        for name in ("prefill_ranks", "decode_ranks", "prefill_threads", "decode_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_parallel", "decode_parallel"):
            if len(getattr(self, name)) != 3 or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be (tp, pp, ep), each >= 1, got {getattr(self, name)}")
        for tier, n in (("prefill", self.prefill), ("decode", self.decode)):
            if not 0 <= n <= self.max_replicas:
                raise ValueError(f"{tier} replicas must be in [0, {self.max_replicas}], got {n}")
        if self.cpus_per_replica <= 0 or self.ranks < 1:
            raise ValueError(f"need cpus_per_replica > 0 and ranks >= 1, got {self.cpus_per_replica}/{self.ranks}")
        for tier in TIERS:
            world = self.world_size(tier)
            own = self.prefill_ranks if tier == "prefill" else self.decode_ranks
            given = ("ranks", self.ranks) if own is None else (f"{tier}_ranks", own)
            if world > 1 and given[1] not in (world, 1 if own is None else world):
                tp, pp, ep = self.parallel_of(tier)
                raise ValueError(f"{given[0]} {given[1]} disagrees with the {tier} layout tp={tp} pp={pp} ep={ep}, "
                                 f"which has max(tp, ep) x pp = {world} ranks")
        if self.worker_metrics_port is not None and not 0 <= self.worker_metrics_port < 65536:
            raise ValueError(f"worker_metrics_port {self.worker_metrics_port} out of range")
        if min(self.drain_timeout_s, self.start_timeout_s, self.reconcile_interval_s) <= 0:
            raise ValueError("drain_timeout_s, start_timeout_s and reconcile_interval_s must be > 0")

    def parallel_of(self, tier: str) -> tuple[int, int, int]:
        """``(tp, pp, ep)`` of a ``tier`` replica."""
        return self.prefill_parallel if tier == "prefill" else self.decode_parallel

    def world_size(self, tier: str) -> int:
        """A ``tier`` replica's ranks by its layout: ``max(tp, ep) * pp`` (engine/parallel/config.py)."""
        tp, pp, ep = self.parallel_of(tier)
        return max(tp, ep) * pp

    def ranks_of(self, tier: str) -> int:
        """Bundles per ``tier`` replica: its layout's world size when that is above 1 (an explicit count that
        disagrees is refused in ``__post_init__``), else the tier's own count, else ``ranks`` (a single-rank worker
        then only reserves the extra bundles' CPUs)."""
        if self.world_size(tier) > 1:
            return self.world_size(tier)
        own = self.prefill_ranks if tier == "prefill" else self.decode_ranks
        return self.ranks if own is None else own

    def tier_flags(self, tier: str) -> tuple[str, ...]:
        """The worker flags of a ``tier`` replica's ranks: its layout (none for a single rank) and each rank's
        threads when the tier names them (after ``worker_flags``, so they win as argparse reads them)."""
        tp, pp, ep = self.parallel_of(tier)
        threads = self.prefill_threads if tier == "prefill" else self.decode_threads
        return (*(f for name, n in (("--tp", tp), ("--pp", pp), ("--ep", ep)) if n > 1 for f in (name, str(n))),
                *(("--threads", str(threads)) if threads is not None else ()))

    def kv_backend_of(self, tier: str) -> str:
        own = self.prefill_kv_backend if tier == "prefill" else self.decode_kv_backend
        return self.kv_backend if own is None else own

    @property
    def device(self) -> str:
        """The workers' ``--device`` (the last one in ``worker_flags``, as argparse reads them; cpu if none)."""
        device = "cpu"
        flags = self.worker_flags
        for i, flag in enumerate(flags):
            if flag == "--device" and i + 1 < len(flags):
                device = flags[i + 1]
            elif flag.startswith("--device="):
                device = flag.split("=", 1)[1]
        return device

    def strategy(self, tier: str) -> str:
        """The placement strategy of a ``tier`` replica's group: STRICT_PACK when its ranks are TP ranks on GPUs
        (a TP group all-reduces twice per layer: every rank on one node, over NVLink or PCIe, never across the
        network), PACK otherwise (one node when one has room, else spilling onto others rather than waiting; the
        ranks still run as the worker's child processes on the first bundle's node, so spilled bundles only
        reserve CPUs elsewhere)."""
        tp = (self.prefill_parallel if tier == "prefill" else self.decode_parallel)[0]
        return "STRICT_PACK" if tp > 1 and self.device.startswith("cuda") else "PACK"

    def bundles(self, tier: str) -> list[dict[str, float]]:
        """The placement-group bundles of one ``tier`` replica: one per rank."""
        bundle = {"CPU": self.cpus_per_replica}
        if self.tier_resources:
            bundle[tier_resource(tier)] = 1.0
        return [dict(bundle) for _ in range(self.ranks_of(tier))]


def replica_placement_group(cfg: ControllerConfig, tier: str, name: str) -> PlacementGroup:
    """A new ``tier`` replica's placement group (Ray places it asynchronously): one bundle per rank, in
    :meth:`ControllerConfig.strategy`'s strategy."""
    from ray.util.placement_group import placement_group

    return placement_group(cfg.bundles(tier), strategy=cfg.strategy(tier), name=name)


def layout_refusals(cfg: ControllerConfig) -> dict[str, str]:
    """Each tier whose parallel layout its workers would refuse, with why ("decode: tensor parallel size 3 must
    divide the attention heads (8)"): the worker's own check (:func:`worker.server.parallel_config`: the model's
    heads, layers and experts, and the ranks' KV between tiers), run here on the model's HF config before any
    placement group exists. Single-rank tiers are not checked. A model directory this process cannot read (a path
    only the worker nodes mount, a hub name) is left to the workers, with a warning."""
    import argparse

    refused: dict[str, str] = {}
    for tier in TIERS:
        if cfg.world_size(tier) == 1:
            continue
        from worker.server import parallel_config

        tp, pp, ep = cfg.parallel_of(tier)
        args = argparse.Namespace(model=cfg.model, tp=tp, pp=pp, ep=ep, kv_backend=cfg.kv_backend_of(tier), role=tier)
        try:
            parallel = parallel_config(args)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as e:
            log.warning("%s layout tp=%d pp=%d ep=%d not checked here: %s (the workers check it)", tier, tp, pp, ep, e)
        except ValueError as e:
            refused[tier] = f"{tier}: {e}"
        else:
            from worker.server import kv_split_by_tp

            # A decode worker whose ranks are stages or experts serves colocated requests only (it refuses Reserve):
            # beside a prefill tier every disaggregated request would fail, so the tier is refused, as tandem up does.
            if tier == "decode" and cfg.prefill > 0 and not kv_split_by_tp(parallel):
                refused[tier] = (f"decode: pp={pp} ep={ep} ranks do not hold KV split by TP, so they cannot land the "
                                 "prefill tier's KV (use --tp, with --ep equal to it, or run without a prefill tier)")
    return refused


def tier_resource(tier: str) -> str:
    """The Ray custom resource that only ``tier``'s nodes (pods) advertise."""
    return f"tandem_{tier}"


class Registrar(Protocol):
    """Who routes to the replicas: told when one is ready, is about to drain, and is gone."""

    async def ready(self, replica: Replica) -> None: ...
    def draining(self, replica: Replica) -> None: ...
    async def removed(self, replica: Replica) -> None: ...


class Controller:
    def __init__(self, cfg: ControllerConfig, registrar: Registrar | None = None,
                 on_change: Callable[[], None] | None = None, credentials: Credentials | None = None) -> None:
        """``on_change`` is called after every replica started, failed to start, or was removed. ``credentials``:
        the cluster token (and TLS files) for the workers' RPCs; default: this process's cluster token."""
        self.cfg = cfg
        self.credentials = credentials if credentials is not None else Credentials.for_cluster()
        self.registrar = registrar
        self.on_change = on_change
        self.desired = {"prefill": cfg.prefill, "decode": cfg.decode}
        self.replicas: dict[str, Replica] = {}
        self.removed: collections.deque[Replica] = collections.deque(maxlen=256)  # most recent last
        self.changed = asyncio.Event()  # set on every state change (waiters re-check)
        self._wake = asyncio.Event()
        self._stubs: dict[str, tuple[grpc.aio.Channel, wpb_grpc.WorkerStub]] = {}
        self._registered: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # replica id -> its start or drain task
        self._failures = dict.fromkeys(TIERS, 0)  # consecutive failed starts or deaths, per tier
        self._next_start = dict.fromkeys(TIERS, 0.0)  # back-off: no new replica of the tier before this time
        self._loop_task: asyncio.Task[None] | None = None
        # tier -> why its layout is refused: no placement group of that tier is ever created; Status carries it
        self.refused = layout_refusals(cfg)
        for why in self.refused.values():
            log.error("layout refused, no replica of the tier will be placed: %s", why)

    # ---- API -------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="tandem-controller")

    def set_replicas(self, tier: str, n: int) -> None:
        """Desired replicas of ``tier``; ValueError for an unknown tier or a count out of range."""
        check_tier(tier)
        if not 0 <= n <= self.cfg.max_replicas:
            raise ValueError(f"replicas must be in [0, {self.cfg.max_replicas}], got {n}")
        self.desired[tier] = n
        self._wake.set()

    def drain(self, replica_id: str) -> Replica:
        """Drain one active replica and lower its tier's desired count by one; KeyError if there is none."""
        r = self.replicas.get(replica_id)
        if r is None or not r.active:
            raise KeyError(f"no starting or ready replica {replica_id!r}")
        self.desired[r.tier] = max(0, self.desired[r.tier] - 1)
        self._begin_drain(r)
        return r

    def of_tier(self, tier: str) -> list[Replica]:
        return sorted((r for r in self.replicas.values() if r.tier == tier), key=lambda r: r.created)

    def converged(self) -> bool:
        """Every tier has exactly its desired replicas READY and none starting, draining or failed."""
        return all(len(self.of_tier(t)) == self.desired[t] and all(r.state == ReplicaState.READY
                                                                      for r in self.of_tier(t)) for t in TIERS)

    async def wait_converged(self, timeout_s: float) -> None:
        """TimeoutError if not converged within ``timeout_s``; ValueError at once if a tier that should have
        replicas has a refused layout (it never will)."""
        deadline = time.monotonic() + timeout_s
        while not self.converged():
            refused = [why for t, why in self.refused.items() if self.desired[t] > 0]
            if refused:
                raise ValueError("; ".join(refused))
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                states = {t: [(r.replica_id, r.state.name) for r in self.of_tier(t)] for t in TIERS}
                raise TimeoutError(f"replicas not converged to {self.desired} within {timeout_s}s: {states}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))

    async def register_ready(self) -> None:
        """Register every READY replica not yet registered (a registrar set after they started)."""
        for r in list(self.replicas.values()):
            if r.state == ReplicaState.READY and r.replica_id not in self._registered and self.registrar:
                await self.registrar.ready(r)
                self._registered.add(r.replica_id)

    async def close(self) -> None:
        """Stop every replica now (no drain: the whole deployment is going away)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(self._stop(r) for r in list(self.replicas.values())), return_exceptions=True)

    # ---- the reconcile loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before the step: a change made while it runs wakes the next one at once
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.reconcile_interval_s)

    async def _reconcile(self) -> None:
        await self._probe()
        for r in [r for r in self.replicas.values() if r.state == ReplicaState.FAILED and r.replica_id not in
                  self._tasks]:
            self._spawn(r, self._remove(r))
        now = time.monotonic()
        for tier in TIERS:
            active = [r for r in self.of_tier(tier) if r.active]
            surplus = len(active) - self.desired[tier]
            if surplus > 0:
                # STARTING first (nothing runs there; it may be a group Ray cannot place), then least in flight
                for r in sorted(active, key=lambda r: (r.state == ReplicaState.READY, r.in_flight))[:surplus]:
                    self._begin_drain(r)
            elif surplus < 0 and now >= self._next_start[tier] and tier not in self.refused:
                for _ in range(-surplus):
                    self._begin_start(tier)

    async def _probe(self) -> None:
        """READY replicas only: a draining one is polled by its drain task, a starting one by its start task."""
        await asyncio.gather(*(self._probe_one(r) for r in self.replicas.values() if r.state == ReplicaState.READY))

    async def _probe_one(self, r: Replica) -> None:
        load = await self._load(r, 2.0)
        if load is not None:
            r.load = load
        try:
            alive = await _ray(r.actor.alive.remote(), 5.0)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor died (or its node did)
            log.warning("replica %s: actor unreachable (%s)", r.replica_id, e)
            alive = False
        if not alive and r.state == ReplicaState.READY:
            log.warning("replica %s (%s at %s) died; replacing it", r.replica_id, r.tier, r.address)
            self._fail(r)

    def _fail(self, r: Replica) -> None:
        r.state = ReplicaState.FAILED
        self._failures[r.tier] += 1
        self._next_start[r.tier] = time.monotonic() + min(30.0, 0.5 * 2 ** (self._failures[r.tier] - 1))
        self.changed.set()
        self._wake.set()

    def _spawn(self, r: Replica, coro: Any) -> None:
        task = asyncio.create_task(coro, name=f"tandem-replica-{r.replica_id}")
        self._tasks[r.replica_id] = task
        rid = r.replica_id
        task.add_done_callback(lambda t: self._done(rid, t))

    def _done(self, replica_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(replica_id) is task:
            del self._tasks[replica_id]
        if not task.cancelled() and task.exception() is not None:
            log.error("replica %s task failed: %r", replica_id, task.exception())
        if self.on_change is not None:
            self.on_change()
        self.changed.set()
        self._wake.set()

    # ---- scale up --------------------------------------------------------------------------------------------

    def _begin_start(self, tier: str) -> None:
        r = Replica(f"{tier}-{uuid.uuid4().hex[:8]}", tier, self.cfg.ranks_of(tier), restarts=self._failures[tier])
        self.replicas[r.replica_id] = r
        self._spawn(r, self._start(r))
        self.changed.set()

    async def _start(self, r: Replica) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from controlplane.replica import ReplicaSpec, WorkerReplica

        spec = ReplicaSpec(r.tier, self.cfg.model, self.cfg.kv_backend_of(r.tier), self.cfg.cpus_per_replica,
                           (*self._flags(), *self.cfg.tier_flags(r.tier),
                            *(f for a in self.cfg.lora for f in ("--lora", a))), self.cfg.worker_host)
        try:
            r.placement_group = replica_placement_group(self.cfg, r.tier, f"tandem-{r.replica_id}")
            await _ray(r.placement_group.ready(), None)  # unbounded: a pending group waits for capacity
            # @ray.remote made WorkerReplica an ActorClass (mypy keeps a decorated class's own type)
            actor_cls = cast("ActorClass[WorkerReplica]", WorkerReplica)
            r.actor = actor_cls.options(num_cpus=self.cfg.cpus_per_replica, scheduling_strategy=(
                PlacementGroupSchedulingStrategy(placement_group=r.placement_group,
                                                 placement_group_bundle_index=0))).remote(spec)
            deadline = time.monotonic() + self.cfg.start_timeout_s
            r.address = await _ray(r.actor.start.remote(), self.cfg.start_timeout_s)
            r.pid = await _ray(r.actor.pid.remote(), 30.0)
            r.metrics_address = await _ray(r.actor.metrics_address.remote(), 30.0)
            await self._wait_serving(r, deadline)
            if self.cfg.redis:
                from controlplane.registry import wait_registered

                await wait_registered(self.cfg.redis, r.address, deadline - time.monotonic(), self.credentials.token)
            if self.registrar is not None:
                await self.registrar.ready(r)
                self._registered.add(r.replica_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.error("replica %s failed to start: %s", r.replica_id, e)
            self._fail(r)
            return
        r.state = ReplicaState.READY
        self._failures[r.tier] = 0
        log.info("replica %s (%s) ready at %s", r.replica_id, r.tier, r.address)

    def _flags(self) -> tuple[str, ...]:
        flags = self.cfg.worker_flags
        if self.cfg.redis and "--redis" not in flags:
            flags = (*flags, "--redis", self.cfg.redis)
        if self.cfg.worker_metrics_port is not None and "--metrics-port" not in flags:
            flags = (*flags, "--metrics-port", str(self.cfg.worker_metrics_port))
        return flags

    async def _wait_serving(self, r: Replica, deadline: float) -> None:
        _, stub = self._stub(r)
        while True:
            try:
                h = await stub.Health(wpb.HealthRequest(), timeout=2.0)
                if h.status == "SERVING":
                    r.worker_id = h.worker_id
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {r.address} not serving within {self.cfg.start_timeout_s}s")
            await asyncio.sleep(0.1)

    # ---- scale down ------------------------------------------------------------------------------------------

    def _begin_drain(self, r: Replica) -> None:
        was_ready = r.state == ReplicaState.READY
        r.state = ReplicaState.DRAINING
        r.draining_since = time.monotonic()
        start = self._tasks.pop(r.replica_id, None)
        if start is not None:  # still starting: stop that first
            start.cancel()
        if was_ready and self.registrar is not None and r.replica_id in self._registered:
            self.registrar.draining(r)  # the router stops choosing it before the worker starts refusing
        self._spawn(r, self._drain(r, start))
        self.changed.set()

    async def _drain(self, r: Replica, start: asyncio.Task[None] | None) -> None:
        if start is not None:
            await asyncio.gather(start, return_exceptions=True)
        if r.address:
            _, stub = self._stub(r)
            try:
                await stub.Drain(wpb.DrainRequest(), timeout=5.0)
                r.drain_acked = True
            except grpc.aio.AioRpcError as e:  # still waited for below: the router has stopped sending it work
                log.warning("replica %s: Drain refused (%s: %s)", r.replica_id, e.code().name, e.details())
            deadline = r.draining_since + self.cfg.drain_timeout_s if r.draining_since else 0.0
            while True:
                load = await self._load(r)
                if load is None:  # no answer: the worker is gone, nothing left to wait for
                    break
                r.load = r.final_load = load
                if in_flight(load) == 0 and load.held_blocks == 0:
                    break
                if time.monotonic() > deadline:
                    log.warning("replica %s: drain timed out after %.0fs with %d in flight", r.replica_id,
                                self.cfg.drain_timeout_s, in_flight(load))
                    break
                await asyncio.sleep(0.1)
            if r.final_load is not None and not holds_nothing(r.final_load):
                log.warning("replica %s leaves with blocks held: %s", r.replica_id, r.final_load)
        if r.draining_since is not None:
            r.drain_seconds = time.monotonic() - r.draining_since
        await self._remove(r)

    async def _remove(self, r: Replica) -> None:
        """Unregister ``r``, stop its worker and actor, remove its placement group and forget it."""
        if r.replica_id in self._registered and self.registrar is not None:
            with contextlib.suppress(Exception):
                await self.registrar.removed(r)
        self._registered.discard(r.replica_id)
        await self._stop(r)
        self.replicas.pop(r.replica_id, None)
        r.removed_at = time.monotonic()
        self.removed.append(r)
        log.info("replica %s (%s) removed", r.replica_id, r.tier)

    async def _stop(self, r: Replica) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if r.actor is not None:
            try:
                await _ray(r.actor.stop.remote(), 30.0)
            except Exception as e:  # the actor is dead or stuck: its worker process may be left without a parent
                log.warning("replica %s: actor stop failed (%r)", r.replica_id, e)
                if self.cfg.worker_host == "127.0.0.1":  # a worker on this host: stop it by its PID
                    _kill_worker(r.pid)
            with contextlib.suppress(Exception):
                ray.kill(r.actor)
        if r.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(r.placement_group)
        chan = self._stubs.pop(r.replica_id, None)
        if chan is not None:
            await chan[0].close()

    # ---- worker RPCs -----------------------------------------------------------------------------------------

    def _stub(self, r: Replica) -> tuple[grpc.aio.Channel, wpb_grpc.WorkerStub]:
        got = self._stubs.get(r.replica_id)
        if got is None:
            channel = aio_channel(r.address, self.credentials, ())
            got = self._stubs[r.replica_id] = (channel, attach(wpb_grpc.WorkerStub(channel), self.credentials))
        return got

    async def _load(self, r: Replica, timeout_s: float = 5.0) -> wpb.LoadResponse | None:
        if not r.address:
            return None
        try:
            return await self._stub(r)[1].Load(wpb.LoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None


def _kill_worker(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a ``tandem worker`` process (a PID is reused once its process is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"worker" not in f.read().split(b"\0"):
                return
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def check_lora(adapters: tuple[str, ...]) -> None:
    """ValueError unless each is ``NAME=DIR`` with a distinct NAME (the worker checks the adapter itself)."""
    names = []
    for a in adapters:
        name, sep, path = a.partition("=") if isinstance(a, str) else ("", "", "")
        if not sep or not name or not path:
            raise ValueError(f"lora adapters are NAME=DIR, got {a!r}")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError(f"lora adapter names must be unique, got {names}")


def check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r} (choose from {', '.join(TIERS)})")


async def _ray(ref: Any, timeout_s: float | None) -> Any:
    """Await a Ray ObjectRef from asyncio, bounded by ``timeout_s`` (None: unbounded)."""
    fut = asyncio.wrap_future(ref.future())
    return await (fut if timeout_s is None else asyncio.wait_for(fut, timeout_s))
