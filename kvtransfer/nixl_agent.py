"""NIXL helpers shared by both ends: agent creation (UCX pinned to loopback), the HELLO payload, and the
descriptor offsets of a plan. Design: :mod:`kvtransfer.nixl_backend`."""

from __future__ import annotations

import base64
import json
import logging
import os
import struct
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtransfer.config import TransferConfig
from kvtransfer.io_cpus import io_affinity
from kvtransfer.layout import KVLayout
from kvtransfer.plan import Piece
from kvtransfer.wire import HEADER_SIZE


def ucx_environment(config: TransferConfig) -> dict[str, str]:
    """The UCX variables an agent of ``config`` is created under (UCX reads only its environment).

    ``UCX_TLS`` is set only when the config names transports. By default UCX chooses: between two processes on one
    host that is shared memory (cma/posix), where the *initiator* performs a WRITE's copy, so a decode worker
    that receives KV spends no CPU on the bytes at all, as with RDMA across hosts (measured on 2 vCPUs, alternating:
    decode ITL while 32 MiB transfers kept landing was 4% lower to equal against the same run with prefill
    computing and nothing landing, and 16-28% higher over ``tcp,self``, whose receive path runs on decode's CPU).
    With CUDA, UCX's choice (cuda_ipc, RDMA) is the fast path anyway.
    """
    env = {}
    if config.ucx_net_devices:
        env["UCX_NET_DEVICES"] = config.ucx_net_devices
    if config.ucx_tls:
        env["UCX_TLS"] = config.ucx_tls
    return env


def make_agent(config: TransferConfig, role: str) -> Any:
    """A NIXL agent with the configured backends, UCX pinned to the configured devices and transports."""
    os.environ.update(ucx_environment(config))
    nixl_api = import_nixl_api()
    name = f"tandem-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cfg = nixl_api.nixl_agent_config(enable_prog_thread=True, backends=list(config.nixl_backends))
    with _AGENT_CONFIG_LOCK, io_affinity(config.io_cpus):  # NIXL's progress thread and UCX's start on io_cpus
        return _with_progress_delay(nixl_api, config.nixl_progress_delay_us, lambda: nixl_api.nixl_agent(name, cfg))


_AGENT_CONFIG_LOCK = threading.Lock()


def import_nixl_api() -> Any:
    """``nixl._api``, with NIXL's Python logger moved off stdout.

    NIXL configures its ``nixl`` logger at import to print INFO lines ("Backend UCX was instantiated", one per
    agent) on stdout, which corrupts anything a Tandem process prints there (``tandem bench kv --json``, a worker's
    READY line). Its handler is dropped and the logger propagates to the process's own logging (stderr) at WARNING,
    unless ``NIXL_LOG_LEVEL`` asks for another level.
    """
    try:
        import nixl._api as nixl_api
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the nixl backend needs NIXL: pip install nixl-cu12==1.5.1 (see kvtransfer docs)") from e
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            logger.removeHandler(handler)
    logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    return nixl_api


def _with_progress_delay(nixl_api: Any, delay_us: int, build: Callable[[], Any]) -> Any:
    """Run ``build`` (which creates a ``nixl_agent``) so that the agent's progress thread sleeps ``delay_us``.

    ``nixl_agent.__init__`` fills a ``nixlAgentConfig`` binding object and sets ``pthrDelay = 0`` with no way to
    pass another value. For the duration of ``build`` the binding class is replaced by a subclass whose
    ``pthrDelay`` setter stores ``delay_us`` instead; everything else about the config is NIXL's own.
    """
    base = nixl_api.nixlBind.nixlAgentConfig

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(base.pthrDelay.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            base.pthrDelay.__set__(self, delay_us)

    nixl_api.nixlBind.nixlAgentConfig = _DelayedConfig
    try:
        return build()
    finally:
        nixl_api.nixlBind.nixlAgentConfig = base


def mem_of(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


def hello_payload(layout: KVLayout, agent_name: str, metadata: bytes) -> bytes:
    return json.dumps({"layout": layout.to_dict(), "agent": agent_name,
                       "metadata": base64.b64encode(metadata).decode()}).encode()


def parse_hello(payload: bytes) -> tuple[KVLayout, str, bytes]:
    try:
        doc = json.loads(payload)
        return KVLayout.from_dict(doc["layout"]), str(doc["agent"]), base64.b64decode(doc["metadata"], validate=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed NIXL HELLO: {e}") from None


_HANDED = struct.Struct("!Q")


def data_notif(header: bytes, handed_after_hello_s: float) -> bytes:
    """A layer's DATA notification: its frame header, then (8 bytes, microseconds) how long after the leg's HELLO
    the sender was handed the layer, i.e. when that layer's compute ended, on the sender's own clock. Offsets from
    one clock need no clock sync; the receiver learns the prefill's layer pace from them (:func:`handed_after`)."""
    return header + _HANDED.pack(max(0, round(handed_after_hello_s * 1e6)))


def handed_after(msg: bytes) -> float | None:
    """The seconds :func:`data_notif` appended to a DATA notification, or None (none there)."""
    if len(msg) < HEADER_SIZE + _HANDED.size:
        return None
    return _HANDED.unpack_from(msg, HEADER_SIZE)[0] / 1e6


def piece_offsets(pieces: Sequence[Piece], src: KVLayout, dst: KVLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte offsets (from a layer tensor's base) and lengths of every descriptor of one layer's K (or V).

    Full-head pieces are one descriptor each; head-slice pieces are one descriptor per token row.
    """
    if all(p.src_heads[1] - p.src_heads[0] == src.local_heads == dst.local_heads for p in pieces):
        table = np.array([(p.src_start, p.dst_start, p.nbytes) for p in pieces], dtype=np.uint64).reshape(-1, 3)
        return table[:, 0] * np.uint64(src.block_bytes), table[:, 1] * np.uint64(dst.block_bytes), table[:, 2].copy()
    src_off: list[np.ndarray] = []
    dst_off: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    head_bytes = src.head_dim * src.element_size
    for p in pieces:
        heads = p.src_heads[1] - p.src_heads[0]
        if heads == src.local_heads and heads == dst.local_heads:
            src_off.append(np.array([p.src_start * src.block_bytes], dtype=np.uint64))
            dst_off.append(np.array([p.dst_start * dst.block_bytes], dtype=np.uint64))
            lens.append(np.array([p.nbytes], dtype=np.uint64))
            continue
        rows = np.arange(p.num_blocks * src.block_size, dtype=np.uint64)
        src_off.append((p.src_start * src.block_size + rows) * src.token_bytes + p.src_heads[0] * head_bytes)
        dst_off.append((p.dst_start * dst.block_size + rows) * dst.token_bytes + p.dst_heads[0] * head_bytes)
        lens.append(np.full(rows.shape, heads * head_bytes, dtype=np.uint64))
    return np.concatenate(src_off), np.concatenate(dst_off), np.concatenate(lens)
