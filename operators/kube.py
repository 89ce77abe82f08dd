"""A small typed door to the Kubernetes API for the objects the operator owns, on kubernetes_asyncio's ApiClient.

kopf watches and patches the custom resources it handles; everything the operator creates goes through here:
get, create, JSON merge patch (optionally of a subresource), a scale through ``/scale``, list by label, delete, and
API-group discovery. The paths come from a fixed table of the kinds the operator renders (no discovery round trip
per object, and nothing it does not own can be touched by accident).

Connection: the in-cluster service account, else the kubeconfig; or an explicit URL (tests: kmock's).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.config.config_exception import ConfigException

MERGE_PATCH = "application/merge-patch+json"


@dataclass(slots=True, frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str

    def __post_init__(self) -> None:
        if not self.plural or not self.kind:
            raise ValueError("kind and plural must not be empty")

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        out = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            out += f"/{name}"
            if subresource:
                out += f"/{subresource}"
        return out


KINDS = {k.kind: k for k in (
    Kind("tandem.dev/v1alpha1", "TandemDeployment", "tandemdeployments"),
    Kind("tandem.dev/v1alpha1", "TandemTier", "tandemtiers"),
    Kind("ray.io/v1", "RayCluster", "rayclusters"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("v1", "Service", "services"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
)}


def kind_of(obj: dict[str, Any]) -> Kind:
    kind = KINDS.get(obj.get("kind", ""))
    if kind is None or kind.api_version != obj.get("apiVersion"):
        raise ValueError(f"the operator does not manage {obj.get('apiVersion')}/{obj.get('kind')}")
    return kind


class Kube:
    """Async Kubernetes calls on one ApiClient; ``close()`` when done."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self._api = api

    @classmethod
    async def connect(cls, url: str | None = None) -> Kube:
        if url is not None:
            return cls(k8s.ApiClient(k8s.Configuration(host=url)))
        try:
            k8s_config.load_incluster_config()
        except ConfigException:
            await k8s_config.load_kube_config()
        return cls(k8s.ApiClient())

    async def close(self) -> None:
        await self._api.close()

    async def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
                    content_type: str = "application/json") -> Any:
        return await self._api.call_api(
            path, method, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            response_types_map={200: "object", 201: "object"}, _return_http_data_only=True)

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(await self._call("GET", kind.path(namespace, name)))
        except k8s.ApiException as e:
            if e.status == 404:
                return None
            raise

    async def secret_data(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's decoded ``data`` (None if there is no such Secret): read by name only, as the RBAC allows."""
        try:
            secret = dict(await self._call("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}"))
        except k8s.ApiException as e:
            if e.status == 404:
                return None
            raise
        return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}

    async def list(self, kind: Kind, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        out = await self._call("GET", kind.path(namespace), query=[("labelSelector", label_selector)])
        return list(out.get("items") or [])

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        return dict(await self._call("POST", kind.path(obj["metadata"]["namespace"]), body=obj))

    async def patch(self, obj: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of ``obj`` onto the live object of the same name; lists are replaced."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        path = kind.path(meta["namespace"], meta["name"], subresource)
        return dict(await self._call("PATCH", path, body=obj, content_type=MERGE_PATCH))

    async def scale(self, kind: Kind, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set ``spec.replicas`` through the scale subresource, as ``kubectl scale`` and an HPA do (a merge patch
        of the ``autoscaling/v1`` Scale)."""
        path = kind.path(namespace, name, "scale")
        return dict(await self._call("PATCH", path, body={"spec": {"replicas": replicas}}, content_type=MERGE_PATCH))

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete one object, its dependents in the background; False when it was already gone."""
        try:
            await self._call("DELETE", kind.path(namespace, name), query=[("propagationPolicy", "Background")])
        except k8s.ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    async def has_group(self, group: str) -> bool:
        """Whether the API server serves ``group`` (e.g. monitoring.coreos.com for ServiceMonitors)."""
        try:
            await self._call("GET", f"/apis/{group}")
        except k8s.ApiException as e:
            if e.status == 404:
                return False
            raise
        return True
