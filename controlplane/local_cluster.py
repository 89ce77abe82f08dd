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

The control plane imports neither the router nor the engine: the composition root (cli/up.py) passes in a
:class:`~controlplane.frontend.Preparation`, started once ``ray`` is imported so that it runs while ``ray.init``
waits for its processes (there: the model, generated if need be, the router's imports and the native kernels), which
yields the checkpoint to serve; and a :data:`~controlplane.frontend.FrontendFactory`, which builds the router once
the workers are ready. This process never imports torch.

From then on the controller's reconcile loop owns the replicas: ``tandem scale`` changes a tier's desired count, a
dead worker is replaced, a scale-down drains first; :class:`RouterSync` keeps the router's worker pool in step, and
the state file lists the current workers' PIDs. With ``tandem up --autoscale`` the composer also hands in a planner,
and the autoscaler (controlplane/autoscaler.py) sets the tiers' desired counts from the router's metrics. Ctrl-C,
SIGTERM or ``tandem down`` (which signals the PID recorded in the state file) stops the autoscaler, the router,
every worker process, the actors and Ray, in that order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.controller import check_lora
from controlplane.paths import STATE_FILE, token_file_for
from controlplane.prometheus_targets import prometheus_targets_for, write_prometheus_targets

if TYPE_CHECKING:
    from controlplane.autoscaler import Autoscaler, Planner
    from controlplane.controller import Controller
    from controlplane.frontend import Frontend, FrontendFactory, Preparation

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
    # Each replica's ranks (its worker's --tp/--pp/--ep: child processes joined by gloo; engine/parallel/replica.py)
    prefill_tp: int = 1
    decode_tp: int = 1
    pp: int = 1
    ep: int = 1
    # LoRA adapters every worker replica serves, ``NAME=DIR`` each (tandem up --lora; controlplane/controller.py)
    lora: tuple[str, ...] = ()
    # torch intra-op threads of each worker rank (tandem up --threads); None: this host's CPUs shared among the ranks
    # started here (:meth:`worker_threads`). A Ray actor's child would otherwise run one thread (Ray sets
    # OMP_NUM_THREADS=1 for an actor of fractional CPUs), leaving a lone colocated replica one core of many.
    threads: int | None = None

    def __post_init__(self) -> None:
        from worker.launcher import KV_BACKENDS

        if self.kv_backend not in KV_BACKENDS:
            raise ValueError(f"unknown kv_backend {self.kv_backend!r} (choose from {', '.join(KV_BACKENDS)})")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(f"need >= 0 prefill and >= 1 decode replicas, got {self.prefill}/{self.decode}")
        for name in ("prefill_tp", "decode_tp", "pp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.prefill and max(self.prefill_tp, self.decode_tp, self.pp, self.ep) > 1:
            # KV moves between the tiers TP rank to TP rank (engine/parallel/replica.py), at any two TP degrees
            if self.pp > 1 or any(self.ep not in (1, tp) for tp in (self.prefill_tp, self.decode_tp)):
                raise ValueError("with prefill replicas, ranks move KV TP rank to TP rank: pp must be 1 and ep 1 or "
                                 "equal to each tier's tp (or prefill = 0: colocated replicas take any split)")
            if self.kv_backend == "torch":
                raise ValueError("kv_backend torch cannot move the KV of replicas with ranks: use tcp, nixl or auto")
        check_lora(self.lora)
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an int >= 1, got {self.threads!r}")
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


    def ranks_of(self, tier: str) -> int:
        """A ``tier`` replica's ranks, one placement-group bundle each (engine/parallel/config.py's world size)."""
        tp = self.prefill_tp if tier == "prefill" else self.decode_tp
        return max(tp, self.ep) * self.pp

    def worker_threads(self, cpus: int | None = None, ranks: int | None = None) -> int:
        """Each worker rank's torch threads: ``threads`` when given, else the host's usable CPUs (``cpus``; default
        this process's affinity) divided among ``ranks`` (default: the ranks started here), at least one. ``tandem up
        --autoscale`` passes its rank budget, so the replicas it adds do not oversubscribe the cores; replicas added
        by ``tandem scale`` get the same count as the first, so scaling past the CPUs oversubscribes them: give
        ``threads`` (``--threads 1``) for a cluster that will grow on a small host."""
        if self.threads is not None:
            return self.threads
        if cpus is None:
            cpus = len(os.sched_getaffinity(0))
        if ranks is None:
            ranks = self.prefill * self.ranks_of("prefill") + self.decode * self.ranks_of("decode")
        return max(1, cpus // max(ranks, 1))

    def flags_for_workers(self, cpus: int | None = None) -> tuple[str, ...]:
        """The flags every worker gets: ``worker_flags``, then ``--threads`` unless they set it, and the OTLP
        endpoint when tracing is on."""
        flags = self.worker_flags
        if "--threads" not in flags:
            flags = (*flags, "--threads", str(self.worker_threads(cpus)))
        if self.otlp_endpoint:  # the workers trace their part of each request to the router's collector
            flags = (*flags, "--otlp-endpoint", self.otlp_endpoint)
        return flags


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


def say(msg: str) -> None:
    """Print one start-up line, stamped with the seconds since this process started."""
    print(f"[tandem up +{time.monotonic() - _STARTED:.2f}s] {msg}", flush=True)


def ray_env_defaults() -> None:
    """What every Ray that Tandem starts gets unless the environment says otherwise: no token auth (a local
    cluster; Tandem's own cluster token guards its RPCs), no usage stats, and 120 s rather than Ray's 30 s for its GCS
    to publish its port (a 2-CPU host busy with a previous cluster's exit can take longer). ``tandem up``, ``tandem
    controller`` and the test suite call it before Ray starts."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


def run_up(cfg: UpConfig, prepare: Preparation, frontend: FrontendFactory, planner: Planner | None = None) -> int:
    """Start Ray, the workers, the router ``frontend`` builds and the Control API; serve until a signal. A busy
    port fails before Ray starts (so should a bad model, in the caller, before this). With a ``planner``, the
    autoscaler (controlplane/autoscaler.py) scales the tiers once the cluster serves."""
    from controlplane.ports import check_bindable

    check_bindable(cfg.host, cfg.port, "the HTTP API")
    if cfg.grpc_port is not None and cfg.grpc_port > 0:
        check_bindable(cfg.host, cfg.grpc_port, "the gRPC API")
    ray_env_defaults()
    # The cluster's secret (auth/token.py), before Ray starts: its processes, so every worker, inherit it, and the
    # router and controller here hold it too. Admin RPCs (Drain, Snapshot, Abort) need it even with TLS off.
    from auth.token import ensure_cluster_token

    ensure_cluster_token()
    import ray

    from worker.launcher import resolve_kv_backend

    prepare.start()  # after `import ray`: imports share one GIL; what overlaps is ray.init waiting for its processes
    ray.init(num_cpus=max(os.cpu_count() or 1, 1), include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", configure_logging=False)
    say("ray started")
    try:
        model = prepare.model_path()
        return asyncio.run(_serve(LocalCluster(cfg, model, resolve_kv_backend(cfg.kv_backend), frontend,
                                               planner=planner)))
    finally:
        ray.shutdown()
        STATE_FILE.unlink(missing_ok=True)
        token_file_for(STATE_FILE).unlink(missing_ok=True)
        prometheus_targets_for(STATE_FILE).unlink(missing_ok=True)
        say("stopped")


class LocalCluster:
    """The controller, the router and the Control API on this process's event loop: ``tandem up`` after Ray has
    started. ``frontend`` builds the router once the workers are ready; ``state_file`` (None: none written) records
    this process, its ports and the workers' PIDs."""

    def __init__(self, cfg: UpConfig, model: Path, kv_backend: str, frontend: FrontendFactory,
                 state_file: Path | None = STATE_FILE, planner: Planner | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.kv_backend = kv_backend
        self.build_frontend = frontend
        self.state_file = state_file
        self.controller: Controller | None = None
        self.frontend: Frontend | None = None
        self.control_port = 0
        self._servers: list[Any] = []
        self.planner = planner
        self.autoscaler: Autoscaler | None = None

    async def start(self) -> None:
        from controlplane.control_server import start_control_server
        from controlplane.controller import Controller, ControllerConfig
        from controlplane.replica_state import ReplicaState
        from controlplane.router_sync import RouterSync

        cfg = self.cfg
        self.controller = controller = Controller(ControllerConfig(
            str(self.model), cfg.prefill, cfg.decode, self.kv_backend, cfg.cpus_per_replica,
            worker_flags=cfg.flags_for_workers(),
            redis=cfg.redis, drain_timeout_s=cfg.drain_timeout_s,
            prefill_ranks=cfg.ranks_of("prefill"), decode_ranks=cfg.ranks_of("decode"),
            prefill_parallel=(cfg.prefill_tp, cfg.pp, cfg.ep), decode_parallel=(cfg.decode_tp, cfg.pp, cfg.ep),
            worker_metrics_port=0,  # each worker's /metrics on a free port, listed in the Prometheus targets file
            lora=cfg.lora),
            on_change=self.write_state)
        controller.start()
        await controller.wait_converged(180.0)
        say(f"{cfg.prefill} prefill + {cfg.decode} decode workers started (KV transfer: {self.kv_backend})")
        addresses = tuple(r.address for r in controller.replicas.values())
        self.frontend = frontend = await self.build_frontend(self.model, addresses)
        controller.registrar = RouterSync(frontend.pool)
        frontend.attach_tiers(lambda: {t: (n, sum(r.state == ReplicaState.READY for r in controller.of_tier(t)))
                                       for t, n in controller.desired.items()})
        await controller.register_ready()  # any replaced while the router started
        grpc_port = cfg.port + 1 if cfg.grpc_port is None else cfg.grpc_port
        if grpc_port >= 0:
            try:
                grpc_port = await frontend.serve_grpc(cfg.host, grpc_port)
                say(f"serving the gRPC API (tandem.v1.Gateway) at {cfg.host}:{grpc_port}")
            except (OSError, RuntimeError) as e:
                if cfg.grpc_port is not None:  # asked for explicitly: that is an error
                    raise
                say(f"warning: no gRPC API ({e}); pass --grpc-port to choose another port")
        server, self.control_port = await start_control_server(controller, cfg.host, cfg.control_port)
        self._servers.append(server)
        if self.state_file is not None and controller.credentials.token is not None:
            from auth.token import write_token_file

            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            write_token_file(token_file_for(self.state_file), controller.credentials.token)
        self.write_state()
        # The HTTP gateway opens last (the gRPC and Control ports are up by then), and the URL line follows at once,
        # so that it precedes the first answer anyone can get from it.
        await frontend.serve_http(cfg.host, cfg.port)
        say(f"workers healthy; serving OpenAI API at http://{cfg.host}:{cfg.port}/v1 (Ctrl-C or `tandem down` to "
             f"stop; `tandem scale TIER N` to scale)")
        if self.planner is not None:
            self.start_autoscaler(self.planner)

    def start_autoscaler(self, planner: Planner) -> None:
        """Scale the tiers from the router's own ``/metrics`` (on loopback when the API listens on every address)."""
        from controlplane.autoscaler import Autoscaler, ScrapeTarget, first_api_key

        assert self.controller is not None
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host
        host = f"[{host}]" if ":" in host else host
        target = ScrapeTarget(f"http://{host}:{self.cfg.port}/metrics",
                              first_api_key(self.cfg.api_keys, self.cfg.api_key_file))
        self.autoscaler = Autoscaler(self.controller, target, planner, say)
        self.autoscaler.start()
        say(f"autoscaling every {planner.interval_s:g}s from {target.url}")

    def write_state(self) -> None:
        """The state file, and beside it the Prometheus targets file (controlplane/prometheus_targets.py)."""
        from controlplane.replica_state import ReplicaState

        if self.state_file is None or self.controller is None:
            return
        pids = [r.pid for r in self.controller.replicas.values() if r.pid > 0]
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "port": self.cfg.port,
                                   "control": f"{self.cfg.host}:{self.control_port}", "worker_pids": pids,
                                   "token_file": str(token_file_for(self.state_file)),
                                   "prometheus_targets": str(prometheus_targets_for(self.state_file))}))
        tmp.replace(self.state_file)
        write_prometheus_targets(prometheus_targets_for(self.state_file), f"{self.cfg.host}:{self.cfg.port}",
                                 {r.metrics_address: r.tier for r in self.controller.replicas.values()
                                  if r.metrics_address and r.state != ReplicaState.FAILED})

    async def close(self) -> None:
        if self.autoscaler is not None:
            await self.autoscaler.close()
        for server in self._servers:
            await server.stop(1.0)
        if self.frontend is not None:
            await self.frontend.close()
        if self.controller is not None:
            await self.controller.close()


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, handled by the running loop (``tandem up`` and the controller daemon)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve(cluster: LocalCluster) -> int:
    stop = stop_on_signals()
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
