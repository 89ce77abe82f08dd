"""A served replica's ranks: rank 0 (the worker process) schedules and samples; every other rank is a process that
runs the same forward passes on its own shard, step by step, as rank 0 describes them.

The offline :class:`engine.parallel.llm.ParallelLLM` can replay one ``generate`` call on every rank, since its
scheduling is deterministic. A server cannot: requests arrive at rank 0 at any time, and the worker's loop hooks
(parking a stalled stream, aborts) change rank 0's batch between steps. So rank 0 stays the only scheduler, block
pool and sampler, and before each forward pass it sends every other rank the step's rows (:class:`StepRow`: the
tokens to compute, their positions and block-table row). A follower rank allocates the same number of KV blocks,
so rank 0's block ids address its cache too; it keeps only its heads' KV there. The collectives in the forward pass
(gloo on CPU, NCCL on CUDA) keep the hidden states and logits identical on every rank.

KV between tiers (prefill and decode replicas of any TP, "kvtransfer moves KV rank to rank"): every rank that holds
KV has its own transfer endpoint, made in its own process by a :class:`RankExtension` (``worker/rank_kv.py``) for
its own ``KVLayout(tp_size, tp_rank)``; the engine knows nothing of kvtransfer. Rank 0 talks to the followers' ends
over the same pipes, in three kinds of message, and the rest follows from kvtransfer's head mapping:

- *with a step*: rank 0 attaches items to the next step's rows (:meth:`ServedReplica.attach_to_step`). Prefill
  attaches, for each request whose prompt completes in that step, the legs that rank sends (the decode ranks whose
  heads overlap its own), so each follower starts its send at layer 0 of the same forward and hands over each layer
  as it finishes it, as rank 0 does;
- *calls*: rank 0 asks every follower and waits for each answer (:meth:`ServedReplica.call`). Decode's ``Reserve``
  asks each follower to open a receive on the same block ids; the reply is one destination per decode rank;
- *reports and tells*: a follower reports what its transport saw (a leg landed or failed, a send ended, a release
  done) whenever it happens (``on_report``), and rank 0 tells followers to release a request (fire and forget).

Why this shape: the step rows already tell each follower what its forward computes, so the same message tells it
what to send and when, and a follower's transport never waits for rank 0 between layers; the router and the gRPC
API still see one worker per replica and one opaque destination (now a list), so nothing above the worker changes.

Rank 0 stays the only owner of blocks: a decode request is landed only once every decode rank reported it landed,
a prefill request's blocks stay held until every prefill rank reported its send ended, and any failure fails that
request alone and releases it on every rank (``prefill_worker/ranks.py``, ``decode_worker/ranks.py``).

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
from typing import Any, Protocol, cast

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.parallel.config import ParallelConfig
from engine.parallel.process_group import RankComms, free_port, join, leave, rank_device
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


class RankExtension(Protocol):
    """What a follower rank runs besides its shard of each step (its KV transfer endpoint): made on rank 0, pickled
    into every follower process, started there once the engine is built."""

    def start(self, rank: int, engine: LLMEngine, report: Callable[[object], None]) -> None:
        """This rank is up; ``report(payload)`` sends rank 0 a report from any thread."""

    def before_step(self, items: list[object]) -> Callable[[int], None] | None:
        """The items rank 0 attached to this step; returns the hook run after each layer's forward, if any."""

    def call(self, payload: object) -> object:
        """Answer a call of rank 0 (it waits for the answer)."""

    def tell(self, payload: object) -> None:
        """A message of rank 0 that needs no answer."""

    def close(self) -> None:
        """The rank is stopping."""


class _NoSampler:
    """A follower samples nothing: rank 0's sampler decides every token."""

    def prefetch(self, requests: list[Request]) -> None:
        return None

    def settle_masks(self) -> None:
        return None

    def __call__(self, logits: Any, requests: list[Request]) -> SampleResult | None:
        return None


class _Link:
    """Rank 0's end of one follower's pipe: sends (locked: the engine loop, the watchdog and ``close`` all send),
    and, once the rank is ready, a reader thread that hands answers to the waiting :meth:`answer` and reports to
    ``on_report``."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self.conn = conn
        self._send_lock = threading.Lock()
        self._cv = threading.Condition()
        self._answers: dict[int, tuple[bool, object]] = {}
        self._gone = False

    def send(self, msg: object) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def read(self, on_report: Callable[[int, object], None]) -> None:
        try:
            while True:
                kind, *rest = self.conn.recv()
                if kind == "answer":
                    with self._cv:
                        self._answers[rest[0]] = (rest[1], rest[2])
                        self._cv.notify_all()
                elif kind == "report":
                    on_report(self.rank, rest[0])
        except (EOFError, OSError):
            pass
        finally:
            with self._cv:
                self._gone = True
                self._cv.notify_all()

    def answer(self, seq: int, deadline: float) -> object:
        with self._cv:
            while seq not in self._answers:
                left = deadline - time.monotonic()
                if self._gone:
                    raise RuntimeError(f"rank {self.rank} is gone")
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank} did not answer in time")
                self._cv.wait(left)
            ok, value = self._answers.pop(seq)
        if not ok:
            raise RuntimeError(f"rank {self.rank}: {value}")
        return value


class LeaderRunner:
    """Rank 0's model runner: sends every follower the step's rows, then runs its own shard of the step."""

    def __init__(self, runner: ModelRunner, links: list[_Link]) -> None:
        self.runner = runner
        self.links = links
        self.extra: list[list[object]] = [[] for _ in links]  # per follower: items for the next step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("runner", "links", "extra"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.runner, name, value)  # e.g. a test's logit recorder replacing the sampler

    def execute_spec(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None,
                     drafts: dict[str, list[int]] | None = None) -> Any:
        rows = describe(out, self.runner.block_ids)
        for i, link in enumerate(self.links):
            items, self.extra[i] = self.extra[i], []
            link.send(("step", rows, drafts, items))
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


def follower_main(rank: int, parallel: ParallelConfig, port: int, config: EngineConfig, conn: Connection,
                  extension: RankExtension | None = None) -> None:
    """A follower rank: join the group, load this rank's shard, run each step rank 0 sends until it says close;
    ``extension`` answers rank 0's calls and tells, and runs after each layer of a step it was given items for."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    send_lock = threading.Lock()

    def send(msg: object) -> None:
        with send_lock:
            conn.send(msg)

    try:
        config = replace(_bind_cpus(rank, parallel, config), device=rank_device(config.device, rank))
        comms = join(rank, parallel, port, config.device)
        engine = LLMEngine(config, shard=parallel.shard(rank), tp_reduce=comms.tp_reduce,
                           ep_reduce=comms.ep_reduce, pipe=comms.pipe)
        if comms.exchange is not None:
            engine.model.attach_expert_exchange(comms.exchange)
        runner = engine.runner
        runner.micro_batches = parallel.pp
        runner.sampler = _NoSampler()  # type: ignore[assignment]
        tables: dict[str, list[int]] = {}
        runner.block_ids = tables.__getitem__
        if extension is not None:
            extension.start(rank, engine, lambda payload: send(("report", payload)))
        send(("ready", engine.pool.num_blocks))
        while True:
            try:
                cmd, *args = conn.recv()
            except EOFError:
                break
            if cmd == "close":
                break
            if cmd == "call":
                seq, payload = args
                try:
                    if extension is None:
                        raise RuntimeError("this rank has no extension to answer calls")
                    send(("answer", seq, True, extension.call(payload)))
                except Exception as e:  # the caller (rank 0) raises it; this rank goes on
                    send(("answer", seq, False, f"{type(e).__name__}: {e}"))
                continue
            if cmd == "tell":
                if extension is not None:
                    extension.tell(args[0])
                continue
            rows: list[StepRow] = args[0]
            drafts: dict[str, list[int]] | None = args[1]
            after_layer = extension.before_step(args[2]) if extension is not None and args[2] else None
            tables.clear()
            for row in rows:
                tables[row.request_id] = row.block_ids
            out = SchedulerOutput(requests=cast(list[Request], [_RowRequest(r) for r in rows]),
                                  num_new_tokens=[len(r.token_ids) for r in rows])
            runner.execute_spec(out, after_layer, drafts)  # a speculated request's drafts: the same rows as rank 0's
    except BaseException:
        log.exception("rank %d failed", rank)
        raise
    finally:
        if extension is not None:
            extension.close()
        leave()


class ServedReplica:
    """Rank 0's side of a replica: starts the follower ranks, joins their group and builds rank 0's engine."""

    def __init__(self, config: EngineConfig, parallel: ParallelConfig,
                 on_rank_exit: Callable[[str], None], start_timeout_s: float = 300.0,
                 extension: RankExtension | None = None) -> None:
        parallel.check_model(ModelConfig.from_dir(config.model))
        self.parallel = parallel
        self.on_rank_exit = on_rank_exit
        # (rank, payload) of every follower report, on that rank's reader thread: set by whoever made the extension
        self.on_report: Callable[[int, object], None] = lambda rank, payload: None
        self._closing = threading.Event()
        self._seq = 0
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.links: list[_Link] = []
        self.procs: list[BaseProcess] = []
        try:
            for rank in range(1, parallel.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=follower_main, args=(rank, parallel, port, config, child, extension),
                                   name=f"tandem-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.links.append(_Link(rank, parent))
                self.procs.append(proc)
            config = replace(_bind_cpus(0, parallel, config), device=rank_device(config.device, 0))
            comms = self._join(parallel, port, config.device, start_timeout_s)
            self.engine = LLMEngine(config, shard=parallel.shard(0), tp_reduce=comms.tp_reduce,
                                    ep_reduce=comms.ep_reduce, pipe=comms.pipe)
            if comms.exchange is not None:
                self.engine.model.attach_expert_exchange(comms.exchange)
            self.engine.runner.micro_batches = parallel.pp
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.leader = LeaderRunner(self.engine.runner, self.links)
        self.engine.runner = self.leader  # type: ignore[assignment]
        for link in self.links:
            threading.Thread(target=link.read, args=(lambda r, p: self.on_report(r, p),),
                             name=f"rank{link.rank}-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    def attach_to_step(self, rank: int, item: object) -> None:
        """Send ``item`` to follower ``rank`` with the next step's rows (its extension's ``before_step``)."""
        self.leader.extra[rank - 1].append(item)

    def call(self, payload: object, timeout_s: float = 10.0) -> list[object]:
        """Ask every follower's extension and wait for each answer (rank 1 first); raises if one fails or is gone."""
        self._seq += 1
        for link in self.links:
            link.send(("call", self._seq, payload))
        deadline = time.monotonic() + timeout_s
        return [link.answer(self._seq, deadline) for link in self.links]

    def tell(self, rank: int, payload: object) -> None:
        """Send follower ``rank``'s extension ``payload``; no answer (a rank already gone is ignored: the
        watchdog takes the replica down)."""
        with contextlib.suppress(OSError):
            self.links[rank - 1].send(("tell", payload))

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
        for link in self.links:
            with contextlib.suppress(OSError):
                link.send(("close",))
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in self.conns:
            conn.close()
