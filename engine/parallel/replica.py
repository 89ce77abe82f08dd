"""A served replica's ranks: rank 0 (the worker process) schedules and samples; every other rank is a process that
runs the same forward passes on its own shard, step by step, as rank 0 describes them.

The offline :class:`engine.parallel.llm.ParallelLLM` can replay one ``generate`` call on every rank, since its
scheduling is deterministic. A server cannot: requests arrive at rank 0 at any time, and the worker's loop hooks
(parking a stalled stream, aborts) change rank 0's batch between steps. So rank 0 stays the only scheduler, block
pool and sampler, and before each forward pass it sends every other rank the step's rows (:class:`StepRow`: the
tokens to compute, their positions and block-table row). A follower rank allocates the same number of KV blocks,
so rank 0's block ids address its cache too; it keeps only its heads' KV there. The collectives in the forward pass
(gloo on CPU, NCCL on CUDA) keep the hidden states and logits identical on every rank.

Failure: a follower that exits is seen by a watchdog thread on rank 0 (its process sentinel), which stops the other
ranks and calls ``on_rank_exit`` (the worker exits non-zero, and the controller replaces the replica as a whole).
A follower stops when rank 0 goes: its pipe ends, a collective fails, or, if rank 0 was killed, the kernel sends it
SIGKILL (``PR_SET_PDEATHSIG``), so no rank is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, cast

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.models.decoder import _identity
from engine.parallel.config import ParallelConfig
from engine.parallel.process_group import RankComms, free_port, join, leave
from engine.parallel.rank_process import cpus_for
from engine.request import Request
from engine.sampler import SampleResult
from engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


@dataclass(slots=True, frozen=True)
class StepRow:
    """One request's part of a step, as a follower rank's model runner reads it."""

    request_id: str
    start: int  # tokens already computed (the first position this step computes)
    token_ids: list[int]  # the tokens computed this step
    num_tokens: int  # the request's length (a row samples when start + len(token_ids) reaches it)
    block_ids: list[int]  # rank 0's block-table row; a follower's cache has the same blocks
    num_prompt_tokens: int
    prompt_logprobs: int | None
    num_scored: int  # prompt positions already scored (prompt logprobs)
    prompt_token_ids: list[int]  # only when prompt_logprobs is asked for (the scores' targets)


def describe(out: SchedulerOutput, block_ids: Callable[[str], list[int]]) -> list[StepRow]:
    rows = []
    for req, q in zip(out.requests, out.num_new_tokens, strict=True):
        start = req.num_computed_tokens
        k = req.params.prompt_logprobs
        rows.append(StepRow(req.request_id, start, list(req.all_token_ids[start:start + q]), req.num_tokens,
                            list(block_ids(req.request_id)), req.num_prompt_tokens, k, len(req.prompt_logprobs),
                            list(req.prompt_token_ids) if k is not None else []))
    return rows


class _Window:
    """``all_token_ids`` of a follower's request: only this step's tokens, at their positions."""

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start = start
        self.ids = ids

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return self.ids[k.start - self.start: k.stop - self.start]
        return self.ids[k - self.start]


@dataclass(slots=True)
class _Params:
    prompt_logprobs: int | None


class _RowRequest:
    """What :class:`engine.model_runner.ModelRunner` and prompt logprobs read of a request, from a :class:`StepRow`."""

    def __init__(self, row: StepRow) -> None:
        self.request_id = row.request_id
        self.num_computed_tokens = row.start
        self.all_token_ids = _Window(row.start, row.token_ids)
        self.num_tokens = row.num_tokens
        self.num_prompt_tokens = row.num_prompt_tokens
        self.params = _Params(row.prompt_logprobs)
        self.prompt_logprobs: list[object] = [None] * row.num_scored
        self.prompt_token_ids = row.prompt_token_ids


class _NoSampler:
    """A follower samples nothing: rank 0's sampler decides every token."""

    def prefetch(self, requests: list[Request]) -> None:
        return None

    def __call__(self, logits: Any, requests: list[Request]) -> SampleResult | None:
        return None


class LeaderRunner:
    """Rank 0's model runner: sends every follower the step's rows, then runs its own shard of the step."""

    def __init__(self, runner: ModelRunner, conns: list[Connection]) -> None:
        self.runner = runner
        self.conns = conns

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("runner", "conns"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.runner, name, value)  # e.g. a test's logit recorder replacing the sampler

    def execute_spec(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None,
                     drafts: dict[str, list[int]] | None = None) -> Any:
        msg = ("step", describe(out, self.runner.block_ids), drafts)
        for conn in self.conns:
            conn.send(msg)
        return self.runner.execute_spec(out, after_layer, drafts)

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> Any:
        reqs, result, _ = self.execute_spec(out, after_layer)
        return reqs, result


def _bind_cpus(rank: int, parallel: ParallelConfig, config: EngineConfig) -> EngineConfig:
    """Give this rank its own cores where the machine has one per rank (else all ranks share them, one thread
    each); return the config with that thread count unless one was asked for."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = cpus_for(rank, parallel.world_size, allowed)
    os.sched_setaffinity(0, cpus)
    if config.num_threads is not None:
        return config
    shared = len(allowed) < parallel.world_size
    return replace(config, num_threads=max(1, len(cpus) // parallel.world_size) if shared else len(cpus))


def follower_main(rank: int, parallel: ParallelConfig, port: int, config: EngineConfig, conn: Connection) -> None:
    """A follower rank: join the group, load this rank's shard, run each step rank 0 sends until it says close."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        config = _bind_cpus(rank, parallel, config)
        comms = join(rank, parallel, port, config.device)
        engine = LLMEngine(config, shard=parallel.shard(rank),
                           tp_reduce=comms.tp_reduce if parallel.tp > 1 else _identity,
                           ep_reduce=comms.ep_reduce if parallel.ep > 1 else _identity, pipe=comms.pipe)
        runner = engine.runner
        runner.micro_batches = parallel.pp
        runner.sampler = _NoSampler()  # type: ignore[assignment]
        tables: dict[str, list[int]] = {}
        runner.block_ids = tables.__getitem__
        conn.send(("ready", engine.pool.num_blocks))
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                break
            if cmd == "close":
                break
            rows: list[StepRow] = args[0]
            drafts: dict[str, list[int]] | None = args[1]
            tables.clear()
            for row in rows:
                tables[row.request_id] = row.block_ids
            out = SchedulerOutput(requests=cast(list[Request], [_RowRequest(r) for r in rows]),
                                  num_new_tokens=[len(r.token_ids) for r in rows])
            runner.execute_spec(out, None, drafts)  # a speculated request's drafts: the same rows as rank 0's
    except BaseException:
        log.exception("rank %d failed", rank)
        raise
    finally:
        leave()


class ServedReplica:
    """Rank 0's side of a replica: starts the follower ranks, joins their group and builds rank 0's engine."""

    def __init__(self, config: EngineConfig, parallel: ParallelConfig,
                 on_rank_exit: Callable[[str], None], start_timeout_s: float = 300.0) -> None:
        parallel.check_model(ModelConfig.from_dir(config.model))
        self.parallel = parallel
        self.on_rank_exit = on_rank_exit
        self._closing = threading.Event()
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        try:
            for rank in range(1, parallel.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=follower_main, args=(rank, parallel, port, config, child),
                                   name=f"tandem-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
            config = _bind_cpus(0, parallel, config)
            comms = self._join(parallel, port, config.device, start_timeout_s)
            self.engine = LLMEngine(config, shard=parallel.shard(0),
                                    tp_reduce=comms.tp_reduce if parallel.tp > 1 else _identity,
                                    ep_reduce=comms.ep_reduce if parallel.ep > 1 else _identity, pipe=comms.pipe)
            self.engine.runner.micro_batches = parallel.pp
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.engine.runner = LeaderRunner(self.engine.runner, self.conns)  # type: ignore[assignment]
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        """The follower ranks' process ids (rank 1 first)."""
        return [p.pid for p in self.procs if p.pid is not None]

    def _join(self, parallel: ParallelConfig, port: int, device: str, timeout_s: float) -> RankComms:
        """Rank 0 joins the group on a thread, so that a follower dying before it joins fails the start at once."""
        result: list[RankComms | BaseException] = []

        def run() -> None:
            try:
                result.append(join(0, parallel, port, device, timeout_s=timeout_s))
            except BaseException as e:
                result.append(e)

        t = threading.Thread(target=run, name="rank0-join", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(0.2)
            dead = [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
            if dead:
                r, p = dead[0]
                raise RuntimeError(f"rank {r} exited with code {p.exitcode} before joining the group")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks did not join within {timeout_s:.0f} s")
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for i, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True)):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise RuntimeError(f"rank {i + 1} exited with code {proc.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {i + 1} not ready within {timeout_s:.0f} s")
            kind, blocks = conn.recv()
            if kind != "ready" or blocks != self.engine.pool.num_blocks:
                raise RuntimeError(f"rank {i + 1} has {blocks} KV blocks, rank 0 {self.engine.pool.num_blocks}")

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        rank, proc = sentinels[cast(int, ready[0])]
        proc.join(1.0)
        reason = f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}: the replica goes down"
        log.error("%s", reason)
        self._stop_followers(timeout_s=2.0)  # the group is left as it is: rank 0's loop may be in a collective
        self.on_rank_exit(reason)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop every follower rank (by its process handle), and leave the group."""
        self._closing.set()
        self._stop_followers(timeout_s)
        leave()

    def _stop_followers(self, timeout_s: float) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in self.conns:
            conn.close()
