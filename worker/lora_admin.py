"""A worker's LoRA adapters at run time: ``LoadLoRAAdapter`` and ``UnloadLoRAAdapter`` (admin RPCs), and the adapter
list that ``Health`` and the Redis registry entry advertise.

Both changes run on the engine loop's thread between steps (``EngineLoop.call``), so a step never sees an adapter
half added or removed. A worker started without ``--lora`` gets its :class:`~engine.lora.manager.LoRAManager` (hooks
attached to the model, default ``max_loras``) on its first load. Unloading is refused while any unfinished request
(waiting, running or paused) names the adapter: the caller retries once they finish, rather than the worker cutting
them off or holding the call open for their whole length. Every role takes adapters (prefill and decode apply them
to a disaggregated request's two halves: worker/lora_handoff.py), on a single-rank worker only, as at start
(worker/server.py ``lora_config``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from proto.tandem.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class Host(Protocol):
    """What the ops need of the worker's service (worker/service.py): its ranks."""

    replica: Any  # engine.parallel.replica.ServedReplica when the engine has ranks, else None


class AdapterInUse(RuntimeError):
    """An unload named an adapter that unfinished requests still run under."""


class AdaptersRefused(RuntimeError):
    """This worker cannot take adapters at run time (it has ranks)."""


def adapter_infos(engine: LLMEngine) -> list[pb.LoRAAdapterInfo]:
    """The adapters ``engine`` serves, sorted by name. Safe off the loop thread: it copies the manager's dicts in one
    step each (no Python code runs while a dict of strings is copied, so the loop cannot change it meanwhile)."""
    manager = engine.lora
    if manager is None:
        return []
    hashes, resident = dict(manager.hashes), frozenset(manager.resident)
    return [pb.LoRAAdapterInfo(name=name, content_hash=h, resident=name in resident)
            for name, h in sorted(hashes.items())]


def adapter_hashes(engine: LLMEngine) -> dict[str, str]:
    """Name -> content hash of every adapter ``engine`` serves (the registry entry's ``loras``)."""
    return {a.name: a.content_hash for a in adapter_infos(engine)}


def _check_role(svc: Host) -> None:
    if svc.replica is not None:
        raise AdaptersRefused("LoRA adapters run on a single-rank worker only (no --tp/--pp/--ep)")


def load_op(svc: Host, name: str, path: str) -> Callable[[LLMEngine], list[pb.LoRAAdapterInfo]]:
    """The engine command of ``LoadLoRAAdapter``: ValueError naming a bad name, directory or adapter."""

    def load(eng: LLMEngine) -> list[pb.LoRAAdapterInfo]:
        _check_role(svc)
        if not name:
            raise ValueError("lora_name is required")
        if not path:
            raise ValueError("lora_path is required")
        if eng.lora is None:
            from engine.lora.config import LoRAConfig

            eng.lora = eng._lora_manager(LoRAConfig(), None)  # attaches the hooks; single rank (checked above)
        eng.lora.register(name, path)
        return adapter_infos(eng)

    return load


def unload_op(svc: Host, name: str) -> Callable[[LLMEngine], list[pb.LoRAAdapterInfo]]:
    """The engine command of ``UnloadLoRAAdapter``: UnknownAdapterError for a name not served, AdapterInUse while
    unfinished requests name it."""

    def unload(eng: LLMEngine) -> list[pb.LoRAAdapterInfo]:
        _check_role(svc)
        from engine.lora.manager import UnknownAdapterError

        if eng.lora is None:
            raise UnknownAdapterError(f"unknown LoRA adapter {name!r}; this worker serves none")
        eng.lora.check(name)
        users = [r.request_id for r in eng.scheduler.requests.values() if r.lora == name and not r.is_finished]
        if users:
            raise AdapterInUse(f"LoRA adapter {name!r} is in use by {len(users)} unfinished requests; unload it "
                               "once they finish")
        eng.lora.unregister(name)
        return adapter_infos(eng)

    return unload
