"""Transfer plans: which block runs and head slices move from a source rank into a destination rank.

KV heads are split contiguously across tensor-parallel ranks: rank ``r`` of ``tp`` holds global heads
``[r*H/tp, (r+1)*H/tp)``, so a prefill replica of one TP degree can feed a decode replica of another. A transfer is
planned per (source rank, destination rank) leg as the overlap of their head ranges (:class:`HeadSlice`), every
piece of which is a contiguous slice of heads on both sides (local indices differ). With equal TP each rank talks
to its twin and the slice is the whole head dimension, so a block run stays one contiguous byte range.

Refused, with a clear error, instead of silently guessed: a head count that does not divide by either TP degree
(that would need uneven shards) and TP larger than the head count (that needs KV-head replication, which the
engine does not do).

A leg's plan is a list of :class:`Piece`. The same pieces apply to every layer and to both K and V, so a plan is
computed once at ``start`` and reused for each ``send_layer``. A piece is consecutive on both sides (the
intersection of the source's and the destination's block runs) and carries the head slice.
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
        raise ValueError(
            f"source rank {src.tp_rank}/{src.tp_size} holds none of the heads of destination rank "
            f"{dst.tp_rank}/{dst.tp_size}"
        )
    per_block = src.block_size * hs.num_heads * src.head_dim * src.element_size
    return [
        Piece(s, d, n, hs.src_heads, hs.dst_heads, n * per_block) for s, d, n in paired_runs(src_ids, dst_ids)
    ]


def expected_layer_bytes(dst: KVLayout, num_blocks: int) -> int:
    """Bytes that must land in one layer (K and V) of a destination rank for ``num_blocks`` blocks."""
    return 2 * num_blocks * dst.block_bytes


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
