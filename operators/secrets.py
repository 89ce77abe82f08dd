"""The credentials the operator presents to one TandemDeployment's controller, read from that deployment's Secrets.

The cluster token comes from ``spec.security.tokenSecret``; with mTLS on, the certificate, key and CA come from the
mTLS Secret (``tls.crt``, ``tls.key``, ``ca.crt``) and the server name from ``spec.security.mtls.serverName``: the
same credentials the deployment's own pods mount. A missing Secret or key is a ``ControlError`` naming it, which
the status timer reports as the controller being unreachable (and retries every interval), so creating the Secret
later recovers without a restart.
"""

from __future__ import annotations

from kubernetes_asyncio.client import ApiException

from auth.token import check_token
from operators.control import ControlAuth, ControlError
from operators.kube import Kube
from operators.spec import DeploymentSpec

TLS_KEYS = ("tls.crt", "tls.key", "ca.crt")


async def _read(kube: Kube, namespace: str, name: str, keys: tuple[str, ...]) -> list[bytes]:
    try:
        data = await kube.secret_data(namespace, name)
    except ApiException as e:
        raise ControlError(f"reading Secret {namespace}/{name}: {e.status} {e.reason}") from e
    if data is None:
        raise ControlError(f"Secret {namespace}/{name} does not exist")
    missing = [k for k in keys if not data.get(k)]
    if missing:
        raise ControlError(f"Secret {namespace}/{name} has no {', '.join(missing)}")
    return [data[k] for k in keys]


async def control_auth(kube: Kube, spec: DeploymentSpec, namespace: str) -> ControlAuth:
    """The token (and mTLS material) for ``spec``'s controller; ControlError when a Secret or key is missing."""
    ref = spec.security.token_secret
    (raw,) = await _read(kube, namespace, ref.name, (ref.key,))
    try:
        token = check_token(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ControlError(f"Secret {namespace}/{ref.name} key {ref.key}: not a cluster token ({e})") from None
    if spec.security.mtls_secret is None:
        return ControlAuth(token)
    cert, key, ca = await _read(kube, namespace, spec.security.mtls_secret, TLS_KEYS)
    return ControlAuth(token, (cert, key, ca), spec.security.server_name)
