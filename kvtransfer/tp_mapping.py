"""Head mapping between a prefill replica and a decode replica of different tensor-parallel degree.

KV heads are split contiguously: rank ``r`` of ``tp`` holds global heads ``[r*H/tp, (r+1)*H/tp)``. A transfer is
planned per (source rank, destination rank) pair as the overlap of their head ranges; every piece of the overlap
is a contiguous slice of heads on both sides (local indices differ). With equal TP each rank talks to its twin
and the slice is the whole head dimension, so a block run stays one contiguous byte range.

Refused, with a clear error, instead of silently guessed: a head count that does not divide by either TP degree
(that would need uneven shards) and TP larger than the head count (that needs KV-head replication, which the
engine does not do).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class HeadSlice:
    """Heads ``global_heads`` travel from ``src_rank`` to ``dst_rank``; ``*_heads`` are local ``[lo, hi)``."""

    src_rank: int
    dst_rank: int
    global_heads: tuple[int, int]
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.global_heads[1] - self.global_heads[0]


def _check(num_kv_heads: int, tp: int, side: str) -> int:
    if tp < 1:
        raise ValueError(f"{side} tp must be >= 1, got {tp}")
    if tp > num_kv_heads:
        raise ValueError(f"{side} tp={tp} exceeds {num_kv_heads} KV heads (KV-head replication is not supported)")
    if num_kv_heads % tp:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split evenly across {side} tp={tp}")
    return num_kv_heads // tp


def heads_of(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Global head range ``[lo, hi)`` held by ``rank`` of ``tp``."""
    per = _check(num_kv_heads, tp, "rank's")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside tp={tp}")
    return rank * per, (rank + 1) * per


def slice_between(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> HeadSlice | None:
    """The heads ``src_rank`` sends to ``dst_rank``, or ``None`` when their ranges do not overlap."""
    _check(num_kv_heads, src_tp, "source")
    _check(num_kv_heads, dst_tp, "destination")
    s_lo, s_hi = heads_of(num_kv_heads, src_tp, src_rank)
    d_lo, d_hi = heads_of(num_kv_heads, dst_tp, dst_rank)
    lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
    if lo >= hi:
        return None
    return HeadSlice(src_rank, dst_rank, (lo, hi), (lo - s_lo, hi - s_lo), (lo - d_lo, hi - d_lo))


def tp_head_map(num_kv_heads: int, src_tp: int, dst_tp: int) -> dict[int, list[HeadSlice]]:
    """For each destination rank, the source ranks and head slices it receives (ordered by head)."""
    _check(num_kv_heads, src_tp, "source")
    _check(num_kv_heads, dst_tp, "destination")
    out: dict[int, list[HeadSlice]] = {}
    for d in range(dst_tp):
        pieces = [slice_between(num_kv_heads, src_tp, s, dst_tp, d) for s in range(src_tp)]
        out[d] = [p for p in pieces if p is not None]
    return out


def slice_heads(run: torch.Tensor, piece: HeadSlice) -> torch.Tensor:
    """The source side of ``piece`` out of a block run ``[n, block_size, src_local_heads, head_dim]`` (a view)."""
    lo, hi = piece.src_heads
    return run[:, :, lo:hi]


def merge_heads(dst_run: torch.Tensor, part: torch.Tensor, piece: HeadSlice) -> None:
    """Write a received slice into the destination block run ``[n, block_size, dst_local_heads, head_dim]``."""
    lo, hi = piece.dst_heads
    target = dst_run[:, :, lo:hi]
    if target.shape != part.shape:
        raise ValueError(f"slice shape {tuple(part.shape)} does not fit destination heads {tuple(target.shape)}")
    target.copy_(part)
