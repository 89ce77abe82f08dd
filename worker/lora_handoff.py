"""A disaggregated request's LoRA adapter across the hand-off: both workers apply it, so both must hold the same one.

Prefill computes the prompt's KV (and samples the first token) under the adapter; decode continues from that KV
under its own copy. Two workers that serve different files under one name would each look right and together
produce output neither adapter gives, so the hand-off carries the adapter by name and content hash
(``LoRARef``, proto/tandem/v1/worker.proto) and each side checks it against its own copy:

    Reserve(lora = name + prefill's hash) ──► decode checks, reserves, answers its own hash in ReserveResponse.lora
    Prefill(lora = ReserveResponse.lora)  ──► prefill checks before any compute or transfer

A mismatch is a :class:`LoRAMismatchError`, a :class:`~kvtransfer.layout.CompatibilityError` like a KV layout
mismatch, answered FAILED_PRECONDITION ("KV handshake refused: ...") naming the adapter and both hashes. Decode
refuses before it reserves a block; a prefill refusal comes before the request enters its engine, and the caller
aborts the decode reservation as for any failed Prefill. An empty hash on the wire is not checked (the name still
has to be served here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lora.manager import UnknownAdapterError
from kvtransfer.layout import CompatibilityError
from proto.tandem.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class LoRAMismatchError(CompatibilityError):
    """The two sides of a hand-off hold different content under the request's adapter name."""


def adapter_hash(engine: LLMEngine, name: str) -> str:
    """The content hash of the adapter ``engine`` serves as ``name``; UnknownAdapterError if it serves none."""
    manager = engine.lora
    digest = None if manager is None else manager.hashes.get(name)
    if digest is None:
        served = [] if manager is None else sorted(manager.hashes)
        raise UnknownAdapterError(f"unknown LoRA adapter {name!r}; this worker serves {served or 'none'}")
    return digest


def accept_lora(engine: LLMEngine, ref: pb.LoRARef | None, role: str) -> str | None:
    """The adapter a hand-off's request runs under on this ``role`` worker (None: the base model). Raises
    UnknownAdapterError if it is not served here, LoRAMismatchError if the other side's hash differs from ours."""
    if ref is None or not ref.name:
        return None
    ours = adapter_hash(engine, ref.name)
    if ref.content_hash and ref.content_hash != ours:
        other = "decode" if role == "prefill" else "prefill"
        raise LoRAMismatchError(
            f"LoRA adapter {ref.name!r} differs between the workers: this {role} worker's has content hash {ours}, "
            f"the {other} worker's {ref.content_hash}; both must serve the same adapter files under one name")
    return ref.name


def lora_ref(engine: LLMEngine, name: str | None) -> pb.LoRARef | None:
    """``name`` and this worker's content hash for it, for the other side of the hand-off (None: the base model)."""
    return None if name is None else pb.LoRARef(name=name, content_hash=adapter_hash(engine, name))


def request_lora(ref_holder: pb.ReserveRequest | pb.PrefillRequest) -> pb.LoRARef | None:
    """The message's ``lora`` field, None when unset."""
    return ref_holder.lora if ref_holder.HasField("lora") else None
