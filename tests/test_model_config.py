"""Tests for :mod:`engine.model_config`: what is refused, and how rope and MoE layouts are parsed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.model_config import ModelConfig, RopeConfig, UnsupportedModelError


def _llama(**overrides: Any) -> dict[str, Any]:
    """A minimal valid Llama config.json dict, with overrides applied."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        "rope_theta": 500000.0,
        "eos_token_id": [1, 2],
    }
    cfg.update(overrides)
    return cfg


def _qwen3_moe(**overrides: Any) -> dict[str, Any]:
    """A minimal valid Qwen3-MoE config.json dict, with overrides applied."""
    cfg = _llama(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=6, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    cfg.update(overrides)
    return cfg


def test_minimal_llama_config_parses() -> None:
    """A plain Llama config gives the expected shapes, GQA heads, default rope and eos list."""
    cfg = ModelConfig.from_dict(_llama())
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope == RopeConfig(theta=500000.0)
    assert cfg.eos_token_ids == (1, 2)
    assert cfg.moe is None and cfg.sliding_window is None
    assert not cfg.is_moe_layer(0)


@pytest.mark.parametrize(
    ("overrides", "offending"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": []}, "architecture"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_option_is_refused_naming_it(overrides: dict[str, Any], offending: str) -> None:
    """Each unsupported architecture or option raises UnsupportedModelError whose message names it."""
    with pytest.raises(UnsupportedModelError, match=offending):
        ModelConfig.from_dict(_llama(**overrides))


def test_unsupported_model_error_is_a_value_error() -> None:
    """UnsupportedModelError subclasses ValueError, so generic bad-input handlers catch it."""
    assert issubclass(UnsupportedModelError, ValueError)


def test_disabled_switches_are_accepted() -> None:
    """Explicitly false / default values of refused options do not trip the checks."""
    cfg = ModelConfig.from_dict(_llama(use_sliding_window=False, mlp_bias=False, hidden_act="silu", pretraining_tp=1))
    assert cfg.architecture == "LlamaForCausalLM"


def test_legacy_rope_scaling_and_rope_parameters_parse_the_same() -> None:
    """Legacy rope_theta + rope_scaling and transformers-5 rope_parameters give identical RopeConfig."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    legacy = ModelConfig.from_dict(_llama(rope_theta=500000.0, rope_scaling=scaling))
    cfg = _llama(rope_parameters={"rope_theta": 500000.0, **scaling})
    del cfg["rope_theta"]
    modern = ModelConfig.from_dict(cfg)
    assert legacy.rope == modern.rope
    assert legacy.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_legacy_type_key_and_rope_type_key_parse_the_same() -> None:
    """The old rope_scaling 'type' key means the same as 'rope_type'."""
    old = ModelConfig.from_dict(_llama(rope_scaling={"type": "linear", "factor": 2.0}))
    new = ModelConfig.from_dict(_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert old.rope == new.rope
    assert (old.rope.rope_type, old.rope.factor) == ("linear", 2.0)


def test_default_rope_parses_the_same_in_both_layouts() -> None:
    """Plain rope_theta and rope_parameters {rope_type: default} give the same default RopeConfig."""
    cfg = _llama(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    del cfg["rope_theta"]
    assert ModelConfig.from_dict(cfg).rope == ModelConfig.from_dict(_llama(rope_theta=1e6)).rope == RopeConfig(1e6)


def test_missing_rope_theta_defaults_to_10000() -> None:
    """Without any rope field the HF default theta of 10000 is used."""
    cfg = _llama()
    del cfg["rope_theta"]
    assert ModelConfig.from_dict(cfg).rope == RopeConfig(theta=10000.0)


def test_qwen3_moe_sparse_step_and_mlp_only_layers_give_dense_layers() -> None:
    """decoder_sparse_step=2 makes even-indexed layers dense, and mlp_only_layers adds more (HF rule)."""
    cfg = ModelConfig.from_dict(_qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe is not None
    assert cfg.moe.dense_layers == (0, 2, 3, 4)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_qwen3_moe_defaults_make_every_layer_sparse() -> None:
    """With decoder_sparse_step 1 and no mlp_only_layers every layer is MoE."""
    cfg = ModelConfig.from_dict(_qwen3_moe())
    assert cfg.moe is not None
    assert cfg.moe.dense_layers == ()
    assert cfg.moe.norm_topk_prob and cfg.moe.weights_in_activation_dtype
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (8, 2, 32)
    assert cfg.qk_norm


def test_qwen3_moe_mlp_only_layers_alone() -> None:
    """mlp_only_layers with step 1 makes exactly those layers dense."""
    cfg = ModelConfig.from_dict(_qwen3_moe(mlp_only_layers=[0, 5]))
    assert cfg.moe is not None and cfg.moe.dense_layers == (0, 5)


def test_moe_top_k_larger_than_experts_is_refused() -> None:
    """num_experts_per_tok above num_experts raises ValueError."""
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(_qwen3_moe(num_experts_per_tok=9))


def test_heads_not_divisible_by_kv_heads_is_refused() -> None:
    """num_attention_heads must be a multiple of num_key_value_heads."""
    with pytest.raises(ValueError, match="not divisible"):
        ModelConfig.from_dict(_llama(num_key_value_heads=3))


def test_sliding_window_is_read_only_for_mistral_family() -> None:
    """sliding_window is honoured for Mistral and ignored for Llama (whose HF model ignores it too)."""
    assert ModelConfig.from_dict(_llama(architectures=["MistralForCausalLM"], sliding_window=64)).sliding_window == 64
    assert ModelConfig.from_dict(_llama(sliding_window=64)).sliding_window is None


def test_from_dir_reads_the_tiny_checkpoint(checkpoint: Callable[[str], Path]) -> None:
    """The tiny llama checkpoint's config.json parses, with its Llama-3 rope scaling and eos id."""
    cfg = ModelConfig.from_dir(checkpoint("llama"))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rope.rope_type == "llama3"
    assert 2045 in cfg.eos_token_ids
    assert cfg.vocab_size == 2048


def test_from_dir_without_config_json_raises(tmp_path: Path) -> None:
    """A directory with no config.json raises FileNotFoundError."""
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelConfig.from_dir(tmp_path)
