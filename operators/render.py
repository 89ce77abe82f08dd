"""``render(td, namespace)``: every object a TandemDeployment becomes, as manifest dicts, owned by it.

Pure: the same TandemDeployment gives the same list, in the same order, whether the reconcile applies it or
``tandem operator render`` prints it. A bad spec raises ``spec.SpecError``.

Order: TandemTiers, the RayCluster, Redis, the router and its Services (and its ServiceMonitor and the workers'
PodMonitor when ``monitoring``: the reconcile passes whether the monitoring.coreos.com API exists), disruption
budgets, network policies.

Each object carries an ownerReference to the TandemDeployment (``kopf.adopt``: controller, blockOwnerDeletion),
so deleting the TandemDeployment garbage-collects everything. A TandemDeployment read from a file has no uid yet
(the API server assigns it on create), so its objects come out without ownerReferences and otherwise identical.

TandemTier ``spec.replicas`` belongs to whoever scales the tier (kubectl scale, an HPA, the planner). The
annotation ``tandem.dev/deployment-replicas`` records the TandemDeployment's own count when it last wrote it; the
apply step writes ``spec.replicas`` only when that count changes (see ``apply.owned_view``).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import kopf

from operators.labels import API_VERSION, labels
from operators.render_policy import render_network_policies, render_pdbs
from operators.render_ray import render_raycluster
from operators.render_redis import render_redis
from operators.render_router import render_router
from operators.spec import DeploymentSpec, parse

DEPLOYMENT_REPLICAS_ANNOTATION = "tandem.dev/deployment-replicas"


def render_tiers(spec: DeploymentSpec, namespace: str) -> list[dict[str, Any]]:
    return [{
        "apiVersion": API_VERSION, "kind": "TandemTier",
        "metadata": {"name": f"{spec.name}-{t.name}", "namespace": namespace, "labels": labels(spec.name, t.name),
                     "annotations": {DEPLOYMENT_REPLICAS_ANNOTATION: str(t.replicas)}},
        "spec": {"deployment": spec.name, "tier": t.name, "replicas": t.replicas,
                 "minReplicas": t.min_replicas, "maxReplicas": t.max_replicas},
    } for t in spec.tiers]


def render_spec(spec: DeploymentSpec, namespace: str, monitoring: bool = False) -> list[dict[str, Any]]:
    """The manifests of an already validated spec, without owner references."""
    return [
        *render_tiers(spec, namespace),
        render_raycluster(spec, namespace),
        *render_redis(spec, namespace),
        *render_router(spec, namespace, monitoring),
        *render_pdbs(spec, namespace),
        *render_network_policies(spec, namespace),
    ]


def render(td: dict[str, Any], namespace: str, monitoring: bool = False) -> list[dict[str, Any]]:
    """Every object ``td`` becomes in ``namespace``, each owned by ``td``; SpecError for a bad spec."""
    spec = parse(td)
    objs = render_spec(spec, namespace, monitoring)
    owner = copy.deepcopy(td)
    owner.setdefault("apiVersion", API_VERSION)
    owner.setdefault("kind", "TandemDeployment")
    owner.setdefault("metadata", {})["namespace"] = namespace
    if owner["metadata"].get("uid"):
        kopf.adopt(objs, owner=kopf.Body(cast(kopf.RawBody, owner)))
    else:  # read from a file: nothing to own them yet, but the same labels
        kopf.label(objs, labels=owner["metadata"].get("labels") or {})
    return objs
