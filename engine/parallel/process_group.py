"""Joining a replica's rank processes with ``torch.distributed``: gloo on CPU, NCCL on CUDA (when available).

Each rank calls :func:`join` with the same loopback rendezvous port; the returned reducer is what the model's
``tp_reduce``/``ep_reduce`` call. With two ranks an all-reduce adds ``a + b`` (commutative, so bit-identical on both
ranks and to an in-process ``p0 + p1``); see :mod:`engine.parallel.thread_group` for that reference.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.models.decoder import AllReduce


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous port of a new group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: str) -> str:
    """NCCL for CUDA ranks when torch has it, gloo otherwise (CPU, or a build without NCCL)."""
    if device.startswith("cuda") and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def join(rank: int, world_size: int, port: int, device: str = "cpu", timeout_s: float = 300.0) -> AllReduce:
    """Join the group of ``world_size`` ranks rendezvousing on ``127.0.0.1:port``; return its in-place sum."""
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    return all_reduce


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
