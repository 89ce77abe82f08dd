"""Test harness for the operator: kmock's Kubernetes emulator on 127.0.0.1, a fake ``Control`` gRPC server, and the
real kopf operator (``operators.handlers.build_registry``) running against both in one event loop.

No kube-apiserver can run on this machine or in CI, so kmock (by kopf's author) stands in for it; it has no
resourceVersion, schema validation or scale subresource, so a TandemDeployment is stored with a fixed
resourceVersion and a scale is a merge patch of the TandemTier's ``spec.replicas``. The Control server is real
gRPC on 127.0.0.1 with a fake servicer, since no Ray cluster runs here; it is guarded as the real one is (the
cluster token on SetReplicas, mutual TLS with a throwaway CA's certificate for the name ``tandem``), and the
operator reads both from the TandemDeployment's Secrets, which the harness creates in kmock.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import re
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import kmock
import kopf
import pytest
import yaml
from prometheus_client import REGISTRY

from auth.credentials import Credentials
from auth.dev_certs import DevCA
from auth.grpc_server import CONTROL_ADMIN_METHODS, AdminGuard, add_port
from auth.token import new_token
from operators.config import OperatorConfig
from operators.handlers import build_registry
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc

NAMESPACE = "serving"
TD_PATH = f"/apis/tandem.dev/v1alpha1/namespaces/{NAMESPACE}/tandemdeployments"
TT_PATH = f"/apis/tandem.dev/v1alpha1/namespaces/{NAMESPACE}/tandemtiers"
WRITES = ("POST", "PATCH", "PUT", "DELETE")

TD_YAML = """
apiVersion: tandem.dev/v1alpha1
kind: TandemDeployment
metadata: {name: llama, namespace: serving}
spec:
  image: {repository: ghcr.io/tandem-dev/tandem, tag: "0.1.0"}
  model:
    source: {pvc: {claimName: models, path: llama-3-8b}}
    dtype: bfloat16
  router: {replicas: 2, apiKeySecret: {name: tandem-keys, key: api-keys}}
  prefill: {replicas: 2, tp: 1, kvBackend: nixl, resources: {limits: {nvidia.com/gpu: "1"}}}
  decode:
    scaling: {min: 1, max: 4}
    tp: 2
    kvBackend: nixl
    resources: {requests: {cpu: "4", memory: 32Gi}, limits: {nvidia.com/gpu: "1"}}
  slo: {ttft: {percentile: 99, targetMs: 500}, itl: {percentile: 99, targetMs: 50}}
  redis: {inCluster: true}
  security: {mtls: {enabled: true, secretName: tandem-mtls}}
"""

_RESOURCES = [  # (group/version/plural, kind, namespaced, subresources)
    ("tandem.dev/v1alpha1/tandemdeployments", "TandemDeployment", True, {"status"}),
    ("tandem.dev/v1alpha1/tandemtiers", "TandemTier", True, {"status", "scale"}),
    ("ray.io/v1/rayclusters", "RayCluster", True, {"status"}),
    ("apps/v1/deployments", "Deployment", True, {"status", "scale"}),
    ("v1/services", "Service", True, set()),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, set()),
    ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ("monitoring.coreos.com/v1/servicemonitors", "ServiceMonitor", True, set()),
    ("monitoring.coreos.com/v1/podmonitors", "PodMonitor", True, set()),
    ("v1/events", "Event", True, set()),
    ("v1/secrets", "Secret", True, set()),
    ("v1/namespaces", "Namespace", False, set()),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
]


def td_manifest(text: str = TD_YAML) -> dict[str, Any]:
    td: dict[str, Any] = yaml.safe_load(text)
    # What the API server adds on create (kmock does not); kopf's patches test resourceVersion.
    td["metadata"].update(namespace=NAMESPACE, uid="0b7c5a8e-0000-4000-8000-000000000001", generation=1,
                          resourceVersion="1")
    return td


class FakeControl(cpb_grpc.ControlServicer):
    """Records SetReplicas calls; Status reports every desired replica ready (no Ray here)."""

    def __init__(self, initial: dict[str, int]) -> None:
        self.lock = threading.Lock()
        self.desired = dict(initial)
        self.calls: list[tuple[str, int]] = []
        self.peers: set[str] = set()  # the common names of the client certificates that called
        self.refused: dict[str, str] = {}  # tier -> the controller's refusal of its layout: no replica placed

    def _tier(self, tier: str) -> cpb.TierStatus:
        if tier in self.refused:
            return cpb.TierStatus(tier=tier, desired=self.desired[tier], refused=self.refused[tier])
        n = self.desired[tier]
        return cpb.TierStatus(tier=tier, desired=n, ready=n, replicas=[
            cpb.ReplicaStatus(replica_id=f"{tier}-{i}", tier=tier, state=cpb.REPLICA_STATE_READY) for i in range(n)])

    def _peer(self, context: grpc.ServicerContext) -> None:
        for name in context.auth_context().get("x509_common_name", []):
            self.peers.add(name.decode())

    def SetReplicas(self, request: cpb.SetReplicasRequest, context: grpc.ServicerContext) -> cpb.SetReplicasResponse:
        self._peer(context)
        with self.lock:
            self.calls.append((request.tier, request.replicas))
            self.desired[request.tier] = request.replicas
            return cpb.SetReplicasResponse(tier=self._tier(request.tier))

    def Status(self, request: cpb.StatusRequest, context: grpc.ServicerContext) -> cpb.StatusResponse:
        self._peer(context)
        with self.lock:
            return cpb.StatusResponse(tiers=[self._tier(t) for t in self.desired])


@dataclass
class Cluster:
    k: Any  # kmock.KubernetesEmulator
    control: FakeControl
    url: str
    secrets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> the Secret created

    def obj(self, plural: str, name: str) -> dict[str, Any] | None:
        for (res, ns, n), o in list(self.k.objects.items()):
            if res.plural == plural and ns == NAMESPACE and n == name and not o.deleted:
                return copy.deepcopy(dict(o.raw))
        return None

    def objects(self) -> list[dict[str, Any]]:
        skip = {"tandemdeployments", "events", "namespaces", "customresourcedefinitions", "secrets"}
        return [copy.deepcopy(dict(o.raw)) for (res, _, _), o in list(self.k.objects.items())
                if res.plural not in skip and not o.deleted]

    def events(self) -> list[dict[str, Any]]:
        return [dict(o.raw) for (res, _, _), o in list(self.k.objects.items()) if res.plural == "events"]

    def writes(self, exclude_plural: tuple[str, ...] = ()) -> list[tuple[str, str]]:
        out = []
        for r in list(self.k):
            method = str(getattr(r.method, "value", r.method)).upper()
            if method in WRITES and not any(f"/{p}" in r.url.path for p in exclude_plural):
                out.append((method, r.url.path))
        return out

    def gets(self, path: str) -> int:
        return sum(1 for r in list(self.k) if str(getattr(r.method, "value", r.method)).upper() == "GET"
                   and r.url.path == path)

    async def ticks(self, n: int, path: str = "/apis/monitoring.coreos.com") -> None:
        """Wait until ``n`` more reconciles ran (each asks whether the monitoring API exists, then renders)."""
        target = self.gets(path) + n
        await until(lambda: self.gets(path) >= target, what=f"{n} more reconciles")

    async def create_td(self, td: dict[str, Any]) -> None:
        async with self.k.post(TD_PATH, json=td) as resp:
            assert resp.status in (200, 201), await resp.text()

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        async with self.k.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"}) as resp:
            assert resp.status == 200, await resp.text()


async def until(check: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running_operator(initial: dict[str, int] | None = None, interval_s: float = 1.0,
                           monitoring: bool = False, kuberay: bool = True) -> AsyncIterator[Cluster]:
    control = FakeControl(initial or {"prefill": 2, "decode": 1})
    certs = tempfile.TemporaryDirectory(prefix="tandem-kmock-")
    ca = DevCA.create(certs.name)
    token = new_token()
    server_tls = ca.issue(certs.name, "controller", dns_names=("tandem",))
    client_tls = ca.issue(certs.name, "tandem-operator")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         interceptors=[AdminGuard(token, CONTROL_ADMIN_METHODS)])
    cpb_grpc.add_ControlServicer_to_server(control, server)
    port = add_port(server, "127.0.0.1:0", Credentials(token, server_tls))
    server.start()
    async with kmock.KubernetesEmulator() as k, kmock.Server(k) as srv:
        for key, kind, namespaced, subresources in _RESOURCES:
            if (key.startswith("monitoring.") and not monitoring) or (key.startswith("ray.io") and not kuberay):
                continue
            k.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources=subresources,
                                                  verbs={"get", "list", "watch", "create", "patch", "delete"})
        url = str(srv.url).rstrip("/")
        cert_pem, key_pem, ca_pem = client_tls.read()
        secrets: list[tuple[str, dict[str, bytes]]] = [("tandem-cluster-token", {"token": token.encode()})]
        secrets.append(("tandem-mtls", {"tls.crt": cert_pem, "tls.key": key_pem, "ca.crt": ca_pem}))
        created = {}
        for name, data in secrets:
            secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                      "metadata": {"name": name, "namespace": NAMESPACE},
                      "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
            async with k.post(f"/api/v1/namespaces/{NAMESPACE}/secrets", json=secret) as resp:
                assert resp.status in (200, 201), await resp.text()
            created[name] = secret
        cfg = OperatorConfig(control_address=f"127.0.0.1:{port}", kube_url=url,
                             status_interval_s=interval_s, status_initial_delay_s=0.2, retry_delay_s=1.0)
        settings = kopf.OperatorSettings()
        settings.scanning.disabled = True
        settings.posting.level = 30
        # kmock has no resourceVersion, so kopf's wait for its own patch to come back on the watch never ends early.
        settings.persistence.consistency_timeout = 0.2
        settings.queueing.exit_timeout = 0.5
        stop = asyncio.Event()
        task = asyncio.create_task(kopf.operator(registry=build_registry(cfg), settings=settings, clusterwide=True,
                                                 standalone=True, stop_flag=stop))
        try:
            yield Cluster(k, control, url, created)
            assert not task.done(), f"the operator stopped: {task.exception() if task.done() else ''}"
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=30)
            finally:
                server.stop(grace=None)
                certs.cleanup()


pytestmark = pytest.mark.slow  # each test runs the operator, kmock and a gRPC server for several seconds


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _owned_by_td(obj: dict[str, Any], td: dict[str, Any]) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == td["metadata"]["uid"] and r.get("kind") == "TandemDeployment" and r.get("controller")
               and r.get("name") == td["metadata"]["name"] for r in refs)


EXPECTED = {  # (kind, name) the fixture TandemDeployment becomes (monitoring on)
    ("TandemTier", "llama-prefill"), ("TandemTier", "llama-decode"), ("RayCluster", "llama"),
    ("Deployment", "llama-redis"), ("Service", "llama-redis"), ("Deployment", "llama-router"),
    ("Service", "llama-router"), ("Service", "llama-router-metrics"), ("ServiceMonitor", "llama"),
    ("PodMonitor", "llama-workers"),
    ("PodDisruptionBudget", "llama-router"), ("PodDisruptionBudget", "llama-prefill"),
    ("PodDisruptionBudget", "llama-decode"), ("NetworkPolicy", "llama-workers"), ("NetworkPolicy", "llama-head"),
    ("NetworkPolicy", "llama-redis"),
}


def _kinds(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objs}


def _ready(c: Cluster) -> bool:
    td = c.obj("tandemdeployments", "llama") or {}
    conditions = {x["type"]: x for x in (td.get("status") or {}).get("conditions") or []}
    return conditions.get("Progressing", {}).get("status") == "False" or conditions.get("Ready", {}).get(
        "status") == "False"


def test_create_makes_every_object_owned_by_the_deployment_and_reports_status() -> None:
    """Against kmock (no kube-apiserver can run here): a created TandemDeployment becomes every expected object,
    each with a controller ownerReference to it; the timer writes status from the fake controller's Status;
    deleting it completes."""
    async def scenario() -> None:
        td = td_manifest()
        async with running_operator(monitoring=True) as c:
            await c.create_td(td)
            await until(lambda: _kinds(c.objects()) >= EXPECTED, what="every owned object")
            objs = c.objects()
            assert _kinds(objs) == EXPECTED
            assert all(_owned_by_td(o, td) for o in objs)
            status = await until(lambda: (c.obj("tandemdeployments", "llama") or {}).get("status", {}).get("tiers"),
                                 what="status.tiers")
            assert status == {"prefill": {"desired": 2, "ready": 2, "draining": 0},
                              "decode": {"desired": 1, "ready": 1, "draining": 0}}
            st = c.obj("tandemdeployments", "llama")["status"]  # type: ignore[index]
            assert st["prefill"] == "2/2" and st["decode"] == "1/1" and st["observedGeneration"] == 1
            conditions = {x["type"]: x for x in st["conditions"]}
            # kmock has no Deployment controller: the router's readyReplicas never appear, so it stays not Ready.
            assert conditions["Ready"]["status"] == "False" and "router 0/2 ready" in conditions["Ready"]["message"]
            assert conditions["Degraded"]["status"] == "False"
            tt = await until(lambda: (c.obj("tandemtiers", "llama-decode") or {}).get("status", {}).get(
                "readyReplicas"), what="TandemTier status")
            assert tt == 1
            assert c.obj("tandemtiers", "llama-decode")["status"]["selector"] == (  # type: ignore[index]
                "tandem.dev/deployment=llama,tandem.dev/tier=decode")
            labels = {"namespace": NAMESPACE, "deployment": "llama", "tier": "prefill", "state": "ready"}
            assert REGISTRY.get_sample_value("tandem_operator_tier_replicas", labels) == 2
            assert (REGISTRY.get_sample_value("tandem_operator_object_writes_total",
                                              {"kind": "RayCluster", "outcome": "created"}) or 0) >= 1
            # Deletion is not held up: kopf's finalizer (it has a timer on the object) comes off at once; the owned
            # objects go with the API server's garbage collector, which kmock does not run.
            async with c.k.delete(f"{TD_PATH}/llama") as resp:
                assert resp.status == 200
            await until(lambda: c.obj("tandemdeployments", "llama") is None, what="the TandemDeployment deleted")
    _run(scenario())


def test_scaling_a_tier_calls_set_replicas_clamped_and_is_not_reset_by_reconcile() -> None:
    """Against kmock (no kube-apiserver can run here; no scale subresource either, so `kubectl scale` is a merge
    patch of spec.replicas): the controller's SetReplicas (a real gRPC server with a fake servicer) gets the new
    count, clamped to scaling.max with a Warning Event; the TandemTier keeps its hand-set count across timer
    reconciles; a change of the TandemDeployment's own replicas rewrites the TandemTier."""
    async def scenario() -> None:
        async with running_operator(interval_s=0.5) as c:
            await c.create_td(td_manifest())
            await until(lambda: c.obj("tandemtiers", "llama-decode"), what="the decode TandemTier")
            await c.patch(f"{TT_PATH}/llama-decode", {"spec": {"replicas": 3}})
            await until(lambda: ("decode", 3) in c.control.calls, what="SetReplicas(decode, 3)")
            # past the token guard, over mTLS with the certificate from the deployment's Secret
            assert c.control.peers == {"tandem-operator"}
            await c.patch(f"{TT_PATH}/llama-decode", {"spec": {"replicas": 9}})
            await until(lambda: ("decode", 4) in c.control.calls, what="SetReplicas(decode, 4), clamped")
            assert ("decode", 9) not in c.control.calls
            await until(lambda: any(e.get("reason") == "Clamped" for e in c.events()), what="a Clamped Event")
            await c.ticks(4)
            assert c.obj("tandemtiers", "llama-decode")["spec"]["replicas"] == 9  # type: ignore[index]
            assert c.control.desired["decode"] == 4
            td = c.obj("tandemdeployments", "llama")
            assert td is not None
            await c.patch(f"{TD_PATH}/llama", {"metadata": {"generation": 2}, "spec": {"prefill": {"replicas": 3}}})
            await until(lambda: (c.obj("tandemtiers", "llama-prefill") or {}).get("spec", {}).get("replicas") == 3,
                        what="the prefill TandemTier rewritten")
            await until(lambda: ("prefill", 3) in c.control.calls, what="SetReplicas(prefill, 3)")
    _run(scenario())


def test_a_missing_token_secret_is_reported_and_no_call_is_made_until_it_exists() -> None:
    """Against kmock (no kube-apiserver can run here): without the cluster-token Secret the operator makes no Control
    call at all (the controller would refuse it), reports Ready=Unknown naming the Secret, and once the Secret is
    created forwards a tier change through the token-guarded SetReplicas."""
    async def scenario() -> None:
        async with running_operator(interval_s=0.5) as c:
            async with c.k.delete(f"/api/v1/namespaces/{NAMESPACE}/secrets/tandem-cluster-token") as resp:
                assert resp.status == 200
            await c.create_td(td_manifest())

            def ready() -> dict[str, Any] | None:
                st = (c.obj("tandemdeployments", "llama") or {}).get("status") or {}
                return next((x for x in st.get("conditions") or [] if x["type"] == "Ready"), None)
            cond = await until(lambda: ready() if (ready() or {}).get("reason") == "ControllerUnreachable" else None,
                               what="Ready=Unknown for the missing Secret")
            assert cond["status"] == "Unknown" and f"Secret {NAMESPACE}/tandem-cluster-token does not exist" in cond[
                "message"]
            await c.patch(f"{TT_PATH}/llama-decode", {"spec": {"replicas": 2}})
            await c.ticks(3)
            assert c.control.calls == [] and c.control.peers == set()
            async with c.k.post(f"/api/v1/namespaces/{NAMESPACE}/secrets",
                                json=c.secrets["tandem-cluster-token"]) as resp:
                assert resp.status in (200, 201)
            await until(lambda: ("decode", 2) in c.control.calls, what="SetReplicas(decode, 2) once the Secret exists")
    _run(scenario())


def test_hand_edit_of_an_owned_object_is_reasserted() -> None:
    """Against kmock (no kube-apiserver can run here): someone edits the router Deployment's replicas and image
    (NVIDIA Dynamo #4420's fight); the operator patches both back, and keeps a label it does not own; a Service
    deleted by hand comes back."""
    async def scenario() -> None:
        async with running_operator(interval_s=30.0) as c:  # the owned-object watch, not the timer, must do it
            await c.create_td(td_manifest())
            router = await until(lambda: c.obj("deployments", "llama-router"), what="the router Deployment")
            image = router["spec"]["template"]["spec"]["containers"][0]["image"]
            path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama-router"
            await c.patch(path, {"metadata": {"labels": {"team": "ml"}},
                                 "spec": {"replicas": 5, "template": {"spec": {"containers": [
                                     {"name": "router", "image": "attacker/router:latest"}]}}}})
            def restored() -> bool:
                d = c.obj("deployments", "llama-router") or {}
                containers = d.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
                return d.get("spec", {}).get("replicas") == 2 and containers[0].get("image") == image
            await until(restored, timeout=20, what="the router Deployment re-asserted")
            d = c.obj("deployments", "llama-router")
            assert d is not None and d["metadata"]["labels"]["team"] == "ml"
            assert d["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["-m", "router.serve"]
            async with c.k.delete(f"/api/v1/namespaces/{NAMESPACE}/services/llama-router-metrics") as resp:
                assert resp.status == 200
            await until(lambda: c.obj("services", "llama-router-metrics"), timeout=20, what="the Service recreated")
    _run(scenario())


def test_bad_spec_sets_degraded_with_an_event_and_no_retry_loop() -> None:
    """Against kmock (no kube-apiserver, hence no CEL here): replicas together with scaling gets Degraded=True
    with reason InvalidSpec, one Warning Event, no owned object, and no retry loop; fixing the spec recovers."""
    async def scenario() -> None:
        td = td_manifest()
        td["spec"]["decode"]["replicas"] = 2  # beside scaling: exclusive
        async with running_operator(interval_s=0.5) as c:
            await c.create_td(td)
            def degraded() -> dict[str, Any] | None:
                st = (c.obj("tandemdeployments", "llama") or {}).get("status") or {}
                return next((x for x in st.get("conditions") or [] if x["type"] == "Degraded"), None)
            cond = await until(degraded, what="the Degraded condition")
            assert cond["status"] == "True" and cond["reason"] == "InvalidSpec"
            assert "spec.decode: replicas and scaling are exclusive" in cond["message"]
            events = await until(lambda: [e for e in c.events() if e.get("reason") == "InvalidSpec"],
                                 what="an InvalidSpec Event")
            assert events[0]["type"] == "Warning" and "exclusive" in events[0]["message"]
            await c.ticks(3)
            writes = len(c.writes())
            await c.ticks(5)
            assert len(c.writes()) == writes, "the operator kept writing for an unchanged bad spec"
            assert len([e for e in c.events() if e.get("reason") == "InvalidSpec"]) == 1
            assert c.objects() == []
            await c.patch(f"{TD_PATH}/llama", {"metadata": {"generation": 2}, "spec": {"decode": {"replicas": None}}})
            await until(lambda: c.obj("deployments", "llama-router"), what="objects after the fix")
            await until(lambda: degraded() and degraded()["status"] == "False", what="Degraded=False")  # type: ignore[index]
    _run(scenario())


def test_a_layout_the_controller_refuses_lands_in_the_deployments_status(checkpoint: Callable[[str], Path]) -> None:
    """Against kmock (no kube-apiserver, no Ray here): the operator cannot read the model, so a decode tier of tp 3
    on an 8-head model passes its spec checks; the controller refuses it. The fake servicer reports the refusal the
    real controller's rule (``controlplane.controller.layout_refusals`` on the tiny Llama's config) gives, and the
    TandemDeployment turns Degraded with reason InvalidLayout and that message; once the controller accepts the
    layout again, Degraded clears (issue 27)."""
    from controlplane.controller import ControllerConfig, layout_refusals

    refused = layout_refusals(ControllerConfig(str(checkpoint("llama")), decode_parallel=(3, 1, 1)))
    assert refused == {"decode": "decode: tensor parallel size 3 must divide the attention heads (8)"}

    async def scenario() -> None:
        td = td_manifest()
        td["spec"]["decode"]["tp"] = 3
        async with running_operator(interval_s=0.5) as c:
            c.control.refused = dict(refused)
            await c.create_td(td)
            def condition(kind: str) -> dict[str, Any] | None:
                st = (c.obj("tandemdeployments", "llama") or {}).get("status") or {}
                return next((x for x in st.get("conditions") or [] if x["type"] == kind), None)
            cond = await until(lambda: condition("Degraded") if (condition("Degraded") or {}).get("reason") ==
                               "InvalidLayout" else None, what="Degraded=True, InvalidLayout")
            assert cond["status"] == "True" and cond["message"] == refused["decode"]
            ready = condition("Ready")
            assert ready is not None and (ready["status"], ready["reason"]) == ("False", "InvalidLayout")
            assert (c.obj("tandemdeployments", "llama") or {})["status"]["decode"] == "0/1"
            c.control.refused.clear()  # the layout fixed and the controller restarted with it
            await until(lambda: (condition("Degraded") or {}).get("reason") == "AsExpected", what="Degraded cleared")
    _run(scenario())


def test_an_api_server_error_is_retried_not_fatal() -> None:
    """Against kmock (no kube-apiserver can run here): the first reads of the router Deployment fail with 500; the
    reconcile raises kopf.TemporaryError(delay=1s), kopf retries it, and the Deployment is created after that."""
    async def scenario() -> None:
        async with running_operator(interval_s=60.0) as c:
            path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama-router"
            c.k["get", path][:3] << 500
            await c.create_td(td_manifest())
            await until(lambda: c.obj("deployments", "llama-router"), what="the router Deployment after retries")
            assert c.gets(path) >= 4
            await until(lambda: c.obj("networkpolicies", "llama-redis"), what="the rest of the list")
    _run(scenario())


def test_objects_the_deployment_no_longer_renders_are_deleted() -> None:
    """Against kmock (no kube-apiserver can run here): switching Redis from in-cluster to an external URL deletes
    the in-cluster Redis Deployment, Service and NetworkPolicy; an object of the same kind that the TandemDeployment
    does not own is left alone."""
    async def scenario() -> None:
        async with running_operator(interval_s=60.0) as c:
            await c.create_td(td_manifest())
            await until(lambda: c.obj("networkpolicies", "llama-redis"), what="the in-cluster Redis objects")
            foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {
                "name": "llama-notes", "namespace": NAMESPACE,
                "labels": {"tandem.dev/deployment": "llama", "app.kubernetes.io/managed-by": "tandem-operator"}},
                "spec": {"ports": [{"port": 80}]}}
            async with c.k.post(f"/api/v1/namespaces/{NAMESPACE}/services", json=foreign) as resp:
                assert resp.status in (200, 201)
            await c.patch(f"{TD_PATH}/llama", {"metadata": {"generation": 2},
                                               "spec": {"redis": {"inCluster": None, "url": "redis://r.ext:6379/0"}}})
            await until(lambda: c.obj("deployments", "llama-redis") is None and c.obj("services", "llama-redis") is None
                        and c.obj("networkpolicies", "llama-redis") is None, what="the Redis objects deleted")
            router = c.obj("deployments", "llama-router")
            assert router is not None and "redis://r.ext:6379/0" in router["spec"]["template"]["spec"][
                "containers"][0]["args"]
            assert c.obj("services", "llama-notes") is not None  # no ownerReference to the TandemDeployment
    _run(scenario())


def test_a_cluster_without_kuberay_gets_degraded_missing_api_once() -> None:
    """Against kmock (no kube-apiserver can run here), with no ray.io API served: Degraded=True with reason
    MissingAPI naming KubeRay, one Warning Event however many timer ticks retry it, and no crash."""
    async def scenario() -> None:
        async with running_operator(interval_s=0.3, kuberay=False) as c:
            (c.k ** 100)[re.compile(r"/apis/ray\.io/.*")] << 404  # kmock would serve any resource sent to it
            await c.create_td(td_manifest())
            def degraded() -> dict[str, Any] | None:
                st = (c.obj("tandemdeployments", "llama") or {}).get("status") or {}
                return next((x for x in st.get("conditions") or [] if x["type"] == "Degraded"), None)
            cond = await until(degraded, what="the Degraded condition")
            assert cond["status"] == "True" and cond["reason"] == "MissingAPI" and "KubeRay" in cond["message"]
            await c.ticks(5)
            assert len([e for e in c.events() if e.get("reason") == "MissingAPI"]) == 1
    _run(scenario())


def test_reconciling_twice_changes_nothing() -> None:
    """Against kmock (no kube-apiserver can run here): once settled, further reconciles (timer ticks, each
    re-rendering and comparing every owned object) issue no write at all."""
    async def scenario() -> None:
        async with running_operator(interval_s=0.3) as c:
            await c.create_td(td_manifest())
            monitors = {("ServiceMonitor", "llama"), ("PodMonitor", "llama-workers")}
            await until(lambda: _kinds(c.objects()) >= EXPECTED - monitors, what="objects")
            await until(lambda: (c.obj("tandemtiers", "llama-decode") or {}).get("status", {}).get("readyReplicas"),
                        what="settled status")
            await c.ticks(2)
            before = c.writes()
            router = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/llama-router"
            compared = c.gets(router)
            await c.ticks(5)
            assert c.gets(router) >= compared + 5  # each reconcile read the object to compare it
            assert c.writes() == before
    _run(scenario())


def _comparable(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k in ("name", "namespace", "labels", "annotations")}
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": meta, "spec": obj["spec"]}


def _td_sources() -> list[str]:
    from pathlib import Path

    examples = sorted(Path(__file__).resolve().parents[1].glob("deploy/helm/tandem/examples/*.yaml"))
    return [p.read_text() for p in examples if "kind: TandemDeployment" in p.read_text()] + [TD_YAML]


def test_render_cli_prints_exactly_what_the_operator_creates(tmp_path: Any) -> None:
    """Against kmock (no kube-apiserver can run here): `tandem operator render -f td.yaml --namespace serving`
    on each chart example (and the fixture) prints the same objects, field for field, as the operator created,
    less the ownerReferences (they need the TandemDeployment's uid, which only the API server assigns)."""
    import subprocess
    import sys

    for i, text in enumerate(_td_sources()):
        source = yaml.safe_load(text)
        source.setdefault("metadata", {})["namespace"] = NAMESPACE
        path = tmp_path / f"td{i}.yaml"
        path.write_text(yaml.safe_dump(source))
        out = subprocess.run([sys.executable, "-m", "cli.main", "operator", "render", "-f", str(path),
                              "--namespace", NAMESPACE, "--monitoring"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        printed = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert not [d for d in printed if "ownerReferences" in d["metadata"]]

        async def created(td: dict[str, Any], n: int) -> list[dict[str, Any]]:
            async with running_operator(monitoring=True) as c:
                await c.create_td(td)
                await until(lambda: len(c.objects()) >= n, what=f"{n} objects")
                await asyncio.sleep(0.5)
                return c.objects()

        td = td_manifest(yaml.safe_dump(source))
        got = _run(created(td, len(printed)))
        assert sorted(map(_comparable, got), key=repr) == sorted(map(_comparable, printed), key=repr)
