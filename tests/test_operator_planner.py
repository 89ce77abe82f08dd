"""The planner loop in the operator (operators/autoscale.py): a real Prometheus, the real kopf operator, a TandemTier
scale written from a decision, and the decision's state kept across an operator restart.

What is real and what stands in:
- Prometheus is the real server (tests/prom_harness.py), scraping every second a real HTTP ``/metrics`` endpoint that
  this test serves with ``prometheus_client``. That endpoint stands in for a loaded router: it exports the router's
  metric families under their catalogue names, buckets and labels (router/metric_catalogue.py), with values the test
  controls (a request rate fed into the histograms and counters by a thread, and the per-worker gauges).
- The operator is the real kopf registry (``operators.handlers.build_registry``) against kmock, which stands in for
  the Kubernetes API server since none can run here (no scale subresource semantics: kmock applies the ``/scale``
  patch to the TandemTier itself).
- The controller's ``Control`` API is a real gRPC server, token-guarded as the real one is, with a fake servicer
  (no Ray here) that converges as the real controller does: new replicas are STARTING for a moment, and a scale-down
  marks the surplus DRAINING, holding its GPUs until the drain ends, before they are gone.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kmock
import kopf
import pytest
import yaml
from prom_harness import Prometheus, free_port
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from test_operator_kmock import _RESOURCES, NAMESPACE, TD_PATH, td_manifest, until

from auth.credentials import Credentials
from auth.grpc_server import CONTROL_ADMIN_METHODS, AdminGuard, add_port
from auth.token import new_token
from operators.autoscaling import SELECTOR
from operators.config import OperatorConfig
from operators.handlers import build_registry
from operators.planner.forecast import HoltState
from operators.planner.planner import PlannerState, TierState
from operators.planner_store import dump, load
from operators.prometheus import METRICS, PrometheusError, observations, queries
from operators.spec import SpecError, parse
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc
from router.metric_catalogue import BY_NAME, exported_series
from router.metric_catalogue import spec as metric

TD = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: llama, namespace: serving}
spec:
  model: {source: {pvc: {claimName: models, path: llama-3-8b}}}
  prefill: {replicas: 1, kvBackend: tcp, resources: {limits: {nvidia.com/gpu: "1"}}}
  decode: {scaling: {min: 1, max: 4}, kvBackend: tcp, resources: {limits: {nvidia.com/gpu: "1"}}}
  slo: {ttft: {percentile: 90, targetMs: 500}, itl: {percentile: 90, targetMs: 50}}
  redis: {inCluster: true}
  security: {mtls: {enabled: false}}
  autoscaling:
    enabled: true
    prometheusUrl: PROMETHEUS
    selector: 'job="tandem"'
    gpuBudget: 4
    intervalSeconds: 1
    windowSeconds: 3
    mode: predictive
    prefillTokensPerSecond: 1000000
    decodeTokensPerSecond: 200
    scaleUpCooldownSeconds: 0
    scaleDownCooldownSeconds: 20
    scaleDownWindows: 2
"""
GPUS = {"prefill": 1, "decode": 1}
BUDGET = 4
BOUNDS = {"prefill": (1, 1), "decode": (1, 4)}


# -- the endpoint that stands in for a loaded router ------------------------------------------------------------


@dataclass
class Load:
    """What the router would be seeing: requests per second and their shape, and each worker's last Load."""

    rate: float = 0.0
    prompt_tokens: int = 200
    output_tokens: int = 100
    cached_fraction: float = 0.25
    ttft_s: float = 0.2
    itl_s: float = 0.03
    workers: dict[str, tuple[str, float, int, int]] = field(default_factory=dict)  # id -> role, queue, used, free


class FakeRouterMetrics:
    """A ``/metrics`` endpoint with the router's families; a thread feeds ``load.rate`` requests per second."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.load = Load()
        self.lock = threading.Lock()

        def hist(name: str) -> Histogram:
            m = metric(name)
            return Histogram(m.name, m.help, list(m.labels), buckets=m.buckets, registry=self.registry)

        def gauge(name: str) -> Gauge:
            m = metric(name)
            return Gauge(m.name, m.help, list(m.labels), registry=self.registry)

        self.prompt, self.generation = hist("tandem_request_prompt_tokens"), hist("tandem_request_generation_tokens")
        self.ttft, self.itl = hist("tandem_ttft_seconds"), hist("tandem_itl_seconds")
        self.prompt_total = Counter("tandem_prompt_tokens", metric("tandem_prompt_tokens").help,
                                    registry=self.registry)
        self.cached_total = Counter("tandem_prompt_cached_tokens", metric("tandem_prompt_cached_tokens").help,
                                    registry=self.registry)
        self.up, self.queue = gauge("tandem_worker_up"), gauge("tandem_worker_queue_depth")
        self.used, self.free = gauge("tandem_kv_blocks_used"), gauge("tandem_kv_blocks_free")
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def set(self, **changes: Any) -> None:
        with self.lock:
            for key, value in changes.items():
                setattr(self.load, key, value)
            workers = dict(self.load.workers)
        for wid, (role, q, u, f) in workers.items():
            self.up.labels(wid, role).set(1)
            self.queue.labels(wid, role).set(q)
            self.used.labels(wid, role).set(u)
            self.free.labels(wid, role).set(f)

    def _feed(self) -> None:
        owed, last = 0.0, time.monotonic()
        deadline = last + 300  # bounded however the test ends
        while not self.stop.wait(0.1) and time.monotonic() < deadline:
            now = time.monotonic()
            with self.lock:
                ld = copy.copy(self.load)
            owed += ld.rate * (now - last)
            last = now
            while owed >= 1:
                owed -= 1
                self.prompt.observe(ld.prompt_tokens)
                self.generation.observe(ld.output_tokens)
                self.ttft.labels("disaggregated").observe(ld.ttft_s)
                self.itl.observe(ld.itl_s)
                self.prompt_total.inc(ld.prompt_tokens)
                self.cached_total.inc(ld.prompt_tokens * ld.cached_fraction)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.server.shutdown()
        self.server.server_close()


# -- the controller's Control API, converging as the real one does ------------------------------------------------


@dataclass
class Replica:
    rid: str
    state: cpb.ReplicaState
    since: float


class ConvergingControl(cpb_grpc.ControlServicer):
    """SetReplicas up: new replicas STARTING for ``start_s``, then READY. Down: the surplus (starting ones first)
    DRAINING for ``drain_s``, then gone. ``held`` records the GPUs held after every call (draining ones included)."""

    def __init__(self, initial: dict[str, int], start_s: float = 0.3, drain_s: float = 2.0) -> None:
        self.lock = threading.Lock()
        self.start_s, self.drain_s = start_s, drain_s
        self.next_id = 0
        self.tiers: dict[str, list[Replica]] = {t: [self._new(t, cpb.REPLICA_STATE_READY) for _ in range(n)]
                                                for t, n in initial.items()}
        self.desired = dict(initial)
        self.calls: list[tuple[str, int]] = []
        self.held: list[int] = []
        self.draining_seen: dict[str, int] = {t: 0 for t in initial}

    def _new(self, tier: str, state: cpb.ReplicaState) -> Replica:
        self.next_id += 1
        return Replica(f"{tier}-{self.next_id}", state, time.monotonic())

    def _advance(self) -> None:
        now = time.monotonic()
        for tier, reps in self.tiers.items():
            for r in reps:
                if r.state == cpb.REPLICA_STATE_STARTING and now - r.since >= self.start_s:
                    r.state, r.since = cpb.REPLICA_STATE_READY, now
            self.tiers[tier] = [r for r in reps if not (r.state == cpb.REPLICA_STATE_DRAINING
                                                        and now - r.since >= self.drain_s)]

    def _status(self, tier: str) -> cpb.TierStatus:
        reps = self.tiers[tier]
        count = {s: sum(r.state == s for r in reps) for s in (cpb.REPLICA_STATE_READY, cpb.REPLICA_STATE_STARTING,
                                                              cpb.REPLICA_STATE_DRAINING)}
        self.draining_seen[tier] = max(self.draining_seen[tier], count[cpb.REPLICA_STATE_DRAINING])
        return cpb.TierStatus(tier=tier, desired=self.desired[tier], ready=count[cpb.REPLICA_STATE_READY],
                              starting=count[cpb.REPLICA_STATE_STARTING], draining=count[cpb.REPLICA_STATE_DRAINING],
                              replicas=[cpb.ReplicaStatus(replica_id=r.rid, tier=tier, state=r.state) for r in reps])

    def SetReplicas(self, request: cpb.SetReplicasRequest, context: grpc.ServicerContext) -> cpb.SetReplicasResponse:
        with self.lock:
            self._advance()
            tier, n = request.tier, request.replicas
            self.calls.append((tier, n))
            self.desired[tier] = n
            reps = self.tiers[tier]
            active = [r for r in reps if r.state != cpb.REPLICA_STATE_DRAINING]
            now = time.monotonic()
            for _ in range(n - len(active)):
                reps.append(self._new(tier, cpb.REPLICA_STATE_STARTING))
            surplus = sorted(active, key=lambda r: r.state != cpb.REPLICA_STATE_STARTING)[:max(len(active) - n, 0)]
            for r in surplus:
                r.state, r.since = cpb.REPLICA_STATE_DRAINING, now
            self.held.append(sum(len(rs) * GPUS[t] for t, rs in self.tiers.items()))
            return cpb.SetReplicasResponse(tier=self._status(tier))

    def Status(self, request: cpb.StatusRequest, context: grpc.ServicerContext) -> cpb.StatusResponse:
        with self.lock:
            self._advance()
            return cpb.StatusResponse(tiers=[self._status(t) for t in self.tiers])


# -- kmock and the operator, separately, so that the operator can be restarted over the same API server ----------


@dataclass
class Api:
    k: Any  # kmock.KubernetesEmulator
    url: str

    def obj(self, plural: str, name: str) -> dict[str, Any] | None:
        for (res, ns, n), o in list(self.k.objects.items()):
            if res.plural == plural and ns == NAMESPACE and n == name and not o.deleted:
                return copy.deepcopy(dict(o.raw))
        return None

    def events(self, reason: str) -> list[dict[str, Any]]:
        """Events posted with ``reason`` (from kmock's request log: it stores only one Event, as it does not
        implement the generateName kopf posts them with)."""
        return [dict(r.data) for r in list(self.k) if str(getattr(r.method, "value", r.method)).upper() == "POST"
                and r.url.path.endswith("/events") and isinstance(r.data, dict) and r.data.get("reason") == reason]

    def autoscaling(self) -> dict[str, Any]:
        return dict(((self.obj("tandemdeployments", "llama") or {}).get("status") or {}).get("autoscaling") or {})


@contextlib.asynccontextmanager
async def api_server(token: str) -> AsyncIterator[Api]:
    async with kmock.KubernetesEmulator() as k, kmock.Server(k) as srv:
        for key, kind, namespaced, subresources in _RESOURCES:
            if not key.startswith("monitoring."):
                k.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources=subresources,
                                                      verbs={"get", "list", "watch", "create", "patch", "delete"})
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": "tandem-cluster-token", "namespace": NAMESPACE},
                  "data": {"token": base64.b64encode(token.encode()).decode()}}
        async with k.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret) as resp:
            assert resp.status in (200, 201), await resp.text()
        yield Api(k, str(srv.url).rstrip("/"))


@contextlib.asynccontextmanager
async def operator(api: Api, control_port: int) -> AsyncIterator[None]:
    cfg = OperatorConfig(control_address=f"127.0.0.1:{control_port}", kube_url=api.url, status_interval_s=1.0,
                         status_initial_delay_s=0.2, retry_delay_s=1.0, autoscale_tick_s=0.25)
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    settings.posting.level = 30
    settings.persistence.consistency_timeout = 0.2  # kmock has no resourceVersion
    settings.queueing.exit_timeout = 0.5
    stop = asyncio.Event()
    task = asyncio.create_task(kopf.operator(registry=build_registry(cfg), settings=settings, clusterwide=True,
                                             standalone=True, stop_flag=stop))
    try:
        yield
        assert not task.done(), f"the operator stopped: {task.exception() if task.done() else ''}"
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


@contextlib.contextmanager
def control_server(control: ConvergingControl, token: str) -> Iterator[int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         interceptors=[AdminGuard(token, CONTROL_ADMIN_METHODS)])
    cpb_grpc.add_ControlServicer_to_server(control, server)
    port = add_port(server, "127.0.0.1:0", Credentials(token))
    server.start()
    try:
        yield port
    finally:
        server.stop(grace=None)


def _workers(role: str, n: int, queue: float, used: int, free: int) -> dict[str, tuple[str, float, int, int]]:
    return {f"{role}-{i}": (role, queue, used, free) for i in range(n)}


@pytest.mark.slow
def test_planner_scales_decode_up_within_budget_resumes_after_restart_and_drains_down(tmp_path: Path) -> None:
    """High load makes the planner scale the decode TandemTier up, trimmed by the GPU budget (4 GPUs, prefill holds
    one, so decode stops at 3 of its max 4) with the reason in status and a ScaledUp Event; the operator restarts
    and the new one resumes the old one's state (the decode tier's cool-down since its scale-up, read from
    .status.autoscaling.state); the load ends and, once sustained and past the cool-down, decode drains to its
    minimum, one hysteresis step per decision (3 -> 2 -> 1), through the controller's drain (replicas DRAINING, GPUs
    held until they are gone), never below it."""
    router = FakeRouterMetrics()
    prom = Prometheus([f"127.0.0.1:{router.port}"], tmp_path)
    token = new_token()
    control = ConvergingControl({"prefill": 1, "decode": 1})
    reasons: list[tuple[float, str]] = []

    async def scenario(control_port: int) -> None:
        router.set(rate=8.0, workers={**_workers("prefill", 1, 1, 100, 900), **_workers("decode", 1, 2, 600, 400)})
        prom.wait_for('tandem_request_prompt_tokens_count{job="tandem"} > 0', timeout_s=60)
        td = td_manifest(TD.replace("PROMETHEUS", prom.url))
        async with api_server(token) as api:
            async def watch_reasons() -> None:
                while True:
                    r = (api.autoscaling().get("tiers") or {}).get("decode", {}).get("reason")
                    if r and (not reasons or reasons[-1][1] != r):
                        reasons.append((time.time(), r))
                    await asyncio.sleep(0.1)
            watcher = asyncio.create_task(watch_reasons())
            async with operator(api, control_port):
                async with api.k.post(TD_PATH, json=td) as resp:
                    assert resp.status in (200, 201), await resp.text()
                await until(lambda: ("decode", 3) in control.calls, timeout=30, what="SetReplicas(decode, 3)")
                tier = api.obj("tandemtiers", "llama-decode")
                assert tier is not None and tier["spec"]["replicas"] == 3
                scaled = await until(lambda: api.events("ScaledUp"), what="a ScaledUp Event")
                assert scaled[0]["message"].startswith("scale decode up 1 -> ")
                assert {e["involvedObject"]["kind"] for e in scaled} == {"TandemDeployment", "TandemTier"}
                # at 8 req/s x 100 tokens, decode needs 5 replicas of 200 tok/s at 80%: max 4, and the budget 3
                await until(lambda: "budget: 4 GPUs allow 3" in (api.autoscaling().get("tiers") or {}).get(
                    "decode", {}).get("reason", ""), timeout=20, what="the budget named as the reason")
                # the forecast's smoothed level climbs toward the observed 8 req/s over the ticks (CI once read 4.0)
                await until(lambda: ((api.autoscaling().get("state") or {}).get("forecast") or {}).get(
                    "level", 0) > 4, timeout=20, what="the forecast level above 4")
                st = api.autoscaling()
                assert st["tiers"]["prefill"]["desired"] == 1 and st["observed"]["requestRate"] > 4
                changed = st["state"]["tiers"]["decode"]["lastChangeTime"]
                assert changed is not None and st["state"]["forecast"]["level"] > 4
            # the operator is gone; the load ends while it is away; a new operator (nothing in memory) takes over
            router.set(rate=0.0, workers={**_workers("prefill", 1, 0, 10, 990), **_workers("decode", 3, 0, 50, 950)})
            restarted = time.time()
            async with operator(api, control_port):
                await until(lambda: any(t > restarted and r.startswith("cool-down after a change")
                                        for t, r in reasons), timeout=30,
                            what=f"the resumed cool-down ({changed=}, {restarted=}, decode's reasons: {reasons})")
                # the cool-down is measured from the scale-up the first operator made
                assert api.autoscaling()["state"]["tiers"]["decode"]["lastChangeTime"] == changed
                # one hysteresis step (20%) per decision, the reactive mode's, which bounds the predictive one:
                # 3 -> 2, and after another cool-down 2 -> 1
                def downs() -> list[int]:  # decode's SetReplicas since its scale-up, repeats folded
                    ns = [n for t, n in control.calls if t == "decode"]
                    ns = ns[len(ns) - ns[::-1].index(3):]
                    return [n for i, n in enumerate(ns) if not i or ns[i - 1] != n]

                await until(lambda: downs()[-1:] == [1], timeout=90, what=f"SetReplicas(decode, 1) ({control.calls})")
                assert downs() == [2, 1], control.calls
                drained = await until(lambda: api.events("Draining"), what="a Draining Event")
                assert "drain 1 of 3 decode replicas -> 2" in drained[0]["message"]
                # not before the cool-down since the first operator's change
                assert api.autoscaling()["state"]["tiers"]["decode"]["lastChangeTime"] - changed >= 20
                st = api.autoscaling()
                assert st["tiers"]["decode"]["drain"] in (0, 1)  # 1 when decided, 0 on the next decision
                await until(lambda: control.draining_seen["decode"] == 1, what="a decode replica draining")
                await until(lambda: (api.obj("tandemtiers", "llama-decode") or {}).get("spec", {}).get(
                    "replicas") == 1, what="the TandemTier scaled to 1")
                await asyncio.sleep(2.5)  # more decisions at no load: the minimum holds
            watcher.cancel()
        assert any(r.startswith("sustaining 1/2") for t, r in reasons if t > restarted)
        for name, n in control.calls:
            lo, hi = BOUNDS[name]
            assert lo <= n <= hi, f"SetReplicas({name}, {n}) outside [{lo}, {hi}]"
        assert ("decode", 4) not in control.calls
        assert max(control.held) <= BUDGET, f"GPUs held {control.held} above the budget {BUDGET}"

    try:
        with control_server(control, token) as port:
            asyncio.run(scenario(port))
    finally:
        prom.stop()
        router.close()


# -- the pieces, without a cluster --------------------------------------------------------------------------------


def test_every_query_reads_a_metric_the_router_exports() -> None:
    """operators may not import the router: its metric names are checked against the catalogue here."""
    assert set(METRICS) <= set(BY_NAME)
    series = exported_series()
    for expr in queries('job="tandem"', 60).values():
        for token in expr.replace("(", " ").replace("{", " ").split():
            if token.startswith("tandem_"):
                assert token in series, f"{token} in {expr!r} is not exported by the router"


def _result(value: float, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value)]


def test_observations_from_query_results_fill_every_field_and_nan_means_not_measured() -> None:
    results = {key: _result(math.nan) for key in queries("", 60)}
    results.update(workers=_result(4), rate=_result(2.5), input_mean=_result(180), input_p90=_result(450),
                   output_mean=_result(90), hit_rate=_result(0.3), itl_p90=_result(0.04),
                   queue=[({"role": "prefill"}, 3.0), ({"role": "decode"}, 1.0)],
                   kv=[({"role": "decode"}, 0.7)])
    from operators.prometheus import TierCounts
    obs = observations(results, 100.0, 30.0, {"prefill": TierCounts(1), "decode": TierCounts(2, 1, 1)})
    assert obs.request_rate == 2.5 and obs.input_len.mean == 180 and obs.input_len.p90 == 450
    assert obs.output_len.mean == 90 and obs.output_len.p90 == 0.0  # NaN: no requests measured
    assert obs.prefix_hit_rate == 0.3 and obs.itl.p90 == 0.04 and obs.ttft.p90 is None
    decode = obs.tier("decode")
    assert decode is not None and (decode.ready, decode.starting, decode.draining) == (2, 1, 1)
    assert decode.queue_depth == 1.0 and decode.kv_utilisation == 0.7
    prefill = obs.tier("prefill")
    assert prefill is not None and prefill.queue_depth == 3.0 and prefill.kv_utilisation == 0.0
    results["workers"] = []
    with pytest.raises(PrometheusError, match="no tandem_worker_up series match the selector"):
        observations(results, 100.0, 30.0, {"decode": TierCounts(1)})


def test_planner_state_round_trips_through_the_status() -> None:
    state = PlannerState(HoltState(3.5, -0.25), {"decode": TierState(1_700_000_000.5, 2), "prefill": TierState()})
    saved = yaml.safe_load(yaml.safe_dump(dump(state, 1_700_000_010.0)))  # as JSON/YAML through the API server
    assert saved["tiers"]["prefill"]["lastChangeTime"] is None
    assert load(saved) == (state, 1_700_000_010.0)
    assert load(None) is None and load({"forecast": {}}) is None


def _td(autoscaling: dict[str, Any], **spec: Any) -> dict[str, Any]:
    td: dict[str, Any] = yaml.safe_load(TD.replace("PROMETHEUS", "http://prometheus:9090"))
    td["spec"]["autoscaling"] = autoscaling
    td["spec"].update(spec)
    return td


def test_autoscaling_spec_builds_the_planner_config_from_tiers_and_slos() -> None:
    td = _td({"enabled": True, "prometheusUrl": "http://prometheus:9090", "gpuBudget": 20, "queueHigh": 6,
              "scaleDownWindows": 4}, decode={"scaling": {"min": 1, "max": 4}, "tp": 2, "kvBackend": "tcp",
                                              "resources": {"limits": {"nvidia.com/gpu": "1"}}})
    a = parse(td).autoscaling
    assert a is not None and a.interval_s == 30 and a.window_s == 60
    assert a.matchers("llama", "serving") == 'namespace="serving",service="llama-router-metrics"'
    cfg = a.planner
    assert cfg.gpu_budget == 20 and cfg.queue_high == 6 and cfg.scale_down_windows == 4
    assert cfg.ttft_slo_s == 0.5 and cfg.itl_slo_s == 0.05
    assert cfg.tier("decode").gpus_per_replica == 2 and (cfg.tier("decode").min_replicas,
                                                        cfg.tier("decode").max_replicas) == (1, 4)
    assert (cfg.tier("prefill").min_replicas, cfg.tier("prefill").max_replicas) == (1, 1)  # fixed replicas: pinned
    assert parse(_td({"enabled": False})).autoscaling is None


@pytest.mark.parametrize(("autoscaling", "message"), [
    ({"enabled": True, "prometheusUrl": "http://p:9090"}, "spec.autoscaling.gpuBudget is required"),
    ({"enabled": True, "gpuBudget": 4}, "spec.autoscaling.prometheusUrl is required"),
    ({"enabled": True, "prometheusUrl": "p:9090", "gpuBudget": 4}, "must start with http:// or https://"),
    ({"enabled": True, "prometheusUrl": "http://p", "gpuBudget": 1}, "gpu_budget=1 is below the tiers' minimums"),
    ({"enabled": True, "prometheusUrl": "http://p", "gpuBudget": 4, "selector": 'job="x"} or vector(1'},
     "is not a list of PromQL label matchers"),
    ({"enabled": True, "prometheusUrl": "http://p", "gpuBudget": 4, "queueLow": 5}, "need 0 <= queue_low < queue_high"),
    ({"enabled": True, "prometheusUrl": "http://p", "gpuBudget": 4, "mode": "psychic"}, "mode 'psychic' is not one of"),
    ({"enabled": True, "prometheusUrl": "http://p", "gpuBudget": 4, "intervalSeconds": 90, "windowSeconds": 30},
     "windowSeconds=30.0 must be >= intervalSeconds=90.0"),
])
def test_a_bad_autoscaling_spec_is_a_spec_error_naming_the_field(autoscaling: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as e:
        parse(_td(autoscaling))
    assert message in str(e.value)


def test_selector_takes_label_matchers_only() -> None:
    assert SELECTOR.match('namespace="serving", service=~"llama-.*"')
    assert not SELECTOR.match('job="a"}) or up{job="b"')


@pytest.mark.slow
def test_an_unreachable_prometheus_is_reported_once_and_scales_nothing() -> None:
    """Against kmock (no kube-apiserver can run here) with a Prometheus URL nothing listens on: no decision is made,
    the tiers keep their replicas, status.autoscaling.message names the failure, and one Warning Event is posted
    however many ticks retry."""
    token = new_token()
    control = ConvergingControl({"prefill": 1, "decode": 1})

    async def scenario(control_port: int) -> None:
        async with api_server(token) as api, operator(api, control_port):
            async with api.k.post(TD_PATH, json=td_manifest(TD.replace("PROMETHEUS",
                                                                       f"http://127.0.0.1:{free_port()}"))) as resp:
                assert resp.status in (200, 201), await resp.text()
            message = await until(lambda: api.autoscaling().get("message"), timeout=30, what="the reported failure")
            assert message.startswith("MetricsUnavailable: querying http://127.0.0.1:")
            await asyncio.sleep(2.0)  # several more ticks, each retrying
            warnings = api.events("MetricsUnavailable")
            assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
            assert "lastDecisionTime" not in api.autoscaling()
            assert set(control.calls) <= {("prefill", 1), ("decode", 1)}  # the TandemTiers' own counts forwarded
            assert (api.obj("tandemtiers", "llama-decode") or {}).get("spec", {}).get("replicas") == 1

    with control_server(control, token) as port:
        asyncio.run(scenario(port))
