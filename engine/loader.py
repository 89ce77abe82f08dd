"""Loading an unmodified HF checkpoint directory: config, safetensors shards (single file or indexed) and weights.

Tensors stream shard by shard (memory-mapped by safetensors), so peak memory is the model plus one tensor.
Quantized checkpoints (``quantization_config``: compressed-tensors, GPTQ, AWQ) load through :mod:`engine.quant`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models.decoder import AllReduce, CausalLM, Pipe, ShardSpec, _identity
from engine.quant.scheme import scheme_from_config


def safetensors_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / f for f in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"index names missing shard(s): {[m.name for m in missing]}")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: str = "cpu",
    max_positions: int | None = None,
    shard: ShardSpec | None = None,
    tp_reduce: AllReduce = _identity,
    ep_reduce: AllReduce = _identity,
    pipe: Pipe | None = None,
) -> tuple[CausalLM, ModelConfig]:
    cfg = ModelConfig.from_dir(model_dir)
    scheme = scheme_from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    positions = max_positions or cfg.max_position_embeddings
    with torch.device("cpu"):
        model = CausalLM(cfg, dtype, positions, shard=shard, tp_reduce=tp_reduce, ep_reduce=ep_reduce, pipe=pipe)
    if scheme is None:
        model.load_weights(iter_weights(model_dir))
    else:  # dequantized into the dense parameters, then (CPU) the integers replace them under a kernel
        from engine.quant.reader import QuantizedCheckpoint  # imports compressed-tensors: only for such checkpoints

        quantized = QuantizedCheckpoint(scheme, iter_weights(model_dir))
        model.load_weights(quantized.weights())
    model.eval()
    if device != "cpu":
        model.to(device)
    else:
        if scheme is not None:
            from engine.quant.attach import attach_kernels

            attach_kernels(model, quantized.matrices)
        model.prepack()
    return model, cfg
