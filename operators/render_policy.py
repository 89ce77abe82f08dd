"""PodDisruptionBudgets and NetworkPolicies.

Disruption: at most one router pod and one pod per tier are evicted at a time (a tier pod is a whole replica;
the controller's drain covers scale-down, the budget covers node maintenance).

Network: the tier pods accept their gRPC and session ports from router pods (and the controller, which reads each
replica's load), their KV port from tier pods only, Ray's pinned ports from the cluster's own pods, and their
``/metrics`` port from anywhere (a Prometheus runs in a namespace of its own; the port serves read-only counters
and histograms, no request content, like the router's metrics Service). In-cluster
Redis accepts only this deployment's pods.
"""

from __future__ import annotations

from typing import Any

from operators.labels import (
    REDIS_PORT,
    WORKER_GRPC_PORT,
    WORKER_KV_PORT,
    WORKER_METRICS_PORT,
    WORKER_SESSION_PORT,
    metadata,
    pods_of,
    selector,
)
from operators.render_ray import RAY_GCS_PORT, RAY_PORTS, RAY_WORKER_PORTS
from operators.spec import DeploymentSpec


def render_pdbs(spec: DeploymentSpec, namespace: str) -> list[dict[str, Any]]:
    out = []
    for component in ("router", *(t.name for t in spec.tiers)):
        out.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": metadata(spec.name, namespace, f"{spec.name}-{component}", component),
                    "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(spec.name, component)}}})
    return out


def render_network_policies(spec: DeploymentSpec, namespace: str) -> list[dict[str, Any]]:
    td = spec.name
    tiers = [t.name for t in spec.tiers]
    ray_peers = {"podSelector": pods_of(td, "controller", *tiers)}
    ray_ports = [{"protocol": "TCP", "port": p} for p in sorted(RAY_PORTS.values())]
    ray_ports.append({"protocol": "TCP", "port": RAY_WORKER_PORTS[0], "endPort": RAY_WORKER_PORTS[1]})
    out: list[dict[str, Any]] = [{
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(td, namespace, f"{td}-workers", tiers[-1]),
        "spec": {
            "podSelector": pods_of(td, *tiers),
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": pods_of(td, "router", "controller")}],
                 "ports": [{"protocol": "TCP", "port": WORKER_GRPC_PORT},
                           {"protocol": "TCP", "port": WORKER_SESSION_PORT}]},
                {"from": [{"podSelector": pods_of(td, *tiers)}],
                 "ports": [{"protocol": "TCP", "port": WORKER_KV_PORT}]},
                {"from": [ray_peers], "ports": ray_ports},
                {"ports": [{"protocol": "TCP", "port": WORKER_METRICS_PORT}]},
            ],
        },
    }, {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": metadata(td, namespace, f"{td}-head", "controller"),
        "spec": {
            "podSelector": pods_of(td, "controller"),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [ray_peers],
                         "ports": [{"protocol": "TCP", "port": RAY_GCS_PORT}, *ray_ports]},
                        {"ports": [{"protocol": "TCP", "port": 9400}, {"protocol": "TCP", "port": 8265},
                                   {"protocol": "TCP", "port": 10001}]}],
        },
    }]
    if spec.redis.in_cluster:
        out.append({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(td, namespace, f"{td}-redis", "redis"),
            "spec": {"podSelector": {"matchLabels": selector(td, "redis")}, "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": pods_of(td, "router", "controller", *tiers)}],
                                  "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}]},
        })
    return out
