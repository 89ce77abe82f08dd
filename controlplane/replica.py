"""One worker replica as a Ray actor.

Each replica gets its own placement group (one bundle per rank; today one rank per replica, so one bundle); the
actor is scheduled into it and runs the ``tandem worker`` process, which it supervises: ``ensure()`` restarts a
worker that died and reports its new address. The actor itself is restartable by Ray (``max_restarts``), and the
controller re-registers whatever address it reports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray

from worker.launcher import WorkerProcess, start_worker

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    role: str
    model: str
    kv_backend: str = "tcp"
    cpus: float = 0.5
    flags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
        if self.cpus <= 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus}")


@ray.remote(max_restarts=-1, max_task_retries=0)
class WorkerReplica:
    def __init__(self, spec: ReplicaSpec) -> None:
        self.spec = spec
        self.proc: WorkerProcess | None = None
        self.restarts = 0

    def start(self) -> str:
        self.proc = start_worker(self.spec.role, self.spec.model, self.spec.kv_backend, list(self.spec.flags))
        return self.proc.address

    def ensure(self) -> tuple[str, bool]:
        """(address, restarted): restart the worker process if it exited."""
        if self.proc is not None and self.proc.proc.poll() is None:
            return self.proc.address, False
        code = None if self.proc is None else self.proc.proc.returncode
        log.warning("%s worker exited (%s); restarting", self.spec.role, code)
        self.restarts += 1
        return self.start(), True

    def pid(self) -> int:
        return self.proc.proc.pid if self.proc is not None else -1

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None
