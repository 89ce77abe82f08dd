"""``tandem model quantize IN OUT --scheme w8a16|w4a16 [--group-size N]``: an HF checkpoint written quantized.

Round-to-nearest, symmetric, weight-only: each linear projection of every decoder layer (attention q/k/v/o, the MLP's
gate/up/down and each expert's) gets scales from its absolute maximum per output channel (``w8a16``) or per group of
``group_size`` inputs (``w4a16``, 128 by default), computed and applied by compressed-tensors' own
``calculate_qparams``/``quantize``, and is stored in compressed-tensors' ``pack-quantized`` format with the
``quantization_config`` that format's loaders (transformers, vLLM, Tandem) read. Embeddings, norms, MoE routers and
``lm_head`` stay as they are (``ignore: ["lm_head"]``, the usual choice). ``fmt="gptq"`` or ``"awq"`` writes the same
integers and scales in those layouts instead (INT4 only for AWQ), so those loaders are tested on known weights.

Tokenizer and generation files are copied unchanged.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
)
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

from engine.loader import iter_weights
from engine.quant import formats
from engine.quant.scheme import cli_scheme
from engine.quant.weights import QuantizedMatrix

OUTPUT_FORMATS = ("compressed-tensors", "gptq", "awq")
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def weight_args(bits: int, group_size: int | None) -> QuantizationArgs:
    strategy = QuantizationStrategy.GROUP if group_size else QuantizationStrategy.CHANNEL
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size,
                            dynamic=False)


def quantize_matrix(w: torch.Tensor, args: QuantizationArgs) -> QuantizedMatrix:
    """Round-to-nearest symmetric quantization of one ``[out, in]`` weight with compressed-tensors' functions."""
    rows, cols = w.shape
    group = args.group_size or cols
    if cols % group:
        raise ValueError(f"group size {group} does not divide the {cols} inputs of a {rows}x{cols} weight; "
                         "choose a --group-size that divides every layer's inputs")
    wf = w.float()
    grouped = wf.view(rows, cols // group, group)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    q = ct_quantize(wf, scale, zero, args, dtype=torch.int8)
    return QuantizedMatrix(q, scale, None, args.num_bits)


def quantization_config(bits: int, group_size: int | None, fmt: str) -> dict[str, Any]:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1, "desc_act": False,
                "sym": True, "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group_size or -1, "zero_point": True,
                "version": "gemm"}
    scheme = QuantizationScheme(targets=["Linear"], weights=weight_args(bits, group_size))
    config = QuantizationConfig(config_groups={"group_0": scheme}, quant_method="compressed-tensors",
                                format="pack-quantized", quantization_status=QuantizationStatus.COMPRESSED,
                                ignore=["lm_head"])
    return config.model_dump(mode="json")


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, group_size: int | None = None,
                        fmt: str = "compressed-tensors") -> Path:
    """Write ``src`` quantized with ``scheme`` into ``dst`` (created; must be empty or absent) and return it."""
    bits, group = cli_scheme(scheme, group_size)
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; choose one of {list(OUTPUT_FORMATS)}")
    if fmt == "awq" and (bits != 4 or group is None):
        raise ValueError("the AWQ format holds grouped INT4 weights only (--scheme w4a16)")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    args = weight_args(bits, group)
    pack = {"compressed-tensors": formats.to_compressed_tensors, "gptq": formats.to_gptq, "awq": formats.to_awq}[fmt]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(src):
        if _LINEAR.search(name) and tensor.dim() == 2:
            prefix = name.removesuffix(".weight")
            for suffix, t in pack(quantize_matrix(tensor, args), tensor.dtype).items():
                out[f"{prefix}.{suffix}"] = t.contiguous()
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(bits, group, fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    return dst


def dequantized_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write a quantized checkpoint ``src`` back as a dense float32 HF checkpoint ``dst`` (``(q - zero) * scale``):
    the reference transformers runs in the exactness tests and the bench's float baseline of the same weights."""
    from engine.quant.reader import QuantizedCheckpoint
    from engine.quant.scheme import scheme_from_config

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    scheme = scheme_from_config(config)
    if scheme is None:
        raise ValueError(f"{src} is not a quantized checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.float().contiguous() if t.is_floating_point() else t.contiguous()
               for n, t in QuantizedCheckpoint(scheme, iter_weights(src)).weights()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst
