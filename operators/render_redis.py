"""In-cluster Redis (``spec.redis.inCluster``): one Deployment and its Service, ``<td>-redis:6379``.

It holds the worker registry and the KV event streams, both rebuilt from the workers when Redis restarts, so it
runs without persistence.
"""

from __future__ import annotations

from typing import Any

from operators.labels import REDIS_PORT, labels, metadata, selector
from operators.spec import DeploymentSpec

REDIS_IMAGE = "redis:7.4-alpine"


def render_redis(spec: DeploymentSpec, namespace: str) -> list[dict[str, Any]]:
    if not spec.redis.in_cluster:
        return []
    td, name = spec.name, f"{spec.name}-redis"
    sel = selector(td, "redis")
    container = {
        "name": "redis", "image": REDIS_IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
    }
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(td, namespace, name, "redis"),
         "spec": {"replicas": 1, "selector": {"matchLabels": sel},
                  "template": {"metadata": {"labels": labels(td, "redis")}, "spec": {"containers": [container]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(td, namespace, name, "redis"),
         "spec": {"type": "ClusterIP", "selector": sel,
                  "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}]}},
    ]
