"""``tandem up``'s composition: the model and the router, built here and handed to the local cluster.

The control plane (controlplane/local_cluster.py) runs Ray, the controller and the Control API, and imports neither
the router nor the engine. This module, in the composition root, which may import everything, gives it:

- :class:`Prepare`, the start-up work beside ``ray.init``: the checkpoint (the built-in tiny model generated if need
  be), then the router's imports (HTTP server, tokenizer, gRPC stubs) and the native code (the engine's kernels,
  which the workers would otherwise each compile, and the router's CPython extensions, off its first request's path);
- :func:`router_frontend`, which builds the router (router/server.py) over the ready workers, wrapped in
  :class:`RouterFrontend`, the shape the cluster drives (controlplane/frontend.py).

The router's modules are imported in :class:`Prepare`'s thread and inside the factory, never at this module's
import, so that they load while Ray starts rather than before it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.model import ensure_model, hub_id, resolve_model
from controlplane.local_cluster import UpConfig, run_up, say

if TYPE_CHECKING:
    from controlplane.autoscaler import Planner
    from controlplane.frontend import FrontendFactory, TierReplicas
    from router.pool import WorkerPool
    from router.server import Router


class Prepare(threading.Thread):
    """Runs beside ``ray.init``: makes sure the model exists, imports the router so that the factory finds it
    loaded, then builds the native code into its cache. An import error is left for the factory's own import to
    raise."""

    def __init__(self, model: str | None) -> None:
        super().__init__(name="tandem-up-prepare", daemon=True)
        self.model = model
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.model_ready = threading.Event()

    def run(self) -> None:
        try:
            self.path = ensure_model(self.model)
            say(f"model {self.path}")
        except BaseException as e:
            self.error = e
            return
        finally:
            self.model_ready.set()
        with contextlib.suppress(Exception):
            import router.server  # noqa: F401
        from engine.kernels import block_hash_module, build_all
        from router.cost import _kernel
        from router.kv_index import native_available

        build_all()
        native_available()
        block_hash_module()
        _kernel()

    def model_path(self, timeout_s: float = 600.0) -> Path:
        if not self.model_ready.wait(timeout_s):
            raise TimeoutError(f"the model was not ready within {timeout_s}s")
        if self.error is not None:
            raise self.error
        assert self.path is not None
        return self.path


@dataclass(slots=True)
class RouterFrontend:
    """The in-process router as the local cluster's :class:`~controlplane.frontend.Frontend`."""

    router: Router
    grpc_servers: list[Any] = field(default_factory=list)  # the gRPC gateway's server, once serving

    @property
    def pool(self) -> WorkerPool:
        return self.router.pool

    def attach_tiers(self, tiers: TierReplicas) -> None:
        self.router.gateway.metrics.attach_tiers(tiers)

    async def serve_grpc(self, host: str, port: int) -> int:
        from router.grpc_gateway import start_grpc_gateway

        server, bound = await start_grpc_gateway(self.router.gateway, host, port)
        self.grpc_servers.append(server)
        return bound

    async def serve_http(self, host: str, port: int) -> int:
        return await self.router.serve_http(host, port)

    async def close(self) -> None:
        for server in self.grpc_servers:
            await server.stop(1.0)
        await self.router.close()


def flag_int(flags: tuple[str, ...], name: str, default: int) -> int:
    """The value of ``name`` in worker flags (``--name V`` or ``--name=V``), so the router hashes as they do."""
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return int(flags[i + 1])
        if f.startswith(name + "="):
            return int(f.split("=", 1)[1])
    return default


def router_frontend(cfg: UpConfig) -> FrontendFactory:
    """Builds the router of ``cfg`` (its API keys, served name, metrics, tracing) over the workers it is given."""

    async def build(model: Path, workers: tuple[str, ...]) -> RouterFrontend:
        from router.server import RouterConfig, build_router

        router = await build_router(RouterConfig(
            model=str(model), workers=workers, redis=cfg.redis, min_uncached_tokens=cfg.min_uncached_tokens,
            served_model_name=cfg.served_model_name or hub_id(cfg.model),
            block_size=flag_int(cfg.worker_flags, "--block-size", 16), api_keys=cfg.api_keys,
            api_key_file=cfg.api_key_file, vllm_metrics=cfg.vllm_metrics, otlp_endpoint=cfg.otlp_endpoint))
        return RouterFrontend(router)

    return build


def run(cfg: UpConfig, planner: Planner | None = None) -> int:
    """``tandem up``: a bad ``--model`` fails here, before Ray starts; then the local cluster runs (autoscaled by
    ``planner``, cli/autoscale.py, when given)."""
    resolve_model(cfg.model)
    check_parallel(cfg)
    return run_up(cfg, Prepare(cfg.model), router_frontend(cfg), planner)


def check_parallel(cfg: UpConfig) -> None:
    """Each tier's split against the model (TP dividing the heads, PP within the layers, EP within the experts):
    ValueError naming the constraint, before Ray or any worker starts."""
    tiers = [t for t, n in (("prefill", cfg.prefill), ("decode", cfg.decode)) if n]
    if all(cfg.ranks_of(t) == 1 for t in tiers):
        return
    from engine.model_config import ModelConfig
    from engine.parallel.config import ParallelConfig

    model = ModelConfig.from_dir(ensure_model(cfg.model))
    for tier in tiers:
        tp = cfg.prefill_tp if tier == "prefill" else cfg.decode_tp
        try:
            ParallelConfig(tp=tp, pp=cfg.pp, ep=cfg.ep).check_model(model)
        except ValueError as e:
            raise ValueError(f"{tier}: {e}") from None
        if cfg.prefill and tp > model.num_kv_heads:  # each rank sends or lands its own heads' KV
            raise ValueError(f"{tier}: tp {tp} is above the model's {model.num_kv_heads} KV heads, whose KV cannot "
                             "move between the tiers rank to rank (or prefill = 0: colocated)")
