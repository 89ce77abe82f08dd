"""The operator's client of the controller's ``tandem.v1.Control`` API (``proto/tandem/v1/control.proto``).

One grpc.aio channel per controller address, kept for the operator's life; every call has a deadline, and a
failure surfaces as ``ControlError`` (the reconcile retries with ``kopf.TemporaryError``; the status timer reports
the controller unreachable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc


class ControlError(RuntimeError):
    """The controller could not be reached or refused a call."""


@dataclass(slots=True)
class ControlClients:
    timeout_s: float
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)

    def _stub(self, address: str) -> cpb_grpc.ControlStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return cpb_grpc.ControlStub(channel)

    async def set_replicas(self, address: str, tier: str, replicas: int) -> cpb.TierStatus:
        try:
            reply = await self._stub(address).SetReplicas(cpb.SetReplicasRequest(tier=tier, replicas=replicas),
                                                          timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise ControlError(f"SetReplicas({tier}, {replicas}) on {address}: {e.code().name}: {e.details()}") from e
        return reply.tier

    async def status(self, address: str) -> dict[str, cpb.TierStatus]:
        try:
            reply = await self._stub(address).Status(cpb.StatusRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise ControlError(f"Status on {address}: {e.code().name}: {e.details()}") from e
        return {t.tier: t for t in reply.tiers}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
