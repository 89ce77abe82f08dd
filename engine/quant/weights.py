"""One canonical form for a quantized weight matrix, whatever checkpoint format it came from.

``q`` holds signed integers ``[out, in]`` (int8 storage for 4- and 8-bit values: INT4 in [-8, 7]), ``scale`` and
``zero`` are ``[out, groups]`` with ``in = groups * group_size`` (one group per row: per channel), and the weight is
``(q - zero) * scale``, computed in float32. This is compressed-tensors' definition; GPTQ's and AWQ's unsigned
integers and zero points map onto it by subtracting ``2 ** (bits - 1)`` from both, which changes no product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class QuantizedMatrix:
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int

    def __post_init__(self) -> None:
        if self.q.dim() != 2 or self.q.dtype is not torch.int8:
            raise ValueError(f"q must be a 2-D int8 tensor, got {tuple(self.q.shape)} {self.q.dtype}")
        rows, cols = self.q.shape
        if self.scale.dim() != 2 or self.scale.shape[0] != rows or cols % self.scale.shape[1]:
            raise ValueError(f"scale {tuple(self.scale.shape)} does not fit q {tuple(self.q.shape)}")
        if self.zero is not None and self.zero.shape != self.scale.shape:
            raise ValueError(f"zero {tuple(self.zero.shape)} differs from scale {tuple(self.scale.shape)}")
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``(q - zero) * scale``: what the reference runs and what the kernels approximate."""
        rows, cols = self.q.shape
        groups = self.scale.shape[1]
        q = self.q.view(rows, groups, cols // groups).float()
        if self.zero is not None:
            q = q - self.zero.float().unsqueeze(-1)
        return (q * self.scale.float().unsqueeze(-1)).view(rows, cols)

    @staticmethod
    def cat(parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        """Stack matrices along the output rows (q|k|v, gate|up); they must share bits and group size."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size or p.q.shape[1] != first.q.shape[1]
               or (p.zero is None) != (first.zero is None) for p in parts):
            raise ValueError("cannot fuse quantized matrices of different bits, group sizes or inputs")
        zeros = [p.zero for p in parts if p.zero is not None]
        return QuantizedMatrix(torch.cat([p.q for p in parts]), torch.cat([p.scale.float() for p in parts]),
                               torch.cat(zeros) if zeros else None, first.bits)
