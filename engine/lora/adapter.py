"""A PEFT LoRA adapter directory read into per-layer, per-projection ``(A, B, scaling)`` tensors.

PEFT writes ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
``adapter_model.safetensors`` with keys ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``;
``A`` is ``[r, in]`` and ``B`` is ``[out, r]``, and a target linear ``y = W x`` becomes ``W x + (B (A x)) * scaling``
with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA). Only what that formula covers is accepted: no bias,
no DoRA, no ``modules_to_save``, no ``fan_in_fan_out``; anything else is refused naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.model_config import ModelConfig

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN_TARGETS + MLP_TARGETS

_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(slots=True, frozen=True)
class LoRAWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    layers: list[dict[str, LoRAWeights]]  # per decoder layer: projection name -> weights


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection in the checkpoint's (unsharded) layout."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def load_adapter(name: str, path: Path, cfg: ModelConfig, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check one adapter directory against the base model; ValueError naming what does not fit."""
    conf_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not conf_file.is_file() or not weights_file.is_file():
        raise ValueError(f"adapter {name!r}: {path} needs adapter_config.json and adapter_model.safetensors")
    conf = json.loads(conf_file.read_text())
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {conf.get('peft_type')!r} is not supported (LORA only)")
    for key, ok in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False), ("modules_to_save", None)):
        if conf.get(key, ok) not in (ok, [] if ok is None else ok):
            raise ValueError(f"adapter {name!r}: {key}={conf[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if conf.get(key):
            raise ValueError(f"adapter {name!r}: {key} is not supported")
    rank, alpha = int(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    shapes = projection_shapes(cfg)
    raw = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"adapter {name!r}: unsupported weight {key!r}")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(f"adapter {name!r}: layer {layer} is past the model's {cfg.num_layers}")
        if proj not in TARGETS or (cfg.is_moe_layer(layer) and proj in MLP_TARGETS):
            raise ValueError(f"adapter {name!r}: target {proj!r} of layer {layer} is not supported")
        pairs.setdefault((layer, proj), {})[ab] = tensor
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(cfg.num_layers)]
    for (layer, proj), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {proj} lacks lora_{'A' if 'A' not in ab else 'B'}")
        out, inp = shapes[proj]
        if tuple(ab["A"].shape) != (rank, inp) or tuple(ab["B"].shape) != (out, rank):
            raise ValueError(f"adapter {name!r}: layer {layer} {proj} has A {tuple(ab['A'].shape)}, B "
                             f"{tuple(ab['B'].shape)}; the model needs ({rank}, {inp}) and ({out}, {rank})")
        layers[layer][proj] = LoRAWeights(ab["A"].to(dtype).contiguous(), ab["B"].to(dtype).contiguous(), scaling)
    if not pairs:
        raise ValueError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoRAAdapter(name, path, rank, layers)
