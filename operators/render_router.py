"""The router tier: its Deployment, the client Service (HTTP 8000, gRPC 8001), the metrics Service (9090, onto the
router's ``/metrics`` on its HTTP port) and, when the Prometheus operator's API exists, a ServiceMonitor.

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
    selector,
)
from operators.spec import DeploymentSpec

API_KEYS_ENV = "TANDEM_API_KEYS"


def _container(spec: DeploymentSpec) -> dict[str, Any]:
    args = ["-m", "router.serve", "--model", spec.model.path, "--served-model-name", spec.model.served_name,
            "--redis", pods.redis_url(spec), "--host", "0.0.0.0", "--port", str(ROUTER_HTTP_PORT),
            "--grpc-port", str(ROUTER_GRPC_PORT), *pods.credential_flags(spec)]
    env = pods.env(spec)
    if spec.api_key_secret is not None:
        env.append({"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.api_key_secret.name, "key": spec.api_key_secret.key}}})
    container: dict[str, Any] = {
        "name": "router", "image": spec.image.ref, "imagePullPolicy": spec.image.pull_policy,
        "command": ["python3"], "args": args,
        "ports": [{"name": "http", "containerPort": ROUTER_HTTP_PORT},
                  {"name": "grpc", "containerPort": ROUTER_GRPC_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "volumeMounts": pods.volume_mounts(spec),
    }
    if env:
        container["env"] = env
    if spec.router_resources:
        container["resources"] = dict(spec.router_resources)
    return container


def render_router(spec: DeploymentSpec, namespace: str, monitoring: bool) -> list[dict[str, Any]]:
    td, name = spec.name, f"{spec.name}-router"
    sel = selector(td, "router")
    out: list[dict[str, Any]] = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(td, namespace, name, "router"),
         "spec": {"replicas": spec.router_replicas, "selector": {"matchLabels": sel},
                  "template": {"metadata": {"labels": labels(td, "router")},
                               "spec": {"containers": [_container(spec)], "volumes": pods.volumes(spec)}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(td, namespace, name, "router"),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "http", "port": ROUTER_HTTP_PORT, "targetPort": "http"},
                            {"name": "grpc", "port": ROUTER_GRPC_PORT, "targetPort": "grpc",
                             "appProtocol": "grpc"}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(td, namespace, f"{name}-metrics", "router"),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "metrics", "port": ROUTER_METRICS_PORT, "targetPort": "http"}]}},
    ]
    if monitoring:
        out.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": metadata(td, namespace, td, "router"),
            "spec": {"selector": {"matchLabels": sel}, "namespaceSelector": {"matchNames": [namespace]},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
        })
    return out
