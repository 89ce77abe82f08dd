"""Fusing each layer's quantized projections into the model's packed matrices and attaching the CPU kernel to them.

The model holds q|k|v as one ``qkv_proj`` and gate|up as one ``gate_up_proj``; their integers and scales stack along
the output rows the same way (:meth:`QuantizedMatrix.cat`). Each fused weight gets a :class:`QuantLinear` as
``param.quant``, which :func:`engine.models.layers.linear` calls instead of a dense matmul, and the dense copy the
loader filled is released. A weight stays dense (already dequantized, so still exact) when any of its parts is not
quantized in the checkpoint, when the model is split by tensor parallelism (each rank would need its slice of the
integers), on CUDA, or without the native kernel. MoE experts stay dense.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.models.decoder import CausalLM
from engine.models.layers import GatedMLP
from engine.quant.kernels import QuantLinear, wq_linear_kernel
from engine.quant.weights import QuantizedMatrix

log = logging.getLogger(__name__)


def attach_kernels(model: CausalLM, matrices: dict[str, QuantizedMatrix]) -> int:
    """Attach kernels to every fully quantized linear weight of ``model``; return how many got one."""
    if not matrices:
        return 0
    fn = wq_linear_kernel()
    if fn is None or model.shard.tp_size > 1:
        log.warning("quantized weights run dequantized (%s)", "no native kernel" if fn is None else
                    "tensor parallelism")
        return 0
    attached = 0

    def put(param: nn.Parameter, names: list[str]) -> None:
        nonlocal attached
        if not all(n in matrices for n in names):
            return
        ql = QuantLinear(QuantizedMatrix.cat([matrices[n] for n in names]), fn)
        if (ql.n, ql.k) != tuple(param.shape):
            raise ValueError(f"quantized {names} fuse to {(ql.n, ql.k)}, the model expects {tuple(param.shape)}")
        param.quant = ql  # type: ignore[attr-defined]
        param.data = torch.empty(0, dtype=param.dtype)  # the integers replace the dense copy
        attached += 1

    for i in model.stage:
        p = f"model.layers.{i}."
        layer = model._layer_seq[i]
        attn = layer.self_attn
        put(attn.qkv_proj, [p + f"self_attn.{x}_proj" for x in "qkv"])
        put(attn.o_proj, [p + "self_attn.o_proj"])
        if isinstance(layer.mlp, GatedMLP):
            put(layer.mlp.gate_up_proj, [p + "mlp.gate_proj", p + "mlp.up_proj"])
            put(layer.mlp.down_proj, [p + "mlp.down_proj"])
    if not model.cfg.tie_word_embeddings:
        put(model.lm_head, ["lm_head"])
    return attached
