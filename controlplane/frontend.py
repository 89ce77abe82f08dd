"""What ``tandem up``'s local cluster is handed by its composer: the router, which the control plane does not
import, and the start-up work that yields the model, which needs the engine.

The composition root (cli/up.py) builds both. The cluster starts the :class:`Preparation` once ``ray`` is
imported, so that it runs while ``ray.init`` waits for its processes, then waits for its checkpoint. It calls the
:data:`FrontendFactory` once the first workers are ready, so that the router starts with them, and drives the
result through :class:`Frontend` alone; the pool that exposes is the one
:class:`controlplane.router_sync.RouterSync` keeps in step with the controller.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from controlplane.router_sync import PoolLike

TierReplicas = Callable[[], dict[str, tuple[int, int]]]  # tier -> (desired, ready), read at every metrics scrape


class Frontend(Protocol):
    """The client-facing side of a local cluster: its worker pool, its metrics, and its listeners."""

    @property
    def pool(self) -> PoolLike: ...

    def attach_tiers(self, tiers: TierReplicas) -> None:
        """Export each tier's desired and ready replicas, as ``tiers()`` reports them."""

    async def serve_grpc(self, host: str, port: int) -> int:
        """Serve the client gRPC API on ``host:port`` (0: a free port); return the bound port. OSError or
        RuntimeError when it cannot bind."""

    async def serve_http(self, host: str, port: int) -> int:
        """Serve the OpenAI HTTP API on ``host:port``; return the bound port."""

    async def close(self) -> None:
        """Stop every listener and let go of the workers."""


class Preparation(Protocol):
    """Start-up work beside ``ray.init`` that ends with the checkpoint directory to serve."""

    def start(self) -> None:
        """Begin, in the background."""

    def model_path(self) -> Path:
        """The checkpoint directory, once ready; raises what preparing it raised."""


# (checkpoint directory, the ready workers' addresses) -> a started frontend routing to them.
FrontendFactory = Callable[[Path, tuple[str, ...]], Awaitable[Frontend]]
