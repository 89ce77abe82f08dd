"""``tandem up``: a local Tandem cluster on one machine.

Start-up, printed as it goes, each line stamped with the seconds since this process started (``[tandem up
+6.12s] ray started``; ``tandem bench startup`` parses them):

1. the model: the given checkpoint, or the built-in tiny model (generated once, deterministically);
2. a local Ray instance (loopback only, token auth off, no dashboard);
3. the controller (controlplane/controller.py) in this process: one placement group and one
   :class:`WorkerReplica` actor per prefill/decode replica, started in parallel, each READY once its worker answers
   health checks;
4. the router in this process, with the ready workers; then the Control API (``tandem.v1.Control``, on the port
   recorded in the state file, which ``tandem scale`` reads, with the cluster token that its ``SetReplicas`` and
   ``Drain`` need in a 0600 file beside it) and the URL.

Steps 1 and 2 overlap: while ``ray.init`` waits for its processes, a thread generates the tiny model if needed,
imports the router (HTTP server, tokenizer, gRPC stubs) and compiles the engine's native kernels (a cold cache
only). This process never imports torch.

From then on the controller's reconcile loop owns the replicas: ``tandem scale`` changes a tier's desired count, a
dead worker is replaced, a scale-down drains first; :class:`RouterSync` keeps the router's worker pool in step, and
the state file lists the current workers' PIDs. Ctrl-C, SIGTERM or ``tandem down`` (which signals the PID recorded
in the state file) stops the router, every worker process, the actors and Ray, in that order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.paths import DEFAULT_MODEL_DIR, STATE_FILE, token_file_for
from router.serve import stop_on_signals

if TYPE_CHECKING:
    from controlplane.controller import Controller

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class UpConfig:
    model: str | None = None
    prefill: int = 1
    decode: int = 1
    port: int = 8000
    grpc_port: int | None = None  # the client gRPC API (tandem.v1.Gateway); None: port + 1; negative: not served
    host: str = "127.0.0.1"
    served_model_name: str | None = None  # None: the Hugging Face id given as the model, or the checkpoint's name
    redis: str | None = None
    # "auto" (worker.launcher.resolve_kv_backend) is nixl where installed; not the default here because creating the
    # two workers' NIXL agents adds ~1 s to start-up on 2 vCPUs (8.8-9.3 s -> 10.1-10.7 s, alternating), and a
    # local cluster's short prompts run colocated anyway. `--kv-backend auto|nixl` when long prompts dominate.
    kv_backend: str = "tcp"
    worker_flags: tuple[str, ...] = ()
    cpus_per_replica: float = 0.5
    min_uncached_tokens: int = 64
    control_port: int = 0  # tandem.v1.Control for `tandem scale`; 0: a free port (recorded in the state file)
    drain_timeout_s: float = 120.0
    api_keys: tuple[str, ...] = ()  # the gateway's API keys, ``KEY`` or ``admin:KEY`` (auth/api_keys.py)
    api_key_file: str | None = None
    vllm_metrics: bool = False  # also export vllm:* metric names (router/metric_catalogue.py)
    otlp_endpoint: str | None = None  # trace requests to this OTLP/gRPC collector (router/tracing.py)

    def __post_init__(self) -> None:
        from worker.launcher import KV_BACKENDS

        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {self.kv_backend!r} (choose from {', '.join(KV_BACKENDS)})")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need >= 0 prefill and >= 1 decode replicas, got {self.prefill}/{self.decode}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        if self.grpc_port is not None and self.grpc_port >= 65536:
            raise ValueError(f"grpc_port {self.grpc_port} out of range")
        if not 0 <= self.control_port < 65536:
            raise ValueError(f"control_port {self.control_port} out of range")
        if self.drain_timeout_s <= 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        from auth.api_keys import ApiKeys

        ApiKeys.load(self.api_keys, self.api_key_file)  # a bad key or key file fails here, before anything starts


def _process_start() -> float:
    """``time.monotonic()`` when this process started, so that the stamps include interpreter start-up and the
    imports before ``run_up``. Linux: the process's start time and the uptime, both from /proc (10 ms ticks)."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    age_s = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    return now - age_s if 0.0 <= age_s < 600.0 else now


_STARTED = _process_start()


def _say(msg: str) -> None:
    print(f"[tandem up +{time.monotonic() - _STARTED:.2f}s] {msg}", flush=True)


def resolve_model(model: str | None) -> Path:
    """The checkpoint directory to serve; raises FileNotFoundError for a --model that is not one."""
    from engine.model_source import resolve_checkpoint

    if not model:
        return DEFAULT_MODEL_DIR
    return resolve_checkpoint(model)  # a directory, or a Hugging Face id found in the local cache


def ensure_model(model: str | None) -> Path:
    """:func:`resolve_model`, generating the built-in tiny model on first use (the only step here needing torch)."""
    path = resolve_model(model)
    if not (path / "config.json").is_file():
        from tinymodel.checkpoint import write_tiny_checkpoint

        _say(f"generating the built-in tiny model in {path}")
        write_tiny_checkpoint(path)
    return path


class _Prepare(threading.Thread):
    """Runs beside ``ray.init``: makes sure the model exists, imports the router (HTTP server, tokenizer, gRPC
    stubs) so that ``_serve`` finds it loaded, then builds the engine's native kernels into their cache so that
    the workers do not each compile them. An import error is left for ``_serve``'s own import to raise."""

    def __init__(self, model: str | None) -> None:
        super().__init__(name="tandem-up-prepare", daemon=True)
        self.model = model
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.model_ready = threading.Event()

    def run(self) -> None:
        try:
            self.path = ensure_model(self.model)
            _say(f"model {self.path}")
        except BaseException as e:
            self.error = e
            return
        finally:
            self.model_ready.set()
        with contextlib.suppress(Exception):
            import router.server  # noqa: F401
        from engine.kernels import block_hash_module, build_all
        from router.kv_index import native_available

        build_all()
        # The router's CPython extensions too (prefix map, block hash for token lists), off its first request's path.
        native_available()
        block_hash_module()
        from router.cost import _kernel

        _kernel()

    def model_path(self, timeout_s: float = 600.0) -> Path:
        if not self.model_ready.wait(timeout_s):
            raise TimeoutError(f"the model was not ready within {timeout_s}s")
        if self.error is not None:
            raise self.error
        assert self.path is not None
        return self.path


def run_up(cfg: UpConfig) -> int:
    resolve_model(cfg.model)  # a bad --model fails here, before Ray starts; and so does a busy port
    from controlplane.ports import check_bindable

    check_bindable(cfg.host, cfg.port, "the HTTP API")
    if cfg.grpc_port is not None and cfg.grpc_port > 0:
        check_bindable(cfg.host, cfg.grpc_port, "the gRPC API")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The cluster's secret (auth/token.py), before Ray starts: its processes, so every worker, inherit it, and the
    # router and controller here hold it too. Admin RPCs (Drain, Snapshot, Abort) need it even with TLS off.
    from auth.token import ensure_cluster_token

    ensure_cluster_token()
    import ray

    from worker.launcher import resolve_kv_backend

    prepare = _Prepare(cfg.model)
    prepare.start()  # after `import ray`: imports share one GIL; what overlaps is ray.init waiting for its processes
    ray.init(num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", configure_logging=False)
    _say("ray started")
    try:
        model = prepare.model_path()
        return asyncio.run(_serve(cfg, model, resolve_kv_backend(cfg.kv_backend)))
    finally:
        ray.shutdown()
        STATE_FILE.unlink(missing_ok=True)
        token_file_for(STATE_FILE).unlink(missing_ok=True)
        _say("stopped")


def _hub_id(model: str | None) -> str | None:
    """``model`` when it named a Hugging Face id (served under that name, as vLLM does), else None."""
    from engine.model_source import looks_like_hub_id

    return model if model and looks_like_hub_id(model) and not Path(model).expanduser().exists() else None


def _flag_int(flags: tuple[str, ...], name: str, default: int) -> int:
    """The value of ``name`` in worker flags (``--name V`` or ``--name=V``), so the router hashes as they do."""
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return int(flags[i + 1])
        if f.startswith(name + "="):
            return int(f.split("=", 1)[1])
    return default


class LocalCluster:
    """The controller, the router and the Control API on this process's event loop: ``tandem up`` after Ray has
    started. ``state_file`` (None: none written) records this process, its ports and the workers' PIDs."""

    def __init__(self, cfg: UpConfig, model: Path, kv_backend: str, state_file: Path | None = STATE_FILE) -> None:
        self.cfg = cfg
        self.model = model
        self.kv_backend = kv_backend
        self.state_file = state_file
        self.controller: Controller | None = None
        self.router: Any = None
        self.control_port = 0
        self._servers: list[Any] = []

    async def start(self) -> None:
        from controlplane.control_server import start_control_server
        from controlplane.controller import Controller, ControllerConfig
        from controlplane.replica_state import ReplicaState
        from controlplane.router_sync import RouterSync
        from router.server import RouterConfig, build_router

        cfg = self.cfg
        self.controller = controller = Controller(ControllerConfig(
            str(self.model), cfg.prefill, cfg.decode, self.kv_backend, cfg.cpus_per_replica,
            worker_flags=cfg.worker_flags, redis=cfg.redis, drain_timeout_s=cfg.drain_timeout_s),
            on_change=self.write_state)
        controller.start()
        await controller.wait_converged(180.0)
        _say(f"{cfg.prefill} prefill + {cfg.decode} decode workers started (KV transfer: {self.kv_backend})")
        addresses = tuple(r.address for r in controller.replicas.values())
        self.router = router = await build_router(RouterConfig(
            model=str(self.model), workers=addresses, redis=cfg.redis, min_uncached_tokens=cfg.min_uncached_tokens,
            served_model_name=cfg.served_model_name or _hub_id(cfg.model),
            block_size=_flag_int(cfg.worker_flags, "--block-size", 16), api_keys=cfg.api_keys,
            api_key_file=cfg.api_key_file, vllm_metrics=cfg.vllm_metrics, otlp_endpoint=cfg.otlp_endpoint))
        controller.registrar = RouterSync(router.pool)
        router.gateway.metrics.attach_tiers(lambda: {t: (n, sum(r.state == ReplicaState.READY
                                                                for r in controller.of_tier(t)))
                                                     for t, n in controller.desired.items()})
        await controller.register_ready()  # any replaced while the router started
        grpc_port = cfg.port + 1 if cfg.grpc_port is None else cfg.grpc_port
        if grpc_port >= 0:
            from router.grpc_gateway import start_grpc_gateway

            try:
                server, grpc_port = await start_grpc_gateway(router.gateway, cfg.host, grpc_port)
                self._servers.append(server)
                _say(f"serving the gRPC API (tandem.v1.Gateway) at {cfg.host}:{grpc_port}")
            except (OSError, RuntimeError) as e:
                if cfg.grpc_port is not None:  # asked for explicitly: that is an error
                    raise
                _say(f"warning: no gRPC API ({e}); pass --grpc-port to choose another port")
        server, self.control_port = await start_control_server(controller, cfg.host, cfg.control_port)
        self._servers.append(server)
        if self.state_file is not None and controller.credentials.token is not None:
            from auth.token import write_token_file

            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            write_token_file(token_file_for(self.state_file), controller.credentials.token)
        self.write_state()
        # The HTTP gateway opens last (the gRPC and Control ports are up by then), and the URL line follows at once,
        # so that it precedes the first answer anyone can get from it.
        await router.serve_http(cfg.host, cfg.port)
        _say(f"workers healthy; serving OpenAI API at http://{cfg.host}:{cfg.port}/v1 (Ctrl-C or `tandem down` to "
             f"stop; `tandem scale TIER N` to scale)")

    def write_state(self) -> None:
        if self.state_file is None or self.controller is None:
            return
        pids = [r.pid for r in self.controller.replicas.values() if r.pid > 0]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "port": self.cfg.port,
                                   "control": f"{self.cfg.host}:{self.control_port}", "worker_pids": pids,
                                   "token_file": str(token_file_for(self.state_file))}))
        tmp.replace(self.state_file)

    async def close(self) -> None:
        for server in self._servers:
            await server.stop(1.0)
        if self.router is not None:
            await self.router.close()
        if self.controller is not None:
            await self.controller.close()


async def _serve(cfg: UpConfig, model: Path, kv_backend: str) -> int:
    stop = stop_on_signals()
    cluster = LocalCluster(cfg, model, kv_backend)
    try:
        starting = asyncio.create_task(cluster.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # Ctrl-C while starting
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 130
        stopped.cancel()
        starting.result()
        await stop.wait()
    finally:
        await cluster.close()
    return 0


def run_down(timeout_s: float = 60.0) -> int:
    if not STATE_FILE.is_file():
        print("no running `tandem up` found", file=sys.stderr)
        return 1
    state = json.loads(STATE_FILE.read_text())
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        STATE_FILE.unlink(missing_ok=True)
        print(f"`tandem up` (pid {pid}) was not running; removed its state file", file=sys.stderr)
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _running(pid):
            print(f"stopped `tandem up` (pid {pid})")
            return 0
        time.sleep(0.1)
    print(f"`tandem up` (pid {pid}) did not stop within {timeout_s}s", file=sys.stderr)
    return 1


def _running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (a zombie waiting for its parent counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
