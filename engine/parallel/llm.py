"""``ParallelLLM``: the offline API (as :class:`engine.llm.LLM`) over a replica of tensor/expert-parallel ranks.

The driver holds no model. It checks the split against the checkpoint's config (refusing a bad one before any
process starts), spawns one process per rank (:mod:`.rank_process`), which join a gloo group on loopback, and sends
each command to every rank. A rank that fails or dies takes the whole replica down: the driver stops every rank
it started, by its process handle, and raises.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch

from engine.llm import CompletionOutput
from engine.model_config import ModelConfig
from engine.parallel.config import ParallelConfig
from engine.parallel.process_group import free_port
from engine.parallel.rank_process import RankInfo, rank_main
from engine.sampling_params import SamplingParams

EXIT_SEEN_S = 3.0  # how long a failure waits for a dead rank's exit to show before naming the ranks


class RankFailedError(RuntimeError):
    """A rank raised or exited; the replica has been stopped."""


class ParallelLLM:
    def __init__(self, model: str, parallel: ParallelConfig, *, start_timeout_s: float = 300.0,
                 command_timeout_s: float = 600.0, **llm_kwargs: Any) -> None:
        parallel.check_model(ModelConfig.from_dir(model))
        self.parallel = parallel
        self.command_timeout_s = command_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns: list[Connection] = []
        self._procs: list[BaseProcess] = []
        try:
            for rank in range(parallel.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(rank, parallel, port, model, llm_kwargs, child),
                                   name=f"tandem-rank{rank}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            self.ranks: list[RankInfo] = self._gather(start_timeout_s, expect="ready")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, record_logits: bool = False) -> list[CompletionOutput]:
        """As :meth:`engine.llm.LLM.generate`. With ``record_logits``, :attr:`last_logits` then holds each prompt's
        sampled-from logits rows, ``[steps, vocab]`` in fp32, as rank 0 saw them."""
        outs, logits = self._command(("generate", list(prompts), params, record_logits))[0]
        self.last_logits: list[torch.Tensor] | None = logits
        return outs  # type: ignore[no-any-return]

    def stats(self) -> list[dict[str, float]]:
        """Each rank's engine step seconds, steps, all-reduce seconds and calls since the last call; and its RSS."""
        return self._command(("stats",))

    def check_block_accounting(self) -> None:
        """Raise AssertionError unless every rank's block pool has every block free or cached."""
        errors = [e for e in self._command(("check",)) if e is not None]
        if errors:
            raise AssertionError("; ".join(errors))

    def close(self, timeout_s: float = 30.0) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> ParallelLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the pipes -------------------------------------------------------------------------------------------

    def _command(self, cmd: tuple[Any, ...]) -> list[Any]:
        if not self._conns:
            raise RankFailedError("the replica is stopped")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(cmd)
            except OSError as e:
                self._fail(f"rank {rank}'s pipe: {e}")
        return self._gather(self.command_timeout_s, expect="ok")

    def _fail(self, reason: str) -> NoReturn:
        """Stop every rank and raise, naming first the ranks that exited (the cause; the others' errors follow)."""
        # A killed rank's peers see their collective break at once, but on a loaded host the killed process may
        # take a while to be scheduled and exit: wait (bounded) for one to exit so that it is named as the cause.
        deadline = time.monotonic() + EXIT_SEEN_S
        while all(p.is_alive() for p in self._procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in enumerate(self._procs)
                if not p.is_alive()]
        self.close(timeout_s=5.0)
        raise RankFailedError("; ".join([*dead, reason]))

    def _gather(self, timeout_s: float, expect: str) -> list[Any]:
        """Each rank's reply, in rank order; any error, exit or timeout stops the replica and raises."""
        replies: list[Any] = [None] * len(self._conns)
        pending = set(range(len(self._conns)))
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0.05):
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError) as e:  # a killed rank's socket pipe may read as reset, not closed
                        kind, value = "error", f"rank {rank} closed its pipe ({e!r}, exit code {proc.exitcode})"
                    if kind != expect:
                        self._fail(str(value))
                    replies[rank] = value
                    pending.discard(rank)
                elif not proc.is_alive():
                    self._fail(f"rank {rank} stopped answering")
            if time.monotonic() > deadline:
                self._fail(f"ranks {sorted(pending)} did not answer within {timeout_s:.0f} s")
        return replies
