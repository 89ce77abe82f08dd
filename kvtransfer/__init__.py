"""kvtransfer: move KV cache blocks from a prefill engine into blocks a decode engine reserved, layer by layer.

Public surface: :class:`KVLayout`, :class:`DestinationInfo`, :class:`KVSender` / :class:`KVReceiver`,
:class:`TransferState` / :class:`TransferStatus`, :class:`TransferConfig` and :func:`get_backend`. The package
knows nothing about models or routing and does not import ``engine``.
"""

from kvtransfer.base import KVReceiver, KVSender, TransferState, TransferStatus
from kvtransfer.config import TransferConfig
from kvtransfer.destination import DestinationInfo
from kvtransfer.layout import CompatibilityError, KVLayout, block_runs
from kvtransfer.registry import backend_names, get_backend

__all__ = [
    "CompatibilityError",
    "DestinationInfo",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "TransferConfig",
    "TransferState",
    "TransferStatus",
    "backend_names",
    "block_runs",
    "get_backend",
]
