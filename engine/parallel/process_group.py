"""Joining a replica's rank processes with ``torch.distributed``: gloo on CPU, NCCL on CUDA (only where a GPU and
NCCL are there: never required), each CUDA rank on its own GPU.

Every rank calls :func:`join` with the same loopback rendezvous port. Ranks are numbered stage by stage; each
pipeline stage's ranks form the group its ``tp_reduce`` sums over and its MoE layers exchange rows in
(:class:`GroupExchange`, or ``ep_reduce`` for the ``all_reduce`` dispatch), and :class:`StagePipe` links a rank to
the same-position rank of the neighbouring stages. With two ranks an all-reduce adds ``a + b`` (commutative, so
bit-identical on both ranks and to an in-process ``p0 + p1``; see :mod:`engine.parallel.thread_group`).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.models.decoder import AllReduce, Pipe, _identity
from engine.parallel.config import ParallelConfig


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the rendezvous port of a new group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: str) -> str:
    """NCCL for CUDA ranks where a GPU is there and torch has NCCL; gloo otherwise (CPU, or no GPU or NCCL)."""
    if device.startswith("cuda") and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device rank ``rank`` runs on: its own GPU (``cuda:<rank mod GPUs>``) for CUDA, else ``device``."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return device
    return f"cuda:{rank % torch.cuda.device_count()}"


@dataclass(slots=True, frozen=True)
class RankComms:
    tp_reduce: AllReduce
    ep_reduce: AllReduce
    pipe: Pipe | None
    exchange: GroupExchange | None = None  # EP's row exchange (attach with CausalLM.attach_expert_exchange)


class GroupExchange:
    """:class:`engine.models.layers.ExpertExchange` over a process group (gloo and NCCL both have both
    collectives; gloo's all-to-all takes uneven splits, its all-gather does not, so :class:`SparseMoE` pads). It adds
    up its own wall time and calls, as :class:`engine.parallel.rank_process.TimedReduce` does for the all-reduces."""

    def __init__(self, group: Any, rank: int, size: int, dispatch: str) -> None:
        self.group, self.rank, self.size, self.dispatch = group, rank, size, dispatch
        self.seconds = 0.0
        self.calls = 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


class StagePipe:
    """Point-to-point hidden states between stages; the last stage's logits broadcast to every rank."""

    def __init__(self, rank: int, parallel: ParallelConfig, device: str = "cpu") -> None:
        self.prev = rank - parallel.stage_width
        self.next = rank + parallel.stage_width
        self.logits_src = (parallel.pp - 1) * parallel.stage_width
        self.device = torch.device(device)  # NCCL moves only tensors on this rank's GPU

    def recv_hidden(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, src=self.prev)
        return x

    def send_hidden(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.next)

    def share_logits(self, logits: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=self.device) if logits is None else logits.contiguous()
        dist.broadcast(out, src=self.logits_src)
        return out


def join(rank: int, parallel: ParallelConfig, port: int, device: str = "cpu", timeout_s: float = 300.0) -> RankComms:
    """Join the replica's group rendezvousing on ``127.0.0.1:port``; return this rank's collectives. ``device``:
    this rank's (:func:`rank_device`); on CUDA it becomes the current device before NCCL starts."""
    backend = backend_for(device)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=parallel.world_size, timeout=timedelta(seconds=timeout_s))
    width = parallel.stage_width
    group: Any = None  # the whole world when there is one stage
    if parallel.pp > 1:
        # every rank creates every stage's group, in the same order (torch.distributed requires it)
        groups = [dist.new_group(list(range(s * width, (s + 1) * width))) for s in range(parallel.pp)]
        group = groups[rank // width]

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    by_reduce = parallel.ep > 1 and parallel.ep_dispatch == "all_reduce"
    exchange = None
    if parallel.ep > 1 and not by_reduce:
        exchange = GroupExchange(group, parallel.shard(rank).ep_rank, parallel.ep, parallel.ep_dispatch)
    return RankComms(tp_reduce=all_reduce if parallel.tp > 1 else _identity,
                     ep_reduce=all_reduce if by_reduce else _identity,
                     pipe=StagePipe(rank, parallel, device) if parallel.pp > 1 else None, exchange=exchange)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
