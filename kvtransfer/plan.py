"""Transfer plan for one (source rank → destination rank) leg: which block runs and head slices move where.

A plan is a list of :class:`Piece`. The same pieces apply to every layer and to both K and V, so it is computed once
at ``start`` and reused for each ``send_layer``. A piece is consecutive on both sides (the intersection of the
source's and the destination's block runs) and carries the head slice from :mod:`kvtransfer.tp_mapping`. With
equal TP the slice is the whole head dimension and each piece is one contiguous byte range on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvtransfer.layout import KVLayout, paired_runs
from kvtransfer.tp_mapping import slice_between


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

    def dst_view(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.dst_start : self.dst_start + self.num_blocks, :, self.dst_heads[0] : self.dst_heads[1]]


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
