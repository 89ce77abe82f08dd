"""Pieces every Tandem pod shares: the model volume, the mTLS Secret, the Redis URL and the credential flags.

The Redis password never appears in a manifest: it comes from its Secret as an environment variable, and
Kubernetes expands ``$(TANDEM_REDIS_PASSWORD)`` inside the ``--redis`` argument when the container starts.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from operators.labels import REDIS_PORT
from operators.spec import DeploymentSpec

TLS_DIR = "/etc/tandem/tls"
REDIS_PASSWORD_ENV = "TANDEM_REDIS_PASSWORD"


def redis_url(spec: DeploymentSpec) -> str:
    if spec.redis.url is None:
        return f"redis://{spec.name}-redis:{REDIS_PORT}/0"
    if spec.redis.password is None:
        return spec.redis.url
    parts = urlsplit(spec.redis.url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f":$({REDIS_PASSWORD_ENV})@{host}"))


def env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if spec.redis.password is not None:
        out.append({"name": REDIS_PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.redis.password.name, "key": spec.redis.password.key}}})
    if spec.model.kind == "hf":  # read from the cache volume only: nothing is downloaded in the cluster
        out += [{"name": "HF_HOME", "value": spec.model.mount_path}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    return out


def volumes(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out = [{"name": "model", **spec.model.volume}]
    if spec.security.mtls_secret:
        out.append({"name": "tls", "secret": {"secretName": spec.security.mtls_secret}})
    return out


def volume_mounts(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": True}]
    if spec.security.mtls_secret:
        out.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    return out


def credential_flags(spec: DeploymentSpec) -> list[str]:
    """``auth.credentials``' flags for the mounted Secret (tls.crt, tls.key, ca.crt); none when mTLS is off."""
    if not spec.security.mtls_secret:
        return []
    return ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.crt"]
