"""Backends by name. Modules are imported on first use, so a missing optional dependency (NIXL) only fails the
backend that needs it, with an error that says what to install."""

from __future__ import annotations

import importlib

from kvtransfer.base import KVReceiver, KVSender

_BACKENDS: dict[str, tuple[str, str, str]] = {
    "nixl": ("kvtransfer.nixl_backend", "NixlSender", "NixlReceiver"),
    "torch": ("kvtransfer.torch_dist", "TorchSender", "TorchReceiver"),
    "tcp": ("kvtransfer.tcp", "TcpSender", "TcpReceiver"),
    "fake": ("kvtransfer.fake", "FakeSender", "FakeReceiver"),
}


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> tuple[type[KVSender], type[KVReceiver]]:
    """``(sender_cls, receiver_cls)`` for ``name`` (one of :func:`backend_names`)."""
    try:
        module_name, sender, receiver = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {name!r}; known: {', '.join(_BACKENDS)}") from None
    module = importlib.import_module(module_name)
    return getattr(module, sender), getattr(module, receiver)
