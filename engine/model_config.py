"""Reading an HF ``config.json`` into the one typed description every model class is built from.

Supported architectures and their switches:

| architecture            | differences handled                                    |
|-------------------------|--------------------------------------------------------|
| LlamaForCausalLM        | Llama-3 / linear rope scaling, optional attention bias |
| MistralForCausalLM      | sliding-window attention                               |
| Qwen2ForCausalLM        | q/k/v bias, tied embeddings                            |
| Qwen3ForCausalLM        | per-head q/k RMSNorm, explicit head_dim                |
| MixtralForCausalLM      | sparse MoE (softmax, top-k, renormalised)              |
| Qwen3MoeForCausalLM     | sparse MoE with ``norm_topk_prob``, dense layers mixed |

Anything else, and any option whose semantics we do not implement, is refused with an error naming it: a
silently-wrong model is worse than none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option this engine does not implement."""


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in _SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: {list(_SUPPORTED_ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")


@dataclass(slots=True, frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    # Qwen3-MoE casts the routing weights back to the activation dtype; Mixtral keeps them in float32.
    weights_in_activation_dtype: bool
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_window: int | None
    moe: MoEConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} not divisible by kv heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers, per element size 1 (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: not an HF checkpoint directory")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {archs!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true (Qwen-style per-layer windows) is not supported")
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"pretraining_tp={cfg['pretraining_tp']} is not supported")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
        o_bias = arch in ("LlamaForCausalLM", "MistralForCausalLM") and bool(cfg.get("attention_bias", False))
        sliding_window = cfg.get("sliding_window") if arch in ("MistralForCausalLM", "MixtralForCausalLM") else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=_parse_rope(cfg),
            sliding_window=int(sliding_window) if sliding_window else None,
            moe=_parse_moe(arch, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # Real checkpoints write legacy `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if v is not None})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _parse_moe(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
            weights_in_activation_dtype=False,
        )
    if arch == "Qwen3MoeForCausalLM":
        num_layers = int(cfg["num_hidden_layers"])
        step = int(cfg.get("decoder_sparse_step", 1))
        only_dense = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(num_layers) if i in only_dense or (i + 1) % step != 0)
        return MoEConfig(
            num_experts=int(cfg["num_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            weights_in_activation_dtype=True,
            dense_layers=dense,
        )
    return None
