"""kvtransfer: move KV cache blocks from a prefill engine into blocks a decode engine reserved, layer by layer.

:func:`get_backend` imports a backend on first use, so a missing optional dependency (NIXL) fails only that
backend. The package does not import ``engine``.
"""

import importlib

from kvtransfer.base import DestinationInfo, KVReceiver, KVSender, TransferState, TransferStatus
from kvtransfer.config import TransferConfig
from kvtransfer.layout import CompatibilityError, KVLayout, block_runs

__all__ = [
    "CompatibilityError", "DestinationInfo", "KVLayout", "KVReceiver", "KVSender", "TransferConfig", "TransferState",
    "TransferStatus", "backend_names", "block_runs", "get_backend",
]

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
