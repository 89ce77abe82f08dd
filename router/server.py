"""Assembling a router: tokenizer, worker pool, KV index, load tracker, selectors, dispatcher, gateway, metrics.

The KV index is fed by the workers' KV event streams (the in-process bus: each router follows each worker
directly). Both selectors share the index and the load tracker, so prefill and decode choices see the same view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.block_hash import extra_keys_for
from engine.tokenizer import Tokenizer
from proto.tandem.v1 import worker_pb2 as pb
from router.cost import CostConfig
from router.dispatch import DisaggConfig, Dispatcher
from router.gateway import MAX_BODY, Gateway, GatewayConfig
from router.http import HTTPServer
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

    def __post_init__(self) -> None:
        if not self.workers and not self.redis:
            raise ValueError("a router needs worker addresses or a Redis URL to discover them")


@dataclass(slots=True)
class Router:
    pool: WorkerPool
    index: KVIndex
    dispatcher: Dispatcher
    gateway: Gateway

    bus: RedisBus | None = None
    http: HTTPServer | None = None

    async def serve_http(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Serve the OpenAI gateway on ``host:port`` (0: a free port; ``reuse_port``: share it with other router
        processes through SO_REUSEPORT); return the bound port."""
        self.http = HTTPServer(self.gateway.handle, max_body=MAX_BODY, express=self.gateway.express)
        return await self.http.start(host, port, reuse_port=reuse_port)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.stop()
        if self.bus is not None:
            await self.bus.close()
        await self.pool.close()


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
                      hashing=(cfg.block_size, extra), dead_after_s=cfg.worker_dead_after_s)
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
    metrics = RouterMetrics(pool, retries=lambda: stats.retries, migrations=lambda: stats.migrations)
    gateway = Gateway(GatewayConfig(cfg.served_model_name or model.name, max_len, vocab), tokenizer, dispatcher,
                      metrics)
    return Router(pool, index, dispatcher, gateway, bus)
