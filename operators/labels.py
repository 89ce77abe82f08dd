"""Names, labels and ports shared by every object the operator renders (the chart and controller use the same).

Selectors use only labels the operator sets and never changes (name, instance, component, tier), so a rendered
Deployment's selector stays valid across upgrades.
"""

from __future__ import annotations

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = "tandem-operator"

ROUTER_HTTP_PORT = 8000
ROUTER_GRPC_PORT = 8001
ROUTER_METRICS_PORT = 9090  # the router's --metrics-port and its metrics Service's port
WORKER_GRPC_PORT = 7100
WORKER_SESSION_PORT = 7101
WORKER_METRICS_PORT = 7102  # each worker's own /metrics (tandem controller --worker-metrics-port's default in a pod)
WORKER_KV_PORT = 7200
REDIS_PORT = 6379

LABEL_DEPLOYMENT = "tandem.dev/deployment"
LABEL_TIER = "tandem.dev/tier"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"


def selector(td: str, component: str) -> dict[str, str]:
    """The immutable subset of ``labels`` that selects one component's pods."""
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": td, LABEL_COMPONENT: component}


def pods_of(td: str, *components: str) -> dict[str, object]:
    """A label selector for the pods of several components of one TandemDeployment."""
    return {"matchLabels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": td},
            "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In", "values": list(components)}]}


def labels(td: str, component: str) -> dict[str, str]:
    out = {**selector(td, component), LABEL_MANAGED_BY: MANAGED_BY, LABEL_DEPLOYMENT: td}
    if component in ("prefill", "decode"):
        out[LABEL_TIER] = component
    return out


def tier_selector_string(td: str, tier: str) -> str:
    """``.status.selector`` of a TandemTier (the scale subresource's labelSelectorPath)."""
    return f"{LABEL_DEPLOYMENT}={td},{LABEL_TIER}={tier}"


def metadata(td: str, namespace: str, name: str, component: str) -> dict[str, object]:
    return {"name": name, "namespace": namespace, "labels": labels(td, component)}
