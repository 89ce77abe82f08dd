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
    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        self.size = size
        self._parts: list[torch.Tensor | None] = [None] * size
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

    def abort(self) -> None:
        """Release ranks blocked in a reduce (a rank failed): they get ``threading.BrokenBarrierError``."""
        self._barrier.abort()
