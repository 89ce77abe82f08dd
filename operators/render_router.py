"""The router tier: its Deployment, the client Service (HTTP 8000, gRPC 8001), the metrics Service (9090: the
router's ``--metrics-port``, outside the API keys) and, when the Prometheus operator's API exists, a ServiceMonitor,
with a PodMonitor for the tiers' workers' own ``/metrics`` (the container port ``metrics``: operators/render_ray.py).

API keys: the Secret's one key is mounted as a file for ``--api-key-file`` (never an environment variable).

Routers find workers through the Redis registry (``--redis``), so scaling a tier never touches this Deployment.
"""

from __future__ import annotations

from typing import Any

from operators import pods
from operators.labels import (
    ROUTER_GRPC_PORT,
    ROUTER_HTTP_PORT,
    ROUTER_METRICS_PORT,
    labels,
    metadata,
    pods_of,
    selector,
)
from operators.spec import DeploymentSpec

API_KEYS_DIR = "/etc/tandem/api-keys"


def _container(spec: DeploymentSpec) -> dict[str, Any]:
    args = ["-m", "router.serve", "--model", spec.model.path, "--served-model-name", spec.model.served_name,
            "--redis", pods.redis_url(spec), "--host", "0.0.0.0", "--port", str(ROUTER_HTTP_PORT),
            "--grpc-port", str(ROUTER_GRPC_PORT), "--metrics-port", str(ROUTER_METRICS_PORT),
            *pods.credential_flags(spec)]
    mounts = pods.volume_mounts(spec)
    if spec.api_key_secret is not None:
        args += ["--api-key-file", f"{API_KEYS_DIR}/keys"]
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    env = pods.env(spec)
    container: dict[str, Any] = {
        "name": "router", "image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy,
        "command": ["python3"], "args": args,
        "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT},
                  {"name": "grpc", "containerPort": ROUTER_GRPC_PORT},
                  {"name": "metrics", "containerPort": ROUTER_METRICS_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "volumeMounts": mounts,
    }
    if env:
        container["env"] = env
    if spec.router_resources:
        container["resources"] = dict(spec.router_resources)
    return container


def _volumes(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out = pods.volumes(spec)
    if spec.api_key_secret is not None:  # the one key of the Secret, as the file --api-key-file reads
        out.append({"name": "api-keys", "secret": {"secretName": spec.api_key_secret.name,
                                                   "items": [{"key": spec.api_key_secret.key, "path": "keys"}]}})
    return out


def render_router(spec: DeploymentSpec, namespace: str, monitoring: bool) -> list[dict[str, Any]]:
    td, name = spec.name, f"{spec.name}-router"
    sel = selector(td, "router")
    out: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(td, namespace, name, "router"),
         "spec": {"replicas": spec.router_replicas, "selector": {"matchLabels": sel},
                  "template": {"metadata": {"labels": labels(td, "router")},
                               "spec": {"containers": [_container(spec)], "volumes": _volumes(spec)}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(td, namespace, name, "router"),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"},
                            {"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc",
                             "appProtocol": "grpc"}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(td, namespace, f"{name}-metrics", "router"),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "metrics"}]}},
    ]
    if monitoring:
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": metadata(td, namespace, td, "router"),
            "spec": {"selector": {"matchLabels": sel}, "namespaceSelector": {"matchNames": [namespace]},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
        })
        out.append({  # the tiers' workers' own /metrics: each pod is one replica, its port named "metrics"
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": metadata(td, namespace, f"{td}-workers", spec.tiers[-1].name),
            "spec": {"selector": pods_of(td, *(t.name for t in spec.tiers)),
                     "namespaceSelector": {"matchNames": [namespace]},
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
        })
    return out
