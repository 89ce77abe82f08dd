"""A random PEFT LoRA adapter for a checkpoint (``tandem model init-lora``): tests and users get an adapter that
changes the model's output, without a hub or a training run.

PEFT itself initialises ``B`` to zero (a fresh adapter is the identity); here both ``A`` and ``B`` are random
(seeded), so every target projection really moves, in exactly PEFT's layout and key names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.adapter import MLP_TARGETS, TARGETS, projection_shapes
from engine.model_config import ModelConfig


def write_random_adapter(base: str | Path, out: str | Path, rank: int = 8, targets: tuple[str, ...] = ("q_proj",
                         "v_proj"), alpha: float | None = None, seed: int = 0) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` to ``out`` for the checkpoint ``base``."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise ValueError(f"unsupported LoRA targets {bad or targets}; choose from {', '.join(TARGETS)}")
    cfg = ModelConfig.from_dir(base)
    shapes = projection_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for proj in targets:
            if proj in MLP_TARGETS and cfg.is_moe_layer(layer):
                continue
            n_out, n_in = shapes[proj]
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if proj in MLP_TARGETS else 'self_attn'}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank**0.5
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(Path(base).resolve()),
            "r": rank, "lora_alpha": alpha if alpha is not None else rank, "lora_dropout": 0.0,
            "target_modules": sorted(set(targets)), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "inference_mode": True}
    (out_dir / "adapter_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return out_dir
