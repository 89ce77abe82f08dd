"""``tandem controller``: the controller as a long-running process serving ``tandem.v1.Control``.

In Kubernetes it runs in the Ray head pod (the operator's ``RayCluster``) and joins that cluster
(``--ray-address auto``); the workers register in Redis, where the routers discover them, so a replica is READY
once its lease is there. Locally (``--ray-address local``, the default without ``RAY_ADDRESS``) it starts a Ray
instance of its own. SIGTERM or SIGINT stops the Control server, then every replica, then leaves Ray.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from auth.credentials import Credentials
from controlplane.controller import Controller, ControllerConfig
from controlplane.local_cluster import ray_env_defaults, stop_on_signals

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    controller: ControllerConfig
    host: str = "0.0.0.0"
    control_port: int = 9400
    ray_address: str = "local"  # "local": start Ray here; "auto" or host:port: join a running cluster

    def __post_init__(self) -> None:
        if not 0 <= self.control_port < 65536:
            raise ValueError(f"control_port {self.control_port} out of range")
        if not self.ray_address:
            raise ValueError("ray_address must be 'local', 'auto' or an address")


def _init_ray(address: str) -> None:
    ray_env_defaults()
    import ray

    if address == "local":  # loopback only, as `tandem up`'s
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, _node_ip_address="127.0.0.1")
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)


async def _serve(cfg: DaemonConfig, credentials: Credentials | None) -> int:
    from controlplane.control_server import start_control_server

    stop = stop_on_signals()
    controller = Controller(cfg.controller, credentials=credentials)
    server, port = await start_control_server(controller, cfg.host, cfg.control_port)
    controller.start()
    print(f"READY control {cfg.host}:{port}", flush=True)
    log.info("controller serving tandem.v1.Control on %s:%d; desired %s", cfg.host, port, controller.desired)
    try:
        await stop.wait()
    finally:
        await server.stop(2.0)
        await controller.close()
    return 0


def run_controller(cfg: DaemonConfig, credentials: Credentials | None = None) -> int:
    """Run until SIGTERM or SIGINT; ``credentials`` for the workers' RPCs (default: this process's cluster token)."""
    import ray

    _init_ray(cfg.ray_address)
    try:
        return asyncio.run(_serve(cfg, credentials))
    finally:
        ray.shutdown()
