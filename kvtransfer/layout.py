"""The KV layout contract both ends compare at the handshake, and the block-run helpers.

Per layer K and V are contiguous ``[num_blocks, block_size, local_kv_heads, head_dim]`` tensors (``"NBHD"``), so a
request's blocks are a few byte ranges. :meth:`KVLayout.compat_hash` covers every field that changes a byte's
meaning; TP is left out so that ranks of different TP can exchange (:mod:`kvtransfer.plan`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LAYOUT_NBHD = "NBHD"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "uint8")
}

# The fields that must be equal on both ends, in the order the hash and error messages use.
COMPAT_FIELDS = ("model_id", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "layout")


class CompatibilityError(ValueError):
    """The two ends of a transfer disagree on something that changes the meaning of the bytes."""


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What one rank's KV cache looks like. ``num_kv_heads`` is the model total; a rank holds ``local_heads``."""

    model_id: str
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    layout: str = LAYOUT_NBHD

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("KVLayout.model_id must be non-empty")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(f"{self.num_kv_heads} KV heads cannot be split evenly across tp_size={self.tp_size}")
        if self.layout != LAYOUT_NBHD:
            raise ValueError(f"KVLayout.layout {self.layout!r} is not supported (only {LAYOUT_NBHD!r})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def local_heads(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer of K (or V) on this rank."""
        return self.local_heads * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer of K (or V) on this rank."""
        return self.block_size * self.token_bytes

    def compat_hash(self) -> str:
        """Stable hex digest of the fields that must match across the two ends (TP excluded)."""
        text = "|".join(f"{name}={getattr(self, name)}" for name in COMPAT_FIELDS)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`CompatibilityError` naming every mismatching field; TP differences are allowed."""
        diffs = [f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
                 for name in COMPAT_FIELDS if getattr(self, name) != getattr(other, name)]
        if diffs:
            raise CompatibilityError("KV layout mismatch: " + "; ".join(diffs))

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in (*COMPAT_FIELDS, "tp_size", "tp_rank")}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> KVLayout:
        fields = (*COMPAT_FIELDS, "tp_size", "tp_rank")
        unknown = set(data) - set(fields)
        if unknown:
            raise ValueError(f"unknown KVLayout fields {sorted(unknown)}")
        return cls(**{k: data[k] for k in fields if k in data})  # type: ignore[arg-type]


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Split block ids into ``(start, length)`` runs of consecutive ids, keeping their order.

    >>> block_runs([4, 5, 6, 9, 2, 3])
    [(4, 3), (9, 1), (2, 2)]
    """
    return [(start, n) for start, _, n in paired_runs(block_ids, block_ids)]


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs that are consecutive on *both* sides, in request order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"source has {len(src_ids)} blocks but destination reserved {len(dst_ids)}")
    runs: list[tuple[int, int, int]] = []
    for s_raw, d_raw in zip(src_ids, dst_ids, strict=True):
        s, d = int(s_raw), int(d_raw)
        if s < 0 or d < 0:
            raise ValueError(f"negative block id ({s} to {d})")
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def flat_bytes(t: torch.Tensor) -> memoryview:
    """Writable flat byte memoryview over a contiguous CPU tensor's storage (no copy; any dtype)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("flat_bytes needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


class RegisteredKV:
    """One rank's registered KV tensors (either end), with a flat byte view of each CPU tensor, made once, so that a
    full-head block run is a plain memoryview slice."""

    def __init__(self) -> None:
        self.layout: KVLayout | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.flat: list[tuple[memoryview, ...]] = []

    def register(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: KVLayout) -> None:
        """Check the tensors against ``layout`` (count, dtype, shape, contiguity) and keep them."""
        if len(kv_caches) != layout.num_layers:
            raise ValueError(f"got {len(kv_caches)} layers of KV cache, layout says {layout.num_layers}")
        shape = None
        for i, pair in enumerate(kv_caches):
            if len(pair) != 2:
                raise ValueError(f"layer {i}: expected a (K, V) pair")
            for name, t in zip("KV", pair, strict=True):
                if t.dtype != layout.torch_dtype:
                    raise ValueError(f"layer {i} {name}: dtype {t.dtype} but layout says {layout.dtype}")
                if t.dim() != 4 or tuple(t.shape[1:]) != (layout.block_size, layout.local_heads, layout.head_dim):
                    raise ValueError(f"layer {i} {name}: shape {tuple(t.shape)} is not [num_blocks, "
                                     f"{layout.block_size}, {layout.local_heads}, {layout.head_dim}]")
                if not t.is_contiguous():
                    raise ValueError(f"layer {i} {name}: tensor is not contiguous")
                shape = shape or tuple(t.shape)
                if tuple(t.shape) != shape:
                    raise ValueError(f"layer {i} {name}: {tuple(t.shape)} differs from layer 0 {shape}")
        self.num_blocks = int(kv_caches[0][0].shape[0])
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.flat = [tuple(flat_bytes(t) for t in pair) for pair in kv_caches] if not kv_caches[0][0].is_cuda else []

    def run_bytes(self, layer: int, kv: int, block: int, heads: int, nbytes: int) -> memoryview | None:
        """``nbytes`` of ``layer``'s K or V from ``block`` on, when ``heads`` are all local heads on CPU; else None."""
        layout = self.layout
        if not self.flat or layout is None or heads != layout.local_heads:
            return None
        start = block * layout.block_bytes
        return self.flat[layer][kv][start : start + nbytes]
