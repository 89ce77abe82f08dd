"""Transfer plans: which block runs and head slices move from a source rank into a destination rank.

KV heads are split contiguously across TP ranks, so a leg moves the overlap of the two ranks' head ranges; uneven
splits and TP above the head count are refused. A plan is a list of :class:`Piece` (runs consecutive on both
sides), computed once at ``start`` and reused for every layer and for K and V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvtransfer.layout import KVLayout, paired_runs


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


def slice_between(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> HeadSlice | None:
    """The heads ``src_rank`` sends to ``dst_rank``, or ``None`` when their ranges do not overlap."""
    s_per, d_per = _check(num_kv_heads, src_tp, "source"), _check(num_kv_heads, dst_tp, "destination")
    if not (0 <= src_rank < src_tp and 0 <= dst_rank < dst_tp):
        raise ValueError(f"rank {src_rank} or {dst_rank} outside tp={src_tp} or {dst_tp}")
    s_lo, s_hi, d_lo, d_hi = src_rank * s_per, (src_rank + 1) * s_per, dst_rank * d_per, (dst_rank + 1) * d_per
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


class Piece(NamedTuple):
    """Immutable; a tuple so that building one per block run costs a fraction of a frozen dataclass's ``__init__``
    (a fragmented 2k-token prompt has a run per block, planned on the forward thread after layer 0)."""

    src_start: int
    dst_start: int
    num_blocks: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    nbytes: int  # bytes of this piece for one of K or V

    def src_view(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.src_start : self.src_start + self.num_blocks, :, self.src_heads[0] : self.src_heads[1]]


def plan_leg(src: KVLayout, dst: KVLayout, src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Piece]:
    """Pieces that move ``src_ids`` of rank ``src`` into ``dst_ids`` of rank ``dst``; checks compatibility first."""
    src.check_compatible(dst)
    hs = slice_between(src.num_kv_heads, src.tp_size, src.tp_rank, dst.tp_size, dst.tp_rank)
    if hs is None:
        raise ValueError(f"source rank {src.tp_rank}/{src.tp_size} holds none of the heads of destination rank "
                         f"{dst.tp_rank}/{dst.tp_size}")
    per_block = src.block_size * hs.num_heads * src.head_dim * src.element_size
    return [Piece(s, d, n, hs.src_heads, hs.dst_heads, n * per_block) for s, d, n in paired_runs(src_ids, dst_ids)]

