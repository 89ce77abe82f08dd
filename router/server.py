"""Assembling a router: tokenizer, worker pool, KV index, load tracker, selectors, dispatcher, gateway, metrics.

The KV index is fed by the workers' KV event streams (the in-process bus: each router follows each worker
directly). Both selectors share the index and the load tracker, so prefill and decode choices see the same view.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from engine.block_hash import extra_keys_for
from engine.tokenizer import Tokenizer
from router.cost import CostConfig
from router.dispatch import DisaggConfig, Dispatcher
from router.gateway import Gateway, GatewayConfig
from router.kv_index import KVIndex
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.pool import WorkerPool
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

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("a router needs at least one worker address")


@dataclass(slots=True)
class Router:
    app: web.Application
    pool: WorkerPool
    index: KVIndex
    dispatcher: Dispatcher
    gateway: Gateway

    async def close(self) -> None:
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
    pool = WorkerPool(list(cfg.workers), index=index, load=load)
    await pool.start()
    extra = extra_keys_for(model=model.name)
    cost = CostConfig(block_size=cfg.block_size, temperature=cfg.temperature)
    prefill_sel = Selector(index, load, cost, cfg.block_size, extra, seed=cfg.seed)
    decode_sel = Selector(index, load, cost, cfg.block_size, extra, seed=cfg.seed + 1)
    dispatcher = Dispatcher(pool, prefill_sel, decode_sel, DisaggConfig(min_uncached_tokens=cfg.min_uncached_tokens))
    metrics = RouterMetrics(pool)
    gateway = Gateway(GatewayConfig(cfg.served_model_name or model.name, max_len, vocab), tokenizer, dispatcher,
                      metrics)
    return Router(gateway.app(), pool, index, dispatcher, gateway)
