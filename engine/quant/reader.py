"""A quantized checkpoint's tensors, read as the dense weights the model loader takes plus the integers behind them.

:meth:`QuantizedCheckpoint.weights` yields every tensor the way an unquantized checkpoint would have it
(``P.weight`` in float32, dequantized: ``(q - zero) * scale``), so the model's per-parameter loaders, its fused q|k|v
and gate|up layout and its tensor-parallel slicing work unchanged, and a model that runs those dense weights is the
reference by construction. :attr:`QuantizedCheckpoint.matrices` keeps each module's integers (``P`` -> matrix) for
:func:`engine.quant.attach.attach_kernels`. FP8 weights are widened to float32 the same way; no CPU kernel takes
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.quant import formats
from engine.quant.scheme import QuantScheme, UnsupportedQuantizationError
from engine.quant.weights import QuantizedMatrix

_SUFFIXES = {
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


class QuantizedCheckpoint:
    def __init__(self, scheme: QuantScheme, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.scheme = scheme
        self.tensors = tensors
        self.matrices: dict[str, QuantizedMatrix] = {}

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        suffixes = _SUFFIXES[self.scheme.method]
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.tensors:
            prefix, _, suffix = name.rpartition(".")
            if suffix in suffixes or (suffix == "weight" and tensor.dtype in _QUANT_DTYPES):
                parts.setdefault(prefix, {})[suffix] = tensor
            else:
                yield name, tensor
        for prefix, t in parts.items():
            yield f"{prefix}.weight", self._dense(prefix, t)

    def _dense(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self.scheme
        try:
            if s.float_weights:
                w, scale = t["weight"], t["weight_scale"].float()
                return w.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))
            if s.method == "compressed-tensors":
                if "weight_g_idx" in t:
                    raise UnsupportedQuantizationError(
                        f"{prefix}: compressed-tensors activation ordering (weight_g_idx) is not supported")
                m: QuantizedMatrix | torch.Tensor = formats.from_compressed_tensors(t, s.bits)
            elif s.method == "gptq":
                m = formats.from_gptq(t, s.bits)
            else:
                m = formats.from_awq(t, s.bits)
        except KeyError as e:
            raise ValueError(f"quantized module {prefix!r} lacks tensor {e.args[0]!r} for {s.name}") from None
        if isinstance(m, torch.Tensor):
            return m  # act-order GPTQ: dense only
        self.matrices[prefix] = m
        return m.dequantize()
