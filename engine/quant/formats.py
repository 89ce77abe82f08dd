"""Unpacking each checkpoint format's tensors into a :class:`QuantizedMatrix`, and packing one back.

The bit packing itself is compressed-tensors' (``pack_to_int32``/``unpack_from_int32``: element ``i`` of a packed
row at bits ``i * bits``, values offset to unsigned by ``2 ** (bits - 1)``), which is also GPTQ's layout along the
input dimension; AWQ's GEMM layout is the same with the eight nibbles of a word interleaved (``_AWQ_ORDER``).

Per module (``P`` = e.g. ``model.layers.0.self_attn.q_proj``):

- compressed-tensors ``pack-quantized``: ``P.weight_packed`` int32 ``[out, in * bits / 32]``, ``P.weight_scale``
  ``[out, groups]``, ``P.weight_shape``, and for asymmetric schemes ``P.weight_zero_point`` packed along dim 0;
  ``int-quantized``: ``P.weight`` int8 ``[out, in]`` instead of the packed tensor, zero points unpacked;
- GPTQ: ``P.qweight`` int32 ``[in * bits / 32, out]``, ``P.qzeros`` int32 ``[groups, out * bits / 32]`` holding
  ``zero - 1`` (GPTQ v1), ``P.scales`` ``[groups, out]``, ``P.g_idx`` ``[in]``;
- AWQ: ``P.qweight`` int32 ``[in, out / 8]`` and ``P.qzeros`` ``[groups, out / 8]`` (interleaved), ``P.scales``.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import pack_to_int32, unpack_from_int32

from engine.quant.weights import QuantizedMatrix

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble slot i of an AWQ word holds column _AWQ_ORDER[i] of its 8


def _offset(bits: int) -> int:
    return 1 << (bits - 1)


def _maybe_zero(zero: torch.Tensor) -> torch.Tensor | None:
    return None if not bool(zero.any()) else zero


# ---- compressed-tensors ---------------------------------------------------------------------------------------

def from_compressed_tensors(t: dict[str, torch.Tensor], bits: int) -> QuantizedMatrix:
    """``t``: one module's tensors keyed by their suffix (``weight_packed``, ``weight_scale``, ...)."""
    scale = t["weight_scale"]
    if "weight_packed" in t:
        rows, cols = (int(v) for v in t["weight_shape"].tolist())
        q = unpack_from_int32(t["weight_packed"], bits, torch.Size((rows, cols)))
    else:
        q = t["weight"].to(torch.int8)
        rows = q.shape[0]
    if scale.dim() == 1:
        scale = scale.reshape(rows, -1)
    zero = t.get("weight_zero_point")
    if zero is not None:
        if zero.dtype is torch.int32 and "weight_packed" in t:
            zero = unpack_from_int32(zero, bits, torch.Size(scale.shape), packed_dim=0)
        zero = _maybe_zero(zero.to(torch.int8).reshape(scale.shape))
    return QuantizedMatrix(q.to(torch.int8), scale, zero, bits)


def to_compressed_tensors(m: QuantizedMatrix, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The ``pack-quantized`` tensors of ``m`` (suffixes), scales stored in ``dtype``."""
    out = {"weight_packed": pack_to_int32(m.q, m.bits), "weight_scale": m.scale.to(dtype),
           "weight_shape": torch.tensor(m.shape, dtype=torch.int64)}
    if m.zero is not None:
        out["weight_zero_point"] = pack_to_int32(m.zero, m.bits, packed_dim=0)
    return out


# ---- GPTQ -----------------------------------------------------------------------------------------------------

def from_gptq(t: dict[str, torch.Tensor], bits: int) -> QuantizedMatrix | torch.Tensor:
    """A GPTQ module as a matrix; with act-order (a ``g_idx`` that is not ``k // group``) the dense float32 weight,
    since its groups are not contiguous along the input and no packed kernel here takes them."""
    scales = t["scales"]  # [groups, out]
    groups, rows = scales.shape
    packed_rows = t["qweight"].shape[0]
    cols = packed_rows * 32 // bits
    q = unpack_from_int32(t["qweight"], bits, torch.Size((cols, rows)), packed_dim=0)  # [in, out], u - offset
    z = unpack_from_int32(t["qzeros"], bits, torch.Size((groups, rows)), packed_dim=1)  # stored zero - 1, - offset
    zero = (z.to(torch.int16) + 1).to(torch.int8)  # GPTQ v1 stores zero - 1; signed: zero_u - offset
    g_idx = t.get("g_idx")
    group = cols // groups
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols) // group):
        w = (q.float() - zero.float()[g_idx.long()]) * scales.float()[g_idx.long()]
        return w.t().contiguous()
    return QuantizedMatrix(q.t().contiguous(), scales.t().contiguous(), _maybe_zero(zero.t().contiguous()), bits)


def to_gptq(m: QuantizedMatrix, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    cols = m.shape[1]
    zero = m.zero if m.zero is not None else torch.zeros_like(m.scale, dtype=torch.int8)
    if bool((zero == -_offset(m.bits)).any()):
        raise ValueError("GPTQ v1 stores zero - 1 and cannot hold an unsigned zero point of 0")
    return {
        "qweight": pack_to_int32(m.q.t().contiguous(), m.bits, packed_dim=0),
        "qzeros": pack_to_int32((zero.to(torch.int16) - 1).to(torch.int8).t().contiguous(), m.bits, packed_dim=1),
        "scales": m.scale.t().contiguous().to(dtype),
        "g_idx": (torch.arange(cols) // m.group_size).to(torch.int32),
    }


# ---- AWQ ------------------------------------------------------------------------------------------------------

def _awq_unorder(x: torch.Tensor) -> torch.Tensor:
    """Columns in AWQ's packed slot order -> natural order (slot i holds column ``_AWQ_ORDER[i]``)."""
    rows, cols = x.shape
    inv = torch.tensor(_AWQ_ORDER).argsort()
    return x.view(rows, cols // 8, 8)[:, :, inv].reshape(rows, cols)


def _awq_order(x: torch.Tensor) -> torch.Tensor:
    rows, cols = x.shape
    return x.view(rows, cols // 8, 8)[:, :, torch.tensor(_AWQ_ORDER)].reshape(rows, cols).contiguous()


def from_awq(t: dict[str, torch.Tensor], bits: int) -> QuantizedMatrix:
    scales = t["scales"]  # [groups, out]
    groups, rows = scales.shape
    cols = t["qweight"].shape[0]
    q = _awq_unorder(unpack_from_int32(t["qweight"], bits, torch.Size((cols, rows))))  # [in, out]
    zero = _awq_unorder(unpack_from_int32(t["qzeros"], bits, torch.Size((groups, rows))))
    return QuantizedMatrix(q.t().contiguous(), scales.t().contiguous(), _maybe_zero(zero.t().contiguous()), bits)


def to_awq(m: QuantizedMatrix, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    zero = m.zero if m.zero is not None else torch.zeros_like(m.scale, dtype=torch.int8)
    return {
        "qweight": pack_to_int32(_awq_order(m.q.t().contiguous()), m.bits),
        "qzeros": pack_to_int32(_awq_order(zero.t().contiguous()), m.bits),
        "scales": m.scale.t().contiguous().to(dtype),
    }
