"""Actual state -> ``.status`` of a TandemDeployment and its TandemTiers (pure; the timer feeds it).

Inputs: each TandemTier's desired count (its ``spec.replicas`` clamped to its bounds), the controller's
``Status`` (ready, draining, starting per tier; None when it cannot be reached), and the router Deployment.

Conditions (each with a CamelCase reason and a message; ``lastTransitionTime`` moves only when the status does):
- Ready: every tier has ``ready >= desired`` and every router replica is ready.
- Progressing: not there yet (scaling, starting, or the controller not answering yet).
- Degraded: the spec cannot be reconciled (``InvalidSpec``, see ``spec``), an API it needs is not served
  (``MissingAPI``: KubeRay's RayCluster without KubeRay), the controller refused a tier's parallel layout against
  the model (``InvalidLayout``: its ``TierStatus.refused``, e.g. a ``tp`` that does not divide the attention heads;
  the operator cannot read the model, the controller in the Ray head can), or a replica failed.
"""

from __future__ import annotations

from typing import Any

from operators.labels import tier_selector_string
from operators.spec import DeploymentSpec
from proto.tandem.v1 import control_pb2 as cpb

CONDITIONS = ("Ready", "Progressing", "Degraded")


def tier_desired(spec: DeploymentSpec, tier: str, tier_obj: dict[str, Any] | None) -> int:
    """The count to forward to the controller: the TandemTier's replicas, clamped to the TandemDeployment's range."""
    t = spec.tier(tier)
    assert t is not None
    replicas = (tier_obj or {}).get("spec", {}).get("replicas")
    return t.clamp(int(replicas)) if replicas is not None else t.replicas


def _condition(kind: str, ok: bool | None, reason: str, message: str) -> dict[str, str]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": kind, "status": status, "reason": reason, "message": message}


def with_transition_times(conditions: list[dict[str, str]], previous: list[dict[str, Any]] | None,
                          now: str) -> list[dict[str, str]]:
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in conditions:
        old = before.get(c["type"])
        keep = old is not None and old.get("status") == c["status"] and old.get("lastTransitionTime")
        out.append({**c, "lastTransitionTime": str(old["lastTransitionTime"]) if keep and old else now})
    return out


def invalid_spec_conditions(message: str) -> list[dict[str, str]]:
    return [_condition("Ready", False, "InvalidSpec", message),
            _condition("Progressing", False, "InvalidSpec", "reconcile stopped until the spec changes"),
            _condition("Degraded", True, "InvalidSpec", message)]


def missing_api_conditions(message: str) -> list[dict[str, str]]:
    """An API the TandemDeployment needs is not served (KubeRay not installed): retried by the status timer."""
    return [_condition("Ready", False, "MissingAPI", message),
            _condition("Progressing", True, "MissingAPI", "retried every status interval"),
            _condition("Degraded", True, "MissingAPI", message)]


def tier_status(spec: DeploymentSpec, tier: str, desired: int, control: cpb.TierStatus | None) -> dict[str, Any]:
    """A TandemTier's status (scale subresource: ``.status.replicas``, ``.status.selector``)."""
    out: dict[str, Any] = {"desiredReplicas": desired, "selector": tier_selector_string(spec.name, tier)}
    if control is not None:
        out.update(replicas=control.ready + control.starting, readyReplicas=control.ready,
                   drainingReplicas=control.draining)
    return out


def deployment_status(spec: DeploymentSpec, generation: int | None, desired: dict[str, int],
                      control: dict[str, cpb.TierStatus] | None, control_error: str | None,
                      router: dict[str, Any] | None) -> dict[str, Any]:
    """``.status`` of the TandemDeployment, without transition times (``with_transition_times`` adds them)."""
    tiers: dict[str, dict[str, int]] = {}
    lagging: list[str] = []
    failed = 0
    for t in spec.tiers:
        got = (control or {}).get(t.name)
        ready, draining = (got.ready, got.draining) if got is not None else (0, 0)
        if got is not None:
            failed += sum(r.state == cpb.REPLICA_STATE_FAILED for r in got.replicas)
        tiers[t.name] = {"desired": desired[t.name], "ready": ready, "draining": draining}
        if ready < desired[t.name] or (got is not None and got.desired != desired[t.name]):
            lagging.append(f"{t.name} {ready}/{desired[t.name]} ready")
    router_ready = int(((router or {}).get("status") or {}).get("readyReplicas") or 0)
    if router_ready < spec.router_replicas:
        lagging.append(f"router {router_ready}/{spec.router_replicas} ready")
    refused = [got.refused for got in (control or {}).values() if got.refused]
    if control_error is not None:
        conditions = [_condition("Ready", None, "ControllerUnreachable", control_error),
                      _condition("Progressing", True, "WaitingForController", control_error)]
    elif refused:
        message = "; ".join(refused)
        conditions = [_condition("Ready", False, "InvalidLayout", message),
                      _condition("Progressing", False, "InvalidLayout", "nothing of the tier is placed until the "
                                 "layout changes")]
    elif lagging:
        message = "; ".join(lagging)
        conditions = [_condition("Ready", False, "ReplicasNotReady", message),
                      _condition("Progressing", True, "Scaling", message)]
    else:
        conditions = [_condition("Ready", True, "AllReplicasReady", "every tier and the router are ready"),
                      _condition("Progressing", False, "Converged", "actual replicas match desired")]
    if refused and control_error is None:
        conditions.append(_condition("Degraded", True, "InvalidLayout", "; ".join(refused)))
    else:
        conditions.append(_condition("Degraded", failed > 0, "ReplicasFailed" if failed else "AsExpected",
                                     f"{failed} replica(s) failed; the controller replaces them" if failed
                                     else "no failed replicas"))
    out: dict[str, Any] = {"tiers": tiers, "conditions": conditions}
    if generation is not None:
        out["observedGeneration"] = generation
    for t in spec.tiers:
        out[t.name] = f"{tiers[t.name]['ready']}/{tiers[t.name]['desired']}"
    return out
