"""One rank of a parallel replica, as its own process: join the group, load this rank's shard, serve commands.

The driver (:class:`engine.parallel.llm.ParallelLLM`) sends every rank the same command over its pipe; the ranks run
it in lockstep (the collectives in the forward pass keep them so) and rank 0 answers with the results. Commands:
``("generate", prompts, params, record_logits)``, ``("check",)`` (block accounting on this rank), ``("stats",)``
(this rank's step, all-reduce and expert-exchange seconds since the last ``stats``), ``("close",)``.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

import torch

from engine.llm import LLM
from engine.models.decoder import AllReduce, Attention, _identity
from engine.parallel.config import ParallelConfig
from engine.parallel.logit_recorder import LogitRecorder
from engine.parallel.process_group import join, leave, rank_device


@dataclass(slots=True, frozen=True)
class RankInfo:
    """What a started rank reports: its process, its share of the model and of the KV cache."""

    rank: int
    pid: int
    rss_bytes: int
    weight_bytes: int
    kv_heads: int
    num_blocks: int
    cpus: tuple[int, ...]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpus_for(rank: int, world_size: int, cpus: list[int]) -> list[int]:
    """This rank's own slice of the allowed CPUs when there are enough of them; all of them (shared) otherwise."""
    if len(cpus) < world_size:
        return cpus
    per = len(cpus) // world_size
    return cpus[rank * per : (rank + 1) * per]


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights this rank loaded (its shard of its stage's layers, plus what every rank holds)."""
    model = llm.engine.model
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters():
        if model.in_stage(name) and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


class TimedReduce:
    """An all-reduce that adds up its own wall time (two ``perf_counter`` calls each: ~0.1 us)."""

    def __init__(self, reduce: AllReduce) -> None:
        self.reduce = reduce
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.reduce(x)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def rank_main(rank: int, parallel: ParallelConfig, port: int, model: str, llm_kwargs: dict[str, Any],
              conn: Connection) -> None:
    try:
        allowed = sorted(os.sched_getaffinity(0))
        cpus = cpus_for(rank, parallel.world_size, allowed)
        os.sched_setaffinity(0, cpus)
        shared = len(allowed) < parallel.world_size  # ranks share the cores: one thread each
        kwargs = {"num_threads": max(1, len(cpus) // parallel.world_size) if shared else len(cpus), **llm_kwargs}
        kwargs["device"] = rank_device(str(kwargs.get("device", "cpu")), rank)  # a CUDA rank: its own GPU
        comms = join(rank, parallel, port, kwargs["device"])
        tp_reduce, ep_reduce = TimedReduce(comms.tp_reduce), TimedReduce(comms.ep_reduce)
        llm = LLM(model, shard=parallel.shard(rank), tp_reduce=tp_reduce if parallel.tp > 1 else _identity,
                  ep_reduce=_identity if comms.ep_reduce is _identity else ep_reduce, pipe=comms.pipe, **kwargs)
        exchange = comms.exchange
        if exchange is not None:  # EP by all-gather or all-to-all, not by ep_reduce
            llm.engine.model.attach_expert_exchange(exchange)
        llm.engine.runner.micro_batches = parallel.pp  # decode batches flow through the stages in pp slices
        recorder = LogitRecorder.attach(llm.engine)
        attn = cast(Attention, llm.engine.model.layers[0].self_attn)
        conn.send(("ready", RankInfo(rank, os.getpid(), rss_bytes(), weight_bytes(llm), int(attn.kv_heads),
                                     llm.engine.pool.num_blocks, tuple(cpus))))
        while True:
            cmd, *args = conn.recv()
            if cmd == "close":
                conn.send(("ok", None))
                break
            if cmd == "generate":
                prompts, params, record = args
                recorder.enabled = record
                outs = llm.generate(prompts, params)
                logits = recorder.take() if record else None
                conn.send(("ok", (outs, logits) if rank == 0 else None))
            elif cmd == "stats":
                eng = llm.engine
                conn.send(("ok", {"rank": rank, "step_s": eng.step_seconds, "steps": eng.num_steps,
                                  "allreduce_s": tp_reduce.seconds + ep_reduce.seconds,
                                  "allreduce_calls": tp_reduce.calls + ep_reduce.calls,
                                  "exchange_s": exchange.seconds if exchange else 0.0,
                                  "exchange_calls": exchange.calls if exchange else 0,
                                  "rss_bytes": rss_bytes()}))
                eng.step_seconds, eng.num_steps = 0.0, 0
                for r in (tp_reduce, ep_reduce, exchange):
                    if r is not None:
                        r.seconds, r.calls = 0.0, 0
            elif cmd == "check":
                try:
                    llm.engine.check_block_accounting()
                    conn.send(("ok", None))
                except AssertionError as e:
                    conn.send(("ok", f"rank {rank}: {e}"))
            else:
                conn.send(("error", f"unknown command {cmd!r}"))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        leave()
