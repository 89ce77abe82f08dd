"""An in-process rank group: the split-emulating reference for tensor- and expert-parallel exactness.

Threads stand in for ranks and run the same sharded model code; :meth:`ThreadGroup.reducer` sums the ranks'
partial products in rank order (``p0 + p1 + ...``) with no transport in between. A TP=1 computation that adds the
same partials in the same order is therefore this group's result, and real ranks (gloo on loopback) must reproduce
it bit for bit. Tests only: it proves exactness, it serves nothing.
"""

from __future__ import annotations

import threading

import torch

from engine.models.decoder import AllReduce


class ThreadGroup:
    """``size`` threads' collectives: :meth:`reducer` (an all-reduce) and :meth:`exchange` (expert parallelism's)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        self.size = size
        self._parts: list[torch.Tensor | None] = [None] * size
        self._shared: list[tuple[torch.Tensor, list[int]]] = [(torch.empty(0), [])] * size
        self._barrier = threading.Barrier(size)

    def reducer(self, rank: int) -> AllReduce:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self._parts[rank] = x
            self._barrier.wait()
            parts = list(self._parts)
            total = parts[0].clone()  # type: ignore[union-attr]
            for p in parts[1:]:
                total += p  # type: ignore[operator]
            self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
            return total

        return all_reduce

    def _swap(self, rank: int, x: torch.Tensor, sizes: list[int] | None = None) -> list[tuple[torch.Tensor, list[int]]]:
        """Every rank's ``(x, sizes)``, in rank order, copied before any rank can go on to the next collective."""
        self._shared[rank] = (x, sizes or [])
        self._barrier.wait()
        parts = [(p.clone(), list(n)) for p, n in self._shared]
        self._barrier.wait()
        return parts

    def exchange(self, rank: int, dispatch: str) -> ThreadExchange:
        return ThreadExchange(self, rank, dispatch)

    def abort(self) -> None:
        """Release ranks blocked in a reduce (a rank failed): they get ``threading.BrokenBarrierError``."""
        self._barrier.abort()


class ThreadExchange:
    """One thread-rank's :class:`engine.models.layers.ExpertExchange`."""

    def __init__(self, group: ThreadGroup, rank: int, dispatch: str) -> None:
        self.group, self.rank, self.size, self.dispatch = group, rank, group.size, dispatch

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p for p, _ in self.group._swap(self.rank, x)])

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = []
        for src, (rows, sizes) in enumerate(self.group._swap(self.rank, x, send)):
            if sizes[self.rank] != recv[src]:
                raise ValueError(f"rank {self.rank} expects {recv[src]} rows from rank {src}, which sends "
                                 f"{sizes[self.rank]}")
            out.append(rows.narrow(0, sum(sizes[: self.rank]), sizes[self.rank]))
        return torch.cat(out)
