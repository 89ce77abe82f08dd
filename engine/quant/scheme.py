"""A checkpoint's quantization scheme, read from ``config.json``'s ``quantization_config``.

Supported:

| ``quant_method``     | what                                                                          |
|----------------------|-------------------------------------------------------------------------------|
| ``compressed-tensors`` | ``pack-quantized`` or ``int-quantized`` INT4/INT8 weights (per channel or    |
|                      | grouped, symmetric or with zero points), activations unquantized (W4A16, W8A16);|
|                      | ``float-quantized`` FP8 (e4m3) weights, per tensor or per channel             |
| ``gptq``             | 4- or 8-bit ``qweight``/``qzeros``/``scales``/``g_idx``                        |
| ``awq``              | 4-bit GEMM layout ``qweight``/``qzeros``/``scales``                           |

Everything else (another method, activation quantization, sparsity, a bit width the kernels do not take) is refused
with :class:`UnsupportedQuantizationError`, naming what was asked: a model that loads wrongly is worse than none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.model_config import UnsupportedModelError

# ``tandem model quantize --scheme``: name -> (bits, default group size; None = one scale per output channel)
CLI_SCHEMES: dict[str, tuple[int, int | None]] = {"w8a16": (8, None), "w4a16": (4, 128)}
METHODS = ("compressed-tensors", "gptq", "awq")
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint (or the command line) asks for a quantization scheme this engine does not implement."""


@dataclass(slots=True, frozen=True)
class QuantScheme:
    """How one checkpoint's linear weights are stored.

    ``group_size`` None means one scale per output channel; ``float_weights`` is FP8 (e4m3) rather than integers.
    ``ignore`` names modules left unquantized (compressed-tensors' ``ignore``, e.g. ``lm_head``).
    """

    method: str
    bits: int
    group_size: int | None
    symmetric: bool = True
    fmt: str = ""
    float_weights: bool = False
    act_order: bool = False
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UnsupportedQuantizationError(f"quantization method {self.method!r} is not supported; "
                                               f"supported: {list(METHODS)}")
        allowed = (8,) if self.float_weights else (4, 8)
        if self.bits not in allowed:
            raise UnsupportedQuantizationError(f"{self.method} with {self.bits}-bit weights is not supported; "
                                               f"supported bits: {list(allowed)}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 or None (per channel), got {self.group_size}")

    @property
    def name(self) -> str:
        kind = "fp8" if self.float_weights else f"w{self.bits}a16"
        return f"{self.method}:{kind}"


def cli_scheme(name: str, group_size: int | None = None) -> tuple[int, int | None]:
    """(bits, group size) for ``tandem model quantize --scheme NAME [--group-size N]``; an unknown name is refused."""
    if name not in CLI_SCHEMES:
        raise UnsupportedQuantizationError(f"quantization scheme {name!r} is not supported; "
                                           f"supported: {sorted(CLI_SCHEMES)}")
    bits, default_group = CLI_SCHEMES[name]
    group = default_group if group_size is None else group_size
    if group is not None and (group < 1 or group & (group - 1)):
        raise ValueError(f"--group-size must be a positive power of two, got {group}")
    return bits, group


def scheme_from_config(cfg: dict[str, Any]) -> QuantScheme | None:
    """The scheme of an HF ``config.json`` dict, None for an unquantized checkpoint."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        bits = int(qc.get("bits", 4))
        group = int(qc.get("group_size", 128))
        if qc.get("checkpoint_format", "gptq") not in ("gptq",):
            raise UnsupportedQuantizationError(f"gptq checkpoint_format {qc['checkpoint_format']!r} is not "
                                               "supported; supported: ['gptq']")
        return QuantScheme("gptq", bits, None if group == -1 else group, symmetric=bool(qc.get("sym", True)),
                           fmt="gptq", act_order=bool(qc.get("desc_act", False)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantizationError(f"awq version {version!r} is not supported; supported: ['gemm']")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        if bits != 4:
            raise UnsupportedQuantizationError(f"awq with {bits}-bit weights is not supported; supported: [4]")
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return QuantScheme("awq", bits, None if group == -1 else group, symmetric=not qc.get("zero_point", True),
                           fmt="gemm")
    raise UnsupportedQuantizationError(f"quantization method {method or qc!r} is not supported; "
                                       f"supported: {list(METHODS)}")


def _compressed_tensors(qc: dict[str, Any]) -> QuantScheme:
    fmt = str(qc.get("format", ""))
    if fmt not in _CT_FORMATS:
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} is not supported; "
                                           f"supported: {list(_CT_FORMATS)}")
    if qc.get("sparsity_config"):
        raise UnsupportedQuantizationError("compressed-tensors sparsity_config is not supported")
    if qc.get("kv_cache_scheme"):
        raise UnsupportedQuantizationError("compressed-tensors kv_cache_scheme (quantized KV cache) is not supported")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedQuantizationError(f"compressed-tensors with {len(groups)} config_groups is not supported; "
                                           "exactly one is")
    (group,) = groups.values()
    if group.get("input_activations") or group.get("output_activations"):
        raise UnsupportedQuantizationError("compressed-tensors activation quantization (input_activations) is not "
                                           "supported; only weight-only schemes (W4A16, W8A16, FP8 weights)")
    w = group.get("weights") or {}
    kind = str(w.get("type", "int"))
    strategy = str(w.get("strategy", "channel"))
    float_weights = kind == "float"
    if kind not in ("int", "float"):
        raise UnsupportedQuantizationError(f"compressed-tensors weight type {kind!r} is not supported")
    if strategy not in ("channel", "group", "tensor"):
        raise UnsupportedQuantizationError(f"compressed-tensors weight strategy {strategy!r} is not supported; "
                                           "supported: ['channel', 'group', 'tensor']")
    if w.get("actorder"):
        raise UnsupportedQuantizationError(f"compressed-tensors actorder={w['actorder']!r} is not supported")
    if float_weights != (fmt == "float-quantized"):
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r} with {kind} weights is not supported")
    if strategy == "tensor" and not float_weights:
        raise UnsupportedQuantizationError("compressed-tensors per-tensor integer weights are not supported")
    group_size = int(w["group_size"]) if strategy == "group" else None
    return QuantScheme("compressed-tensors", int(w.get("num_bits", 8)), group_size,
                       symmetric=bool(w.get("symmetric", True)), fmt=fmt, float_weights=float_weights,
                       ignore=tuple(qc.get("ignore") or ()))
