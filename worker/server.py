"""``tandem worker``: one engine behind the Worker gRPC API, on 127.0.0.1 unless told otherwise.

Start-up order: load the model and allocate the KV cache, register the cache with the KV transport, start the
engine loop, then bind gRPC and print one ``READY <port>`` line (what process supervisors wait for; ``Health``
answers from then on). The API is served on ``grpc.aio`` (``worker/aio_service.py``): streams hold no thread, so
concurrency is not capped by a pool, and a busy worker still answers its probes. SIGTERM or SIGINT drains: new
work is refused, in-flight requests and prefill's outgoing KV transfers finish (bounded by ``--drain-timeout``),
then the process exits.

The engine (torch) and gRPC are imported by the functions that use them, not by this module: every ``tandem``
command builds its parser with :func:`add_worker_args`, and ``tandem up`` / ``tandem down`` need no torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from auth.credentials import add_args as add_credential_args

if TYPE_CHECKING:
    from auth.tls import TLSFiles
    from engine.llm_engine import LLMEngine
    from engine.lora.config import LoRAConfig
    from engine.parallel.config import ParallelConfig
    from engine.spec.config import SpeculativeConfig
    from kvtransfer.config import TransferConfig
    from kvtransfer.layout import KVLayout
    from worker.metrics import FamilySpec
    from worker.service import WorkerService

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on the READY line)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kv-backend", default="tcp", choices=["nixl", "torch", "tcp"])
    p.add_argument("--worker-id", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-memory-mb", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--speculative", default=None, metavar="ngram|draft:DIR",
                   help="speculative decoding (engine/spec): n-gram prompt lookup, or a draft model sharing the "
                        "tokenizer; a prefill worker ignores it (it never decodes)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="tokens proposed per step")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a PEFT LoRA adapter under NAME (repeatable; engine/lora): a Generate names it in lora; "
                        "a prefill and a decode worker both apply a disaggregated request's adapter "
                        "(worker/lora_handoff.py)")
    p.add_argument("--max-loras", type=int, default=4, help="LoRA adapters kept loaded (least recently used swapped)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: rank 0 is this process, the others its "
                   "child processes, joined by torch.distributed (gloo on CPU)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, each a contiguous range of layers")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (a MoE model)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--session-port", type=int, default=0,
                   help="port of the plain-TCP Session transport (0: a free one, reported by Health; -1: none)")
    p.add_argument("--kv-io-cpus", default=None, metavar="LIST",
                   help="CPUs (e.g. 3 or 2-3) for the KV transport's threads, off the engine's cores: on a CPU host "
                        "they copy every landing byte, and on the engine's cores that time comes out of decode's steps")
    p.add_argument("--redis", default=None, help="redis://host:port: register a lease and publish KV events")
    p.add_argument("--otlp-endpoint", default=None, metavar="HOST:PORT",
                   help="record this worker's spans of traced requests, exported over OTLP/gRPC to this collector")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus /metrics (a prefill worker's KV transfer latency and size histograms, a "
                        "speculating worker's proposed and accepted tokens) on this port of --host (0: a free one)")
    p.add_argument("--lease-seconds", type=float, default=3.0)
    add_credential_args(p)  # --auth-token-file, --tls-cert/--tls-key/--tls-ca (auth/credentials.py)
    p.add_argument("--stream-stall-timeout", type=_positive, default=60.0, metavar="S",
                   help="a request whose client reads nothing (its stream paused: backpressure) fails after S s")
    p.add_argument("--max-unsent-tokens", type=int, default=256, metavar="N",
                   help="a gRPC stream's tokens generated but not yet sent before its request pauses")
    # Fault injection for the failure tests: the prefill engine stalls after sending this layer.
    p.add_argument("--debug-stall-after-layer", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--debug-stall-seconds", type=float, default=3600.0, help=argparse.SUPPRESS)
    # Fault injection: a prefill's last layer (so its transfer's end) leaves this long after its first token.
    p.add_argument("--debug-transfer-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def kv_layout_for(engine: LLMEngine, tp: int = 1) -> KVLayout:
    """Rank 0's KV layout (``worker/rank_kv.py`` makes each follower's the same way)."""
    from worker.rank_kv import kv_layout

    return kv_layout(engine, tp, 0)


def transfer_config(args: argparse.Namespace, tls: TLSFiles | None = None) -> TransferConfig:
    """The KV transport's config: ``--kv-io-cpus``, and mutual TLS from ``tls`` (the tcp backend's connections;
    NIXL/UCX and torch.distributed carry KV on transports of their own, outside Tandem's TLS)."""
    from kvtransfer.config import TransferConfig
    from kvtransfer.io_cpus import check_cpus, parse_cpu_list

    cpus: tuple[int, ...] = ()
    if args.kv_io_cpus is not None:
        cpus = parse_cpu_list(args.kv_io_cpus)
        check_cpus(cpus)
    if tls is None:
        return TransferConfig(io_cpus=cpus)
    from auth.tls import client_context, server_context

    return TransferConfig(io_cpus=cpus, tls_server=server_context(tls), tls_client=client_context(tls),
                          tls_server_name=tls.server_name)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """``--speculative`` for a decoding role (None for prefill); ValueError for a bad value or a multi-rank worker
    (its ranks step in lockstep, and speculation changes a step's shape on rank 0 only)."""
    from engine.spec.config import parse_speculative

    spec = parse_speculative(args.speculative, args.num_speculative_tokens)
    if spec is None or args.role == "prefill":
        return None
    if max(getattr(args, name, 1) for name in ("tp", "pp", "ep")) > 1:
        raise ValueError("--speculative runs on a single-rank worker (--tp/--pp/--ep 1)")
    return spec


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """``--lora NAME=DIR`` (repeatable) and ``--max-loras``; None without adapters. ValueError for a bad value."""
    from engine.lora.config import LoRAConfig, parse_lora_flag

    if not args.lora:
        return None
    if max(getattr(args, name, 1) for name in ("tp", "pp", "ep")) > 1:
        raise ValueError("--lora runs on a single-rank worker (--tp/--pp/--ep 1)")
    return LoRAConfig(tuple(parse_lora_flag(v) for v in args.lora), max_loras=args.max_loras)


def model_key(engine: LLMEngine) -> str:
    """Names the model on the Redis bus: workers of one model share a registry and an event stream."""
    return Path(engine.config.model).name


def build_service(args: argparse.Namespace, transfer: TransferConfig | None = None,
                  tls: TLSFiles | None = None) -> WorkerService:
    """The worker's engine and service from its flags; ``transfer`` when the caller has already built (and so
    checked) the KV transport's config from them, and ``tls`` its TLS files (a follower rank builds its own)."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from kvtransfer import get_backend
    from worker.decode_service import DecodeService
    from worker.prefill_service import PrefillService

    config = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        num_threads=args.threads,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          memory_budget_bytes=args.kv_memory_mb << 20,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
        speculative=speculative_config(args), lora=lora_config(args),
    )
    parallel = parallel_config(args)
    replica = None
    holder: list[WorkerService] = []  # the service, once built: a rank that dies takes it out of service first
    transfer = transfer or transfer_config(args)
    kv_by_rank = True  # a worker with ranks sends or lands remote KV (else: --role both, colocated only)
    if parallel.world_size > 1:
        from engine.model_config import ModelConfig
        from engine.parallel.replica import ServedReplica
        from worker.rank_kv import RankKV

        kv_by_rank = rank_kv_refusal(parallel, ModelConfig.from_dir(args.model).num_kv_heads, args.kv_backend) is None
        # each follower rank holds its own heads' KV, so it sends (prefill) or lands (decode) them itself
        role = "prefill" if args.role == "prefill" else "decode"
        extension = RankKV(role, args.kv_backend, parallel.tp, transfer.io_cpus, tls) if kv_by_rank else None
        replica = ServedReplica(config, parallel, on_rank_exit=lambda reason: _rank_exited(reason, holder),
                                extension=extension)
        engine = replica.engine
    else:
        engine = LLMEngine(config)
    layout = kv_layout_for(engine, parallel.tp if kv_by_rank else 1)
    sender_cls, receiver_cls = get_backend(args.kv_backend)
    service: WorkerService
    if args.role == "prefill":
        # The service attaches its KV connector to the engine, which registers the KV cache with the sender.
        prefill = PrefillService(engine, sender_cls(transfer), layout, args.kv_backend, args.worker_id, replica)
        if args.debug_stall_after_layer is not None:
            prefill.connector.stall = (args.debug_stall_after_layer, args.debug_stall_seconds)
        prefill.connector.transfer_delay_s = args.debug_transfer_delay_ms / 1000.0
        service = prefill
    else:
        receiver = receiver_cls(transfer) if kv_by_rank else None
        service = DecodeService(engine, receiver, layout, args.kv_backend, args.worker_id, role=args.role,
                                replica=replica)
    service.parking.stall_timeout_s = args.stream_stall_timeout
    service.replica = replica
    holder.append(service)
    return service


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The replica's ranks from ``--tp/--pp/--ep``; ValueError naming the constraint a bad split breaks (the model's
    heads, layers or experts), before any rank starts."""
    from engine.model_config import ModelConfig
    from engine.parallel.config import ParallelConfig

    parallel = ParallelConfig(tp=args.tp, ep=args.ep, pp=args.pp)
    if parallel.world_size > 1:
        cfg = ModelConfig.from_dir(args.model)
        parallel.check_model(cfg)
        why = rank_kv_refusal(parallel, cfg.num_kv_heads, args.kv_backend)
        # A decode worker whose ranks are stages or experts (KV not split by TP) serves colocated requests only, as
        # the decode tier of a cluster with no prefill tier does (``tandem up --prefill 0 --pp 2``; UpConfig refuses
        # PP or EP beside prefill replicas); it refuses Reserve (no KV receiver). A TP split whose KV cannot move
        # (too many ranks for the KV heads, the torch backend) is still refused: a TP decode worker lands KV.
        colocated = args.role == "both" or (args.role == "decode" and not kv_split_by_tp(parallel))
        if why is not None and not colocated:
            raise ValueError(f"a {args.role} worker with ranks: {why}")
    return parallel


def kv_split_by_tp(parallel: ParallelConfig) -> bool:
    """Whether each rank holds its own TP heads' KV (no pipeline stages, EP only alongside an equal TP)."""
    return parallel.pp == 1 and parallel.ep in (1, parallel.tp)


def rank_kv_refusal(parallel: ParallelConfig, num_kv_heads: int, kv_backend: str) -> str | None:
    """Why this replica's ranks cannot each send or land their own heads' KV (None: they can). A prefill or decode
    worker is refused then; a ``--role both`` one serves colocated requests only."""
    if not kv_split_by_tp(parallel):
        return ("--pp above 1, or --ep without the same --tp, gives ranks whose KV is not split by TP, and KV moves "
                "between tiers TP rank to TP rank (use --tp, with --ep equal to it)")
    if parallel.tp > num_kv_heads:
        return f"--tp {parallel.tp} is above the model's {num_kv_heads} KV heads (replicated heads do not move)"
    if kv_backend == "torch":
        return "--kv-backend torch cannot move it (the ranks' torch.distributed group is the process's): tcp or nixl"
    return None


RANK_EXIT_GRACE_S = 2.0  # a dead rank's worker answers NOT_SERVING this long before it exits (routers probe Health
# at least every second: router/pool.py HEALTH_REFRESH_S)


def _rank_exited(reason: str, service: list[WorkerService]) -> None:
    """A rank of this replica died: the replica is down as a whole (the controller replaces it). Health answers
    NOT_SERVING and the registry entry turns draining first, for ``RANK_EXIT_GRACE_S``, so that routers stop
    sending here before the port goes (the ranks' collectives cannot finish a step any more)."""
    log.error("%s; exiting", reason)
    if service:
        service[0].start_draining()
        time.sleep(RANK_EXIT_GRACE_S)
    logging.shutdown()
    os._exit(3)


def serve(args: argparse.Namespace, catalogue: Mapping[str, FamilySpec] | None = None) -> int:
    """Run a worker until SIGTERM or SIGINT; ``catalogue``: the metric families of ``--metrics-port``
    (router/metric_catalogue.WORKER_METRICS, handed in by the composition root: worker/metrics.py)."""
    from auth.credentials import from_args
    from auth.grpc_server import AioAdminGuard, add_port
    from worker.aio_server import AioServerThread
    from worker.aio_service import AioWorker
    from worker.decode_service import DecodeService
    from worker.metrics import WorkerMetrics
    from worker.prefill_service import PrefillService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    t0 = time.monotonic()
    try:
        creds = from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        transfer = transfer_config(args, creds.tls)  # a bad flag fails here, before the model loads
    except ValueError as e:
        print(f"error: --kv-io-cpus: {e}", file=sys.stderr)
        return 2
    if creds.tls is not None and args.kv_backend != "tcp":
        log.warning("--kv-backend %s moves KV on its own transport, outside Tandem's TLS (only tcp's connections are "
                    "mutual TLS)", args.kv_backend)
    if creds.token is None:
        log.warning("no cluster token (--auth-token-file or $TANDEM_CLUSTER_TOKEN): Drain, Snapshot, Abort and "
                    "KVEvents are refused to every caller%s", ", and Redis entries go unsigned" if args.redis else "")
    if args.max_unsent_tokens < 1:
        print(f"error: --max-unsent-tokens must be >= 1, not {args.max_unsent_tokens}", file=sys.stderr)
        return 2
    try:
        parallel_config(args)  # a bad split fails here, naming its constraint, before any rank starts
        speculative_config(args)
        lora_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    service = build_service(args, transfer, creds.tls)
    service.start()
    tracer = None
    if args.otlp_endpoint:  # the OpenTelemetry SDK is an optional extra (.[tracing]): imported only when asked for
        from worker.tracing import tracer_for

        tracer = tracer_for(service, args.otlp_endpoint)
    metrics = None
    if args.metrics_port is not None and catalogue is not None:
        metrics = WorkerMetrics(catalogue, service.worker_id, service.role, service.kv_backend)
        if isinstance(service, PrefillService):
            metrics.watch(service.connector)
        elif isinstance(service, DecodeService) and service.connector is not None:
            metrics.watch_decode(service.connector)
        if service.engine.spec is not None:
            metrics.watch_spec(service.engine.spec.stats)
        metrics_port = metrics.serve(args.host, args.metrics_port)
        log.info("metrics on http://%s:%d/metrics", args.host, metrics_port)
        print(f"METRICS {metrics_port}", flush=True)  # before READY: the launcher advertises it (a free port here)
    # grpc.aio (worker/aio_service.py): a stream holds no thread, and Health never waits behind streams.
    server = AioServerThread(AioWorker(service, args.max_unsent_tokens, tracer),
                             options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)],
                             interceptors=[AioAdminGuard(creds.token)])
    port = server.bind(lambda s: add_port(s, f"{args.host}:{args.port}", creds))
    if port == 0:
        print(f"error: could not bind {args.host}:{args.port}", file=sys.stderr)
        return 2
    server.start()
    listener = None
    if args.session_port >= 0:
        from auth.tls import server_context
        from worker.session import SessionListener

        tls = None if creds.tls is None else server_context(creds.tls)
        listener = SessionListener(service, args.host, args.session_port, tls=tls)
        service.session_port = listener.port
    if args.redis:
        from worker.lora_admin import adapter_hashes
        from worker.redis_bus import RedisPublisher, WorkerAd

        ad = WorkerAd(service.worker_id, f"{args.host}:{port}", service.role, service.compat_hash,
                      loras=adapter_hashes(service.engine))
        service.publisher = RedisPublisher(args.redis, model_key(service.engine), ad, args.lease_seconds,
                                           token=creds.token, tls=creds.tls)
        service.publisher.start()
    log.info("%s worker %s ready on %s:%d in %.1fs", args.role, service.worker_id, args.host, port,
             time.monotonic() - t0)
    print(f"READY {port}", flush=True)

    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        service.start_draining()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    drain(service, args.drain_timeout)
    if listener is not None:
        listener.close()
    server.stop(grace_s=1.0)
    service.stop()
    if tracer is not None:
        tracer.shutdown()  # exports the spans still batched
    if metrics is not None:
        metrics.close()
    if service.replica is not None:
        service.replica.close()
    return 0


def drain(service: WorkerService, timeout_s: float) -> None:
    """Wait (bounded by ``timeout_s``) until nothing is in flight: unfinished and paused requests, and prefill's
    KV transfers still streaming out (each ends DONE or fails explicitly when its lease expires)."""
    deadline = time.monotonic() + timeout_s
    left = -1
    while time.monotonic() < deadline:
        try:
            left = service.loop.call_sync(service.in_flight, timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # the engine loop stopped (or is stuck past the deadline): nothing more will finish
            break
        if not left:
            return
        time.sleep(0.05)
    log.warning("drain ended with %s requests or transfers still in flight", left if left >= 0 else "unknown")
