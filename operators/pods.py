"""Pieces every Tandem pod shares: the model volume, the mTLS and cluster-token Secrets, the Redis URL and the
credential flags.

Every Tandem process (router, controller, workers) gets the same credentials: the cluster token as a file from its
Secret (``--auth-token-file``: a mounted file, never an environment variable or an argument) and, with mTLS on,
the Secret's certificate, key and CA with ``--tls-server-name``, the cluster-wide name the certificate carries
(clients dial pod IPs, which no certificate can name in advance).

The Redis password never appears in a manifest: it comes from its Secret as an environment variable, and
Kubernetes expands ``$(TANDEM_REDIS_PASSWORD)`` inside the ``--redis`` argument when the container starts.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from operators.labels import REDIS_PORT
from operators.spec import DeploymentSpec

TLS_DIR = "/etc/tandem/tls"
TOKEN_DIR = "/etc/tandem/token"
TOKEN_FILE = f"{TOKEN_DIR}/token"
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
    token = spec.security.token_secret
    out = [{"name": "model", **spec.model.volume},
           {"name": "cluster-token", "secret": {"secretName": token.name,
                                                "items": [{"key": token.key, "path": "token"}]}}]
    if spec.security.mtls_secret:
        out.append({"name": "tls", "secret": {"secretName": spec.security.mtls_secret}})
    return out


def volume_mounts(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "model", "mountPath": spec.model.mount_path, "readOnly": True},
                                 {"name": "cluster-token", "mountPath": TOKEN_DIR, "readOnly": True}]
    if spec.security.mtls_secret:
        out.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    return out


def credential_flags(spec: DeploymentSpec) -> list[str]:
    """``auth.credentials``' flags for the mounted Secrets: the token file always; with mTLS, tls.crt, tls.key,
    ca.crt and the server name."""
    out = ["--auth-token-file", TOKEN_FILE]
    if spec.security.mtls_secret:
        out += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.crt"]
        if spec.security.server_name:
            out += ["--tls-server-name", spec.security.server_name]
    return out
