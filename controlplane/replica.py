"""One worker replica as a Ray actor.

Each replica gets its own placement group with one bundle per rank of its tier (``ControllerConfig.bundles``), so
that Ray reserves every rank's resources before the replica starts; the actor is scheduled into its first bundle
and runs the replica's one ``tandem worker`` process. The actor does not restart the worker, and Ray does not
restart the actor (``max_restarts=0``): a replica whose worker or actor died is replaced by the controller
(controlplane/controller.py) with a new placement group, so that what Status reports is always the process that
serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from worker.launcher import WorkerProcess, start_worker

log = logging.getLogger(__name__)

NODE_IP = "node"  # ReplicaSpec.host: listen on and advertise the IP Ray knows this node by (a Kubernetes pod's)


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    role: str
    model: str
    kv_backend: str = "tcp"
    cpus: float = 0.5
    flags: tuple[str, ...] = field(default_factory=tuple)
    host: str = "127.0.0.1"  # where the worker listens and what address it advertises; NODE_IP: the node's IP

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.cpus <= 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus}")
        if not self.host:
            raise ValueError("host must not be empty")


@ray.remote(max_restarts=0, max_task_retries=0)
class WorkerReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.proc: WorkerProcess | None = None
        self.host = ray.util.get_node_ip_address() if spec.host == NODE_IP else spec.host

    def start(self) -> str:
        """Start the worker process and return its gRPC address once it printed READY."""
        flags = [*self.spec.flags] if self.spec.host == "127.0.0.1" else ["--host", self.host, *self.spec.flags]
        self.proc = start_worker(self.spec.role, self.spec.model, self.spec.kv_backend, flags)
        return f"{self.host}:{self.proc.port}"

    def metrics_address(self) -> str:
        """Where the worker serves its own ``/metrics`` (``--metrics-port``), for a Prometheus; "" if it does not."""
        return f"{self.host}:{self.proc.metrics_port}" if self.proc is not None and self.proc.metrics_port else ""

    def alive(self) -> bool:
        """Whether the worker process is still running."""
        return self.proc is not None and self.proc.proc.poll() is None

    def pid(self) -> int:
        return self.proc.proc.pid if self.proc is not None else -1

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
