"""Assembling a router: tokenizer, worker pool, KV index, load tracker, selectors, dispatcher, gateway, metrics,
and its HTTP serving (the gateway's ASGI app on granian; ``/metrics`` on its own port when one is given).

The KV index is fed by the workers' KV event streams (the in-process bus: each router follows each worker
directly). Both selectors share the index and the load tracker, so prefill and decode choices see the same view.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

from auth.api_keys import ApiKeys
from auth.credentials import Credentials
from engine.block_hash import extra_keys_for
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.admission import AdmissionConfig
from router.asgi import ASGIApp, HTTPConfig, Request, Response
from router.cost import CostConfig
from router.dispatch import DisaggConfig, Dispatcher
from router.gateway import GENERATE_PATHS, Gateway, GatewayConfig
from router.http_server import HTTPServer
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.pool import WorkerPool
from router.redis_bus import RedisBus
from router.selector import Selector


@dataclass(slots=True, frozen=True)
class RouterConfig:
    model: str
    workers: tuple[str, ...]
    served_model_name: str | None = None
    redis: str | None = None
    block_size: int = 16
    max_index_blocks: int = 1_000_000
    min_uncached_tokens: int = 64
    temperature: float = 0.1
    seed: int = 0
    worker_dead_after_s: float = 10.0  # a worker silent this long has its requests failed over (router/pool.py)
    credentials: Credentials | None = None  # workers' mTLS and cluster token (None: this process's token, no TLS)
    api_keys: tuple[str, ...] = ()  # ``KEY`` or ``admin:KEY`` (auth/api_keys.py)
    api_key_file: str | None = None
    http: HTTPConfig = field(default_factory=HTTPConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_prompt_bytes: int = 2 << 20
    metrics_port: int | None = None  # /metrics on a port of its own (and not on the gateway's)
    tool_call_parser: str = "hermes"  # hermes | llama3_json | mistral (router/tool_parsers.py)
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1 (router/chat_output.py)
    vllm_metrics: bool = False  # also export vllm:* names where vLLM has an equivalent (router/metric_catalogue.py)
    otlp_endpoint: str | None = None  # host:port of an OTLP/gRPC collector: trace every request (router/tracing.py)

    def __post_init__(self) -> None:
        if not self.workers and not self.redis:
            raise ValueError("a router needs worker addresses or a Redis URL to discover them")
        if self.metrics_port is not None and self.metrics_port < 0:
            raise ValueError(f"metrics_port must be >= 0, got {self.metrics_port}")


@dataclass(slots=True)
class Router:
    pool: WorkerPool
    index: KVIndex
    dispatcher: Dispatcher
    gateway: Gateway

    http_config: HTTPConfig = field(default_factory=HTTPConfig)
    bus: RedisBus | None = None
    http: HTTPServer | None = None
    metrics_http: HTTPServer | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # the router's own background work

    def app(self) -> ASGIApp:
        """The gateway as an ASGI app (router/asgi.py)."""
        return ASGIApp(self.gateway.handle, self.http_config, self.gateway.count, watch=GENERATE_PATHS)

    def metrics_app(self) -> ASGIApp:
        """``/metrics`` alone, for a port of its own."""
        gateway = self.gateway

        async def handle(request: Request) -> Response:
            if request.path != "/metrics":
                return Response(b'{"error":{"message":"only /metrics is served here"}}', status=404)
            return await gateway.render_metrics(request)

        return ASGIApp(handle, self.http_config, gateway.count)

    async def serve_http(self, host: str, port: int) -> int:
        """Serve the OpenAI gateway on ``host:port`` (0: a free port) on granian; return the bound port."""
        self.http = HTTPServer(self.app(), self.http_config)
        return await self.http.start(host, port)

    async def serve_metrics(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port); return the bound port."""
        self.metrics_http = HTTPServer(self.metrics_app(), self.http_config)
        return await self.metrics_http.start(host, port)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for server in (self.http, self.metrics_http):
            if server is not None:
                await server.stop()
        if self.bus is not None:
            await self.bus.close()
        await self.pool.close()
        self.gateway.close()


def _max_model_len(model: Path) -> tuple[int, int]:
    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("max_position_embeddings", 2048)), int(cfg["vocab_size"])


async def build_router(cfg: RouterConfig) -> Router:
    model = Path(cfg.model)
    tokenizer = Tokenizer(model)
    max_len, vocab = _max_model_len(model)
    index = KVIndex(cfg.max_index_blocks)
    load = LoadTracker()
    # With Redis, KV events come from the shared stream (one global order for every router replica); without,
    # the pool follows each worker's own event stream (the in-process bus).
    extra = extra_keys_for(model=model.name)
    pool = WorkerPool(list(cfg.workers), index=None if cfg.redis else index, load=load,
                      hashing=(cfg.block_size, extra), dead_after_s=cfg.worker_dead_after_s,
                      credentials=cfg.credentials)
    try:
        await pool.start()
    except BaseException:
        await pool.close()
        raise
    bus = None
    if cfg.redis:
        async def resync(worker_id: str) -> int | None:
            w = pool.by_id(worker_id)
            if w is None or w.stub is None:
                return None
            snap = await w.stub.Snapshot(pb.SnapshotRequest(), timeout=10.0)
            index.resync(snap.worker_id, snap.seq, list(snap.hashes))
            return int(snap.seq)

        bus = RedisBus(cfg.redis, model.name, index, pool, resync)
        await bus.start()
    cost = CostConfig(block_size=cfg.block_size, temperature=cfg.temperature)
    prefill_sel = Selector(index, load, cost, cfg.block_size, extra, seed=cfg.seed)
    decode_sel = Selector(index, load, cost, cfg.block_size, extra, seed=cfg.seed + 1)
    dispatcher = Dispatcher(pool, prefill_sel, decode_sel, DisaggConfig(min_uncached_tokens=cfg.min_uncached_tokens))
    stats = dispatcher.stats
    metrics = RouterMetrics(pool, retries=lambda: stats.retries, migrations=lambda: stats.migrations,
                            model_name=cfg.served_model_name or model.name, vllm_names=cfg.vllm_metrics)
    gateway = Gateway(GatewayConfig(cfg.served_model_name or model.name, max_len, vocab,
                                    max_prompt_bytes=cfg.max_prompt_bytes,
                                    metrics_on_main_port=cfg.metrics_port is None,
                                    tool_call_parser=cfg.tool_call_parser, reasoning_parser=cfg.reasoning_parser),
                      tokenizer, dispatcher, metrics, ApiKeys.load(cfg.api_keys, cfg.api_key_file), cfg.admission)
    if cfg.otlp_endpoint:
        from router.tracing import RequestTracer, otlp_provider

        gateway.tracer = RequestTracer(otlp_provider(cfg.otlp_endpoint))
    router = Router(pool, index, dispatcher, gateway, cfg.http, bus)
    # run-time LoRA adapters reach the workers that join later (router/lora_admin.py)
    router.tasks.append(asyncio.create_task(gateway.lora_admin.run()))
    return router
