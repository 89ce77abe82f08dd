"""The operator's client of the controller's ``tandem.v1.Control`` API (``proto/tandem/v1/control.proto``).

One grpc.aio channel per controller address and credentials, kept for the operator's life; every call has a
deadline, and a failure surfaces as ``ControlError`` (the reconcile retries with ``kopf.TemporaryError``; the status
timer reports the controller unreachable).

Credentials (``ControlAuth``): the TandemDeployment's cluster token rides on every call (the controller refuses
``SetReplicas`` without it), and with mTLS on the channel presents the deployment's certificate and checks the
controller's against its CA and the cluster-wide server name. The operator reads them from the deployment's
Secrets through the API (``operators.secrets``) rather than from mounted files: one operator serves many
deployments, each with Secrets of its own in its own namespace. They are held in memory, never written to disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from auth.token import bearer
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc


class ControlError(RuntimeError):
    """The controller could not be reached or refused a call."""


@dataclass(slots=True, frozen=True)
class ControlAuth:
    """What the operator presents to one deployment's controller."""

    token: str | None = None
    tls: tuple[bytes, bytes, bytes] | None = None  # (cert, key, CA) PEM from the mTLS Secret; None: plaintext
    server_name: str | None = None  # the name the controller's certificate carries; None: the dialled host

    def __post_init__(self) -> None:
        if self.tls is not None and not all(self.tls):
            raise ValueError("TLS needs a certificate, a key and a CA")
        if self.server_name is not None and self.tls is None:
            raise ValueError("server_name needs TLS")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.token is None else (("authorization", bearer(self.token)),)


@dataclass(slots=True)
class ControlClients:
    timeout_s: float
    _channels: dict[tuple[str, ControlAuth], grpc.aio.Channel] = field(default_factory=dict)
    _retired: list[grpc.aio.Channel] = field(default_factory=list)

    def _stub(self, address: str, auth: ControlAuth) -> cpb_grpc.ControlStub:
        channel = self._channels.get((address, auth))
        if channel is None:
            for old in [k for k in self._channels if k[0] == address]:  # rotated credentials: drop the old channel
                self._retired.append(self._channels.pop(old))  # closed in close(): calls may still be on it
            if auth.tls is None:
                channel = grpc.aio.insecure_channel(address)
            else:
                cert, key, ca = auth.tls
                creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
                options = [("grpc.ssl_target_name_override", auth.server_name)] if auth.server_name else []
                channel = grpc.aio.secure_channel(address, creds, options=options)
            self._channels[(address, auth)] = channel
        return cpb_grpc.ControlStub(channel)

    async def set_replicas(self, address: str, tier: str, replicas: int,
                           auth: ControlAuth = ControlAuth()) -> cpb.TierStatus:
        try:
            reply = await self._stub(address, auth).SetReplicas(cpb.SetReplicasRequest(tier=tier, replicas=replicas),
                                                                timeout=self.timeout_s, metadata=auth.metadata)
        except grpc.aio.AioRpcError as e:
            raise ControlError(f"SetReplicas({tier}, {replicas}) on {address}: {e.code().name}: {e.details()}") from e
        return reply.tier

    async def status(self, address: str, auth: ControlAuth = ControlAuth()) -> dict[str, cpb.TierStatus]:
        try:
            reply = await self._stub(address, auth).Status(cpb.StatusRequest(), timeout=self.timeout_s,
                                                           metadata=auth.metadata)
        except grpc.aio.AioRpcError as e:
            raise ControlError(f"Status on {address}: {e.code().name}: {e.details()}") from e
        return {t.tier: t for t in reply.tiers}

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()
