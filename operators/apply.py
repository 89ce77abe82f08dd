"""Converge one owned object to its rendered state: create it when missing, patch it when a field the operator
owns differs, and otherwise write nothing.

"Owned fields" are exactly the rendered manifest's: the live object may carry more (API-server defaults, status,
other controllers' labels) and that is not a difference. A hand edit of an owned field (the router Deployment's
replicas or image: NVIDIA Dynamo #4420's fight) is a difference and is patched back. Two fields are owned by
someone else and are never asserted over a live value:

- a TandemTier's ``spec.replicas`` belongs to whoever scales the tier, unless the TandemDeployment's own count
  changed since it last wrote it (the ``tandem.dev/deployment-replicas`` annotation tells), or the bounds change
  and exclude it (then it is clamped into them in the same patch: the CRD's CEL rules would refuse it otherwise;
  a count outside unchanged bounds, possible only without CEL, is left as it is and clamped when forwarded);
- a RayCluster worker group's ``replicas`` belongs to KubeRay's autoscaler; a patch carries the live value over
  (a merge patch replaces the whole ``workerGroupSpecs`` list).

An owned object the TandemDeployment no longer renders (Redis after a switch to an external URL, the prefill
tier's objects after the tier is removed) is deleted by ``prune``: only objects that carry this TandemDeployment's
labels and its uid as their controller ownerReference, so nothing created by anyone else is touched.

A no-op reconcile therefore issues reads only: reconciling twice changes nothing.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any

from operators.kube import Kind, Kube, kind_of
from operators.labels import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, MANAGED_BY
from operators.render import DEPLOYMENT_REPLICAS_ANNOTATION


class Outcome(Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


def is_subset(want: Any, live: Any) -> bool:
    """Whether every field of ``want`` has the same value in ``live`` (lists: same length, item by item)."""
    if isinstance(want, dict):
        if not isinstance(live, dict):
            return False
        for key, value in want.items():
            if key not in live or live[key] is None:
                if value in ({}, [], None):  # the API server drops empty fields
                    continue
                return False
            if not is_subset(value, live[key]):
                return False
        return True
    if isinstance(want, list):
        return isinstance(live, list) and len(want) == len(live) and all(map(is_subset, want, live))
    return bool(want == live)


def owned_view(desired: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """``desired`` less what the live object's other owners hold (see the module docstring)."""
    want = copy.deepcopy(desired)
    if desired["kind"] == "TandemTier":
        live_note = (live.get("metadata", {}).get("annotations") or {}).get(DEPLOYMENT_REPLICAS_ANNOTATION)
        if live_note == desired["metadata"]["annotations"][DEPLOYMENT_REPLICAS_ANNOTATION]:
            live_spec = live.get("spec", {})
            live_replicas = live_spec.get("replicas")
            lo, hi = want["spec"]["minReplicas"], want["spec"]["maxReplicas"]
            new_bounds = (live_spec.get("minReplicas"), live_spec.get("maxReplicas")) != (lo, hi)
            if new_bounds and live_replicas is not None and not lo <= live_replicas <= hi:
                want["spec"]["replicas"] = min(max(live_replicas, lo), hi)  # CEL refuses bounds that exclude it
            else:
                want["spec"].pop("replicas", None)
    elif desired["kind"] == "RayCluster":
        live_groups = {g.get("groupName"): g for g in (live.get("spec", {}).get("workerGroupSpecs") or [])}
        for group in want["spec"]["workerGroupSpecs"]:
            live_replicas = live_groups.get(group["groupName"], {}).get("replicas")
            if live_replicas is not None:
                group["replicas"] = live_replicas
    return want


async def apply(kube: Kube, desired: dict[str, Any]) -> Outcome:
    meta = desired["metadata"]
    live = await kube.get(kind_of(desired), meta["namespace"], meta["name"])
    if live is None:
        await kube.create(desired)
        return Outcome.CREATED
    want = owned_view(desired, live)
    if is_subset(want, live):
        return Outcome.UNCHANGED
    await kube.patch(want)
    return Outcome.PATCHED


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


async def prune(kube: Kube, desired: list[dict[str, Any]], kinds: list[Kind], namespace: str, td_name: str,
                td_uid: str) -> list[str]:
    """Delete the objects of ``kinds`` that ``td`` owns but no longer renders; returns "Kind/name" of each."""
    keep = {(o["kind"], o["metadata"]["name"]) for o in desired}
    selector = f"{LABEL_DEPLOYMENT}={td_name},{LABEL_MANAGED_BY}={MANAGED_BY}"
    deleted = []
    for kind in kinds:
        for obj in await kube.list(kind, namespace, selector):
            meta = obj.get("metadata", {})
            labels = meta.get("labels") or {}
            if (kind.kind, meta.get("name")) in keep or labels.get(LABEL_DEPLOYMENT) != td_name:
                continue  # kept, or another deployment's (a list may ignore the selector)
            if _owned_by(obj, td_uid) and await kube.delete(kind, namespace, meta["name"]):
                deleted.append(f"{kind.kind}/{meta['name']}")
    return deleted
