"""``tandem.v1.Control`` over gRPC: the controller's API for the operator, ``tandem scale`` and the planner.

Runs on the controller's asyncio loop (``grpc.aio``), so every call reads and changes the controller's state
between reconcile steps, never during one. Bad input is INVALID_ARGUMENT (an unknown tier, a count outside
``[0, max_replicas]``: a negative count sent on the wire as uint32 arrives as a huge one); an unknown replica for
``Drain`` is NOT_FOUND. A tier whose layout the controller refused still takes ``SetReplicas`` (the count is kept);
its ``TierStatus.refused`` says why none of it is placed.

Who may call: ``SetReplicas`` and ``Drain`` change the cluster and need the cluster token
(``auth.grpc_server.CONTROL_ADMIN_METHODS``: UNAUTHENTICATED without it or with another); ``Status`` stays open. It
is read-only and carries no request data (replica ids, states, addresses and in-flight counts; the addresses are in
the Redis registry anyway), so probes, dashboards and ``tandem scale --wait`` read it without holding the secret,
and nothing it reveals lets a caller change anything without the token. With TLS files in the controller's
credentials the port is mutual TLS as well (the chart's default), so in Kubernetes only holders of a certificate
from the cluster's CA reach any of the three.
"""

from __future__ import annotations

import time

import grpc

from auth.grpc_server import CONTROL_ADMIN_METHODS, AioAdminGuard, add_port
from controlplane.controller import Controller
from controlplane.replica_state import TIERS, Replica, ReplicaState
from proto.tandem.v1 import control_pb2 as cpb
from proto.tandem.v1 import control_pb2_grpc as cpb_grpc


def replica_status(r: Replica) -> cpb.ReplicaStatus:
    return cpb.ReplicaStatus(replica_id=r.replica_id, tier=r.tier, state=cpb.ReplicaState.Name(int(r.state)),
                             address=r.address, in_flight=r.in_flight, ranks=r.ranks, restarts=r.restarts,
                             age_seconds=time.monotonic() - r.created)


def tier_status(controller: Controller, tier: str) -> cpb.TierStatus:
    reps = controller.of_tier(tier)
    count = {s: sum(1 for r in reps if r.state == s) for s in ReplicaState}
    return cpb.TierStatus(tier=tier, desired=controller.desired[tier], ready=count[ReplicaState.READY],
                          draining=count[ReplicaState.DRAINING], starting=count[ReplicaState.STARTING],
                          replicas=[replica_status(r) for r in reps], refused=controller.refused.get(tier, ""))


class ControlService(cpb_grpc.ControlServicer):
    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    async def SetReplicas(self, request: cpb.SetReplicasRequest,
                          context: grpc.aio.ServicerContext[cpb.SetReplicasRequest, cpb.SetReplicasResponse],
                          ) -> cpb.SetReplicasResponse:
        try:
            self.controller.set_replicas(request.tier, request.replicas)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return cpb.SetReplicasResponse(tier=tier_status(self.controller, request.tier))

    async def Status(self, request: cpb.StatusRequest,
                     context: grpc.aio.ServicerContext[cpb.StatusRequest, cpb.StatusResponse]) -> cpb.StatusResponse:
        return cpb.StatusResponse(tiers=[tier_status(self.controller, t) for t in TIERS])

    async def Drain(self, request: cpb.DrainReplicaRequest,
                    context: grpc.aio.ServicerContext[cpb.DrainReplicaRequest, cpb.DrainReplicaResponse],
                    ) -> cpb.DrainReplicaResponse:
        try:
            r = self.controller.drain(request.replica_id)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        return cpb.DrainReplicaResponse(replica=replica_status(r))


async def start_control_server(controller: Controller, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve Control on ``host:port`` (0: a free port) with the controller's credentials: its cluster token guards
    ``SetReplicas`` and ``Drain``, its TLS files (if any) make the port mutual TLS. Returns the started server and
    its port."""
    creds = controller.credentials
    server = grpc.aio.server(interceptors=[AioAdminGuard(creds.token, CONTROL_ADMIN_METHODS)])
    cpb_grpc.add_ControlServicer_to_server(ControlService(controller), server)
    bound = add_port(server, f"{host}:{port}", creds)
    if not bound:
        raise OSError(f"could not bind the Control API to {host}:{port}")
    await server.start()
    return server, bound
