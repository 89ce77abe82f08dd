"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: LoRA adapters changed at run time, with vLLM's
request shapes (``{"lora_name": NAME, "lora_path": DIR}``, and ``{"lora_name": NAME}`` to unload).

The gateway lets only an admin key through (auth/api_keys.py; without keys configured every caller is an admin, as
for ``x-tandem-explain``). The router forwards the call to every available worker of its pool, whatever its role
(prefill and decode apply a disaggregated request's adapter: worker/lora_handoff.py), over the workers'
``LoadLoRAAdapter``/``UnloadLoRAAdapter`` admin RPCs (worker/lora_admin.py), concurrently, and takes each worker's
answer (its adapter list) into the pool at once, so ``/v1/models`` and routing see the change before the call
returns. ``lora_path`` is a directory on the workers' hosts.

All or nothing, as far as it can be: a load that any worker refuses (bad path or adapter: 400 naming it) is undone
on the workers that took it. An unload that a worker refuses because requests still run under the adapter (409)
leaves the adapter loaded: the workers that did unload it get it back from the next sync (below), so a refused
unload changes nothing for long; repeat it once the requests finish. An unknown name on every worker is a 404.

The router remembers what it loaded (name and path) until it unloads it, and :meth:`LoRAAdmin.sync` (every
``SYNC_INTERVAL_S``, from build_router) loads it on a worker that joins later (a scale-up, a replaced replica), which
meanwhile serves only its start-up ``--lora`` adapters and gets no request of the run-time one (the router routes by
each worker's own list). A worker that refuses such a load is not asked again for that adapter (logged). Each
router replica remembers its own loads only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from proto.tandem.v1 import worker_pb2 as pb
from router.api_error import APIError
from router.pool import Worker, WorkerPool

log = logging.getLogger(__name__)
TIMEOUT_S = 120.0  # reading and checking an adapter on a loaded worker
SYNC_INTERVAL_S = 1.0  # how often workers that joined are given the run-time adapters


def _field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{name}' is required (a non-empty string)", name)
    return value


class LoRAAdmin:
    def __init__(self, pool: WorkerPool, served_model: str) -> None:
        self.pool = pool
        self.served_model = served_model
        self.loaded: dict[str, str] = {}  # adapters loaded through this router: name -> path
        self._refused: set[tuple[str, str, str]] = set()  # (worker address, name, path) a sync load failed on
        self._sync_lock = asyncio.Lock()

    async def sync(self) -> int:
        """Load every adapter of ``loaded`` on each available worker that does not serve it yet; how many loads
        succeeded."""
        done = 0
        async with self._sync_lock:
            for name, path in list(self.loaded.items()):
                for w in [w for w in self.pool.workers.values() if w.healthy and w.stub is not None
                          and name not in w.loras and (w.address, name, path) not in self._refused]:
                    got = await self._call(w, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(name=name, path=path))
                    if isinstance(got, grpc.aio.AioRpcError):
                        self._refused.add((w.address, name, path))
                    else:
                        log.info("loaded LoRA adapter %s on worker %s, which joined after its load", name,
                                 w.worker_id or w.address)
                        done += 1
        return done

    async def run(self, interval_s: float = SYNC_INTERVAL_S) -> None:
        """``sync`` forever (a task of the router's; cancelled when it closes)."""
        while True:
            await asyncio.sleep(interval_s)
            if self.loaded:
                await self.sync()

    def _targets(self) -> list[Worker]:
        workers = [w for w in self.pool.workers.values() if w.healthy and w.stub is not None]
        if not workers:
            raise APIError(503, "no available worker to change LoRA adapters on", retry_after=1.0)
        return workers

    async def load(self, body: Any) -> dict[str, Any]:
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == self.served_model:
            raise APIError(400, f"'{name}' is the base model's name; choose another lora_name", "lora_name")
        async with self._sync_lock:  # not beside a sync of the same name
            return await self._load(name, path)

    async def _load(self, name: str, path: str) -> dict[str, Any]:
        self._refused = {r for r in self._refused if r[1] != name}  # an explicit load asks every worker again
        workers = self._targets()
        had = {w.address for w in workers if name in w.loras}  # a no-op there: not undone on a failure
        results = await asyncio.gather(*(self._call(w, "LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(
            name=name, path=path)) for w in workers))
        failed = [(w, e) for w, e in zip(workers, results, strict=True) if isinstance(e, grpc.aio.AioRpcError)]
        if failed:
            took = [w for w, e in zip(workers, results, strict=True) if not isinstance(e, grpc.aio.AioRpcError)
                    and w.address not in had]
            await asyncio.gather(*(self._call(w, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(name=name))
                                   for w in took))
            worker, err = failed[0]
            status = 400 if err.code() == grpc.StatusCode.INVALID_ARGUMENT else 502
            raise APIError(status, f"loading LoRA adapter '{name}' from {path} failed on worker "
                           f"{worker.worker_id or worker.address}: {err.details()}", "lora_path")
        self.loaded[name] = path
        return {"object": "lora_adapter", "lora_name": name, "status": "loaded",
                "workers": {w.worker_id or w.address: w.loras.get(name, "") for w in workers}}

    async def unload(self, body: Any) -> dict[str, Any]:
        name = _field(body, "lora_name")
        async with self._sync_lock:  # a sync must not load it again meanwhile
            return await self._unload(name)

    async def _unload(self, name: str) -> dict[str, Any]:
        workers = self._targets()
        results = await asyncio.gather(*(self._call(w, "UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(name=name))
                                         for w in workers))
        errors = [(w, e) for w, e in zip(workers, results, strict=True) if isinstance(e, grpc.aio.AioRpcError)]
        busy = [(w, e) for w, e in errors if e.code() == grpc.StatusCode.FAILED_PRECONDITION]
        if busy:
            worker, err = busy[0]
            raise APIError(409, f"unloading LoRA adapter '{name}' was refused by worker "
                           f"{worker.worker_id or worker.address}: {err.details()}", "lora_name")
        if all(e.code() == grpc.StatusCode.NOT_FOUND for _, e in errors):
            self.loaded.pop(name, None)  # served nowhere now
        if len(errors) == len(workers) and all(e.code() == grpc.StatusCode.NOT_FOUND for _, e in errors):
            raise APIError(404, f"The LoRA adapter '{name}' is not loaded", "lora_name", code="model_not_found")
        other = [(w, e) for w, e in errors if e.code() != grpc.StatusCode.NOT_FOUND]
        if other:
            worker, err = other[0]
            raise APIError(502, f"unloading LoRA adapter '{name}' failed on worker "
                           f"{worker.worker_id or worker.address}: {err.details()}", "lora_name")
        return {"object": "lora_adapter", "lora_name": name, "status": "unloaded",
                "workers": sorted(w.worker_id or w.address for w, r in zip(workers, results, strict=True)
                                  if not isinstance(r, grpc.aio.AioRpcError))}

    async def _call(self, w: Worker, method: str, request: Any) -> pb.LoRAAdaptersResponse | grpc.aio.AioRpcError:
        """One worker's RPC; its answer taken into the pool, its error returned (not raised)."""
        assert w.stub is not None
        try:
            resp: pb.LoRAAdaptersResponse = await getattr(w.stub, method)(request, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.warning("%s %s on %s: %s", method, getattr(request, "name", ""), w.address, e.details())
            return e
        w.set_adapters(resp.adapters)
        return resp

